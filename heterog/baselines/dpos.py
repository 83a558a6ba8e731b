"""FastT's planners: DPOS (Algorithm 1: critical-path device, insertion-based earliest-finish-time placement
and order of the data-parallel graph's op replicas) and OS-DPOS (Algorithm 2: split critical-path ops)."""
from __future__ import annotations

import dataclasses
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from heterog.baselines.expert import group_strategy, op_memory_bytes, order_priorities, param_units
from heterog.errors import HeterogError
from heterog.shares import even_shares, proportional_shares, split_weights
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cost.model import CostModel
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph


# ----------------------------------------------------------------------------- the problem
@dataclass
class PlacementProblem:
    """A DAG of nodes to place on M devices and order (times in seconds, memory in bytes or any one unit).

    Node kinds: *device* nodes take ``op_time_s[i, d]`` on the device they are placed on; *free* nodes
    (``is_free``: placeholders) take no time and follow their unit (or their first consumer); *collective*
    nodes (``collective_s[i] > 0`` or ``is_collective``) take a fixed time on no device and their result is
    available on every device. Nodes with the same ``unit`` id share a device.

    Shapes: ``op_time_s`` (N, M); ``edge_src``, ``edge_dst``, ``edge_bytes`` (E,); ``comm_alpha_s`` and
    ``comm_beta_s_per_byte`` (M, M): a transfer a->b of x > 0 bytes takes alpha[a, b] + x * beta[a, b]
    (0 on the diagonal, 0 for x = 0); ``is_free``, ``is_collective`` (N,) bool; ``collective_s``, ``unit``,
    ``held_bytes``, ``transient_bytes`` (N,) (memory as in ``op_memory_bytes``); ``capacity_bytes`` (M,);
    ``edge_memory`` (E,) what an edge allocates on a device it arrives at from another (default: its bytes).
    """

    op_time_s: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_bytes: np.ndarray
    comm_alpha_s: np.ndarray
    comm_beta_s_per_byte: np.ndarray
    is_free: np.ndarray
    unit: np.ndarray
    held_bytes: np.ndarray
    transient_bytes: np.ndarray
    capacity_bytes: np.ndarray
    is_collective: np.ndarray | None = None
    collective_s: np.ndarray | None = None
    edge_memory: np.ndarray | None = None
    pred_edges: list[list[int]] = field(init=False, repr=False)
    succ_edges: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.n_nodes
        if self.is_collective is None:
            self.is_collective = np.zeros(n, dtype=bool)
        if self.collective_s is None:
            self.collective_s = np.zeros(n)
        if self.edge_memory is None:
            self.edge_memory = np.asarray(self.edge_bytes, dtype=np.float64)
        self.pred_edges = [[] for _ in range(n)]
        self.succ_edges = [[] for _ in range(n)]
        for k, (s, d) in enumerate(zip(self.edge_src.tolist(), self.edge_dst.tolist())):
            self.pred_edges[d].append(k)
            self.succ_edges[s].append(k)

    @property
    def n_nodes(self) -> int:
        return int(self.op_time_s.shape[0])

    @property
    def n_devices(self) -> int:
        return int(self.op_time_s.shape[1])

    @property
    def on_device(self) -> np.ndarray:
        """(N,) nodes that occupy a device."""
        assert self.is_collective is not None            # filled in by __post_init__
        return ~self.is_free & ~self.is_collective

    def worst_time_s(self) -> np.ndarray:
        """(N,) worst-case time of each node: max over devices, the collective time, 0 for free nodes."""
        assert self.is_collective is not None and self.collective_s is not None     # filled in by __post_init__
        w = np.where(self.on_device, self.op_time_s.max(axis=1), 0.0)
        return np.where(self.is_collective, self.collective_s, w)

    def worst_comm_s(self) -> np.ndarray:
        """(E,) worst-case transfer time of each edge over pairs of distinct devices (0 for edges without
        bytes or touching a collective node)."""
        m = self.n_devices
        if m < 2 or not len(self.edge_bytes):
            return np.zeros(len(self.edge_bytes))
        assert self.is_collective is not None            # filled in by __post_init__
        off = ~np.eye(m, dtype=bool)
        a, b = self.comm_alpha_s[off], self.comm_beta_s_per_byte[off]
        c = np.max(a[None, :] + self.edge_bytes[:, None] * b[None, :], axis=1)
        no_move = (self.edge_bytes <= 0) | self.is_collective[self.edge_src] | self.is_collective[self.edge_dst]
        return np.where(no_move, 0.0, c)

    def topo_position(self) -> np.ndarray:
        """(N,) position of each node in a topological order (smallest ready node first)."""
        import heapq

        n = self.n_nodes
        indeg = np.array([len(p) for p in self.pred_edges], dtype=np.int64)
        ready = [i for i in range(n) if indeg[i] == 0]
        heapq.heapify(ready)
        pos = np.empty(n, dtype=np.int64)
        k = 0
        dst = self.edge_dst
        while ready:
            u = heapq.heappop(ready)
            pos[u] = k
            k += 1
            for e in self.succ_edges[u]:
                v = int(dst[e])
                indeg[v] -= 1
                if indeg[v] == 0:
                    heapq.heappush(ready, v)
        return pos


