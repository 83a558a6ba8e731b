"""One evaluation of a plan: compile -> priorities -> simulate, and the numbers people compare.

``simulate(graph, cluster, strategy)`` is the public entry; ``Evaluator`` keeps the cost model and the
graph's grouping so that planners and the agent can score thousands of strategies cheaply.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

import simulator
from heterog.actions import strategy_from_actions
from heterog.compiler import CompiledPlan, Compiler
from heterog.compiler.compile import COMM_KINDS, COMPUTE_KINDS
from heterog.compiler.offload import host_peaks
from heterog.compose import Repetition, SliceCost, Unrepeated, find_repetition, server_signatures
from heterog.errors import HeterogError
from heterog.graph.grouping import group_ops
from heterog.scheduler import DEFAULT_ORDER, PORTFOLIO, check_order, is_dynamic, priorities
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.cost import CostModel, LayerProfile
    from heterog.graph.opgraph import OpGraph

SHARE_MODES = ("power", "speed", "graph-speed")


def _union_length(start: np.ndarray, finish: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Total length of the union of intervals, and the merged intervals."""
    if len(start) == 0:
        return 0.0, np.zeros(0), np.zeros(0)
    o = np.argsort(start, kind="stable")
    s, f = start[o], finish[o]
    run_max = np.maximum.accumulate(f)
    new = np.concatenate([[True], s[1:] > run_max[:-1]])
    ms = s[new]
    mf = np.maximum.reduceat(f, np.nonzero(new)[0])
    return float(np.sum(mf - ms)), ms, mf


def _intersection_length(a_s: np.ndarray, a_f: np.ndarray, b_s: np.ndarray, b_f: np.ndarray) -> float:
    """Length of the intersection of two sets of disjoint sorted intervals."""
    i = j = 0
    total = 0.0
    while i < len(a_s) and j < len(b_s):
        lo, hi = max(a_s[i], b_s[j]), min(a_f[i], b_f[j])
        if hi > lo:
            total += hi - lo
        if a_f[i] < b_f[j]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class PlanResult:
    """The simulated outcome of one plan (times in seconds, memory in bytes)."""

    method: str
    iteration_time_s: float
    oom: bool
    peak_memory_bytes: dict            # device name -> bytes
    memory_capacity_bytes: dict        # device name -> bytes
    compute_time_s: float              # busiest GPU's compute time
    comm_time_s: float                 # time during which some transfer or collective runs
    overlap_ratio: float               # share of comm_time_s hidden under computation
    search_time_s: float = 0.0
    n_tasks: int = 0
    order: str = ""                    # the task order the time was simulated under (the one ``best`` kept)
    order_requested: str = ""          # the order asked for (``best``: the faster of ``PORTFOLIO``)
    sim: simulator.SimResult | None = field(default=None, repr=False)
    plan: CompiledPlan | None = field(default=None, repr=False)
    host_memory_bytes: dict = field(default_factory=dict)   # server name -> peak bytes in its host memory
                                                            # (plans that offload state; empty otherwise)
    checkpoint_time_s: float = 0.0     # one checkpoint's writing (``Evaluator(checkpoint_every_steps=K)``;
                                       # iteration_time_s then includes 1/K of it), 0 without the term
    checkpoint_bytes: dict = field(default_factory=dict)    # device name -> bytes it writes to a checkpoint
    composed: int = 1                  # slices of the cluster the simulation stands for (``heterog.compose``:
                                       # above 1, ``plan`` and ``sim`` are one slice's)

    def record(self) -> dict:
        """The JSON record of ``heterog simulate --json`` (docs/design.md section 5)."""
        return {"method": self.method, "iteration_time_s": self.iteration_time_s, "oom": self.oom,
                "peak_memory_bytes": self.peak_memory_bytes, "memory_capacity_bytes": self.memory_capacity_bytes,
                "compute_time_s": self.compute_time_s, "comm_time_s": self.comm_time_s,
                "overlap_ratio": self.overlap_ratio, "search_time_s": self.search_time_s, "n_tasks": self.n_tasks,
                "order": self.order, "order_requested": self.order_requested,
                "host_memory_bytes": self.host_memory_bytes, "checkpoint_time_s": self.checkpoint_time_s,
                "checkpoint_bytes": self.checkpoint_bytes, "composed": self.composed}


