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


def compute_bound(graph, cluster, cost=None) -> float:
    """Seconds: no plan of ``graph`` on ``cluster`` (under ``cost``, the roofline by default) iterates
    faster (the linear program of the module docstring, solved with HiGHS)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    from heterog.cost import CostModel

    cost = cost if cost is not None else CostModel(cluster)
    u = unit_times(graph, cost)
    ops = np.nonzero(u.max(axis=1) > 0)[0]
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