@dataclass
class ReplicatedGraph:
    """How a PlacementProblem's nodes map back to the graph: node ``r * n_ops + o`` is replica ``r`` of op
    ``o`` (batch share ``shares[r]``); nodes from ``R * n_ops`` on are AllReduces of partial results
    produced by ``agg_ops``."""

    problem: PlacementProblem
    n_ops: int
    shares: list[int]
    home: list[int]                 # replica r's starting device
    agg_ops: np.ndarray             # producer op of the tensor each collective node aggregates
    op_unit: np.ndarray             # (n_ops,) unit of each op (param_units)


def comm_coefficients(cost: CostModel, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(M, M) alpha and beta of the cost model's transfers (it is linear in bytes)."""
    a_idx, b_idx = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    alpha = cost.transfer_times(a_idx.ravel(), b_idx.ravel(), np.zeros(m * m)).reshape(m, m)
    beta = cost.transfer_times(a_idx.ravel(), b_idx.ravel(), np.ones(m * m)).reshape(m, m) - alpha
    in_flight = [cost.transfer_latencies(a_idx.ravel(), b_idx.ravel(), np.full(m * m, x)).reshape(m, m)
                 for x in (0, 1)]
    alpha, beta = alpha + in_flight[0], beta + in_flight[1] - in_flight[0]          # a message's whole time
    return alpha, beta


def replicated_problem(ev: PlanEvaluator, replicas: int | None = None, shares: str = "proportional",
                       memory_headroom: float = 0.9) -> ReplicatedGraph:
    """The data-parallel graph of ``ev``'s graph as a PlacementProblem.

    Args:
        replicas: number of replicas R (default: one per device; 1 = plain model parallelism). Replica r
            starts on the r-th most powerful device (ties by index).
        shares: batch shares "proportional" to device power (like CP), to the device's "speed" on this
            graph (1 / its full-batch time), or "even".
        memory_headroom: fraction of each device's memory DPOS may plan for.

    Every op has R replicas working on their batch share (ops without a batch tensor are duplicated);
    with R > 1 each partial result that is read (weight gradient, loss: the compiler's tensors that need
    aggregation) gets an AllReduce node over the replicas' home devices that feeds every replica's
    consumers.
    """
    from heterog.compiler.compile import graph_index

    graph, cluster, cost = ev.graph, ev.cluster, ev.cost
    n, m, batch = graph.n_ops, cluster.n_devices, graph.batch_size
    r_count = min(m if replicas is None else int(replicas), batch)
    if r_count < 1:
        raise HeterogError(f"DPOS replicas must be at least 1, got {replicas}")
    home = np.lexsort((np.arange(m), -np.asarray(cluster.power)))[:r_count].tolist()
    if shares == "proportional":
        share = proportional_shares(batch, np.asarray(cluster.power)[home])
    elif shares == "speed":
        share = proportional_shares(batch, 1.0 / cost.full_batch_times(graph).sum(axis=0)[home])
    elif shares == "even":
        share = even_shares(batch, r_count)
    else:
        raise HeterogError(f"unknown DPOS shares {shares!r} (choose proportional, speed or even)")
    keep = [r for r in range(r_count) if share[r] > 0]
    home, share = [home[r] for r in keep], [share[r] for r in keep]
    R = len(share)
    frac = np.asarray(share, dtype=np.float64) / batch

    gi = graph_index(graph)
    agg_t = np.nonzero(gi.t_needs_agg)[0] if R > 1 else np.zeros(0, dtype=np.int64)   # partial tensors
    agg_node = np.full(len(gi.t_needs_agg), -1, dtype=np.int64)
    agg_node[agg_t] = R * n + np.arange(len(agg_t))
    N = R * n + len(agg_t)

    # node times: replica r of op o on device d at fraction frac[r]
    o_idx = np.tile(np.repeat(np.arange(n), m), R)
    d_idx = np.tile(np.arange(m), n * R)
    f_idx = np.repeat(frac, n * m)
    times = np.zeros((N, m))
    times[:R * n] = cost.op_times(graph, o_idx, d_idx, f_idx).reshape(R * n, m)
    collective_s = np.zeros(N)
    is_collective = np.zeros(N, dtype=bool)
    if len(agg_t):
        collective_s[R * n:] = cost.gradient_allreduce_times(home, gi.t_bytes[agg_t])[0]
        is_collective[R * n:] = True

    # edges: replica-local, or through the AllReduce of a partial tensor (value-free reads stay local)
    src, dst, eb, batch_e = graph.edge_src, graph.edge_dst, graph.edge_bytes, graph.edge_has_batch
    via = (agg_node[gi.e_tensor] >= 0) & ~gi.e_value_free if len(src) else np.zeros(0, dtype=bool)
    direct = ~via
    agg_src = gi.t_op[agg_t]
    srcs, dsts, nbytes = [], [], []
    for r in range(R):
        srcs += [r * n + src[direct], agg_node[gi.e_tensor[via]], r * n + agg_src]
        dsts += [r * n + dst[direct], r * n + dst[via], agg_node[agg_t]]
        moved = np.where(batch_e[direct], eb[direct] * frac[r], eb[direct])
        nbytes += [np.where(gi.e_value_free[direct], 0.0, moved), np.zeros(int(via.sum())), np.zeros(len(agg_t))]
    e_src = np.concatenate(srcs).astype(np.int64)
    e_dst = np.concatenate(dsts).astype(np.int64)
    e_bytes = np.concatenate(nbytes).astype(np.float64)

    op_unit = param_units(graph)
    unit = np.concatenate([r * n + op_unit for r in range(R)] + [np.arange(R * n, N)])
    held = np.zeros(N)
    transient = np.zeros(N)
    for r in range(R):
        held[r * n:(r + 1) * n], transient[r * n:(r + 1) * n] = op_memory_bytes(graph, frac[r])
    is_free = np.concatenate([np.tile(~graph.is_compute, R), np.zeros(len(agg_t), dtype=bool)])
    alpha, beta = comm_coefficients(cost, m)
    prob = PlacementProblem(times, e_src, e_dst, e_bytes, alpha, beta, is_free, unit, held, transient,
                            np.asarray(cluster.memory_bytes, dtype=np.float64) * memory_headroom,
                            is_collective, collective_s)
    return ReplicatedGraph(prob, n, share, home, agg_src, op_unit)


# ----------------------------------------------------------------------------- DPOS
@dataclass
class DposSchedule:
    """DPOS's result. Shapes (N,): device (-1 for collectives), start_s, finish_s (free nodes: 0);
    order: nodes by start time; critical_path: nodes that occupy a device, entry to exit."""

    device: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    order: np.ndarray
    makespan_s: float
    critical_path: list[int]
    cp_device: int
    memory_ok: bool


def upward_downward_ranks(prob: PlacementProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Worst-case ranks: rank_u(i) = w(i) + max over out-edges (c(e) + rank_u(dst)),
    rank_d(i) = max over in-edges (rank_d(src) + w(src) + c(e)); w = ``worst_time_s``,
    c = ``worst_comm_s``. Returns (rank_u, rank_d, topological position)."""
    w = prob.worst_time_s()
    c = prob.worst_comm_s().tolist()
    pos = prob.topo_position()
    order = np.argsort(pos).tolist()
    dst, src = prob.edge_dst.tolist(), prob.edge_src.tolist()
    n = prob.n_nodes
    rank_u = [0.0] * n
    wl = w.tolist()
    for i in reversed(order):
        rank_u[i] = wl[i] + max((c[k] + rank_u[dst[k]] for k in prob.succ_edges[i]), default=0.0)
    rank_d = [0.0] * n
    for i in order:
        rank_d[i] = max((rank_d[src[k]] + wl[src[k]] + c[k] for k in prob.pred_edges[i]), default=0.0)
    return np.asarray(rank_u), np.asarray(rank_d), pos


def critical_path(prob: PlacementProblem, rank_u: np.ndarray) -> list[int]:
    """Nodes of the critical path that occupy a device, entry to exit: from the entry of largest rank_u,
    follow the out-edge that attains each node's rank_u (so rank_u + rank_d is maximal all along)."""
    entries = [i for i in range(prob.n_nodes) if not prob.pred_edges[i]]
    if not entries:
        return []
    c = prob.worst_comm_s()
    node = max(entries, key=lambda i: (rank_u[i], -i))
    path = [node]
    while prob.succ_edges[node]:
        k = max(prob.succ_edges[node], key=lambda e: (c[e] + rank_u[prob.edge_dst[e]], -e))
        node = int(prob.edge_dst[k])
        path.append(node)
    on = prob.on_device
    return [i for i in path if on[i]]


def _earliest_gap(starts: list[float], ends: list[float], ready: float, dur: float) -> tuple[float, int]:
    """Insertion policy: earliest t >= ready with [t, t + dur) free between sorted busy slots; returns
    (t, index at which the new slot goes). The plain-Python reference of ``_earliest_gap_kernel``."""
    k = bisect_right(ends, ready)
    t = ready
    while k < len(starts):
        if starts[k] - t >= dur:
            return t, k
        t = max(t, ends[k])
        k += 1
    return t, k


@njit(cache=True)
def _earliest_gap_kernel(starts: np.ndarray, ends: np.ndarray, count: int, ready: float,
                         dur: float) -> tuple[float, int]:
    """``_earliest_gap`` over the first ``count`` slots of the arrays (the same comparisons: the same result)."""
    k = int(np.searchsorted(ends[:count], ready, side="right"))
    t = ready
    while k < count:
        if starts[k] - t >= dur:
            return t, k
        t = max(t, ends[k])
        k += 1
    return t, k


class _Slots:
    """One device's busy slots, sorted (``starts``, ``ends`` up to ``count``), grown by doubling."""

    def __init__(self, capacity: int = 64) -> None:
        self.starts, self.ends, self.count = np.empty(capacity), np.empty(capacity), 0

    def gap(self, ready: float, dur: float) -> tuple[float, int]:
        return _earliest_gap_kernel(self.starts, self.ends, self.count, ready, dur)

    def insert(self, k: int, start: float, end: float) -> None:
        if self.count == len(self.starts):
            self.starts = np.concatenate([self.starts, np.empty(self.count)])
            self.ends = np.concatenate([self.ends, np.empty(self.count)])
        for arr, value in ((self.starts, start), (self.ends, end)):
            arr[k + 1:self.count + 1] = arr[k:self.count].copy()
            arr[k] = value
        self.count += 1


def dpos_schedule(prob: PlacementProblem) -> DposSchedule:
    """FastT's DPOS on ``prob``.

    1. Upward ranks with worst-case node and transfer costs; the critical path attains the largest rank.
    2. Critical-path device: least total time for the critical-path nodes among the devices whose memory
       holds them (least total time overall if none does).
    3. Nodes in decreasing rank_u (ties: topological order). A node whose unit is placed goes there; a
       critical-path node goes to the critical-path device if it fits; any other node goes to the device
       that gives the earliest finish time, inserted into an idle gap (ready time = latest arrival of its
       inputs, with transfer times from their devices), among the devices whose memory estimate (held
       bytes, inputs received from other devices, largest transient) stays within capacity (if none:
       the device with most memory left). Collectives start when their inputs
       are done and occupy no device. Free nodes follow their unit or first consumer at time 0.
    """
    n, m = prob.n_nodes, prob.n_devices
    rank_u, _, pos = upward_downward_ranks(prob)
    cp = critical_path(prob, rank_u)
    cp_set = set(cp)
    times = prob.op_time_s
    units = prob.unit.tolist()
    is_free = prob.is_free.tolist()
    # filled in by PlacementProblem.__post_init__
    assert prob.is_collective is not None and prob.collective_s is not None and prob.edge_memory is not None
    is_coll = prob.is_collective.tolist()
    free_members: dict[int, list[int]] = {}
    for i in range(n):
        if is_free[i]:
            free_members.setdefault(units[i], []).append(i)
    free_held = {u: float(prob.held_bytes[ops].sum()) for u, ops in free_members.items()}

    cp_time = times[cp].sum(axis=0) if cp else np.zeros(m)
    cp_units = {units[i] for i in cp}
    cp_mem = float(prob.held_bytes[cp].sum()) + sum(free_held.get(u, 0.0) for u in cp_units) + \
        float(prob.transient_bytes[cp].max(initial=0.0))
    fits_cp = cp_mem <= prob.capacity_bytes
    cp_device = int(np.argmin(np.where(fits_cp, cp_time, np.inf))) if fits_cp.any() else int(np.argmin(cp_time))

    device = np.full(n, -1, dtype=np.int64)
    start = np.zeros(n)
    finish = np.zeros(n)
    unit_dev: dict[int, int] = {}
    used = np.zeros(m)                                   # held bytes per device
    peak_transient = np.zeros(m)
    slots = [_Slots() for _ in range(m)]
    memory_ok = True
    alpha, beta = prob.comm_alpha_s, prob.comm_beta_s_per_byte
    src, nbytes, emem = prob.edge_src.tolist(), prob.edge_bytes.tolist(), prob.edge_memory.tolist()
    zero = np.zeros(m)

    for i in sorted(range(n), key=lambda j: (-rank_u[j], pos[j])):
        if is_free[i]:
            continue                                     # placed with its unit or first consumer
        if is_coll[i]:
            start[i] = max((finish[src[k]] for k in prob.pred_edges[i]), default=0.0)
            finish[i] = start[i] + prob.collective_s[i]
            continue
        u = units[i]
        ready = zero.copy()
        received = zero.copy()                           # bytes its inputs would bring to each device
        new_units = set() if u in unit_dev else {u}
        for k in prob.pred_edges[i]:
            p = src[k]
            if is_coll[p]:
                ready = np.maximum(ready, finish[p])
                continue
            if is_free[p]:
                pu = units[p]
                if pu not in unit_dev:
                    new_units.add(pu)
                    continue
                at, pd = 0.0, unit_dev[pu]
            else:
                at, pd = finish[p], int(device[p])
            if nbytes[k] > 0:
                ready = np.maximum(ready, at + alpha[pd] + nbytes[k] * beta[pd])
                received += emem[k]
                received[pd] -= emem[k]
            else:
                ready = np.maximum(ready, at)
        extra = prob.held_bytes[i] + sum(free_held.get(x, 0.0) for x in new_units) + received
        mem_after = used + extra + np.maximum(peak_transient, prob.transient_bytes[i])
        fits = mem_after <= prob.capacity_bytes
        if u in unit_dev:
            candidates = [unit_dev[u]]
        elif i in cp_set and fits[cp_device]:
            candidates = [cp_device]
        elif fits.any():
            candidates = np.nonzero(fits)[0].tolist()
        else:
            candidates = [int(np.argmin(mem_after - prob.capacity_bytes))]
        best: tuple[float, int, float, int] | None = None
        for d in candidates:
            t, slot = slots[d].gap(float(ready[d]), float(times[i, d]))
            eft = t + float(times[i, d])
            if best is None or eft < best[0]:
                best = (eft, d, t, slot)
        assert best is not None                          # every branch above names a candidate
        eft, d, t, slot = best
        memory_ok &= bool(fits[d])
        device[i], start[i], finish[i] = d, t, eft
        slots[d].insert(slot, t, eft)
        used[d] += prob.held_bytes[i] + received[d]
        peak_transient[d] = max(peak_transient[d], prob.transient_bytes[i])
        for x in new_units:
            unit_dev[x] = d
            used[d] += free_held.get(x, 0.0)
    for i in np.nonzero(prob.is_free)[0].tolist():     # free nodes: their unit's device (unused: cp device)
        device[i] = unit_dev.get(units[i], cp_device)
    order = np.lexsort((pos, start))
    return DposSchedule(device, start, finish, order, float(finish.max(initial=0.0)), cp, cp_device, memory_ok)


def replicated_strategy(ev: PlanEvaluator, rg: ReplicatedGraph, sched: DposSchedule, *,
                        at_home: bool = False) -> Strategy:
    """Each unit's config merges its replicas' devices and shares (AllReduce across them); the order of
    ops is that of their first replica's start in the schedule. ``at_home``: every replica on its
    starting device instead (the data-parallel deployment DPOS starts from), same order."""
    n, R = rg.n_ops, len(rg.shares)
    dev = sched.device[:R * n].reshape(R, n)
    config_of = {}
    home = ParallelConfig.of(list(zip(rg.home, rg.shares)), sync="allreduce")
    for u in np.unique(rg.op_unit).tolist():
        config_of[u] = home if at_home else \
            ParallelConfig.of([(int(dev[r, u]), rg.shares[r]) for r in range(R)], sync="allreduce")
    op_start = sched.start_s[:R * n].reshape(R, n).min(axis=0)
    pos = rg.problem.topo_position()[:n]
    prio = order_priorities(np.lexsort((pos, op_start)), n)
    info = {"dpos_makespan_s": sched.makespan_s, "critical_path_device": sched.cp_device,
            "critical_path_nodes": len(sched.critical_path), "memory_ok": sched.memory_ok,
            "replicas": R, "replica_shares": list(rg.shares)}
    return group_strategy(ev, rg.op_unit, config_of, priorities=prio, meta=info)


def plan_cost(ev: PlanEvaluator, strategy: Strategy, oom_factor: float = 10.0) -> float:
    """Iteration time of ``strategy``, multiplied by ``oom_factor`` if a device runs out of memory."""
    t, oom = ev.iteration_time(strategy)
    return t * oom_factor if oom else t


def dpos_plan(ev: PlanEvaluator, replicas: int | None, shares: str, memory_headroom: float,
              check_start: bool, micro_batches: int = 1) -> tuple[Strategy, ReplicatedGraph, DposSchedule, float]:
    """DPOS's strategy and its simulated cost, over ``micro_batches`` even micro-batches.

    With ``check_start`` (FastT deploys a new strategy only when it is faster than the running one) the
    simulator scores three plans and the fastest is returned: DPOS's placement in DPOS's order, the
    data-parallel deployment DPOS started from in DPOS's order, and that deployment as it runs before
    DPOS (the scheduler's own rank order). ``meta["deployed"]`` says which; the costs are in meta too.
    """
    rg = replicated_problem(ev, replicas, shares, memory_headroom)
    sched = dpos_schedule(rg.problem)
    candidates = {"dpos": replicated_strategy(ev, rg, sched)}
    if check_start and len(rg.shares) > 1:
        start = replicated_strategy(ev, rg, sched, at_home=True)
        candidates["start+dpos-order"] = start
        candidates["start"] = Strategy(start.graph_fingerprint, start.cluster_name, start.n_devices,
                                       start.batch_size, start.group_of, start.configs, meta=dict(start.meta))
    candidates = {name: st.with_micro_batches(micro_batches) for name, st in candidates.items()}
    costs = {name: plan_cost(ev, st) for name, st in candidates.items()}
    deployed = min(costs, key=lambda k: (costs[k], list(costs).index(k)))
    strategy = candidates[deployed]
    strategy.meta.update(deployed=deployed, **{f"cost_s/{k}": v for k, v in costs.items()})
    return strategy, rg, sched, costs[deployed]


def dpos(ev: PlanEvaluator, replicas: int | None = None, shares: str = "proportional", memory_headroom: float = 0.9,
         check_start: bool = True, micro_batches: int = 1) -> Strategy:
    """FastT DPOS over the data-parallel graph (``replicas=1``: over the plain graph, i.e. model
    parallelism per op); see ``dpos_plan`` for ``check_start``; plans and scores run at
    ``micro_batches``."""
    return dpos_plan(ev, replicas, shares, memory_headroom, check_start, micro_batches)[0]


# ----------------------------------------------------------------------------- OS-DPOS
def split_configs(op_times_s: np.ndarray, batch_size: int, channels: bool = False) -> list[ParallelConfig]:
    """Candidate splits of one op: over its k fastest devices (k = 2..M, ties by index), with even shares
    and with shares proportional to the op's speed on each device; along the batch (AllReduce for partial
    results) and, with ``channels``, along its parameters (FastT's channel splits: a "parameter" split
    config, the devices sorted)."""
    m = len(op_times_s)
    fastest = np.lexsort((np.arange(m), op_times_s))
    out: list[ParallelConfig] = []
    for k in range(2, m + 1):
        devs = fastest[:k].tolist()
        speed = 1.0 / np.maximum(op_times_s[devs], 1e-12)
        if k <= batch_size:
            for shares in (even_shares(batch_size, k), proportional_shares(batch_size, speed)):
                cfg = ParallelConfig.of(list(zip(devs, shares)), sync="allreduce")
                if cfg.n_replicas > 1 and cfg not in out:
                    out.append(cfg)
        if channels:
            order = np.argsort(devs, kind="stable")
            weights = split_weights(speed)
            for w in ([1] * k, weights):
                cfg = ParallelConfig.split_over([devs[i] for i in order], [w[i] for i in order], batch_size)
                if cfg not in out:
                    out.append(cfg)
    return out


def _has_parameter_split(graph: OpGraph, op: int) -> bool:
    """Whether ``op`` can be divided along a parameter dimension (``OpGraph.splits``)."""
    return graph.splits is not None and any(o["kind"] == "parameter" for o in graph.splits[op]["options"])


def with_config(strategy: Strategy, group: int, config: ParallelConfig) -> Strategy:
    """A copy of ``strategy`` with ``group`` running under ``config`` (its micro-batches kept)."""
    configs = list(strategy.configs)
    configs[group] = config
    return dataclasses.replace(strategy, configs=configs, meta=dict(strategy.meta))


def os_dpos(ev: PlanEvaluator, budget_s: float = 60.0, replicas: int | None = None, shares: str = "proportional",
            memory_headroom: float = 0.9, check_start: bool = True, micro_batches: int = 1,
            splits: bool = False) -> Strategy:
    """FastT OS-DPOS: start from DPOS; take the ops of its critical path that carry the batch, longest
    first (on the critical-path device); try every split of the op's group over its 2..M fastest devices
    (even or proportional shares; along the batch with AllReduce, and with ``splits`` along its parameters
    where the op has such a split, ``split_configs``; off by default: they rarely pay on
    the clusters measured, docs/results.md) and keep the best if the simulated iteration gets shorter; stop at the
    first op that no split improves, or when ``budget_s`` is spent; every plan scored at ``micro_batches``.
    ``meta["splits"]`` reports each op split: its name, the
    split ("batch" or "parameter"), its devices and the time it gained."""
    t0 = time.perf_counter()
    strategy, rg, sched, best_cost = dpos_plan(ev, replicas, shares, memory_headroom, check_start, micro_batches)
    start_cost = best_cost
    n = rg.n_ops
    cp_ops = list(dict.fromkeys(i % n for i in sched.critical_path if i < len(rg.shares) * n))
    cp_ops = [o for o in cp_ops if ev.graph.has_batch[o] and ev.graph.is_compute[o]]
    full = ev.cost.full_batch_times(ev.graph)
    cp_ops.sort(key=lambda o: (-full[o, sched.cp_device], o))
    n_split = n_tried = 0
    kept: list[dict] = []
    for o in cp_ops:
        if time.perf_counter() - t0 > budget_s:
            break
        g = int(strategy.group_of[o])
        found, found_cfg, before = None, None, best_cost
        for cfg in split_configs(full[o], ev.graph.batch_size, splits and _has_parameter_split(ev.graph, o)):
            if cfg == strategy.configs[g]:
                continue
            cand = with_config(strategy, g, cfg)
            c = plan_cost(ev, cand)
            if c < best_cost:
                best_cost, found, found_cfg = c, cand, cfg
            if time.perf_counter() - t0 > budget_s:
                break
        n_tried += 1
        if found is None or found_cfg is None:
            break
        strategy = found
        n_split += 1
        kept.append({"op": ev.graph.ops[o].name, "split": found_cfg.split or "batch",
                       "devices": list(found_cfg.devices), "gain_s": before - best_cost})
    strategy.meta.update({"dpos_cost_s": start_cost, "os_dpos_cost_s": best_cost, "ops_split": n_split,
                          "ops_tried": n_tried, "splits": kept})
    return strategy