def reward(iteration_time_s: float, oom: bool, oom_factor: float = 10.0) -> float:
    """-sqrt(iteration time), multiplied by ``oom_factor`` if any device is out of memory."""
    r = -float(np.sqrt(iteration_time_s))
    return r * oom_factor if oom else r


class Evaluator:
    """Scores strategies for one (graph, cluster): compile, prioritise, simulate.

    ``layer_profile``: a per-layer profile (``heterog.cost.LayerProfile``) the cost model takes the times of
    profiled layers from (``cost_model``); ``time_sources`` reports which ops took them.

    ``order`` is the task order (``heterog.scheduler.ORDERS``). The default, ``best``, simulates each order
    of ``PORTFOLIO`` (and ``plan``, the strategy's own op order, when it has one) and keeps the faster;
    ``simulate_kept`` says which was kept, and the runtime executes that one. ``sync_batch_stats``: every
    strategy is compiled with synchronized batch statistics (``heterog.compiler.sync_stats``), as a plan
    carrying ``Strategy.sync_batch_stats`` is.

    ``checkpoint_every_steps``: K adds the optional checkpoint term, 1/K of the time one checkpoint takes
    (``heterog.checkpoint_cost``), to every iteration time it reports, so that planners weigh what a plan's
    layout of the state costs to save; None (the default) leaves it out.

    ``compose``: a plan that repeats one slice of the cluster (``heterog.compose``) is simulated on that slice in
    ``iteration_time`` (the search's path), and in ``evaluate`` when asked; the same time and memory as the
    whole simulation, which every other plan, and ``evaluate`` by default, gets.

    ``n_evaluations`` counts the evaluations made, ``simulate_s`` the seconds they spent in the simulator's event
    loop (a composed plan's on its slice): with them a search reports how many evaluations per second the
    simulations alone would allow.
    """

    def __init__(self, graph: OpGraph, cluster: Cluster, cost: CostModel | None = None, *,
                 order: str = DEFAULT_ORDER, serialize_collectives: bool = False, max_groups: int = 2000,
                 shares: str = "power", delta: bool = True, layer_profile: LayerProfile | None = None,
                 sync_batch_stats: bool = False, checkpoint_every_steps: int | None = None,
                 compose: bool = True) -> None:
        self.graph, self.cluster = graph, cluster
        self.compose = bool(compose)
        self._slices: dict[tuple, Evaluator] = {}
        self._unrepeated: set[tuple] = set()       # repetitions whose slice met a collective it does not cover
        # repetitions found, by the plan's configs (their ids: each kept alive with it), groups and micro-batches
        self._repetitions: dict[tuple, tuple[list[ParallelConfig], Repetition | None, tuple]] = {}
        self._signatures: list[tuple] | None = None
        self._alike = False                          # two servers alike (set with the signatures)
        if checkpoint_every_steps is not None and int(checkpoint_every_steps) < 1:
            raise HeterogError(f"checkpoint_every_steps must be at least 1, got {checkpoint_every_steps}")
        self.checkpoint_every_steps = checkpoint_every_steps
        if cost is not None and layer_profile is not None:
            raise HeterogError("give the layer profile to the CostModel passed as cost, or pass no cost")
        self.cost = cost if cost is not None else cost_model(cluster, layer_profile)
        self.compiler = Compiler(graph, cluster, self.cost, serialize_collectives=serialize_collectives,
                                 max_bases=4 if delta else 0, sync_batch_stats=sync_batch_stats)
        self.sync_batch_stats = bool(sync_batch_stats)
        self.order = check_order(order)
        if shares not in SHARE_MODES:
            raise HeterogError(f"unknown share mode {shares!r} (choose from {', '.join(SHARE_MODES)})")
        self.shares = shares
        self._group_speed: np.ndarray | None = None
        self.serialize_collectives = serialize_collectives
        self.n_evaluations = 0
        self.simulate_s = 0.0           # seconds in the simulator's event loop over its evaluations, slices' included
        self.max_groups = max_groups
        self._group_of: np.ndarray | None = None

    @property
    def group_of(self) -> np.ndarray:
        """The graph's op groups (HeteroG grouping by mean op time over the cluster's devices)."""
        if self._group_of is None:
            self._group_of = group_ops(self.graph, self.cost.full_batch_times(self.graph).mean(axis=1),
                                       self.max_groups)
        return self._group_of

    @property
    def n_groups(self) -> int:
        return int(self.group_of.max()) + 1

    def strategy(self, actions: Sequence[int] | np.ndarray, method: str = "") -> Strategy:
        """Decode one (M+4)-way action per group into a Strategy. Proportional shares follow device peak
        FLOP/s (``shares="power"``, the paper's CP baselines), each group's own speed on each device from
        the cost model (``shares="speed"``; neighbouring groups then differ in layout and need re-layouts),
        or each device's speed on the whole graph (``shares="graph-speed"``, one layout for all groups)."""
        weights: np.ndarray | None = None
        if self.shares == "speed":
            weights = self.group_speed
        elif self.shares == "graph-speed":
            t = self.cost.full_batch_times(self.graph).sum(axis=0)
            weights = np.broadcast_to(1.0 / t, (self.n_groups, len(t)))
        return strategy_from_actions(actions, self.group_of, self.graph, self.cluster, method, weights=weights)

    @property
    def group_speed(self) -> np.ndarray:
        """(G, M): 1 / (time of the group's ops at the full batch on each device); groups without compute
        fall back to device peak FLOP/s."""
        if self._group_speed is None:
            t = self.cost.full_batch_times(self.graph)
            g_time = np.zeros((self.n_groups, self.cluster.n_devices))
            np.add.at(g_time, self.group_of, t)
            power = np.broadcast_to(self.cluster.power / self.cluster.power.max(), g_time.shape)
            ok = np.all(g_time > 0, axis=1)
            self._group_speed = np.where(ok[:, None], 1.0 / np.where(g_time > 0, g_time, 1.0), power)
        return self._group_speed

    def time_sources(self, plan: CompiledPlan) -> dict[str, dict[str, dict[str, float]]]:
        """Where the plan's compute times come from: per device type, per source ("profile": the layer
        profile, "roofline": the roofline or an op profile entry), its distinct ops, compute tasks and their
        seconds (task durations, gradient accumulation included)."""
        from heterog.cost import source_summary

        comp = np.isin(plan.task_kind, [int(k) for k in COMPUTE_KINDS])
        return source_summary([d.type.name for d in self.cluster.devices], self.cost.time_sources(self.graph),
                              plan.task_op[comp], plan.task_device[comp], np.asarray(plan.tg.duration)[comp])

    def compile(self, strategy: Strategy) -> CompiledPlan:
        """The strategy's CompiledPlan; a strategy close to one compiled recently patches that plan
        (``heterog.compiler.delta``: the same plan as a compilation from scratch, in less time)."""
        return self.compiler.compile(strategy)

    def priorities(self, plan: CompiledPlan, order: str | None = None) -> np.ndarray:
        """Static priorities of one order (not ``best``, which is a choice among several)."""
        order = order or self.order
        if order == "plan" and plan.op_priority is not None:
            # the strategy fixes an op order (e.g. DPOS): tasks inherit it; upward rank breaks ties
            rank = priorities(plan.tg, "rank")
            op_p = np.asarray(plan.op_priority, dtype=np.float64)[plan.task_prio_op]
            return op_p * (1.0 + rank.max()) + rank
        if order == "plan":
            order = "rank"
        comm_mask = np.isin(plan.task_kind, [int(k) for k in COMM_KINDS]) if order == "rank-links" else None
        prio = priorities(plan.tg, order, comm_mask=comm_mask)
        if plan.task_slot is not None and not is_dynamic(order):
            # micro-batches in their schedule's order: a task of an earlier slot first, then the order's rank
            span = float(prio.max() - prio.min()) + 1.0 if len(prio) else 1.0
            prio = prio - plan.task_slot * span
        return prio

    def candidate_orders(self, plan: CompiledPlan, order: str | None = None) -> tuple[str, ...]:
        """The orders ``order`` stands for on ``plan``: ``best`` is ``PORTFOLIO`` plus ``plan`` when the
        strategy has its own op order; any other name is itself."""
        order = order or self.order
        if order != "best":
            return (order,)
        return PORTFOLIO + (("plan",) if plan.op_priority is not None else ())

    def simulate_kept(self, plan: CompiledPlan, order: str | None = None) -> tuple[simulator.SimResult, str]:
        """Simulate ``plan`` under each candidate order and keep the fastest (ties: the first; a plan that
        fits in memory beats one that does not): (its SimResult, the order kept)."""
        best: simulator.SimResult | None = None
        kept = ""
        for o in self.candidate_orders(plan, order):
            prio = self.priorities(plan, o)
            t0 = time.perf_counter()
            res = simulator.simulate(plan.tg, priority=prio, fifo=is_dynamic(o))
            self.simulate_s += time.perf_counter() - t0
            if best is None or (res.oom, res.makespan) < (best.oom, best.makespan):
                best, kept = res, o
        assert best is not None  # candidate_orders names at least one order
        return best, kept

    def simulate_plan(self, plan: CompiledPlan, order: str | None = None) -> simulator.SimResult:
        return self.simulate_kept(plan, order)[0]

    def clear_plans(self) -> None:
        """Forget the compiled plans kept for patching (this evaluator's and its slices'): the next evaluation of
        any strategy compiles from scratch."""
        self.compiler.bases.clear()
        for ev in self._slices.values():
            ev.compiler.bases.clear()

    def repetition(self, strategy: Strategy) -> tuple[Evaluator, Repetition] | None:
        """Where ``strategy`` repeats one slice of the cluster (``heterog.compose``) and this evaluator composes:
        the evaluator of that slice (kept for the next plans of the same slice) and the repetition; else None."""
        if not self.compose or self.checkpoint_every_steps is not None:
            return None
        if self._signatures is None:
            self._signatures = server_signatures(self.cluster)
            self._alike = len(set(self._signatures)) < len(self._signatures)
        if not self._alike:                          # no two servers alike: nothing repeats
            return None
        layout = (tuple(map(id, strategy.configs)), strategy.micro, strategy.group_of.tobytes())
        hit = self._repetitions.get(layout)
        if hit is None:                              # the search's plans come back: found once per layout
            if len(self._repetitions) >= 256:
                self._repetitions.clear()
            found = find_repetition(self.graph, self.cluster, strategy, self._signatures)
            hit = self._repetitions[layout] = (list(strategy.configs), found, () if found is None else found.key)
        _, found, key = hit
        if found is None or key in self._unrepeated:
            return None
        rep = found.on(strategy)
        ev = self._slices.get(key)
        if ev is None:
            if len(self._slices) >= 8:
                self._slices.clear()
            ev = self._slices[key] = _SliceEvaluator(
                self.graph, rep.cluster, SliceCost(self.cost, rep), order=self.order,
                serialize_collectives=self.serialize_collectives, delta=self.compiler.bases.max_plans > 0,
                sync_batch_stats=self.sync_batch_stats, compose=False)
        return ev, rep

    def evaluate(self, strategy: Strategy, order: str | None = None, *, method: str | None = None,
                 detail: bool = True, compose: bool = False) -> PlanResult:
        """The simulated outcome of ``strategy``; ``compose``: of one slice where it repeats one (``repetition``),
        as the whole plan's (``compose_result``)."""
        hit = self.repetition(strategy) if compose else None
        if hit is not None:
            ev, rep = hit
            before = ev.simulate_s
            try:
                one = ev.evaluate(rep.strategy, order or self.order, method=method or strategy.method, detail=detail)
            except Unrepeated:
                self._unrepeated.add(rep.key)
            else:
                self.n_evaluations += 1
                self.simulate_s += ev.simulate_s - before
                return compose_result(one, rep, self.cluster)
        plan = self.compile(strategy)
        res, kept = self.simulate_kept(plan, order)
        self.n_evaluations += 1
        out = self.summarise(plan, res, method or strategy.method, detail=detail)
        out.order, out.order_requested = kept, order or self.order
        return out

    def iteration_time(self, strategy: Strategy, order: str | None = None) -> tuple[float, bool]:
        """Fast path for search: (iteration time, OOM); a plan that repeats one slice of the cluster is simulated
        on the slice (``repetition``)."""
        hit = self.repetition(strategy)
        if hit is not None:
            before = hit[0].simulate_s
            try:
                out = hit[0].iteration_time(hit[1].strategy, order or self.order)
            except Unrepeated:
                self._unrepeated.add(hit[1].key)
            else:
                self.n_evaluations += 1
                self.simulate_s += hit[0].simulate_s - before
                return out
        plan = self.compile(strategy)
        res = self.simulate_plan(plan, order)
        self.n_evaluations += 1
        return float(res.makespan) + self.checkpoint_share_s(plan), bool(res.oom)

    def ps_devices(self, strategy: Strategy) -> dict[int, int]:
        """The PS device of each PS group of ``strategy`` as compiled (group -> device)."""
        return {int(g): int(d) for g, d in self.compile(strategy).placements.ps_device.items()}

    def checkpoint_share_s(self, plan: CompiledPlan) -> float:
        """The checkpoint term of ``plan``'s iteration time: one checkpoint's time over the interval (0 without
        ``checkpoint_every_steps``)."""
        if self.checkpoint_every_steps is None:
            return 0.0
        from heterog.checkpoint_cost import checkpoint_bytes, checkpoint_time_s

        t = checkpoint_time_s(self.cluster, checkpoint_bytes(self.graph, self.cluster, plan))
        return t / self.checkpoint_every_steps

    def summarise(self, plan: CompiledPlan, res: simulator.SimResult, method: str, detail: bool = True) -> PlanResult:
        m = plan.n_devices
        names = [d.name for d in self.cluster.devices]
        peak = {names[d]: float(res.peak_memory[d]) for d in range(m)}
        cap = {names[d]: float(self.cluster.memory_bytes[d]) for d in range(m)}
        compute_mask = np.isin(plan.task_kind, [int(k) for k in COMPUTE_KINDS])
        busy = np.asarray(res.busy)[:m]
        compute_time = float(busy.max()) if m else 0.0
        comm_mask = np.isin(plan.task_kind, [int(k) for k in COMM_KINDS])
        comm_mask &= (np.asarray(res.finish) > np.asarray(res.start))
        start, finish = np.asarray(res.start), np.asarray(res.finish)
        comm_len, cs, cf = _union_length(start[comm_mask], finish[comm_mask])
        overlap = 0.0
        if detail and comm_len > 0:
            _, ps_, pf_ = _union_length(start[compute_mask], finish[compute_mask])
            overlap = _intersection_length(cs, cf, ps_, pf_) / comm_len
        ck_s, ck_bytes = 0.0, {}
        if self.checkpoint_every_steps is not None:
            from heterog.checkpoint_cost import checkpoint_bytes, checkpoint_time_s

            written = checkpoint_bytes(self.graph, self.cluster, plan)
            ck_s, ck_bytes = checkpoint_time_s(self.cluster, written), dict(zip(names, written.tolist()))
        share = ck_s / self.checkpoint_every_steps if self.checkpoint_every_steps else 0.0
        return PlanResult(method=method, iteration_time_s=float(res.makespan) + share, oom=bool(res.oom),
                          peak_memory_bytes=peak, memory_capacity_bytes=cap, compute_time_s=compute_time,
                          comm_time_s=comm_len, overlap_ratio=overlap, n_tasks=plan.n_tasks, sim=res, plan=plan,
                          host_memory_bytes=host_peaks(self.compiler.context, plan.placements.state,
                                                        res.peak_memory),
                          checkpoint_time_s=ck_s, checkpoint_bytes=ck_bytes)


