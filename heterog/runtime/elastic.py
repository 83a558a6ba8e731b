"""Runs that survive the loss of workers: when a worker dies or stops making progress, the run drops its
device, re-plans for the devices left within a budget of seconds (``heterog.replan``), and resumes on a new
pool of workers from its newest complete checkpoint (``heterog.runtime.checkpoint``), at most
``max_restarts`` times. Work lost is at most the steps since that checkpoint.

A device comes back through the devices file (``ElasticSettings.devices_file``, one device name a line):
at each re-plan the run uses the devices it lists, less those lost since the file was last written, so a
lost device that the file lists again, written after the loss, is used at the next re-plan. Without the
file, every device not lost is used.

A worker that raises an error (a bad value, a plan that cannot run) is no lost device: the run stops as
any run does, and the error is reported.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from heterog.cluster.topology import subset
from heterog.errors import ClusterError, HeterogError
from heterog.runtime.launcher import WorkerFailure, WorkerPool

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.cost import CostModel
    from heterog.runtime.api import Model, PreparedRun, RunResult
    from heterog.runtime.checkpoint import CheckpointSettings, Resumed
    from heterog.strategy import Strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElasticSettings:
    """What a run does when it loses workers."""

    max_restarts: int = 0                 # restarts allowed (0: a lost worker ends the run)
    replan_method: str = "auto"           # "auto" (heterog.replan) or a planner ("agent": its zero-shot plan)
    replan_budget_s: float = 5.0          # seconds a re-plan may take
    devices_file: Path | None = None      # the devices available now, one name a line (read at each re-plan)
    seed: int = 0                         # seed of randomised planners
    sync_batch_stats: bool = False        # re-planned plans synchronize batch statistics (--sync-batch-stats)

    def __post_init__(self) -> None:
        if int(self.max_restarts) < 0:
            raise HeterogError(f"--max-restarts must be at least 0, got {self.max_restarts}")
        if not float(self.replan_budget_s) > 0:
            raise HeterogError(f"--replan-budget-s must be positive, got {self.replan_budget_s}")
        if self.replan_method != "auto":
            from heterog import planners

            planners.get(self.replan_method)


def available_devices(full: Cluster, lost: dict[str, float], devices_file: Path | None) -> tuple[list[str], list[str]]:
    """(the devices of ``full`` to use now, in its order; the lost ones that are back): ``lost`` maps a lost
    device to when it was lost (``time.time()``); the devices file, if there is one, lists those available
    (module docstring)."""
    names = full.device_names
    if devices_file is None or not Path(devices_file).is_file():
        return [d for d in names if d not in lost], []
    path = Path(devices_file)
    listed = {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}
    unknown = sorted(listed - set(names))
    if unknown:
        raise ClusterError(f"devices file {str(path)!r} names {', '.join(unknown)}, not devices of cluster "
                           f"{full.name!r} ({', '.join(names)})")
    written = path.stat().st_mtime
    back = [d for d in names if d in lost and d in listed and written > lost[d]]
    return [d for d in names if d in listed and (d not in lost or d in back)], back


@dataclass
class Restart:
    """One restart of an elastic run."""

    failure: str                          # the failure's first line
    lost: list[str]                       # devices lost
    back: list[str]                       # devices back (the devices file)
    reached_step: int                     # the step the run had reached
    resumed_from: int                     # the checkpoint's step (0: the start or the resumed checkpoint's)
    cluster: str
    devices: list[str]
    method: str                           # the plan kept
    replan: dict[str, Any]                # heterog.replan.Replan.record()
    simulated_iteration_time_s: float

    def record(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SurvivingRun:
    """Train ``model`` under ``strategy`` on ``cluster`` up to step ``steps``, surviving lost workers
    (module docstring). ``pool``: the worker pool of the current attempt (None between attempts)."""

    model: Model
    cluster: Cluster
    strategy: Strategy
    batches: Sequence[Sequence[torch.Tensor]]
    steps: int
    checkpoint: CheckpointSettings | None = None
    resume: Resumed | None = None
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    backend: str = "gloo"
    warmup: int = 1
    hang_timeout_s: float = 60.0
    cost: CostModel | None = None
    pool: WorkerPool | None = field(default=None, init=False)
    restarts: list[Restart] = field(default_factory=list, init=False)

    def run(self) -> RunResult:
        """The run to its last step: the last attempt's result (``losses`` over every step, ``restarts``)."""
        from heterog.replan import warm_up
        from heterog.runtime.api import prepare, run_prepared

        current, strategy, resumed = self.cluster, self.strategy, self.resume
        lost: dict[str, float] = {}
        if self.elastic.max_restarts:
            warm_up(self.elastic.replan_method, self.model.graph, self.cluster)
        prepared = prepare(self.model, current, strategy, backend=self.backend, cost=self.cost)
        while True:
            try:
                self.pool = WorkerPool(current.n_devices, self.backend, device_names=current.device_names,
                                       hang_timeout_s=self.hang_timeout_s)
                result = run_prepared(prepared, self.batches, self.steps, warmup=self.warmup, pool=self.pool,
                                      resume=resumed, checkpoint=self.checkpoint)
                break
            except WorkerFailure as exc:
                if not exc.lost or len(self.restarts) >= self.elastic.max_restarts:
                    if exc.lost and self.elastic.max_restarts:
                        exc.add_note(f"after {len(self.restarts)} restart(s) (--max-restarts "
                                     f"{self.elastic.max_restarts})")
                    raise
                reached = self._reached(resumed)
                now = time.time()
                gone = [current.device_names[r] for r in exc.lost]
                lost.update(dict.fromkeys(gone, now))
                keep, back = available_devices(self.cluster, lost, self.elastic.devices_file)
                for d in back:
                    lost.pop(d)
                current = subset(self.cluster, keep)
                resumed = self._newest() or self.resume
                prepared, record = replan_prepared(self.model, current, self.elastic, backend=self.backend,
                                                   cost=self.cost, sync_batch_stats=strategy.sync_batch_stats)
                self.restarts.append(Restart(str(exc).splitlines()[0], gone, back, reached,
                                             resumed.step if resumed is not None else 0, current.name, keep,
                                             prepared.strategy.method, record, prepared.simulated_iteration_time_s))
                log.warning("lost %s at step %d; resuming from step %d on %s under %s (re-planned in %.2f s)",
                            ", ".join(gone), reached, self.restarts[-1].resumed_from, ", ".join(keep),
                            prepared.strategy.method, record["seconds"])
            finally:
                if self.pool is not None:
                    self.pool.close()
                self.pool = None
        result.restarts = [r.record() for r in self.restarts]
        result.cluster = current.name
        return result

    def _reached(self, resumed: Resumed | None) -> int:
        """The step the failed attempt had reached: the furthest rank's."""
        pool = self.pool
        if pool is None:
            return resumed.step if resumed is not None else 0
        return max(int(pool.status[3 * r]) for r in range(pool.world))

    def _newest(self) -> Resumed | None:
        """The newest complete checkpoint of this run's directory, read back (None: there is none); what the
        failed attempt left half-written there is removed."""
        from heterog.runtime.api import resume_state
        from heterog.runtime.checkpoint import complete_checkpoints, remove_incomplete

        if self.checkpoint is None:
            return None
        remove_incomplete(self.checkpoint.directory)
        if not complete_checkpoints(self.checkpoint.directory):
            return None
        return resume_state(self.model, self.checkpoint.directory)


def replan_prepared(model: Model, cluster: Cluster, elastic: ElasticSettings, *, backend: str = "gloo",
                    cost: CostModel | None = None, sync_batch_stats: bool = False
                    ) -> tuple[PreparedRun, dict[str, Any]]:
    """A plan for ``cluster`` made within ``elastic``'s budget (``heterog.replan``), prepared: the best
    candidate the runtime accepts; and the re-plan's record with the plan kept (``chosen``). Its batch
    statistics are synchronized when ``elastic`` or ``sync_batch_stats`` (the plan it replaces) says so."""
    from heterog.replan import replan
    from heterog.runtime.api import prepare

    found = replan(model.graph, cluster, elastic.replan_method, elastic.replan_budget_s, seed=elastic.seed,
                   sync_batch_stats=elastic.sync_batch_stats or sync_batch_stats)
    record = found.record()
    reasons = []
    for s in found.candidates:
        try:
            prepared = prepare(model, cluster, s, backend=backend, cost=cost)
        except HeterogError as exc:
            reasons.append(f"{s.method}: {str(exc).splitlines()[0]}")
            continue
        record["chosen"] = s.method
        return prepared, record
    raise HeterogError(f"no re-planned plan for {cluster.name!r} can run: {'; '.join(reasons)}")
