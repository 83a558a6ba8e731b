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

import numpy as np

from heterog.errors import HeterogError

_CHUNK = 4_000_000          # op-time evaluations per batch of shares


def unit_times(graph, cost) -> np.ndarray:
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


def compute_bound(graph, cluster, cost=None, ops_mask: np.ndarray | None = None) -> float:
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
def action_space_bound(evaluator, data_parallel_only: bool = False, integral_groups: int = 0,
                       time_limit_s: float = 60.0) -> dict:
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
    heavy = sync[:, :, n_devices:].max(axis=(1, 2))
    pick = np.argsort(-heavy, kind="stable")[:int(k)]
    out = np.zeros(len(heavy), dtype=bool)
    out[pick[heavy[pick] > 0]] = True
    return out


def dp_action_configs(evaluator) -> list:
    """The ParallelConfig of each of the ``3M + 2`` LP actions (``_action_loads``) past the M model-parallel
    ones: DP-even-AR, DP-prop-AR, DP-even-PS on PS 0..M-1, DP-prop-PS on PS 0..M-1."""
    from heterog.strategy import ParallelConfig, even_shares, proportional_shares

    cluster, m, B = evaluator.cluster, evaluator.cluster.n_devices, evaluator.graph.batch_size
    layouts = [list(zip(range(m), even_shares(B, m))), list(zip(range(m), proportional_shares(B, cluster.power)))]
    out = [ParallelConfig.of(layouts[0]), ParallelConfig.of(layouts[1])]
    for k in range(2):
        out += [ParallelConfig.of(layouts[k], sync="ps", ps_device=p) for p in range(m)]
    return out


def data_parallel_lp(evaluator, integral_groups: int = 0, time_limit_s: float = 60.0) -> dict:
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


def _without_compute(loads: np.ndarray, evaluator) -> np.ndarray:
    lo = loads.copy()
    lo[:, :, :evaluator.cluster.n_devices] = 0.0
    return lo


def _action_loads(evaluator) -> tuple[np.ndarray, np.ndarray]:
    """(G, 3M + 2, R) seconds each action of each group holds each resource (devices, links), and the part
    of it that synchronises gradients (pushes, aggregation, AllReduce; not the pulls). Actions: MP on
    device 0..M-1, DP-even-AR, DP-prop-AR, DP-even-PS on PS 0..M-1, DP-prop-PS on PS 0..M-1."""
    from heterog.compiler.index import graph_index, path_table
    from heterog.compiler.ps import _aggregate_coefs, _cluster_tables
    from heterog.strategy import even_shares, proportional_shares

    graph, cluster, cost = evaluator.graph, evaluator.cluster, evaluator.cost
    gi, paths = graph_index(graph), path_table(cluster)
    m, B = cluster.n_devices, graph.batch_size
    n_res = m + len(cluster.links)
    group_of = evaluator.group_of
    n_groups = evaluator.n_groups
    loads = np.zeros((n_groups, 3 * m + 2, n_res))
    sync = np.zeros_like(loads)
    full = np.asarray(cost.full_batch_times(graph))
    comp = np.where(gi.is_compute, 1.0, 0.0)[:, None] * full
    for d in range(m):                                                     # MP
        np.add.at(loads[:, d, d], group_of, comp[:, d])
    t_group = group_of[gi.t_op]
    agg = gi.t_needs_agg
    n_push = np.bincount(t_group[agg], minlength=n_groups).astype(float)
    b_push = np.bincount(t_group[agg], weights=gi.t_bytes[agg], minlength=n_groups)
    n_pull = np.bincount(t_group[gi.t_pulled], minlength=n_groups).astype(float)
    b_pull = np.bincount(t_group[gi.t_pulled], weights=gi.t_bytes[gi.t_pulled], minlength=n_groups)
    alpha, beta, path_ptr, path_res = _cluster_tables(cost, paths)
    devs = tuple(range(m))
    times, algos = cost.allreduce_times(devs, gi.t_bytes[agg])
    algos = np.asarray(algos)
    ar = np.zeros((n_groups, n_res))
    for a in set(algos.tolist()):
        res = [m + x for x in cost.allreduce_links(devs, a)] + [d for d in devs if paths.host[d]]
        per_group = np.bincount(t_group[agg][algos == a], weights=times[algos == a], minlength=n_groups)
        ar[:, res] += per_group[:, None]
    batch = gi.has_batch & gi.is_compute
    ps_only = gi.is_compute & ~gi.has_batch & gi.post_agg                   # updates: on the PS only
    dup = gi.is_compute & ~gi.has_batch & ~gi.post_agg
    agg_coef = _aggregate_coefs(m, devs, cost)
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
        sync[:, a_ar] += ar
        for p in range(m):                                                  # PS on device p
            a_ps = m + 2 + k * m + p
            loads[:, a_ps, :m] = dev_t
            aggregate = n_push * agg_coef[p, 0] + b_push * agg_coef[p, 1]
            loads[:, a_ps, p] += upd[:, p] + aggregate
            sync[:, a_ps, p] += aggregate
            for w in range(m):
                if w == p:
                    continue
                for src, dst, n, b, is_sync in ((w, p, n_push, b_push, True), (p, w, n_pull, b_pull, False)):
                    res = path_res[path_ptr[src * m + dst]:path_ptr[src * m + dst + 1]]
                    t = (n * alpha[src, dst] + b * beta[src, dst])[:, None]
                    loads[:, a_ps, res] += t
                    if is_sync:
                        sync[:, a_ps, res] += t
    return loads, sync