def compose_result(result: PlanResult, rep: Repetition, cluster: Cluster) -> PlanResult:
    """``result`` of the slice of ``rep`` as the whole plan's on ``cluster``: each device's memory peak its slice
    image's (0 on a device no config uses), each server's host peak its image's, the task count of ``copies``
    slices sharing their collectives (tasks on no device); the times as the slice's. ``plan`` and ``sim`` stay the
    slice's; ``composed`` says how many slices the result stands for."""
    names = rep.cluster.device_names
    peak = dict.fromkeys(cluster.device_names, 0.0)
    host: dict[str, float] = {}
    servers = rep.cluster.servers
    for j in range(rep.copies):
        for i, d in enumerate(rep.images[j].tolist()):
            peak[cluster.devices[d].name] = result.peak_memory_bytes[names[i]]
        for s in servers:
            if s.name in result.host_memory_bytes:
                whole = cluster.servers[int(cluster.server_of[int(rep.images[j, s.devices[0]])])]
                host[whole.name] = result.host_memory_bytes[s.name]
    n_shared = int(np.count_nonzero(np.asarray(result.plan.task_device) < 0)) if result.plan is not None else 0
    return replace(result, peak_memory_bytes=peak,
                   memory_capacity_bytes={d.name: float(cluster.memory_bytes[d.index]) for d in cluster.devices},
                   host_memory_bytes=host, n_tasks=rep.copies * (result.n_tasks - n_shared) + n_shared,
                   composed=rep.copies)


