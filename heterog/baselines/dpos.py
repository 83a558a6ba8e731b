"""FastT's planners: DPOS (its Algorithm 1: critical-path device + insertion-based earliest-finish-time
placement and order) and OS-DPOS (its Algorithm 2: split critical-path ops along the batch).

Granularity: one group per op, except that a parameter, its optimizer state, its gradient producer and
its update ops form one unit on one device (TensorFlow colocates them; the unit follows the first op of
it that is placed, normally the parameter's first forward consumer). Zero-cost placeholders follow their
unit, or their first consumer. The order DPOS computes is exported as the strategy's priorities.
"""
from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from heterog.baselines import register
from heterog.baselines.expert import mp_strategy, op_memory_bytes, order_priorities, param_units
from heterog.strategy import ParallelConfig, Strategy, even_shares, proportional_shares


# ----------------------------------------------------------------------------- the problem
@dataclass
class PlacementProblem:
    """What DPOS needs to know about a graph on a cluster (all times in seconds, memory in bytes).

    Shapes: ``op_time_s`` (n, M); ``edge_src``, ``edge_dst``, ``edge_bytes`` (E,); ``comm_alpha_s`` and
    ``comm_beta_s_per_byte`` (M, M) with a transfer a->b of x bytes taking alpha[a, b] + x * beta[a, b]
    (0 on the diagonal); ``is_free`` (n,) zero-cost placeholders that take no device time and follow their
    unit; ``unit`` (n,) ops that must share a device have the same id; ``held_bytes``,
    ``transient_bytes`` (n,) as in ``op_memory_bytes``; ``capacity_bytes`` (M,).
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
    pred: list[list[int]] = field(init=False, repr=False)
    succ: list[list[int]] = field(init=False, repr=False)
    pred_edges: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.n_ops
        self.pred = [[] for _ in range(n)]
        self.succ = [[] for _ in range(n)]
        self.pred_edges = [[] for _ in range(n)]
        for k, (s, d) in enumerate(zip(self.edge_src.tolist(), self.edge_dst.tolist())):
            self.pred[d].append(s)
            self.succ[s].append(d)
            self.pred_edges[d].append(k)

    @property
    def n_ops(self) -> int:
        return int(self.op_time_s.shape[0])

    @property
    def n_devices(self) -> int:
        return int(self.op_time_s.shape[1])

    def worst_comm_s(self) -> np.ndarray:
        """(E,) worst-case transfer time of each edge over all pairs of distinct devices."""
        m = self.n_devices
        if m < 2:
            return np.zeros(len(self.edge_bytes))
        off = ~np.eye(m, dtype=bool)
        a, b = self.comm_alpha_s[off], self.comm_beta_s_per_byte[off]
        return np.max(a[None, :] + self.edge_bytes[:, None] * b[None, :], axis=1)

    def topo_position(self) -> np.ndarray:
        n = self.n_ops
        indeg = np.array([len(p) for p in self.pred], dtype=np.int64)
        ready = [i for i in range(n) if indeg[i] == 0][::-1]
        pos = np.empty(n, dtype=np.int64)
        k = 0
        while ready:
            u = ready.pop()
            pos[u] = k
            k += 1
            for v in sorted(self.succ[u], reverse=True):
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        return pos


def placement_problem(ev, memory_headroom: float = 0.9) -> PlacementProblem:
    """The PlacementProblem of ``ev``'s graph and cluster from its cost model (full-batch op times)."""
    graph, cluster = ev.graph, ev.cluster
    m = cluster.n_devices
    a_idx, b_idx = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    alpha = ev.cost.transfer_times(a_idx.ravel(), b_idx.ravel(), np.zeros(m * m)).reshape(m, m)
    beta = ev.cost.transfer_times(a_idx.ravel(), b_idx.ravel(), np.ones(m * m)).reshape(m, m) - alpha
    held, transient = op_memory_bytes(graph)
    return PlacementProblem(
        op_time_s=np.asarray(ev.cost.full_batch_times(graph), dtype=np.float64),
        edge_src=graph.edge_src, edge_dst=graph.edge_dst, edge_bytes=graph.edge_bytes,
        comm_alpha_s=alpha, comm_beta_s_per_byte=beta, is_free=~graph.is_compute,
        unit=param_units(graph), held_bytes=held, transient_bytes=transient,
        capacity_bytes=np.asarray(cluster.memory_bytes, dtype=np.float64) * memory_headroom)


