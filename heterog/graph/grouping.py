"""Op grouping: the groups a Strategy gives one ParallelConfig each, as HeteroG forms them (the costliest
ops as centres, the others joining the nearest), with parameters, gradients and updates kept together."""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from heterog.errors import StrategyError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.graph.opgraph import OpGraph


def group_ops(graph: "OpGraph", op_cost: np.ndarray, max_groups: int = 2000) -> np.ndarray:
    """Group ops as HeteroG does: if there are more than ``max_groups`` ops, the ``max_groups``
    costliest ops (by ``op_cost``, e.g. mean time over devices) are centres and every other op joins
    the centre fewest hops away (undirected BFS, ties to the lower centre); ops no centre reaches join
    the cheapest centre's group. Afterwards every
    optimizer-update op and every parameter/state placeholder joins the group of the gradient it
    consumes or serves, so parameters, their gradients and their updates stay together.

    Returns ``group_of`` (n_ops,) with groups numbered 0..G-1 in order of first appearance.
    """
    n = graph.n_ops
    op_cost = np.asarray(op_cost, dtype=np.float64)
    if op_cost.shape != (n,):
        raise StrategyError(f"op_cost has shape {op_cost.shape}, expected ({n},)")
    if max_groups <= 0:
        raise StrategyError(f"max_groups must be positive, got {max_groups}")
    if n <= max_groups:
        group = np.arange(n, dtype=np.int64)
    else:
        # costliest first; ties by index so grouping is deterministic
        centres = np.lexsort((np.arange(n), -op_cost))[:max_groups]
        group = np.full(n, -1, dtype=np.int64)
        group[centres] = centres
        nbrs = [a + b for a, b in zip(graph.succ, graph.pred)]
        q = deque(sorted(int(c) for c in centres))
        while q:  # multi-source BFS: first centre to reach an op owns it (sources in index order)
            u = q.popleft()
            for v in nbrs[u]:
                if group[v] < 0:
                    group[v] = group[u]
                    q.append(v)
        # ops in weakly connected components without a centre (e.g. in-place buffer updates) touch nothing
        # else: they join the cheapest centre's group, so there are never more than max_groups groups
        group[group < 0] = centres[-1]
    group = attach_params_to_grads(graph, group)
    # renumber in order of first appearance
    _, first = np.unique(group, return_index=True)
    remap = {g: k for k, g in enumerate(group[np.sort(first)])}
    return np.array([remap[g] for g in group], dtype=np.int64)


def attach_params_to_grads(graph: "OpGraph", group: np.ndarray) -> np.ndarray:
    """Update ops, param and state placeholders join the group of their parameter's gradient producer."""
    grad_group: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        if op.is_grad and op.param is not None:
            grad_group.setdefault(op.param, int(group[i]))
    group = group.copy()
    for i, op in enumerate(graph.ops):
        if op.param is not None and op.param in grad_group and (op.phase == "update" or op.kind in ("param", "state")):
            group[i] = grad_group[op.param]
    return group


def units_on_groups(unit_of: np.ndarray, group_of: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``unit_of`` (any per-op labelling: a planner's layers, coarse nodes or placement units) with the ops of
    every group of ``group_of`` in one unit: the unit holding the largest ``weight`` (e.g. op time) of the
    group's ops, the lowest such unit on a tie. A plan built on the result gives each group one config, as
    the agent's plan actions (one per group) need; ``unit_of`` itself where it already does."""
    unit_of = np.asarray(unit_of, dtype=np.int64)
    group_of = np.asarray(group_of, dtype=np.int64)
    if unit_of.shape != group_of.shape or np.shape(weight) != unit_of.shape:
        raise StrategyError(f"units of shape {unit_of.shape}, groups of shape {group_of.shape} and weights of "
                            f"shape {np.shape(weight)} differ")
    if len(unit_of) == 0:
        return unit_of
    lo = int(unit_of.min())
    n_units = int(unit_of.max()) - lo + 1
    pairs, inverse = np.unique(group_of * n_units + (unit_of - lo), return_inverse=True)
    w = np.bincount(inverse.ravel(), weights=np.asarray(weight, dtype=np.float64))
    g, u = pairs // n_units, pairs % n_units
    if len(np.unique(g)) == len(g):           # every group in one unit already
        return unit_of
    order = np.lexsort((u, -w, g))            # per group: heaviest unit first, then the lowest
    head = order[np.r_[True, g[order][1:] != g[order][:-1]]]
    unit_of_group = np.zeros(int(g[-1]) + 1, dtype=np.int64)   # pairs are sorted: g[-1] is the largest group
    unit_of_group[g[head]] = u[head] + lo
    return unit_of_group[group_of]
