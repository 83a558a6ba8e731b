"""Plan and train for real: capture a model for the runtime, check and compile a strategy, lower it, run
it on worker processes, compare with single-process training; and the HeteroG programming interface
``get_runner(model_fn, input_fn, device_info, config)``.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from heterog.errors import HeterogError, ModelError
from heterog.graph.inputs import ExampleInputs
from heterog.graph.value_checks import ValueCheck, check_inputs
from heterog.planners import BEST_DP_CANDIDATES
from heterog.runtime.checkpoint import run_start
from heterog.runtime.executor import Job
from heterog.runtime.instructions import Lowered
from heterog.runtime.launcher import WorkerPool
from heterog.runtime.lowering import lower
from heterog.runtime.scaling import Exponents, probe_exponents
from heterog.runtime.split_lowering import held_part, whole_values
from heterog.runtime.stepprog import StepProgram, build_step_program

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.cost import CostModel
    from heterog.graph.inputs import InputSpec
    from heterog.graph.opgraph import OpGraph
    from heterog.graph.tracing import CapturedStep
    from heterog.runtime.checkpoint import CheckpointSettings, RankCheckpoint, Resumed
    from heterog.runtime.instructions import Part
    from heterog.strategy import Strategy

EQUIVALENCE_RTOL = 1e-5
EQUIVALENCE_ATOL = 1e-6
DP_METHODS = BEST_DP_CANDIDATES              # what method "best-dp" picks from
DEFAULT_PLAN_BUDGET_S = 60.0                  # a search's budget when neither budget nor episodes are given


# ---------------------------------------------------------------------------- the model, captured
@dataclass
class Model:
    """A model ready for the runtime: its captured step, OpGraph, StepProgram and initial values."""

    name: str
    prog: StepProgram
    graph: OpGraph
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    state: list[torch.Tensor]
    example_inputs: tuple[torch.Tensor, ...]
    module: nn.Module | None = field(default=None, repr=False)
    checks: list[ValueCheck] = field(default_factory=list)     # assumptions on every step's inputs
    param_writes: list[str] = field(default_factory=list)      # writes into parameters inside forward
    _exponents: Exponents | None = field(default=None, repr=False)

    def exponents(self) -> Exponents:
        """The batch-scaling exponents of the step (measured once; they do not depend on the plan)."""
        if self._exponents is None:
            self._exponents = probe_exponents(self.prog, self.params, self.buffers, self.state, self.example_inputs)
        return self._exponents

    @property
    def batch_size(self) -> int:
        return self.graph.batch_size

    def inexact_causes(self, strategy: Strategy | None = None) -> list[str]:
        """What keeps plans of this model (``strategy``'s, if given) from training exactly like one device,
        one line each: random ops a replica cannot draw as one device does, writes into parameters inside
        forward, and batch statistics (kept per replica, unless the plan synchronizes them in every group)."""
        causes = [f"random op {line}" for line in self.prog.inexact_random_ops()]
        causes += [f"in-place write inside forward: {line}; each replica writes what its own samples select "
                   "(as nn.Embedding's max_norm renormalises the rows its samples read), so the copies of the "
                   "parameter drift apart" for line in self.param_writes]
        stats = sorted({self.prog.leaves[leaf].node or "" for leaf in self.exponents().statistics})
        if strategy is not None and (strategy.sync_batch_stats or all(c.sync_batch_stats for c in strategy.configs)):
            stats = []
        if stats:
            causes.append(f"batch statistics (per replica, as in data parallelism): {', '.join(stats[:6])}"
                          + (f" and {len(stats) - 6} more" if len(stats) > 6 else ""))
        return causes

    def at_batch(self, batch_size: int) -> Model:
        """The same model and initial values captured at another global batch (the first samples of the
        example inputs)."""
        if batch_size == self.batch_size:
            return self
        if self.module is None or not 1 <= batch_size <= self.batch_size:
            raise HeterogError(f"model {self.name}: cannot capture at batch {batch_size} (global batch "
                               f"{self.batch_size}, module {'kept' if self.module is not None else 'not kept'})")
        spec = input_spec_of(self.prog)
        return capture_model_for_runtime(self.module, spec.rebuild(spec.first_samples(self.example_inputs, batch_size)),
                                         optimizer=self.prog.optimizer, lr=self.prog.lr, name=self.name)

    def initial_values(self) -> dict[str, torch.Tensor]:
        """Placeholder name -> value for parameters, buffers and optimizer state."""
        vals = [*self.params, *self.buffers, *self.state]
        return dict(zip(self.prog.placeholders[:len(vals)], vals))


def input_spec_of(prog: StepProgram | CapturedStep) -> InputSpec:
    """How the captured model is called on its inputs (every step captured by ``capture_fx`` says it)."""
    if prog.input_spec is None:
        raise HeterogError("the captured step does not say how the model is called on its inputs; capture it "
                           "again with heterog.graph.tracing.capture_fx")
    return prog.input_spec


def capture_model_for_runtime(module: nn.Module, example_inputs: ExampleInputs, *,
                              optimizer: str = "sgd", lr: float = 0.01, name: str | None = None) -> Model:
    """Trace ``module``'s training step with symbolic batch sizes and build what the runtime executes.

    The OpGraph is the one ``heterog.capture`` (and ``heterog capture``) produces for the same model and
    batch, so strategies planned on a cached graph fit it (same fingerprint). ``example_inputs`` are a
    tensor, a tuple of tensors or a dict of keyword arguments; ``Model.example_inputs`` holds their tensors
    in flat order (``heterog.graph.inputs``).
    """
    from heterog.graph.capture import capture_fx, graph_from_step

    step = capture_fx(module, example_inputs, optimizer=optimizer, lr=lr, tracing_mode="symbolic")
    inputs = input_spec_of(step).flatten(example_inputs)
    graph = graph_from_step(step, name=name or type(module).__name__)
    prog = build_step_program(step, graph)
    named = dict(module.named_parameters())
    named_buffers = dict(module.named_buffers())
    params = [named[n].detach().clone() for n in prog.param_names]
    buffers = [(named_buffers[n] if n in named_buffers else named[n]).detach().clone() for n in prog.buffer_names]
    state = step.init_state(params)
    return Model(graph.name, prog, graph, params, buffers, state, tuple(t.detach() for t in inputs), module,
                 step.checks, step.param_writes)


def load_model(ref: str, batch_size: int | None = None, *, optimizer: str = "sgd", lr: float = 0.01) -> Model:
    """A zoo name or ``file.py:build`` built for real and captured for the runtime."""
    from heterog.graph.modelref import load_model_fn, model_name

    module, inputs = load_model_fn(ref)(batch_size)
    return capture_model_for_runtime(module, inputs, optimizer=optimizer, lr=lr, name=model_name(ref))


# ---------------------------------------------------------------------------- single-process reference
def resume_state(model: Model, path: str | Path) -> Resumed:
    """The checkpoint at ``path`` (a checkpoint, or a directory of them: the newest complete one) read back
    for ``model`` (``heterog.runtime.checkpoint``); CheckpointError, in one line, if it cannot be."""
    from heterog.runtime.checkpoint import load_checkpoint

    return load_checkpoint(path, model.prog, model.initial_values(), model.name)


def train_single_process(model: Model, batches: Sequence[Sequence[torch.Tensor]], steps: int, *,
                         resume: str | Path | Resumed | None = None, checkpoint: CheckpointSettings | None = None
                         ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Training steps up to step ``steps`` of the captured step on one process (step s uses batches[s % len]
    and draws step s's random values): per-step losses and the final placeholder values (parameters,
    buffers, state). Each step's inputs are checked against the model's value checks first
    (``heterog.graph.value_checks``). ``resume``: start from a checkpoint (its recorded losses head the list);
    ``checkpoint``: write checkpoints as a run under a plan does."""
    resumed = resume_state(model, resume) if isinstance(resume, (str, Path)) else resume
    first, prog = run_start(model.prog, steps, resumed)
    for s in range(first, steps):
        check_inputs(model.checks, batches[s % len(batches)], s)
    init = model.initial_values() if resumed is None else resumed.values
    n_p, n_b = len(model.params), len(model.buffers)
    vals = [init[ph] for ph in prog.placeholders[:n_p + n_b + len(model.state)]]
    params, buffers, state = [v.clone() for v in vals[:n_p]], [v.clone() for v in vals[n_p:n_p + n_b]], \
        [v.clone() for v in vals[n_p + n_b:]]
    losses = list(resumed.losses) if resumed is not None else []
    ck = None
    if checkpoint is not None:
        ck = _writers(model, [[(ph, None) for ph in init]], checkpoint, first, steps, losses, len(batches),
                      prog.rng_seed, {"method": "single process", "cluster": "one process", "devices": []})[0]
    with torch.no_grad():
        for s in range(first, steps):
            loss, params, state = prog.step(params, buffers, state, batches[s % len(batches)], step=s)
            losses.append(float(loss))
            if ck is not None:
                persist = dict(zip(prog.placeholders, [*params, *buffers, *state]))
                ck.after_step(s + 1, persist, float(loss), 0, 1, torch.device("cpu"))
    vals = [*params, *buffers, *state]
    return losses, dict(zip(model.prog.placeholders[:len(vals)], vals))


def _writers(model: Model, held: Sequence[Sequence[tuple[str, Part | None]]], settings: CheckpointSettings,
             first: int, steps: int, losses: Sequence[float], n_batches: int, seed: int, plan: dict[str, Any]
             ) -> list[RankCheckpoint]:
    from heterog.runtime.checkpoint import rank_writers

    about = {"model": model.name, "graph_fingerprint": model.graph.fingerprint, "optimizer": model.prog.optimizer,
             "lr": model.prog.lr, "batch_size": model.batch_size, "plan": plan}
    return rank_writers(model.prog, model.initial_values(), held, settings, first=first, steps=steps, losses=losses,
                        n_batches=n_batches, seed=seed, about=about)


# ---------------------------------------------------------------------------- a plan ready to run
@dataclass
class PreparedRun:
    """A strategy checked, compiled, simulated and lowered for one model and cluster."""

    model: Model
    cluster: Cluster
    strategy: Strategy
    simulated_iteration_time_s: float
    lowered: Lowered
    exponents: Exponents
    backend: str
    emulate: bool
    simulated_peak_memory_bytes: dict[str, int] = field(default_factory=dict)   # device name -> bytes

    def jobs(self, batches: Sequence[Sequence[torch.Tensor]], steps: int, *, return_state: bool = True,
             resumed: Resumed | None = None, checkpoint: CheckpointSettings | None = None) -> list[Job]:
        """One job per rank training up to step ``steps``: from the model's initial values, or from
        ``resumed`` (its values cut into the parts each rank holds, its step, its random streams);
        ``checkpoint``: each rank writes its parts when a checkpoint is due."""
        first, prog = run_start(self.model.prog, steps, resumed)
        init = self.model.initial_values() if resumed is None else resumed.values
        writers: list[RankCheckpoint | None] = [None] * len(self.lowered.ranks)
        if checkpoint is not None:
            plan = {"method": self.strategy.method, "cluster": self.cluster.name,
                    "devices": self.cluster.device_names}
            held = [[(ph, rp.persist_parts.get(ph) if ph in self.lowered.parts else None) for _, ph in rp.report]
                    for rp in self.lowered.ranks]
            writers = list(_writers(self.model, held, checkpoint, first, steps, resumed.losses if resumed else [],
                                    len(batches), prog.rng_seed, plan))
        out = []
        sizes_all = {b: self.model.prog.sizes_at(b) for rp in self.lowered.ranks for b in rp.batches}
        for rp, writer in zip(self.lowered.ranks, writers):
            rp.persist = {name: held_part(init[rp.host.get(name, name)], rp.persist_parts.get(name))
                          for name in rp.persist}
            sizes = {b: sizes_all[b] for b in rp.batches}
            out.append(Job(prog, rp, list(self.lowered.groups), sizes, steps - first,
                           [tuple(t.detach() for t in batch) for batch in batches], self.emulate,
                           name=f"{self.model.name}/{self.strategy.method}", return_state=return_state,
                           first_step=first, checkpoint=writer))
        return out


def is_emulated(cluster: Cluster) -> bool:
    """local-cpu clusters are emulated: per-worker slowdown and link speed are enforced by the runtime."""
    return str(cluster.name).startswith("local-cpu")


def prepare(model: Model, cluster: Cluster, strategy: Strategy, *, backend: str = "gloo",
            cost: CostModel | None = None, check: bool = True) -> PreparedRun:
    """Check ``strategy`` against the model's graph and the cluster (before any process starts), compile
    and simulate it (the simulated order is the execution order), measure scaling exponents and lower it
    to per-rank programs. ``check``: run the per-rank programs once on fake tensors and refuse (with a
    ``StrategyError`` that names the rank, the instruction and the reason) a plan that cannot run, e.g. a
    data-parallel plan of a model with its batch size written into a view (``heterog.runtime.check``)."""
    from heterog.evaluate import Evaluator

    strategy.check_fits(model.graph, cluster)
    ev = Evaluator(model.graph, cluster, cost)
    plan = ev.compile(strategy)
    sim = ev.simulate_plan(plan)
    exps = model.exponents()
    if exps.coupled or exps.statistics:
        import logging

        names = exps.coupled + sorted(str(model.prog.leaves[leaf].node) for leaf in exps.statistics)
        logging.getLogger(__name__).info(
            "%d values are statistics of the batch (e.g. batch norm): replicas compute them over their own "
            "samples, as in data parallelism: %s", len(names), ", ".join(names[:8]))
    emulate = is_emulated(cluster) and backend == "gloo"
    lowered = lower(model.prog, model.graph, cluster, plan, sim.start, exps, emulate=emulate,
                    post_early=True, finish=sim.finish)
    peak = {name: int(sim.peak_memory[d]) for d, name in enumerate(cluster.device_names)}
    prepared = PreparedRun(model, cluster, strategy, float(sim.makespan), lowered, exps, backend, emulate, peak)
    if check:
        from heterog.runtime.check import check_prepared

        check_prepared(prepared)
    return prepared


# ---------------------------------------------------------------------------- results
@dataclass
class RunResult:
    """What a real run measured (times in seconds; ``iteration_time_s`` is the median after warm-up).

    ``measured_peak_memory_bytes`` (device name -> bytes, one worker per device): the high-water mark
    over all steps of the bytes each worker holds in its value tables, parameters, buffers, optimizer
    state, gradients and activations from production until their last consumer
    (``heterog.runtime.memory.LiveBytes`` says what is counted and why); ``simulated_peak_memory_bytes``:
    the simulator's peak for the same plan (DESIGN section 3)."""

    method: str
    iteration_times_s: list[float]
    iteration_time_s: float
    losses: list[float]
    values: dict[str, torch.Tensor] = field(repr=False)          # placeholder -> final value
    simulated_iteration_time_s: float = math.nan
    warmup_steps: int = 0
    n_messages: int = 0
    n_allreduce: int = 0
    n_ps_aggregations: int = 0
    measured_peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    simulated_peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    first_step: int = 0                    # a resumed run: the checkpoint's step (``losses`` covers every step)
    checkpoints: list[tuple[int, float]] = field(default_factory=list)   # (step, seconds writing: slowest rank)
    restarts: list[dict[str, Any]] = field(default_factory=list)   # an elastic run's (heterog.runtime.elastic)
    cluster: str = ""                      # the cluster the run ended on (an elastic run's may be smaller)

    def params(self, model: Model) -> dict[str, torch.Tensor]:
        """Final parameters by parameter name."""
        return {n: self.values[ph] for n, ph in zip(model.prog.param_names, model.prog.placeholders)}

    def record(self) -> dict[str, Any]:
        return {"method": self.method, "iteration_time_s": self.iteration_time_s,
                "iteration_times_s": self.iteration_times_s, "losses": self.losses,
                "simulated_iteration_time_s": self.simulated_iteration_time_s, "warmup_steps": self.warmup_steps,
                "n_messages": self.n_messages, "n_allreduce": self.n_allreduce,
                "n_ps_aggregations": self.n_ps_aggregations,
                "measured_peak_memory_bytes": self.measured_peak_memory_bytes,
                "simulated_peak_memory_bytes": self.simulated_peak_memory_bytes, "first_step": self.first_step,
                "checkpoints": [{"step": st, "seconds": sec} for st, sec in self.checkpoints],
                "restarts": self.restarts}


def median_after_warmup(times: Sequence[float], warmup: int) -> tuple[float, int]:
    """Median of ``times`` without the first ``warmup`` (fewer when there are not enough steps)."""
    w = max(0, min(int(warmup), len(times) - 1))
    return float(statistics.median(times[w:])), w


def collect(prepared: PreparedRun, results: list[dict[str, Any]], warmup: int, resumed: Resumed | None = None
            ) -> RunResult:
    """Merge the ranks' results: a step lasts as long as its slowest rank; the loss is the sum of the
    ranks' share-weighted terms (after those of the steps before ``resumed``'s checkpoint)."""
    steps = len(results[0]["times_s"])
    times = [max(r["times_s"][s] for r in results) for s in range(steps)]
    losses = [sum(r["loss_terms"][s] for r in results if r["has_loss"]) for s in range(steps)]
    before = list(resumed.losses) if resumed is not None else []
    written: dict[int, float] = {}
    for r in results:
        for step, took in r.get("checkpoints", ()):
            written[step] = max(written.get(step, 0.0), took)
    by_rank = sorted(results, key=lambda r: r.get("rank", 0))
    values = whole_values(prepared.lowered, [{ph: v for ph, (_, v) in r["values"].items()} for r in by_rank])
    it, w = median_after_warmup(times, warmup)
    low = prepared.lowered
    names = prepared.cluster.device_names
    measured = {names[r.get("rank", k)]: int(r.get("peak_memory_bytes", 0)) for k, r in enumerate(results)}
    return RunResult(prepared.strategy.method or "strategy", times, it, before + losses, values,
                     prepared.simulated_iteration_time_s, w, len(low.messages), low.n_allreduce, low.n_aggregate,
                     measured, dict(prepared.simulated_peak_memory_bytes), len(before), sorted(written.items()),
                     cluster=prepared.cluster.name)


def run_prepared(prepared: PreparedRun, batches: Sequence[Sequence[torch.Tensor]], steps: int, *,
                 warmup: int = 1, pool: WorkerPool | None = None, hang_timeout_s: float = 60.0,
                 return_state: bool = True, resume: str | Path | Resumed | None = None,
                 checkpoint: CheckpointSettings | None = None) -> RunResult:
    """Train up to step ``steps`` on ``pool`` (or a new pool of one process per device, closed afterwards):
    from the start, or from checkpoint ``resume`` (then ``losses`` covers every step); with ``checkpoint``,
    the ranks write checkpoints as they fall due (``heterog.runtime.checkpoint``)."""
    if steps < 1:
        raise HeterogError(f"steps must be at least 1, got {steps}")
    resumed = resume_state(prepared.model, resume) if isinstance(resume, (str, Path)) else resume
    for s in range(resumed.step if resumed is not None else 0, steps):   # the model's own checks, each step
        check_inputs(prepared.model.checks, batches[s % len(batches)], s)
    jobs = prepared.jobs(batches, steps, return_state=return_state, resumed=resumed, checkpoint=checkpoint)
    own = pool is None
    if pool is None:
        pool = WorkerPool(prepared.cluster.n_devices, prepared.backend, device_names=prepared.cluster.device_names,
                          hang_timeout_s=hang_timeout_s)
    elif pool.world != prepared.cluster.n_devices:
        raise HeterogError(f"worker pool has {pool.world} ranks, cluster {prepared.cluster.name!r} has "
                           f"{prepared.cluster.n_devices} devices")
    try:
        results = pool.run(jobs)
    finally:
        if own:
            pool.close()
    return collect(prepared, results, warmup, resumed)


def compare_values(model: Model, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *,
                   rtol: float = EQUIVALENCE_RTOL, atol: float = EQUIVALENCE_ATOL) -> tuple[bool, float, list[str]]:
    """(all parameters close, max |difference| over parameters, names of those that differ)."""
    worst, bad = 0.0, []
    for name, ph in zip(model.prog.param_names, model.prog.placeholders):
        a, b = got[ph].double(), want[ph].double()
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        worst = max(worst, diff)
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            bad.append(name)
    return not bad, worst, bad


# ---------------------------------------------------------------------------- planning
def resolve_strategy(model: Model, cluster: Cluster, *, strategy: Strategy | str | Path | None = None,
                     method: str | None = None, cost: CostModel | None = None, seed: int = 0,
                     budget_s: float | None = None, episodes: int | None = None) -> Strategy:
    """A Strategy object: the given one (object or file, checked against graph and cluster), or planned
    with ``method`` (None: the default, see ``default_method``) through the planner registry
    (``heterog.planners``); without ``budget_s`` or ``episodes`` a search gets ``DEFAULT_PLAN_BUDGET_S``."""
    from heterog import planners
    from heterog.evaluate import Evaluator
    from heterog.strategy import Strategy

    if strategy is not None:
        s = Strategy.load(strategy) if not isinstance(strategy, Strategy) else strategy
        s.check_fits(model.graph, cluster)
        return s
    if budget_s is None and episodes is None:
        budget_s = DEFAULT_PLAN_BUDGET_S
    return planners.plan(method or default_method(), evaluator=Evaluator(model.graph, cluster, cost), seed=seed,
                         budget_s=budget_s, episodes=episodes, progress=False)


def default_method() -> str:
    """"agent" when the learning agent's planner is registered and loads (``heterog.planners``), else
    "best-dp" (the fastest simulated DP baseline)."""
    from heterog import planners

    try:
        planners.get("agent")
    except HeterogError:
        return "best-dp"
    return "agent"


# ---------------------------------------------------------------------------- get_runner
@dataclass
class RunnerConfig:
    """Settings of ``get_runner``."""

    method: str | None = None          # planner; None: "agent" if importable, else "best-dp"
    strategy: Any = None               # a Strategy (or strategy file) instead of planning
    steps: int = 10                    # default for Runner.run()
    optimizer: str = "sgd"             # sgd | momentum | adam
    lr: float = 0.01                   # learning rate
    backend: str = "gloo"              # gloo (CPU processes) | nccl (one GPU per device)
    warmup_steps: int = 1              # steps left out of the median iteration time
    plan_budget_s: float | None = None  # agent: wall-clock budget (default 60 s)
    plan_episodes: int | None = None   # agent: episodes instead of a budget
    seed: int = 0                      # planning seed
    hang_timeout_s: float = 60.0       # a worker silent this long counts as hung
    pool: Any = None                   # a running WorkerPool to use (else one is started and kept until close())

    @classmethod
    def of(cls, config: RunnerConfig | dict | None) -> RunnerConfig:
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            unknown = sorted(set(config) - set(cls.__dataclass_fields__))
            if unknown:
                raise HeterogError(f"unknown runner settings {unknown}; known: {sorted(cls.__dataclass_fields__)}")
            return cls(**config)
        raise HeterogError(f"config must be a RunnerConfig or a dict, got {type(config).__name__}")


@dataclass
class RunnerResult:
    """Per-step losses and iteration times of ``Runner.run``."""

    losses: list[float]
    iteration_times_s: list[float]
    iteration_time_s: float
    simulated_iteration_time_s: float
    method: str


def _cluster_of(device_info: Any) -> Cluster:
    from heterog.cluster import Cluster, load_cluster
    from heterog.cluster.loader import cluster_from_dict

    if isinstance(device_info, Cluster):
        return device_info
    if isinstance(device_info, str):
        return load_cluster(device_info)
    if isinstance(device_info, dict):
        return cluster_from_dict(device_info, source="device_info", default_name="user-cluster")
    if isinstance(device_info, (list, tuple)) and device_info and all(isinstance(d, str) for d in device_info):
        return cluster_from_dict({"name": "user-cluster", "servers": [{"gpus": list(device_info),
                                  "intra": {"kind": "pcie", "bandwidth": "12 GB/s"}}]},
                                 source="device_info", default_name="user-cluster")
    raise HeterogError("device_info must be a cluster name or YAML path (e.g. 'local-cpu-2'), a Cluster, a "
                       "cluster dict, or a list of device type names")


class Runner:
    """The HeteroG programming interface: plan once, then train. See ``get_runner``."""

    def __init__(self, model_fn: Callable[..., Any], input_fn: Callable[..., Any], device_info: Any,
                 config: RunnerConfig | dict | None = None) -> None:
        self.config = RunnerConfig.of(config)
        self.cluster = _cluster_of(device_info)
        self.input_fn = input_fn
        self._step = 0
        first = self._next_inputs()
        built = model_fn()
        module = built[0] if isinstance(built, (tuple, list)) else built
        if not isinstance(module, nn.Module):
            raise ModelError(f"model_fn must return a torch.nn.Module (or (module, example_inputs)), got "
                             f"{type(module).__name__}")
        self.model = capture_model_for_runtime(module, first, optimizer=self.config.optimizer, lr=self.config.lr)
        self._first = first
        self._strategy: Strategy | None = None
        self._prepared: PreparedRun | None = None
        self._values: dict[str, torch.Tensor] | None = None
        self._pool: WorkerPool | None = self.config.pool
        self._finalizer: Callable[[], object] | None = None

    def _next_inputs(self) -> Any:
        x = self.input_fn()
        if isinstance(x, Mapping):
            return x
        x = (x,) if isinstance(x, torch.Tensor) else tuple(x)
        if not x or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in x):
            raise ModelError("input_fn must return a tensor, a tuple of tensors with the batch on dimension 0, "
                             "or a dict of keyword arguments")
        return x

    @property
    def strategy(self) -> Strategy:
        """The plan (computed on first use with the configured method)."""
        if self._strategy is None:
            c = self.config
            self._strategy = resolve_strategy(self.model, self.cluster, strategy=c.strategy, method=c.method,
                                              seed=c.seed, budget_s=c.plan_budget_s, episodes=c.plan_episodes)
        return self._strategy

    def run(self, steps: int | None = None) -> RunnerResult:
        """Train ``steps`` steps (default ``config.steps``) with the plan; parameters carry over between
        calls. Returns per-step losses and iteration times."""
        steps = self.config.steps if steps is None else int(steps)
        if self._prepared is None:
            self._prepared = prepare(self.model, self.cluster, self.strategy, backend=self.config.backend)
        batches = []
        spec = input_spec_of(self.model.prog)
        for _ in range(steps):
            batches.append(spec.flatten(self._first if self._step == 0 else self._next_inputs()))
            self._step += 1
        if self._values is not None:
            self._load(self._values)
        if self._pool is None or self._pool.closed:
            import weakref

            self._pool = WorkerPool(self.cluster.n_devices, self.config.backend,
                                    device_names=self.cluster.device_names, hang_timeout_s=self.config.hang_timeout_s)
            self._finalizer = weakref.finalize(self, self._pool.close)
        res = run_prepared(self._prepared, batches, steps, warmup=self.config.warmup_steps, pool=self._pool)
        self._values = res.values
        return RunnerResult(res.losses, res.iteration_times_s, res.iteration_time_s,
                            res.simulated_iteration_time_s, res.method)

    def close(self) -> None:
        """Stop the worker processes this runner started (a pool passed in the config is left running)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self, values: dict[str, torch.Tensor]) -> None:
        m, prog = self.model, self.model.prog
        n_p, n_b = len(m.params), len(m.buffers)
        phs = prog.placeholders
        m.params = [values.get(ph, v) for ph, v in zip(phs[:n_p], m.params)]
        m.buffers = [values.get(ph, v) for ph, v in zip(phs[n_p:n_p + n_b], m.buffers)]
        m.state = [values.get(ph, v) for ph, v in zip(phs[n_p + n_b:], m.state)]

    def parameters(self) -> dict[str, torch.Tensor]:
        """Current parameters by name (initial ones before the first run)."""
        if self._values is not None:
            self._load(self._values)
        return dict(zip(self.model.prog.param_names, self.model.params))


def get_runner(model_fn: Callable[..., Any], input_fn: Callable[..., Any], device_info: Any,
               config: RunnerConfig | dict | None = None) -> Runner:
    """The HeteroG paper's interface: ``model_fn()`` builds the model (an ``nn.Module`` whose call on the inputs
    returns the scalar mean loss, or a tuple with the loss first, a dict with a "loss" entry or an object with
    ``.loss``: ``heterog.graph.capture.select_loss``; or ``(module, example_inputs)``), ``input_fn()`` returns one
    global batch (a tensor or tuple of tensors, batch on dim 0; called once per step), ``device_info`` names a
    cluster (``"local-cpu-4:slowdown=1,1,2,2"``, a YAML path) or describes devices (a Cluster, a cluster dict, or a
    list of device type names). ``config`` (RunnerConfig or dict) picks the planning method (default: the agent when
    importable, else the fastest simulated DP baseline), optimizer, backend and default steps.
    ``get_runner(...).run(steps)`` plans, then trains, and returns per-step losses and times."""
    return Runner(model_fn, input_fn, device_info, config)