# ----------------------------------------------------------------------------- DPOS
@dataclass
class DposSchedule:
    """DPOS's result. Shapes: device, start_s, finish_s (n,) (placeholders start and finish at 0);
    order (n,) ops by start time; critical_path (ops, entry to exit, compute ops only)."""

    device: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    order: np.ndarray
    makespan_s: float
    critical_path: list[int]
    cp_device: int
    rank_u_s: np.ndarray
    memory_ok: bool


def upward_downward_ranks(prob: PlacementProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Worst-case ranks: rank_u(o) = w(o) + max over successors (c(o, s) + rank_u(s)),
    rank_d(o) = max over predecessors (rank_d(p) + w(p) + c(p, o)), w = max over devices of the op's
    time, c = worst-case transfer time. Returns (rank_u, rank_d, topological position)."""
    n = prob.n_ops
    w = np.where(prob.is_free, 0.0, prob.op_time_s.max(axis=1))
    c = prob.worst_comm_s()
    pos = prob.topo_position()
    order = np.argsort(pos)
    succ_edges: list[list[int]] = [[] for _ in range(n)]
    for k, s in enumerate(prob.edge_src.tolist()):
        succ_edges[s].append(k)
    dst = prob.edge_dst.tolist()
    src = prob.edge_src.tolist()
    rank_u = np.zeros(n)
    for o in order[::-1].tolist():
        rank_u[o] = w[o] + max((c[k] + rank_u[dst[k]] for k in succ_edges[o]), default=0.0)
    rank_d = np.zeros(n)
    for o in order.tolist():
        rank_d[o] = max((rank_d[src[k]] + w[src[k]] + c[k] for k in prob.pred_edges[o]), default=0.0)
    return rank_u, rank_d, pos


def critical_path(prob: PlacementProblem, rank_u: np.ndarray, rank_d: np.ndarray) -> list[int]:
    """Ops of the critical path (priority rank_u + rank_d maximal), entry to exit, compute ops only."""
    prio = rank_u + rank_d
    entries = [i for i in range(prob.n_ops) if not prob.pred[i]]
    if not entries:
        return []
    node = max(entries, key=lambda i: (rank_u[i], -i))
    path = [node]
    while prob.succ[node]:
        node = max(prob.succ[node], key=lambda s: (prio[s], -s))
        path.append(node)
    return [o for o in path if not prob.is_free[o]]


def _earliest_gap(starts: list[float], ends: list[float], ready: float, dur: float) -> tuple[float, int]:
    """Insertion policy: earliest t >= ready with [t, t + dur) free between sorted busy slots."""
    k = bisect_right(ends, ready)
    t = ready
    while k < len(starts):
        if starts[k] - t >= dur:
            return t, k
        t = max(t, ends[k])
        k += 1
    return t, k


def dpos_schedule(prob: PlacementProblem) -> DposSchedule:
    """FastT's DPOS on ``prob``.

    1. Upward ranks with worst-case op and transfer costs; critical path = ops of maximal rank_u + rank_d.
    2. Critical-path device: the device with the least total time for the critical-path ops among those
       whose memory holds them (the fastest overall if none does).
    3. Ops in decreasing rank_u (ties: topological order): an op whose unit is already placed goes there;
       a critical-path op goes to the critical-path device if it fits in memory; any other op goes to the
       device giving the earliest finish time with insertion into idle gaps, counting transfers from its
       inputs' devices and skipping devices whose memory estimate would overflow (if all overflow: the
       device with most memory left). Zero-cost placeholders follow their unit or first consumer.
    """
    n, m = prob.n_ops, prob.n_devices
    rank_u, rank_d, pos = upward_downward_ranks(prob)
    cp = critical_path(prob, rank_u, rank_d)
    cp_set = set(cp)
    times = prob.op_time_s
    units = prob.unit
    members: dict[int, list[int]] = {}
    for i, u in enumerate(units.tolist()):
        members.setdefault(u, []).append(i)
    free_held = {u: float(sum(prob.held_bytes[i] for i in ops if prob.is_free[i])) for u, ops in members.items()}

    # 2. critical-path device
    cp_time = times[cp].sum(axis=0) if cp else np.zeros(m)
    cp_units = {int(units[o]) for o in cp}
    cp_mem = float(prob.held_bytes[cp].sum()) + sum(free_held[u] for u in cp_units) + \
        float(prob.transient_bytes[cp].max(initial=0.0))
    fits = cp_mem <= prob.capacity_bytes
    cp_device = int(np.argmin(np.where(fits, cp_time, np.inf))) if fits.any() else int(np.argmin(cp_time))

    # 3. placement in rank order
    device = np.full(n, -1, dtype=np.int64)
    start = np.zeros(n)
    finish = np.zeros(n)
    unit_dev: dict[int, int] = {}
    used = np.zeros(m)                 # held bytes per device
    peak_transient = np.zeros(m)
    slots_s: list[list[float]] = [[] for _ in range(m)]
    slots_e: list[list[float]] = [[] for _ in range(m)]
    memory_ok = True
    alpha, beta = prob.comm_alpha_s, prob.comm_beta_s_per_byte
    src, nbytes = prob.edge_src, prob.edge_bytes

    def decide_unit(u: int, d: int) -> None:
        unit_dev[u] = d
        used[d] += free_held[u]
        for i in members[u]:
            if prob.is_free[i]:
                device[i] = d

    for o in sorted(range(n), key=lambda i: (-rank_u[i], pos[i])):
        u = int(units[o])
        if prob.is_free[o]:
            continue                                    # placed with its unit or first consumer
        # arrival of each input on each candidate device
        ready = np.zeros(m)
        new_units = {u} if u not in unit_dev else set()
        for k in prob.pred_edges[o]:
            p = int(src[k])
            if prob.is_free[p]:
                pu = int(units[p])
                if pu not in unit_dev:
                    new_units.add(pu)
                    continue
                at, pd = 0.0, unit_dev[pu]
            else:
                at, pd = finish[p], int(device[p])
            ready = np.maximum(ready, at + alpha[pd] + nbytes[k] * beta[pd])
        extra = prob.held_bytes[o] + sum(free_held[x] for x in new_units)
        mem_after = used + extra + np.maximum(peak_transient, prob.transient_bytes[o])
        fits = mem_after <= prob.capacity_bytes
        if u in unit_dev:
            candidates = [unit_dev[u]]
        elif o in cp_set and fits[cp_device]:
            candidates = [cp_device]
        elif fits.any():
            candidates = np.nonzero(fits)[0].tolist()
        else:
            memory_ok = False
            candidates = [int(np.argmin(mem_after - prob.capacity_bytes))]
        if not fits[candidates[0]] and len(candidates) == 1:
            memory_ok = False
        best = None
        for d in candidates:
            t, k = _earliest_gap(slots_s[d], slots_e[d], float(ready[d]), float(times[o, d]))
            eft = t + float(times[o, d])
            if best is None or eft < best[0]:
                best = (eft, d, t, k)
        eft, d, t, k = best
        device[o], start[o], finish[o] = d, t, eft
        slots_s[d].insert(k, t)
        slots_e[d].insert(k, eft)
        used[d] += prob.held_bytes[o]
        peak_transient[d] = max(peak_transient[d], prob.transient_bytes[o])
        for x in sorted(new_units):
            decide_unit(x, d)
    # placeholders nobody consumed: their unit's device, or the critical-path device
    for i in np.nonzero(device < 0)[0].tolist():
        device[i] = unit_dev.get(int(units[i]), cp_device)
    order = np.lexsort((pos, start))
    return DposSchedule(device, start, finish, order, float(finish.max(initial=0.0)), cp, cp_device, rank_u,
                        memory_ok)


def dpos_strategy(ev, sched: DposSchedule, prob: PlacementProblem) -> Strategy:
    """One group per unit on its DPOS device; priorities = DPOS's order."""
    return mp_strategy(ev, prob.unit, {int(u): int(sched.device[i]) for i, u in enumerate(prob.unit.tolist())},
                       priorities=order_priorities(sched.order, prob.n_ops),
                       meta={"dpos_makespan_s": sched.makespan_s, "critical_path_device": sched.cp_device,
                             "critical_path_ops": len(sched.critical_path), "memory_ok": sched.memory_ok})


