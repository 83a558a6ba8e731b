"""Evaluations fanned out to worker processes on Ray (one machine or a cluster), or run in this process:
the generic pool that search code (``heterog.baselines.ray_search``: MCMC's chains) and the agent's
rollouts use.

``make_pool(workers, ray_address, worker)``: with one worker and no address everything runs here and ray is
never imported. Otherwise it joins the Ray cluster at ``ray_address`` (``ray start --head`` on one
machine, ``ray start --address=HEAD:6379`` on the others, every machine with this package installed)
or starts a local one with this machine's CPU count, quietly and without a dashboard, and runs
``workers`` actors of one CPU each, each an instance of ``worker`` (a ``Worker`` or a subclass that adds
job kinds). An actor builds its own Evaluator from an ``EvaluatorSpec`` (the graph, cluster and cost
model travel once) and keeps it, with its recent plans for delta compilation, between jobs; a job carries
action vectors (or what a subclass's jobs carry), and results come back in job order, so what a search
finds does not depend on where its jobs ran.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.cost import CostModel
    from heterog.evaluate import Evaluator
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph


@dataclass(frozen=True)
class EvaluatorSpec:
    """What builds an Evaluator in another process (its caches and recent plans stay behind)."""

    graph: OpGraph
    cluster: Cluster
    cost: CostModel
    order: str
    serialize_collectives: bool
    max_groups: int
    shares: str
    sync_batch_stats: bool = False
    checkpoint_every_steps: int | None = None

    @classmethod
    def of(cls, ev: PlanEvaluator) -> EvaluatorSpec:
        return cls(ev.graph, ev.cluster, ev.cost, ev.order, ev.serialize_collectives, ev.max_groups, ev.shares,
                   ev.sync_batch_stats, ev.checkpoint_every_steps)

    def build(self) -> Evaluator:
        from heterog.evaluate import Evaluator

        return Evaluator(self.graph, self.cluster, self.cost, order=self.order,
                         serialize_collectives=self.serialize_collectives, max_groups=self.max_groups,
                         shares=self.shares, sync_batch_stats=self.sync_batch_stats,
                         checkpoint_every_steps=self.checkpoint_every_steps)


class Worker:
    """What runs on a worker: Evaluators by key, built once, kept for later jobs. A subclass adds job kinds
    (methods taking ``(key, job)``) and what ``setup``'s options build beside the evaluator."""

    def __init__(self) -> None:
        self.evaluators: dict[str, Evaluator] = {}

    def setup(self, key: str, spec: EvaluatorSpec) -> None:
        """Build ``spec``'s evaluator under ``key`` (once)."""
        if key not in self.evaluators:
            ev = self.evaluators[key] = spec.build()
            ev.iteration_time(ev.strategy(np.zeros(ev.n_groups, dtype=np.int64)))   # load the compiled kernels

    def iteration_times(self, key: str, actions: np.ndarray, order: str | None = None) -> list[tuple[float, bool]]:
        """(iteration time, OOM) of the strategies ``actions`` (K, G), decoded by the evaluator."""
        ev = self.evaluators[key]
        return [ev.iteration_time(ev.strategy(a), order) for a in np.asarray(actions)]

    def plan_times(self, key: str, job: tuple[np.ndarray, list[tuple[int, str, tuple[int, ...]]]]) \
            -> list[tuple[float, bool]]:
        """``iteration_times`` of plans: ``job`` is the group actions (K, G) and each plan's (micro-batches,
        schedule, recomputed groups)."""
        ev = self.evaluators[key]
        actions, plans = job
        return [ev.iteration_time(ev.strategy(a).with_recompute(r).with_micro_batches(k, schedule))
                for a, (k, schedule, r) in zip(np.asarray(actions), plans)]


