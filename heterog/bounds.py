"""A lower bound on the iteration time of any plan: how much a search could still gain.

Every compute op runs somewhere: split along the batch into integer shares over some devices, or
whole on one or more. Whatever the plan, device d spends on op i at least ``x[i, d] * u[i, d]``,
where ``x[i, d]`` is the fraction of the op's batch that d computes (fractions sum to 1) and
``u[i, d]`` the op's least time per unit of batch on d over the shares it could get:

    u[i, d] = min over s in 1..B of time(i, d, s / B) / (s / B)      (ops with a batch dimension)
    u[i, d] = time(i, d, 1)                                            (ops without one)

So the iteration takes at least the optimum of the linear program

    minimise T   subject to   sum_d x[i, d] = 1 for every op i,   sum_i x[i, d] u[i, d] <= T for every d,
                              x >= 0,

which ignores communication, dependencies and memory (each only adds time). It holds for any cost
model, profiled ones included, since ``u`` is taken over the integer shares themselves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.caches import DerivedCache
from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.cost.model import CostModel
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import ParallelConfig

_CHUNK = 4_000_000          # op-time evaluations per batch of shares


def unit_times(graph: OpGraph, cost: CostModel) -> np.ndarray:
    """(n_ops, M) least seconds per unit of batch of each compute op on each device (0 elsewhere)."""
    m, B = cost.cluster.n_devices, int(graph.batch_size)
    out = np.array(cost.full_batch_times(graph), dtype=np.float64, copy=True)
    batched = np.nonzero(graph.is_compute & graph.has_batch)[0]
    if len(batched) and B > 1:
        ops = np.repeat(batched, m)
        devs = np.tile(np.arange(m), len(batched))
        step = max(1, _CHUNK // max(len(ops), 1))
        best = np.full(len(ops), np.inf)
        for lo in range(1, B + 1, step):
            shares = np.arange(lo, min(B, lo + step - 1) + 1, dtype=np.float64)
            f = shares / B
            t = cost.op_times(graph, ops[:, None], devs[:, None], f[None, :]) / f[None, :]
            best = np.minimum(best, t.min(axis=1))
        out[batched] = best.reshape(len(batched), m)
    out[~graph.is_compute] = 0.0
    return out


def compute_bound(graph: OpGraph, cluster: Cluster, cost: CostModel | None = None,
                  ops_mask: np.ndarray | None = None) -> float:
    """Seconds: no plan of ``graph`` on ``cluster`` (under ``cost``, the roofline by default) iterates
    faster (the linear program of the module docstring, solved with HiGHS). With ``ops_mask``, the least
    time in which the masked ops can all be computed (e.g. the forward pass: no gradient exists before)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    from heterog.cost import CostModel

    cost = cost if cost is not None else CostModel(cluster)
    u = unit_times(graph, cost)
    ops = np.nonzero((u.max(axis=1) > 0) & (True if ops_mask is None else np.asarray(ops_mask)))[0]
    if not len(ops):
        return 0.0
    u = u[ops]
    k, m = u.shape
    nvar = k * m + 1                              # x[i, d] row-major, then T
    var = np.arange(k * m)
    eq = coo_matrix((np.ones(k * m), (var // m, var)), shape=(k, nvar))
    rows = np.concatenate([var % m, np.arange(m)])
    cols = np.concatenate([var, np.full(m, k * m)])
    vals = np.concatenate([u.ravel(), -np.ones(m)])
    ub = coo_matrix((vals, (rows, cols)), shape=(m, nvar))
    c = np.zeros(nvar)
    c[-1] = 1.0
    res = linprog(c, A_ub=ub.tocsr(), b_ub=np.zeros(m), A_eq=eq.tocsr(), b_eq=np.ones(k),
                  bounds=(0, None), method="highs")
    if res.status != 0:
        raise HeterogError(f"lower bound LP for {graph.name} on {cluster.name} failed: {res.message}")
    return float(res.x[-1])


# ----------------------------------------------------------------------------- over the action space
def action_space_bound(evaluator: PlanEvaluator, data_parallel_only: bool = False, integral_groups: int = 0,
                       time_limit_s: float = 60.0) -> dict[str, float]:
    """Seconds no plan of HeteroG's action space (one of the M + 4 actions per group, PS on any replica)
    beats, counting gradient synchronisation as well as computation; with ``data_parallel_only``, no plan
    whose groups all take one of the four data-parallel actions (any mix of them) beats.

    Each group g takes action a with weight ``x[g, a]`` (weights of a group sum to 1; a plan puts all of
    a group's weight on one action, so every plan is a feasible point). An action loads every device with
    the compute of the group's ops there (DP: at the replica's share; ops without a batch dimension on
    every replica, PS updates on the PS only; PS aggregation on the PS), and every link (and host-driven
    device) with the synchronisation tasks that hold it (AllReduce: the algorithm the compiler picks, per
    tensor; PS: the pushes and pulls of the group's tensors, one action per PS device). Each resource runs
    one task at a time, so its load is at most the iteration time:

        minimise T  subject to  sum_a x[g, a] = 1,  sum_{g, a} x[g, a] load[g, a, r] <= T for every r,  x >= 0.

    No gradient exists before the loss, i.e. before the whole forward pass is computed, which takes at
    least ``F`` (``compute_bound`` of the forward ops), so the synchronisation tasks (pushes, aggregation,
    AllReduce) of every link also fit in ``T - F``: ``sum x[g, a] sync[g, a, r] <= T - F``. Transfers of
    activations between groups, other dependencies and memory are ignored (each only adds time), and so
    the bound holds under any order; they are what model parallelism costs, so the bound over all
    actions is close to the compute bound, while the data-parallel one shows what synchronisation costs
    at the least. Returns ``{"bound_s", "sync_bound_s", "forward_bound_s"}``: the second is the same LP
    with compute left out, the third ``F``. With ``integral_groups`` > 0 also ``integral_bound_s``: the
    same program with the weights of that many groups (those with the most synchronisation work on a link,
    e.g. a 125 MB embedding gradient the LP would push half to one PS and half to another) restricted to
    0 or 1, as every plan has them; HiGHS's branch and bound gives a dual bound that stays valid when
    ``time_limit_s`` stops it early.
    """
    graph, cluster = evaluator.graph, evaluator.cluster
    loads, sync = _action_loads(evaluator)                   # (G, A, R) each: all work, the gradient part
    if data_parallel_only:
        loads, sync = loads[:, cluster.n_devices:], sync[:, cluster.n_devices:]   # the MP actions come first
    forward_s = compute_bound(graph, cluster, evaluator.cost, ops_mask=graph.phase_index == 0)
    out = {"forward_bound_s": forward_s}
    for name, lo in (("bound_s", loads), ("sync_bound_s", _without_compute(loads, evaluator))):
        out[name] = _solve_action_lp(lo, sync, forward_s)[0]
    if integral_groups > 0:
        integral = _heaviest_groups(sync, cluster.n_devices, integral_groups)
        out["integral_bound_s"] = _solve_action_lp(loads, sync, forward_s, integral, time_limit_s)[0]
    return out


def _solve_action_lp(loads: np.ndarray, sync: np.ndarray, forward_s: float, integral: np.ndarray | None = None,
                     time_limit_s: float = 60.0) -> tuple[float, np.ndarray]:
    """The LP of ``action_space_bound``: (T, the weights x (G, A)). With ``integral`` (G,) bool, those groups'
    weights are 0 or 1 (a MILP); T is then HiGHS's dual bound, a valid lower bound even when the time limit
    stops the search before optimality."""
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp
    from scipy.sparse import coo_matrix, vstack

    g_n, a_n, r_n = loads.shape
    nvar = g_n * a_n + 1
    var = np.arange(g_n * a_n)
    eq = coo_matrix((np.ones(g_n * a_n), (var // a_n, var)), shape=(g_n, nvar))
    blocks, rhs = [], []
    for part, shift in ((loads, 0.0), (sync, forward_s)):     # all work <= T; gradient work <= T - F
        flat = part.reshape(g_n * a_n, r_n)
        vi, ri = np.nonzero(flat)
        rows = np.concatenate([ri, np.arange(r_n)])
        cols = np.concatenate([vi, np.full(r_n, g_n * a_n)])
        vals = np.concatenate([flat[vi, ri], -np.ones(r_n)])
        blocks.append(coo_matrix((vals, (rows, cols)), shape=(r_n, nvar)))
        rhs.append(np.full(r_n, -shift))
    c = np.zeros(nvar)
    c[-1] = 1.0
    a_ub, b_ub = vstack(blocks).tocsr(), np.concatenate(rhs)
    if integral is None or not np.any(integral):
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=eq.tocsr(), b_eq=np.ones(g_n), bounds=(0, None), method="highs")
        if res.status != 0:
            raise HeterogError(f"action-space bound LP failed: {res.message}")
        return float(res.x[-1]), res.x[:-1].reshape(g_n, a_n)
    integrality = np.zeros(nvar)
    integrality[:-1] = np.repeat(np.asarray(integral, dtype=bool), a_n)
    res = milp(c, constraints=[LinearConstraint(a_ub, -np.inf, b_ub), LinearConstraint(eq.tocsr(), 1.0, 1.0)],
               integrality=integrality, bounds=Bounds(0.0, np.inf), options={"time_limit": float(time_limit_s)})
    if res.x is None:
        raise HeterogError(f"action-space bound MILP found no solution: {res.message}")
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(res.x[-1]) if bound is None or not np.isfinite(bound) else min(float(bound), float(res.x[-1]))
    return bound, res.x[:-1].reshape(g_n, a_n)


def _heaviest_groups(sync: np.ndarray, n_devices: int, k: int) -> np.ndarray:
    """(G,) bool: the ``k`` groups with the most synchronisation seconds on one link (under any action)."""
    links = sync[:, :, n_devices:]
    if links.size == 0:
        return np.zeros(sync.shape[0], dtype=bool)
    heavy = links.max(axis=(1, 2))
    pick = np.argsort(-heavy, kind="stable")[:int(k)]
    out = np.zeros(len(heavy), dtype=bool)
    out[pick[heavy[pick] > 0]] = True
    return out


def dp_action_configs(evaluator: PlanEvaluator) -> list[ParallelConfig]:
    """The ParallelConfig of each of the ``3M + 2`` LP actions (``_action_loads``) past the M model-parallel
    ones: DP-even-AR, DP-prop-AR, DP-even-PS on PS 0..M-1, DP-prop-PS on PS 0..M-1."""
    from heterog.shares import even_shares, proportional_shares
    from heterog.strategy import ParallelConfig

    cluster, m, B = evaluator.cluster, evaluator.cluster.n_devices, evaluator.graph.batch_size
    layouts = [list(zip(range(m), even_shares(B, m))), list(zip(range(m), proportional_shares(B, cluster.power)))]
    out = [ParallelConfig.of(layouts[0]), ParallelConfig.of(layouts[1])]
    for k in range(2):
        out += [ParallelConfig.of(layouts[k], sync="ps", ps_device=p) for p in range(m)]
    return out


def data_parallel_lp(evaluator: PlanEvaluator, integral_groups: int = 0,
                     time_limit_s: float = 60.0) -> dict[str, Any]:
    """The data-parallel LP of ``action_space_bound`` and its solution: ``{"bound_s", "forward_bound_s",
    "weights"}`` with ``weights`` (G, 2M + 2) over ``dp_action_configs``. ``integral_groups``: that many
    groups, those with the most synchronisation work on a link, take one action each (a MILP; the bound
    stays valid, every plan takes one action per group, and rises towards the integral optimum)."""
    graph, cluster = evaluator.graph, evaluator.cluster
    m = cluster.n_devices
    loads, sync = _action_loads(evaluator)
    loads, sync = loads[:, m:], sync[:, m:]
    forward_s = compute_bound(graph, cluster, evaluator.cost, ops_mask=graph.phase_index == 0)
    integral = _heaviest_groups(sync, m, integral_groups) if integral_groups > 0 else None
    bound, x = _solve_action_lp(loads, sync, forward_s, integral, time_limit_s)
    return {"bound_s": bound, "forward_bound_s": forward_s, "weights": x}


def _without_compute(loads: np.ndarray, evaluator: PlanEvaluator) -> np.ndarray:
    lo = loads.copy()
    lo[:, :, :evaluator.cluster.n_devices] = 0.0
    return lo


def _action_loads(evaluator: PlanEvaluator, pull_mask: np.ndarray | None = None,
                  sync_mask: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """(G, 3M + 2, R) seconds each action of each group holds each resource (devices, links), and the part
    of it that synchronises gradients (pushes, aggregation, AllReduce; not the pulls). Actions: MP on
    device 0..M-1, DP-even-AR, DP-prop-AR, DP-even-PS on PS 0..M-1, DP-prop-PS on PS 0..M-1.

    With ``sync_mask`` (n_tensors,) bool the second array counts the synchronisation of the masked
    aggregated tensors only; with ``pull_mask`` a third array is returned: the pulls of the masked
    tensors alone."""
    from heterog.compiler.index import graph_index, path_table
    from heterog.compiler.ps import aggregate_coefs, link_lines
    from heterog.shares import even_shares, proportional_shares

    graph, cluster, cost = evaluator.graph, evaluator.cluster, evaluator.cost
    gi, paths = graph_index(graph), path_table(cluster)
    m, B = cluster.n_devices, graph.batch_size
    n_res = m + len(cluster.links)
    group_of = evaluator.group_of
    n_groups = evaluator.n_groups
    loads = np.zeros((n_groups, 3 * m + 2, n_res))
    sync = np.zeros_like(loads)
    pulls = np.zeros_like(loads) if pull_mask is not None else None
    full = np.asarray(cost.full_batch_times(graph))
    comp = np.where(gi.is_compute, 1.0, 0.0)[:, None] * full
    for d in range(m):                                                     # MP
        np.add.at(loads[:, d, d], group_of, comp[:, d])
    t_group = group_of[gi.t_op]
    alpha, beta, path_ptr, path_res = link_lines(cost, paths)
    devs = tuple(range(m))

    def amounts(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """per group: tensors and bytes of the masked tensors."""
        return (np.bincount(t_group[mask], minlength=n_groups).astype(float),
                np.bincount(t_group[mask], weights=gi.t_bytes[mask], minlength=n_groups))

    def allreduce(mask: np.ndarray) -> np.ndarray:
        out = np.zeros((n_groups, n_res))
        if not mask.any():
            return out
        times, algos = cost.gradient_allreduce_times(devs, gi.t_bytes[mask])
        algos = np.asarray(algos)
        for a in set(algos.tolist()):
            res = [m + x for x in cost.allreduce_links(devs, a)] + [d for d in devs if paths.host[d]]
            out[:, res] += np.bincount(t_group[mask][algos == a], weights=times[algos == a],
                                       minlength=n_groups)[:, None]
        return out

    agg = gi.t_needs_agg
    agg_s = agg & (np.asarray(sync_mask, dtype=bool) if sync_mask is not None else True)
    push, push_s = amounts(agg), amounts(agg_s)
    pull = amounts(gi.t_pulled)
    pull_m = amounts(gi.t_pulled & (np.asarray(pull_mask, dtype=bool) if pull_mask is not None else False))
    ar, ar_s = allreduce(agg), allreduce(agg_s)
    batch = gi.has_batch & gi.is_compute
    ps_only = gi.is_compute & ~gi.has_batch & gi.post_agg                   # updates: on the PS only
    dup = gi.is_compute & ~gi.has_batch & ~gi.post_agg
    agg_coef = aggregate_coefs(m, devs, cost)

    def link_time(src: int, dst: int, amount: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        res = path_res[path_ptr[src * m + dst]:path_ptr[src * m + dst + 1]]
        return res, (amount[0] * alpha[src, dst] + amount[1] * beta[src, dst])[:, None]

    for k, shares in enumerate((even_shares(B, m), proportional_shares(B, cluster.power))):
        dev_t = np.zeros((n_groups, m))
        for d, s in enumerate(shares):
            t = cost.op_times(graph, np.arange(graph.n_ops), np.full(graph.n_ops, d), np.full(graph.n_ops, s / B))
            np.add.at(dev_t[:, d], group_of, np.where(batch, t, 0.0) + np.where(dup, full[:, d], 0.0))
        upd = np.zeros((n_groups, m))
        for d in range(m):
            np.add.at(upd[:, d], group_of, np.where(ps_only, full[:, d], 0.0))
        a_ar = m + k
        loads[:, a_ar, :m] = dev_t + upd                                   # AR: updates on every replica
        loads[:, a_ar] += ar
        sync[:, a_ar] += ar_s
        for p in range(m):                                                  # PS on device p
            a_ps = m + 2 + k * m + p
            loads[:, a_ps, :m] = dev_t
            loads[:, a_ps, p] += upd[:, p] + push[0] * agg_coef[p, 0] + push[1] * agg_coef[p, 1]
            sync[:, a_ps, p] += push_s[0] * agg_coef[p, 0] + push_s[1] * agg_coef[p, 1]
            for w in range(m):
                if w == p:
                    continue
                for src, dst, amount, target in ((w, p, push, loads), (w, p, push_s, sync), (p, w, pull, loads),
                                                 (p, w, pull_m, pulls)):
                    if target is not None:
                        res, t = link_time(src, dst, amount)
                        target[:, a_ps, res] += t
    if pulls is not None:
        return loads, sync, pulls
    return loads, sync


# ----------------------------------------------------------------------------- release times
_CLOSURES: DerivedCache[OpGraph, list[int]] = DerivedCache("replica closures of each graph")


def _replica_closures(graph: OpGraph) -> list[int]:
    """``ANY(v)`` of ``release_sets`` for every op, as bit sets (bit u set: u in the set); built once per
    graph object."""
    return _CLOSURES.get(graph, lambda: _build_closures(graph))


def _build_closures(graph: OpGraph) -> list[int]:
    """``_replica_closures`` computed."""
    from heterog.compiler.index import graph_index

    gi = graph_index(graph)
    n = graph.n_ops
    agg_t = gi.t_needs_agg[gi.e_tensor]
    sample = gi.e_batch & ~gi.e_value_free
    order = np.argsort(gi.e_dst, kind="stable")          # ops are numbered in topological order
    any_, all_ = [0] * n, [0] * n
    ptr = np.searchsorted(gi.e_dst[order], np.arange(n + 1))
    for v in range(n):
        a = b = 0
        for e in order[ptr[v]:ptr[v + 1]].tolist():
            u = int(gi.e_src[e])
            if agg_t[e]:
                full = (1 << u) | all_[u] | any_[u]
                a |= full
                b |= full
            elif sample[e]:
                a |= any_[u]
                b |= (1 << u) | all_[u] | any_[u]
            else:
                a |= any_[u]
                b |= any_[u]
        any_[v], all_[v] = a, b | a
    return any_


def release_sets(graph: OpGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which ops every plan must have fully computed (every replica, on every device it runs on) before
    the synchronisation of most gradients can start; which gradients; which pulled tensors those ops read.

    For an op v, ``ANY(v)``: the ops all of whose replicas finish before any replica of v starts. An edge
    u -> v carrying a tensor that is aggregated (PS or AllReduce, ``t_needs_agg``) waits for every replica
    of u, so ``ANY(v)`` holds u, ``ALL(u)`` and ``ANY(u)``; any other edge only passes ``ANY(u)`` on (v's
    replica may need one replica of u, or a piece of it). ``ALL(u)``: the ops all of whose replicas finish
    before the last replica of u does. A batch edge u' -> u (not value-free) is sample-preserving: the
    replicas of u cover every sample, so every replica of u' is needed (``ALL(u)`` holds u' and
    ``ALL(u')``); other edges pass ``ANY(u')``. A PS push of tensor t leaves after one replica of its
    producer p, an AllReduce after all of them: neither starts before every op of ``ANY(p)`` is done
    everywhere.

    C is the intersection of ``ANY(producer(t))`` over the aggregated tensors with the largest such sets
    (at least half the largest); the tensors whose set contains C are "late". (On the zoo's language
    models every backward reads the loss's total weight, a count of the targets summed over the replicas,
    computed from the targets alone (``heterog.graph.normalisers``): C is that count, and every gradient is
    late.) Returns ``(C as an (n_ops,) bool
    mask, late (n_tensors,) bool, (n_tensors,) bool: pulled tensors an op of C reads)``: a pull reaches a
    device before that device's replica of its reader starts, so before C is done.
    """
    from heterog.compiler.index import graph_index

    gi = graph_index(graph)
    n = graph.n_ops
    any_ = _replica_closures(graph)
    aggregated = np.nonzero(gi.t_needs_agg)[0]
    sets = [any_[int(gi.t_op[t])] for t in aggregated.tolist()]
    sizes = np.array([x.bit_count() for x in sets], dtype=np.int64)
    late = np.zeros(gi.n_tensors, dtype=bool)
    if not len(sets) or sizes.max() == 0:
        return np.zeros(n, dtype=bool), late, np.zeros(gi.n_tensors, dtype=bool)
    common = -1
    for x, size in zip(sets, sizes.tolist()):
        if 2 * size >= sizes.max():
            common &= x
    late[aggregated] = [(x & common) == common for x in sets]
    mask = np.array([(common >> i) & 1 for i in range(n)], dtype=bool) & graph.is_compute
    read = np.zeros(gi.n_tensors, dtype=bool)
    np.logical_or.at(read, gi.e_tensor, mask[gi.e_dst] & ~gi.e_value_free)
    return mask, late, read & gi.t_pulled


def release_offsets(evaluator: PlanEvaluator, c_ops: np.ndarray) -> np.ndarray:
    """(n_tensors,) seconds after C is done (``release_sets``) before any synchronisation of each tensor
    can start, whatever the plan: along every path of ops from C to the tensor's producer each op needs
    a replica (or a piece) of its predecessor, so the path takes at least the sum of its ops' shortest
    replica times (``min_replica_times``). 0 for tensors that do not depend on all of C."""
    from heterog.compiler.index import graph_index

    graph = evaluator.graph
    gi = graph_index(graph)
    n = graph.n_ops
    any_ = _replica_closures(graph)
    common = 0
    for i in np.nonzero(c_ops)[0].tolist():
        common |= 1 << i
    after = np.array([(a & common) == common for a in any_], dtype=bool) if common else np.zeros(n, bool)
    piece = min_replica_times(evaluator)
    delta = np.zeros(n)
    order = np.argsort(gi.e_dst, kind="stable")
    ptr = np.searchsorted(gi.e_dst[order], np.arange(n + 1))
    for v in np.nonzero(after)[0].tolist():
        es = order[ptr[v]:ptr[v + 1]]
        us = gi.e_src[es]
        us = us[after[us]]
        if len(us):
            delta[v] = float(np.max(delta[us] + piece[us]))
    out = np.where(after[gi.t_op], delta[gi.t_op] + piece[gi.t_op], 0.0)
    return out


def min_replica_times(evaluator: PlanEvaluator) -> np.ndarray:
    """(n_ops,) seconds the shortest replica of each compute op takes under any action of any group: its
    share on any device under the even or the proportional layout, or the whole batch on one device
    (ops without a batch dimension run whole); 0 for non-compute ops."""
    from heterog.shares import even_shares, proportional_shares

    graph, cluster, cost = evaluator.graph, evaluator.cluster, evaluator.cost
    m, B = cluster.n_devices, graph.batch_size
    full = np.asarray(cost.full_batch_times(graph))
    best = full.min(axis=1)
    ops = np.arange(graph.n_ops)
    for shares in (even_shares(B, m), proportional_shares(B, cluster.power)):
        for d, sh in enumerate(shares):
            t = cost.op_times(graph, ops, np.full(graph.n_ops, d), np.full(graph.n_ops, sh / B))
            best = np.minimum(best, np.where(graph.has_batch, t, full[:, d]))
    return np.where(graph.is_compute, best, 0.0)


def release_bound(evaluator: PlanEvaluator, data_parallel_only: bool = True, integral_groups: int = 0,
                  time_limit_s: float = 60.0, offsets: bool = True, n_thresholds: int = 24) -> dict[str, Any]:
    """``action_space_bound`` with the release of the gradients made plan-aware (a valid lower bound for
    every plan of the action space, model parallelism included when ``data_parallel_only`` is False).

    With C the ops that ``release_sets`` shows every plan computes everywhere before any synchronisation
    starts, and L the moment the last replica of C is done:

        L >= sum over ops of C of their seconds on device d under the plan     for every device d
        L >= compute_bound(C)                                                  (any plan)
        L >= the pulls of tensors C reads, on every link                       (they arrive before L)
        sync work of the late tensors on every link <= T - L,   all work on every resource <= T,
        sync work of the late tensors released theta or more after L <= T - L - theta   (``offsets``)

    where a group's sync is released at the least ``release_offsets`` of its late tensors: the backward
    ops from the loss to a gradient take time on any plan, so little synchronisation can start right at L
    (on bert_large the first big gradient, the decoder's, needs its backward matrix product first); the
    thresholds are ``n_thresholds`` quantiles of the groups' offsets.

    The LP of ``action_space_bound`` has only ``sync <= T - F`` with F the compute bound of the forward
    pass, which a plan meets only if it balances the forward pass perfectly over the devices; here the
    plan's own forward time on each device counts, and the parameters that PS plans pull before the
    forward pass ends share the window before L with nothing, the gradients the window after. Returns
    ``{"bound_s", "release_s" (L at the optimum), "release_bound_s" (compute_bound(C)), "release_ops"}``.
    """
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp
    from scipy.sparse import coo_matrix, vstack

    graph, cluster, cost = evaluator.graph, evaluator.cluster, evaluator.cost
    m = cluster.n_devices
    c_ops, late, c_pulled = release_sets(graph)
    loads, sync, pulls = _action_loads(evaluator, pull_mask=c_pulled, sync_mask=late)
    work = _action_loads_of_ops(evaluator, c_ops)                       # (G, A, M) device seconds on C
    if data_parallel_only:
        loads, sync, pulls, work = loads[:, m:], sync[:, m:], pulls[:, m:], work[:, m:]
    f_c = compute_bound(graph, cluster, cost, ops_mask=c_ops) if c_ops.any() else 0.0
    g_n, a_n, r_n = loads.shape
    # each group's sync can start no earlier than its earliest late tensor's offset after L
    from heterog.compiler.index import graph_index

    gi = graph_index(graph)
    rel_t = release_offsets(evaluator, c_ops) if offsets else np.zeros(gi.n_tensors)
    t_group = evaluator.group_of[gi.t_op]
    rel_g = np.full(g_n, np.inf)
    np.minimum.at(rel_g, t_group[late], rel_t[late])
    rel_g[~np.isfinite(rel_g)] = 0.0
    has_sync = sync.reshape(g_n, -1).max(axis=1) > 0
    thresholds = np.unique(np.concatenate([[0.0], np.quantile(rel_g[has_sync], np.linspace(0, 1, n_thresholds))
                                           if has_sync.any() else []]))
    nx = g_n * a_n
    nvar = nx + 2                                                       # x, T, L
    i_t, i_l = nx, nx + 1
    blocks, rhs = [], []

    def rows(part: np.ndarray, t_coef: float, l_coef: float, bound: float) -> None:
        k = part.shape[2]
        flat = part.reshape(nx, k)
        vi, ri = np.nonzero(flat)
        r_all = np.arange(k)
        cols = [vi]
        vals = [flat[vi, ri]]
        rr = [ri]
        for col, coef in ((i_t, t_coef), (i_l, l_coef)):
            if coef:
                rr.append(r_all)
                cols.append(np.full(k, col))
                vals.append(np.full(k, coef))
        blocks.append(coo_matrix((np.concatenate(vals), (np.concatenate(rr), np.concatenate(cols))),
                                 shape=(k, nvar)))
        rhs.append(np.full(k, bound))

    rows(loads, -1.0, 0.0, 0.0)           # all work <= T
    for theta in thresholds:              # sync released theta after L or later: + L + theta <= T
        rows(np.where((rel_g >= theta)[:, None, None], sync, 0.0), -1.0, 1.0, -theta)
    rows(work, 0.0, -1.0, 0.0)            # work on C <= L
    rows(pulls, 0.0, -1.0, 0.0)           # pulls C reads <= L
    a_ub, b_ub = vstack(blocks).tocsr(), np.concatenate(rhs)
    var = np.arange(nx)
    eq = coo_matrix((np.ones(nx), (var // a_n, var)), shape=(g_n, nvar)).tocsr()
    c = np.zeros(nvar)
    c[i_t] = 1.0
    lo = np.zeros(nvar)
    lo[i_l] = f_c
    integral = _heaviest_groups(sync, m, integral_groups) if integral_groups > 0 else None
    if integral is None or not integral.any():
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=eq, b_eq=np.ones(g_n), bounds=list(zip(lo, [None] * nvar)),
                      method="highs")
        if res.status != 0:
            raise HeterogError(f"release-time bound LP failed: {res.message}")
        bound = float(res.x[i_t])
    else:
        integrality = np.zeros(nvar)
        integrality[:nx] = np.repeat(integral, a_n)
        res = milp(c, constraints=[LinearConstraint(a_ub, -np.inf, b_ub), LinearConstraint(eq, 1.0, 1.0)],
                   integrality=integrality, bounds=Bounds(lo, np.inf), options={"time_limit": float(time_limit_s)})
        if res.x is None:
            raise HeterogError(f"release-time bound MILP found no solution: {res.message}")
        dual = getattr(res, "mip_dual_bound", None)
        bound = float(res.x[i_t]) if dual is None or not np.isfinite(dual) else min(float(dual), float(res.x[i_t]))
    return {"bound_s": bound, "release_s": float(res.x[i_l]), "release_bound_s": f_c,
            "release_ops": int(c_ops.sum()), "late_tensors": int(late.sum()),
            "weights": res.x[:nx].reshape(g_n, a_n)}


def _action_loads_of_ops(evaluator: PlanEvaluator, ops_mask: np.ndarray) -> np.ndarray:
    """(G, 3M + 2, M) seconds each action of each group keeps each device busy with the masked ops (actions
    as in ``_action_loads``; ops without a batch dimension run on every replica, PS updates on the PS)."""
    from heterog.compiler.index import graph_index
    from heterog.shares import even_shares, proportional_shares

    graph, cluster, cost = evaluator.graph, evaluator.cluster, evaluator.cost
    gi = graph_index(graph)
    m, B = cluster.n_devices, graph.batch_size
    group_of, n_groups = evaluator.group_of, evaluator.n_groups
    mask = np.asarray(ops_mask, dtype=bool) & gi.is_compute
    full = np.where(mask[:, None], np.asarray(cost.full_batch_times(graph)), 0.0)
    out = np.zeros((n_groups, 3 * m + 2, m))
    for d in range(m):
        np.add.at(out[:, d, d], group_of, full[:, d])
    batch = mask & gi.has_batch
    ps_only = mask & ~gi.has_batch & gi.post_agg
    dup = mask & ~gi.has_batch & ~gi.post_agg
    for k, shares in enumerate((even_shares(B, m), proportional_shares(B, cluster.power))):
        dev_t = np.zeros((n_groups, m))
        upd = np.zeros((n_groups, m))
        for d, s in enumerate(shares):
            t = cost.op_times(graph, np.arange(graph.n_ops), np.full(graph.n_ops, d), np.full(graph.n_ops, s / B))
            np.add.at(dev_t[:, d], group_of, np.where(batch, t, 0.0) + np.where(dup, full[:, d], 0.0))
            np.add.at(upd[:, d], group_of, np.where(ps_only, full[:, d], 0.0))
        out[:, m + k] = dev_t + upd
        for p in range(m):
            out[:, m + 2 + k * m + p] = dev_t
            out[:, m + 2 + k * m + p, p] += upd[:, p]
    return out