@register("dpos")
def dpos(ev, memory_headroom: float = 0.9, **_):
    """FastT DPOS: model parallelism per op with a critical-path device and insertion-based EFT."""
    prob = placement_problem(ev, memory_headroom)
    return dpos_strategy(ev, dpos_schedule(prob), prob)


# ----------------------------------------------------------------------------- OS-DPOS
def plan_cost(ev, strategy: Strategy, oom_factor: float = 10.0) -> float:
    """Iteration time of ``strategy``, multiplied by ``oom_factor`` if a device runs out of memory."""
    t, oom = ev.iteration_time(strategy)
    return t * oom_factor if oom else t


def split_configs(op_times_s: np.ndarray, batch_size: int) -> list[ParallelConfig]:
    """Candidate splits of one op: over its k fastest devices (k = 2..M, ties by index), with even shares
    and with shares proportional to the op's speed on each device; AllReduce for partial results."""
    m = len(op_times_s)
    fastest = np.lexsort((np.arange(m), op_times_s))
    out: list[ParallelConfig] = []
    for k in range(2, min(m, batch_size) + 1):
        devs = fastest[:k].tolist()
        speed = 1.0 / np.maximum(op_times_s[devs], 1e-12)
        for shares in (even_shares(batch_size, k), proportional_shares(batch_size, speed)):
            cfg = ParallelConfig.of(list(zip(devs, shares)), sync="allreduce")
            if cfg.n_replicas > 1 and cfg not in out:
                out.append(cfg)
    return out