class Pool:
    """Workers that run ``Worker`` methods: ``register`` an evaluator on every worker, then ``map`` jobs
    over the workers (results in job order); remote pools also ``submit`` one job and ``wait_any``.
    This base runs everything here, on one ``worker``."""

    remote = False

    def __init__(self, worker: type[Worker] = Worker) -> None:
        self.n_workers = 1
        self.worker = worker
        self._local = worker()
        self._keys: dict[int, str] = {}

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    def register(self, spec: EvaluatorSpec, **options: Any) -> str:
        """A key naming ``spec``'s evaluator on the workers (built there on first use); ``options`` go to
        the worker's ``setup``."""
        key = self._keys.get(id(spec.graph))
        if key is None:
            key = self._keys[id(spec.graph)] = f"{spec.graph.fingerprint[:16]}@{spec.cluster.name}#{len(self._keys)}"
        self._setup(key, spec, options)
        return key

    def _setup(self, key: str, spec: EvaluatorSpec, options: dict[str, Any]) -> None:
        self._local.setup(key, spec, **options)

    def map(self, method: str, key: str, jobs: list) -> list:
        """``Worker.<method>(key, job)`` for every job, spread over the workers; results in job order."""
        return [getattr(self._local, method)(key, job) for job in jobs]


class RayPool(Pool):
    """``n_workers`` Ray actors (one CPU each, instances of ``worker``) on the cluster at ``address``, or
    on a local Ray started here with ``os.cpu_count()`` CPUs."""

    remote = True

    def __init__(self, n_workers: int, address: str | None = None, worker: type[Worker] = Worker) -> None:
        super().__init__(worker)
        ray = import_ray()
        if not ray.is_initialized():
            init_ray(address)
        self.ray = ray
        self.n_workers = int(n_workers)
        actor = ray.remote(num_cpus=1)(worker)
        self.actors = [actor.remote() for _ in range(self.n_workers)]
        self._busy: dict[Any, int] = {}              # submitted job -> the worker running it

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []

    def _setup(self, key: str, spec: EvaluatorSpec, options: dict[str, Any]) -> None:
        ref = self.ray.put(spec)
        self.ray.get([a.setup.remote(key, ref, **options) for a in self.actors])

    def map(self, method: str, key: str, jobs: list) -> list:
        refs = [getattr(self.actors[i % self.n_workers], method).remote(key, job) for i, job in enumerate(jobs)]
        return self.ray.get(refs)

    def submit(self, method: str, key: str, job: Any) -> Any:
        """Run the job on a worker without a submitted job (the caller keeps at most one per worker)."""
        i = min(set(range(self.n_workers)) - set(self._busy.values()))
        ref = getattr(self.actors[i], method).remote(key, job)
        self._busy[ref] = i
        return ref

    def wait_any(self, handles: list) -> tuple[Any, Any]:
        done, _ = self.ray.wait(handles, num_returns=1)
        self._busy.pop(done[0])
        return done[0], self.ray.get(done[0])


def import_ray() -> ModuleType:
    """The ray module, or a HeterogError saying how to install it."""
    try:
        import ray
    except ModuleNotFoundError:
        raise HeterogError("parallel search needs Ray: pip install 'heterog[ray]' (or 'ray>=2.9')") from None
    return ray


def init_ray(address: str | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a local one with this machine's CPU count (quiet, no
    dashboard). Ray's own start-up logs are kept off the terminal."""
    import logging

    ray = import_ray()
    opts = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False, configure_logging=True)
    try:
        if address:
            ray.init(address=address, **opts)
        else:
            ray.init(address="local", num_cpus=os.cpu_count() or 1, **opts)     # a new one, whatever runs
    except Exception as exc:  # noqa: BLE001 - any failure to start or join is one message to the user
        where = f"join the Ray cluster at {address!r}" if address else "start a local Ray cluster"
        raise HeterogError(f"could not {where}: {type(exc).__name__}: {exc}") from None


def make_pool(workers: int = 1, ray_address: str | None = None, worker: type[Worker] = Worker) -> Pool:
    """The pool of ``workers`` workers of class ``worker``: in this process for one worker and no address,
    else on Ray."""
    if int(workers) < 1:
        raise HeterogError(f"workers must be at least 1, got {workers}")
    if int(workers) == 1 and not ray_address:
        return Pool(worker)
    return RayPool(int(workers), ray_address, worker)