class _SliceEvaluator(Evaluator):
    """The evaluator of one slice of a repetition: its strategies are of the slice's batch, not the graph's."""

    def compile(self, strategy: Strategy) -> CompiledPlan:
        return self.compiler.compile(strategy, check=False)


def cost_model(cluster: Cluster, layer_profile: LayerProfile | None = None, *,
               allreduce_bucket_bytes: float = 0.0, comm_blocks_compute: bool = False) -> CostModel:
    """The roofline CostModel of ``cluster``; with ``layer_profile``, its measured layer times where it has
    them (layers numbered by ``heterog.baselines.expert.block_layers``); the training runtime's habits
    (``allreduce_bucket_bytes``, ``comm_blocks_compute``) as ``CostModel`` takes them."""
    from heterog.cost import CostModel

    if layer_profile is None:
        return CostModel(cluster, allreduce_bucket_bytes=allreduce_bucket_bytes,
                         comm_blocks_compute=comm_blocks_compute)
    from heterog.baselines.expert import block_layers

    return CostModel(cluster, layer_profile=layer_profile, layer_numbering=block_layers,
                     allreduce_bucket_bytes=allreduce_bucket_bytes, comm_blocks_compute=comm_blocks_compute)


def simulate(graph: OpGraph, cluster: Cluster, strategy: Strategy, order: str = DEFAULT_ORDER,
             cost: CostModel | None = None, *, serialize_collectives: bool = False,
             layer_profile: LayerProfile | None = None) -> PlanResult:
    """Compile ``strategy`` for ``graph`` on ``cluster``, schedule it (by default the faster of
    rank-contention and FIFO; ``.order`` says which) and simulate one training iteration. The result
    carries the SimResult (``.sim``) and the plan (``.plan``). ``layer_profile``: measured layer times
    (``Evaluator``)."""
    ev = Evaluator(graph, cluster, cost, order=order, serialize_collectives=serialize_collectives,
                   layer_profile=layer_profile)
    out = ev.evaluate(strategy)
    out.search_time_s = float(strategy.meta.get("search_time_s", 0.0))
    return out
