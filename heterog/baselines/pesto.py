"""Pesto's planner: coarsen the graph by height-based merging (cycle-free batches, largest tensors first),
then place and order the coarse graph jointly with OR-Tools CP-SAT under a time limit, and expand back."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from heterog.baselines.dpos import PlacementProblem, comm_coefficients, dpos_schedule
from heterog.baselines.expert import balanced_partition, mp_strategy, op_memory_bytes, order_priorities

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.strategy import Strategy


# ----------------------------------------------------------------------------- coarsening
def heights(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(n,) height of each node: length (in edges) of the longest path from a source to it."""
    indeg = np.bincount(dst, minlength=n)
    succ: list[list[int]] = [[] for _ in range(n)]
    for s, d in zip(src.tolist(), dst.tolist()):
        succ[s].append(d)
    h = np.zeros(n, dtype=np.int64)
    stack = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while stack:
        u = stack.pop()
        seen += 1
        for v in succ[u]:
            h[v] = max(h[v], h[u] + 1)
            indeg[v] -= 1
            if indeg[v] == 0:
                stack.append(v)
    if seen != n:
        raise ValueError("heights: the graph has a cycle")
    return h


def quotient_edges(cluster_of: np.ndarray, src: np.ndarray, dst: np.ndarray,
                   nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges between distinct clusters with their bytes summed: (src, dst, bytes), sorted by (src, dst)."""
    cs, cd = cluster_of[src], cluster_of[dst]
    keep = cs != cd
    if not keep.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    k = int(cluster_of.max()) + 1
    key = cs[keep] * k + cd[keep]
    uniq, inv = np.unique(key, return_inverse=True)
    return uniq // k, uniq % k, np.bincount(inv, weights=nbytes[keep], minlength=len(uniq))


def merge_round(k: int, qs: np.ndarray, qd: np.ndarray, qb: np.ndarray, sizes: np.ndarray, n_merges: int,
                caps: np.ndarray) -> list[tuple[int, int]]:
    """One batch of merges on a DAG of ``k`` nodes (edges ``qs -> qd`` with bytes ``qb``).

    Candidates are edges (u, v) with height(v) = height(u) + 1 (contracting one such edge cannot close a
    cycle: another u -> v path would make height(v) >= height(u) + 2), taken largest tensor first, whose
    merged sizes stay within ``caps`` (``sizes`` (k, S), ``caps`` (S,)). A batch is a matching, and a pair
    (u, v) is refused if an edge joins its upper node u to the lower node of another chosen pair at the
    same heights, or another chosen pair's upper node to v. Then keying every unmerged node by
    2 * height and every merged pair by 2 * height(u) + 1 strictly increases along every edge of the
    merged graph, so the batch is cycle-free (the argument of Pesto's Theorem 3.5).
    """
    h = heights(k, qs, qd)
    cand = np.nonzero(h[qd] == h[qs] + 1)[0]
    cand = cand[np.lexsort((cand, -qb[cand]))]
    ok = np.all(sizes[qs[cand]] + sizes[qd[cand]] <= caps[None, :], axis=1)
    cand = cand[ok]
    succ: list[list[int]] = [[] for _ in range(k)]
    pred: list[list[int]] = [[] for _ in range(k)]
    for s, d in zip(qs.tolist(), qd.tolist()):
        succ[s].append(d)
        pred[d].append(s)
    matched = np.zeros(k, dtype=bool)
    upper = np.zeros(k, dtype=bool)
    lower = np.zeros(k, dtype=bool)
    pairs: list[tuple[int, int]] = []
    for e in cand.tolist():
        u, v = int(qs[e]), int(qd[e])
        if matched[u] or matched[v]:
            continue
        if any(lower[x] and x != v and h[x] == h[u] + 1 for x in succ[u]):
            continue
        if any(upper[x] and x != u and h[x] == h[v] - 1 for x in pred[v]):
            continue
        matched[u] = matched[v] = upper[u] = lower[v] = True
        pairs.append((u, v))
        if len(pairs) >= n_merges:
            break
    return pairs


def coarsen(n: int, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, weight: np.ndarray,
            target: int, balance: float = 2.0, memory: np.ndarray | None = None,
            memory_cap: float = np.inf) -> np.ndarray:
    """Coarsen a DAG of ``n`` nodes to ``target`` nodes without creating a cycle.

    Rounds of ``merge_round`` on the current quotient graph. A merged node should weigh at most
    ``balance`` x the average weight at the target size and hold at most ``memory_cap`` (``memory`` per
    node); a round that would merge nothing drops the weight limit, then the memory limit. When no edge
    is left (isolated nodes only), nodes are merged pairwise, lightest first: any such merge is safe.

    Returns: (n,) coarse node of each node, numbered 0..K-1 in a topological order of the coarse graph,
    K = min(n, target).
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    weight = np.asarray(weight, dtype=np.float64)
    memory = np.zeros(n) if memory is None else np.asarray(memory, dtype=np.float64)
    cluster_of = np.arange(n, dtype=np.int64)
    target = max(1, int(target))
    limits = [np.array([balance * float(weight.sum()) / target, memory_cap]), np.array([np.inf, memory_cap]),
              np.array([np.inf, np.inf])]
    k = n
    while k > target:
        qs, qd, qb = quotient_edges(cluster_of, src, dst, nbytes)
        sizes = np.stack([np.bincount(cluster_of, weights=weight, minlength=k),
                          np.bincount(cluster_of, weights=memory, minlength=k)], axis=1)
        pairs: list[tuple[int, int]] = []
        if len(qs):
            for caps in limits:
                pairs = merge_round(k, qs, qd, qb, sizes, k - target, caps)
                if pairs:
                    break
        else:                                           # isolated nodes only: any merge is cycle-free
            order = np.argsort(sizes[:, 0], kind="stable").tolist()
            pairs = list(zip(order[0::2], order[1::2]))[:k - target]
        into = np.arange(k)
        for u, v in pairs:
            into[v] = u
        _, cluster_of = np.unique(into[cluster_of], return_inverse=True)
        cluster_of = cluster_of.astype(np.int64)
        k = int(cluster_of.max()) + 1
    qs, qd, _ = quotient_edges(cluster_of, src, dst, nbytes)
    h = heights(k, qs, qd)
    order = np.lexsort((np.arange(k), h))              # by height: a topological order
    rank = np.empty(k, dtype=np.int64)
    rank[order] = np.arange(k)
    return rank[cluster_of]


# ----------------------------------------------------------------------------- the scheduling problem
@dataclass
class ScheduleProblem:
    """Joint placement and order of K tasks on M devices with transfers on links (integer time units).

    Shapes: ``duration`` (K, M); ``edge_src``, ``edge_dst`` (E,); ``transfer`` (E, M, M) time of edge e
    when its endpoints are on devices (a, b), 0 on the diagonal; ``pair_links[a][b]`` link ids a
    transfer a -> b holds; ``memory`` (K,) and ``capacity`` (M,) in the same (any) unit;
    ``edge_memory`` (E,) what a transfer allocates on the receiving device (default 0).
    """

    duration: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    transfer: np.ndarray
    pair_links: list[list[tuple[int, ...]]]
    memory: np.ndarray
    capacity: np.ndarray
    edge_memory: np.ndarray | None = None
    n_links: int = field(init=False)

    def __post_init__(self) -> None:
        if self.edge_memory is None:
            self.edge_memory = np.zeros(len(self.edge_src), dtype=np.int64)
        self.n_links = 1 + max((x for row in self.pair_links for p in row for x in p), default=-1)

    @property
    def n_tasks(self) -> int:
        return int(self.duration.shape[0])

    @property
    def n_devices(self) -> int:
        return int(self.duration.shape[1])


@dataclass
class ScheduleSolution:
    """Device (K,) and start (K,) of every task, transfer starts (E,) and the makespan (time units)."""

    device: np.ndarray
    start: np.ndarray
    transfer_start: np.ndarray
    makespan: int
    status: str = ""


def list_schedule(prob: ScheduleProblem, device: np.ndarray, order: np.ndarray) -> ScheduleSolution:
    """Append-only schedule of tasks in ``order`` (a topological order) on the given devices: each task
    starts when its inputs have arrived and its device is free; each transfer starts when its producer is
    done and all links of its path are free. Always feasible for the CP-SAT model (used as its hint)."""
    K, E = prob.n_tasks, len(prob.edge_src)
    dev_free = np.zeros(prob.n_devices, dtype=np.int64)
    link_free = np.zeros(max(prob.n_links, 1), dtype=np.int64)
    start = np.zeros(K, dtype=np.int64)
    end = np.zeros(K, dtype=np.int64)
    t_start = np.zeros(E, dtype=np.int64)
    in_edges: list[list[int]] = [[] for _ in range(K)]
    for e, d in enumerate(prob.edge_dst.tolist()):
        in_edges[d].append(e)
    for j in np.asarray(order).tolist():
        ready = 0
        for e in in_edges[j]:
            i = int(prob.edge_src[e])
            a, b = int(device[i]), int(device[j])
            t = int(prob.transfer[e, a, b])
            if a == b or t == 0:
                t_start[e] = end[i]
                ready = max(ready, int(end[i]))
                continue
            links = prob.pair_links[a][b]
            ts = max([int(end[i])] + [int(link_free[x]) for x in links])
            t_start[e] = ts
            for x in links:
                link_free[x] = ts + t
            ready = max(ready, ts + t)
        d = int(device[j])
        start[j] = max(ready, int(dev_free[d]))
        end[j] = start[j] + int(prob.duration[j, d])
        dev_free[d] = end[j]
    return ScheduleSolution(np.asarray(device, dtype=np.int64), start, t_start, int(end.max(initial=0)), "list")


def fits_memory(prob: ScheduleProblem, device: np.ndarray) -> bool:
    """Whether a placement satisfies the model's memory constraint (tasks plus received transfers)."""
    used = np.bincount(device, weights=prob.memory, minlength=prob.n_devices).astype(np.float64)
    a, b = device[prob.edge_src], device[prob.edge_dst]
    cross = (a != b) & (prob.transfer[np.arange(len(a)), a, b] > 0)
    assert prob.edge_memory is not None                  # filled in by __post_init__
    used += np.bincount(b[cross], weights=prob.edge_memory[cross], minlength=prob.n_devices)
    return bool(np.all(used <= prob.capacity))


def solve_cpsat(prob: ScheduleProblem, *, time_limit_s: float = 60.0, workers: int = 1, seed: int = 0,
                hint: ScheduleSolution | None = None, deadline: float | None = None) -> ScheduleSolution:
    """Minimise the makespan of ``prob`` with CP-SAT, for at most ``time_limit_s`` seconds and, with a
    ``deadline`` (a ``time.perf_counter()`` value), at most until it (building the model counts: 0.1 s at
    least).

    Model: per task an optional interval per device (exactly one present, durations per device), one
    NoOverlap per device; per edge a transfer start and, per ordered pair of distinct devices with a
    nonzero transfer time, an optional fixed-size interval present iff the endpoints sit on that pair,
    added to the NoOverlap of every link on the pair's path; a consumer starts after its producer ends
    and after its incoming transfers end; per device, the memory of its tasks plus what its incoming
    transfers allocate is within capacity.
    Returns the best solution found (status OPTIMAL or FEASIBLE), or the hint if none was found.
    """
    from ortools.sat.python import cp_model

    K, M, E = prob.n_tasks, prob.n_devices, len(prob.edge_src)
    horizon = int(prob.duration.max(axis=1).sum() + (prob.transfer.max(axis=(1, 2)).sum() if E else 0)) + 1
    mdl = cp_model.CpModel()
    x = [[mdl.new_bool_var(f"x{i}_{d}") for d in range(M)] for i in range(K)]
    s = [mdl.new_int_var(0, horizon, f"s{i}") for i in range(K)]
    e = [mdl.new_int_var(0, horizon, f"e{i}") for i in range(K)]
    dev_iv: list[list] = [[] for _ in range(M)]
    for i in range(K):
        mdl.add_exactly_one(x[i])
        for d in range(M):
            dev_iv[d].append(mdl.new_optional_interval_var(s[i], int(prob.duration[i, d]), e[i], x[i][d],
                                                           f"iv{i}_{d}"))
    for d in range(M):
        mdl.add_no_overlap(dev_iv[d])
    link_iv: list[list] = [[] for _ in range(max(prob.n_links, 1))]
    ts = [mdl.new_int_var(0, horizon, f"ts{k}") for k in range(E)]
    y: dict[tuple[int, int, int], cp_model.IntVar] = {}
    for k in range(E):
        i, j = int(prob.edge_src[k]), int(prob.edge_dst[k])
        mdl.add(s[j] >= e[i])
        mdl.add(ts[k] >= e[i])
        delay = []
        for a in range(M):
            for b in range(M):
                t = int(prob.transfer[k, a, b])
                if a == b or t == 0:
                    continue
                lit = mdl.new_bool_var(f"y{k}_{a}_{b}")
                mdl.add_bool_and([x[i][a], x[j][b]]).only_enforce_if(lit)
                mdl.add_bool_or([x[i][a].Not(), x[j][b].Not(), lit])
                y[(k, a, b)] = lit
                iv = mdl.new_optional_fixed_size_interval_var(ts[k], t, lit, f"tr{k}_{a}_{b}")
                for link in prob.pair_links[a][b]:
                    link_iv[link].append(iv)
                delay.append(t * lit)
        if delay:
            mdl.add(s[j] >= ts[k] + sum(delay))
    for ivs in link_iv:
        if len(ivs) > 1:
            mdl.add_no_overlap(ivs)
    received: list[list] = [[] for _ in range(M)]
    assert prob.edge_memory is not None                  # filled in by __post_init__
    for (k, a, b), lit in y.items():
        if prob.edge_memory[k] > 0:
            received[b].append(int(prob.edge_memory[k]) * lit)
    for d in range(M):
        mdl.add(sum(int(prob.memory[i]) * x[i][d] for i in range(K)) + sum(received[d]) <= int(prob.capacity[d]))
    makespan = mdl.new_int_var(0, horizon, "makespan")
    mdl.add_max_equality(makespan, e)
    mdl.minimize(makespan)
    if hint is not None:
        for i in range(K):
            for d in range(M):
                mdl.add_hint(x[i][d], int(hint.device[i]) == d)
            mdl.add_hint(s[i], int(hint.start[i]))
            mdl.add_hint(e[i], int(hint.start[i] + prob.duration[i, hint.device[i]]))
        for k in range(E):
            mdl.add_hint(ts[k], int(hint.transfer_start[k]))
        for (k, a, b), lit in y.items():
            mdl.add_hint(lit, int(hint.device[prob.edge_src[k]]) == a and int(hint.device[prob.edge_dst[k]]) == b)
        mdl.add_hint(makespan, int(hint.makespan))
    solver = cp_model.CpSolver()
    limit = float(time_limit_s) if deadline is None else min(float(time_limit_s), deadline - time.perf_counter())
    solver.parameters.max_time_in_seconds = max(limit, 0.1)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    solver.parameters.cp_model_probing_level = 0   # probing ~10^4 transfer literals eats the whole budget
    status = solver.solve(mdl)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is None:
            raise RuntimeError(f"CP-SAT found no schedule ({name}) within {time_limit_s} s")
        return ScheduleSolution(hint.device, hint.start, hint.transfer_start, hint.makespan, f"hint ({name})")
    device = np.array([next(d for d in range(M) if solver.boolean_value(x[i][d])) for i in range(K)],
                      dtype=np.int64)
    return ScheduleSolution(device, np.array([solver.value(v) for v in s], dtype=np.int64),
                            np.array([solver.value(v) for v in ts], dtype=np.int64),
                            int(solver.value(makespan)), name)


# ----------------------------------------------------------------------------- the planner
def coarse_problem(ev: PlanEvaluator, cluster_of: np.ndarray, time_unit_s: float,
                   memory_headroom: float) -> tuple[ScheduleProblem, PlacementProblem]:
    """The coarse graph as a ScheduleProblem (integer time units of ``time_unit_s``, memory in MiB) and
    as a PlacementProblem in seconds (for the DPOS hint)."""
    graph, cluster = ev.graph, ev.cluster
    K, m = int(cluster_of.max()) + 1, cluster.n_devices
    full = np.asarray(ev.cost.full_batch_times(graph))
    dur_s = np.zeros((K, m))
    np.add.at(dur_s, cluster_of, full)
    qs, qd, qb = quotient_edges(cluster_of, graph.edge_src, graph.edge_dst, graph.edge_bytes)
    alpha, beta = comm_coefficients(ev.cost, m)
    tr_s = alpha[None, :, :] + qb[:, None, None] * beta[None, :, :]
    tr_s[:, np.arange(m), np.arange(m)] = 0.0
    tr_s[qb <= 0] = 0.0
    held, transient = op_memory_bytes(graph)
    mem_mib = np.ceil(np.bincount(cluster_of, weights=held, minlength=K) / 2**20).astype(np.int64)
    cap = np.asarray(cluster.memory_bytes, dtype=np.float64) * memory_headroom - transient.max(initial=0.0)
    cap_mib = np.floor(np.maximum(cap, 0.0) / 2**20).astype(np.int64)

    def units(t: np.ndarray) -> np.ndarray:
        return np.where(t > 0, np.maximum(1, np.round(t / time_unit_s)), 0).astype(np.int64)

    pair_links = [[tuple(cluster.path(a, b)) for b in range(m)] for a in range(m)]
    edge_mib = np.ceil(qb / 2**20).astype(np.int64)
    sched = ScheduleProblem(units(dur_s), qs, qd, units(tr_s), pair_links, mem_mib, cap_mib, edge_mib)
    # the same problem in seconds for DPOS, with the same memory rule (MiB held + received within capacity)
    place = PlacementProblem(dur_s, qs, qd, qb, alpha, beta, np.zeros(K, dtype=bool), np.arange(K),
                             mem_mib.astype(np.float64), np.zeros(K), cap_mib.astype(np.float64),
                             edge_memory=edge_mib.astype(np.float64))
    return sched, place


def pesto(ev: PlanEvaluator, budget_s: float = 60.0, target_nodes: int = 200, seed: int = 0,
          solver_workers: int | None = None, memory_headroom: float = 0.9, time_resolution: int = 100_000,
          micro_batches: int = 1) -> Strategy:
    """Pesto: coarsen to ``target_nodes`` nodes (a coarse node holds at most half of the smallest device's
    memory), solve placement + order with CP-SAT within what is left of ``budget_s`` and expand back: one
    group per coarse node on its device, ops ordered by their coarse node's start time.

    Memory per device: the held bytes (resident + activations kept for backward) of its coarse nodes plus
    the tensors it receives from other devices, within ``memory_headroom`` x capacity minus the largest
    transient allocation. The solver starts from the fastest memory-feasible of three hints: DPOS on the
    coarse graph, contiguous segments balanced over the devices, and the best single device. Time is
    discretised in units of (total op time on the fastest devices) / ``time_resolution``. ``solver_workers``:
    CP-SAT's search workers (default: the CPUs, at most 8). The plan runs over ``micro_batches`` even
    micro-batches (the solver places the whole batch; each device then works through the micro-batches).
    """
    t0 = time.perf_counter()
    graph, cluster = ev.graph, ev.cluster
    full = np.asarray(ev.cost.full_batch_times(graph))
    held, _ = op_memory_bytes(graph)
    # a coarse node should fit in half of the smallest device, so that the solver keeps choices
    cluster_of = coarsen(graph.n_ops, graph.edge_src, graph.edge_dst, graph.edge_bytes, full.mean(axis=1),
                         target_nodes, memory=held,
                         memory_cap=0.5 * memory_headroom * float(cluster.memory_bytes.min()))
    time_unit_s = max(float(full.min(axis=1).sum()) / time_resolution, 1e-9)
    sched, place = coarse_problem(ev, cluster_of, time_unit_s, memory_headroom)
    K = sched.n_tasks
    # hints: DPOS on the coarse graph; contiguous segments balanced over the devices (the expert's split
    # of the coarse nodes in topological order); the best single device. The fastest that fits is used.
    d_sched = dpos_schedule(place)
    hints = [list_schedule(sched, d_sched.device, d_sched.order),
             list_schedule(sched, balanced_partition(sched.duration, sched.memory, sched.capacity), np.arange(K))]
    total = sched.duration.sum(axis=0)
    d = int(np.argmin(np.where(sched.memory.sum() <= sched.capacity, total, total + total.max() + 1)))
    hints.append(list_schedule(sched, np.full(K, d), np.arange(K)))
    hint = min(hints, key=lambda h: (not fits_memory(sched, h.device), h.makespan))
    left = max(1.0, budget_s - (time.perf_counter() - t0))
    n_workers = solver_workers if solver_workers is not None else max(1, min(8, os.cpu_count() or 1))
    sol = solve_cpsat(sched, time_limit_s=left, workers=n_workers, seed=seed, hint=hint, deadline=t0 + budget_s)
    pos = np.empty(graph.n_ops, dtype=np.int64)
    pos[graph.topo_order()] = np.arange(graph.n_ops)
    order = np.lexsort((pos, sol.start[cluster_of]))
    meta = {"coarse_nodes": K, "coarse_edges": len(sched.edge_src), "cpsat_status": sol.status,
            "cpsat_makespan_s": sol.makespan * time_unit_s, "hint_makespan_s": hint.makespan * time_unit_s,
            "time_unit_s": time_unit_s}
    return mp_strategy(ev, cluster_of, sol.device, priorities=order_priorities(order, graph.n_ops), meta=meta,
                       micro_batches=micro_batches)