@register("os-dpos")
def os_dpos(ev, budget_s: float = 60.0, memory_headroom: float = 0.9, **_):
    """FastT OS-DPOS: start from DPOS; take the critical-path ops that carry the batch, longest first
    (on the critical-path device); try every split of an op over its 2..M fastest devices (even or
    proportional shares, AllReduce); keep the best split if the simulated iteration gets shorter, and
    stop at the first op that no split improves (or when ``budget_s`` is spent)."""
    t0 = time.perf_counter()
    prob = placement_problem(ev, memory_headroom)
    sched = dpos_schedule(prob)
    strategy = dpos_strategy(ev, sched, prob)
    best_cost = plan_cost(ev, strategy)
    start_cost = best_cost
    splittable = ev.graph.has_batch
    cp = [o for o in sched.critical_path if splittable[o]]
    cp.sort(key=lambda o: (-prob.op_time_s[o, sched.cp_device], o))
    n_split = n_tried = 0
    for o in cp:
        if time.perf_counter() - t0 > budget_s:
            break
        g = int(strategy.group_of[o])
        found = None
        for cfg in split_configs(prob.op_time_s[o], ev.graph.batch_size):
            configs = list(strategy.configs)
            configs[g] = cfg
            cand = Strategy(strategy.graph_fingerprint, strategy.cluster_name, strategy.n_devices,
                            strategy.batch_size, strategy.group_of, configs, priorities=strategy.priorities,
                            meta=dict(strategy.meta))
            c = plan_cost(ev, cand)
            if c < best_cost - 1e-12:
                best_cost, found = c, cand
            if time.perf_counter() - t0 > budget_s:
                break
        n_tried += 1
        if found is None:
            break
        strategy = found
        n_split += 1
    strategy.meta.update({"dpos_cost_s": start_cost, "os_dpos_cost_s": best_cost, "ops_split": n_split,
                          "ops_tried": n_tried})
    return strategy
