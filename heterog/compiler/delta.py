"""Delta compilation: patch a compiled plan for a strategy that differs from its own in a few groups,
giving the plan that compiling the strategy from scratch gives, task for task.

A group *changes* when its config does or when the PS choice (a greedy over every PS group of the plan,
``heterog.compiler.ps``, run again for every strategy) moves its PS device. Its ops are re-emitted
(instances and aggregation), and so are the edges of every tensor that a changed op produces or
consumes; every other task and dependency of the base plan is kept. Tasks have distinct canonical order
keys (``heterog.compiler.tasks``), so the kept tasks (already in order) and the new ones (sorted) merge
into exactly the task list, and the dependency lists, that compiling the strategy from scratch gives.
``merge_kernel`` is the compiled merge, ``merge_reference`` its numpy twin (a test asserts they agree).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from heterog.compiler.context import CompileContext
from heterog.compiler.emit import emit_aggregation, emit_connections, emit_instances
from heterog.compiler.index import GraphIndex
from heterog.compiler.place import Placement
from heterog.compiler.plan import PlanState, aggregation_of, finish
from heterog.compiler.registries import LayoutTable
from heterog.compiler.tasks import Deps, TaskBatch, Tasks, pair_order, ragged_gather


@dataclass(frozen=True)
class Dirty:
    """What a strategy change touches: ``groups`` (G,), ``ops`` (n_ops,) whose instances and aggregation
    are re-emitted, ``tensors`` (n_tensors,) whose edges are, and ``owners`` (n_ops + n_tensors,) the
    emission units (``heterog.compiler.tasks``) whose tasks and dependencies are dropped from the base."""

    groups: np.ndarray
    ops: np.ndarray
    tensors: np.ndarray
    owners: np.ndarray


def dirty_units(index: GraphIndex, base: Placement, new: Placement) -> Dirty | None:
    """The units to re-emit to go from placement ``base`` to ``new`` (same grouping), None if none."""
    groups = (base.group_cfg != new.group_cfg) | (base.group_ps != new.group_ps)
    if not groups.any():
        return None
    ops = groups[new.grouping.op_group]
    for state in (base.state, new.state):         # a config's reduce-scatters wait for one another
        if state is not None and state.rs_prev is not None and state.rs_wait is not None:
            chained = np.zeros(index.n_ops, dtype=bool)
            chained[index.t_op[(state.rs_prev >= 0) | (state.rs_wait >= 0)]] = True
            chained[index.t_op[state.rs_prev[state.rs_prev >= 0]]] = True
            rows = np.unique(state.op_row[ops & chained])
            ops = ops | (chained & np.isin(state.op_row, rows))
    tensors = ops[index.t_op].copy()
    tensors[index.e_tensor[ops[index.e_dst]]] = True
    for state in (base.state, new.state):         # stage-3 gathers wait for ops of other groups
        if state is not None:
            tensors[state.trig_tensor[ops[state.trig_op]]] = True
    return Dirty(groups, ops, tensors, np.concatenate([ops, tensors]))


def patch_plan(ctx: CompileContext, layouts: LayoutTable, base: PlanState, op_priority: np.ndarray | None,
               place: Placement, dirty: Dirty) -> PlanState:
    """The plan placed as ``place`` (with ``op_priority``) from ``base``: re-emit the units ``dirty``
    (``dirty_units`` from ``base.placement``), keep the rest, merge."""
    gi = ctx.index
    prov = base.providers.copy()
    batch = TaskBatch(base.tasks.n, ctx.order_key)
    ops = np.nonzero(dirty.ops)[0]
    emit_instances(ctx, layouts, batch, ops, place, prov)
    agg = np.nonzero(place.aggregate & dirty.ops[gi.t_op])[0]
    emit_aggregation(ctx, layouts, batch, agg, place, prov)
    emit_connections(ctx, layouts, batch, np.nonzero(dirty.tensors[gi.e_tensor])[0], place, prov)

    new = batch.tasks()
    m = merge_kernel(base.tasks, (base.dep_task, base.dep_on, base.dep_owner), dirty.owners, new,
                     batch.dependencies())
    prov.inst_start = m.new_of[prov.inst_start]
    prov.at = m.new_of[prov.at]
    aggregation = dict(base.plan.placements.aggregation)
    for t in np.nonzero(dirty.ops[gi.t_op] & base.placement.aggregate)[0].tolist():
        aggregation.pop(t, None)
    aggregation.update(aggregation_of(ctx, layouts, place, agg))
    # the TaskGraph's own checks ran on the kept tasks when they were first compiled; the new ones get
    # the checks that the compiler's construction does not guarantee
    if not np.all((new.dur >= 0) & (new.dur < np.inf) & (new.lag >= 0) & (new.lag < np.inf)):
        raise ValueError("compiler produced a task with a negative or infinite duration or lag")
    return finish(ctx, layouts, op_priority, m.tasks, (m.dep_task, m.dep_on, m.dep_owner), place, prov,
                  aggregation, validate=False, csr=(m.dep_ptr, m.dep_idx))


# ----------------------------------------------------------------------------------- the merge


@dataclass
class Merged:
    """The patched plan's tasks and dependencies: ``tasks`` in canonical order; every dependency as
    emitted (``dep_task``, ``dep_on``, ``dep_owner``, sorted by (task, on), duplicates kept) and as the
    TaskGraph's CSR (``dep_ptr``, ``dep_idx``: duplicates dropped); ``new_of`` maps the ids the emission
    used (base tasks, then new ones; index -1 -> -1) to the patched plan's."""

    tasks: Tasks
    dep_task: np.ndarray
    dep_on: np.ndarray
    dep_owner: np.ndarray
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    new_of: np.ndarray


def merge_reference(old: Tasks, old_deps: Deps, drop: np.ndarray, new: Tasks, new_deps: Deps) -> Merged:
    """Keep the tasks and dependencies of ``old`` whose owner is not dropped, merge in ``new`` (in emission
    order, ids ``old.n ..``, dependencies in those ids) by order key; numpy (``merge_kernel``'s twin)."""
    n_base = old.n
    p = np.argsort(new.order)
    new = new.take(p)
    kept = np.nonzero(~drop[old.owner])[0]
    pos_kept, pos_new, total = _merge_positions(old.order[kept], new.order)
    ints = np.empty((old.ints.shape[0], total), dtype=np.int64)
    floats = np.empty((old.floats.shape[0], total), dtype=np.float64)
    for out, a, b in ((ints, old.ints, new.ints), (floats, old.floats, new.floats)):
        for i in range(len(a)):
            out[i, pos_kept] = a[i][kept]
            out[i, pos_new] = b[i]
    res_len = np.empty(total, dtype=np.int64)
    res_len[pos_kept] = old.res_ptr[kept + 1] - old.res_ptr[kept]
    res_len[pos_new] = np.diff(new.res_ptr)
    start = np.empty(total, dtype=np.int64)
    start[pos_kept] = old.res_ptr[kept]
    start[pos_new] = len(old.res_idx) + new.res_ptr[:-1]
    res_ptr = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(res_len, out=res_ptr[1:])
    res_idx = np.concatenate([old.res_idx, new.res_idx])[ragged_gather(start, res_len)]
    new_of = np.full(n_base + new.n + 1, -1, dtype=np.int64)
    new_of[kept] = pos_kept
    new_of[n_base + p] = pos_new
    # dependencies: the kept ones stay sorted by (task, on) (ids map monotonically), the new ones merge in
    o_task, o_on, o_owner = old_deps
    keep = ~drop[o_owner]
    k_task, k_on, k_owner = new_of[o_task[keep]], new_of[o_on[keep]], o_owner[keep]
    n_task, n_on, n_owner = new_deps
    n_task, n_on = new_of[n_task], new_of[n_on]
    s = pair_order(n_task, n_on, total)
    n_task, n_on, n_owner = n_task[s], n_on[s], n_owner[s]
    d_kept, d_new, n_dep = _merge_positions(k_task * total + k_on, n_task * total + n_on)
    dep = []
    for a, b in ((k_task, n_task), (k_on, n_on), (k_owner, n_owner)):
        merged = np.empty(n_dep, dtype=np.int64)
        merged[d_kept] = a
        merged[d_new] = b
        dep.append(merged)
    first = np.ones(n_dep, dtype=bool)
    first[1:] = (dep[0][1:] != dep[0][:-1]) | (dep[1][1:] != dep[1][:-1])
    dep_ptr = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(np.bincount(dep[0][first], minlength=total), out=dep_ptr[1:])
    return Merged(Tasks(ints, floats, res_ptr, res_idx), dep[0], dep[1], dep[2], dep_ptr, dep[1][first], new_of)


def _merge_positions(kept_keys: np.ndarray, new_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Positions of the kept and of the new items in the merged order, both inputs sorted."""
    total = len(kept_keys) + len(new_keys)
    pos_new = np.searchsorted(kept_keys, new_keys) + np.arange(len(new_keys))
    is_new = np.zeros(total, dtype=bool)
    is_new[pos_new] = True
    return np.nonzero(~is_new)[0], pos_new, total


@njit(cache=True)
def _merge_tasks_kernel(o_int: np.ndarray, o_flt: np.ndarray, o_res_ptr: np.ndarray, o_res_idx: np.ndarray,
                        o_owner: np.ndarray, drop: np.ndarray, n_int: np.ndarray, n_flt: np.ndarray,
                        n_res_ptr: np.ndarray, n_res_idx: np.ndarray, n_order: np.ndarray,
                        p: np.ndarray) -> tuple[np.ndarray, ...]:  # pragma: no cover - compiled
    """One pass of ``merge_reference``'s task merge; columns as (8, n) ints and (3, n) floats, new tasks
    sorted by ``n_order`` (``p``: their emission positions)."""
    n_old, n_new = o_owner.shape[0], n_order.shape[0]
    n_kept = 0
    n_res = n_res_idx.shape[0]
    for i in range(n_old):
        if not drop[o_owner[i]]:
            n_kept += 1
            n_res += o_res_ptr[i + 1] - o_res_ptr[i]
    total = n_kept + n_new
    out_int = np.empty((o_int.shape[0], total), dtype=np.int64)
    out_flt = np.empty((o_flt.shape[0], total), dtype=np.float64)
    res_ptr = np.zeros(total + 1, dtype=np.int64)
    res_idx = np.empty(n_res, dtype=np.int64)
    new_of = np.full(n_old + n_new + 1, -1, dtype=np.int64)
    i, j, k, r = 0, 0, 0, 0
    while k < total:
        while i < n_old and drop[o_owner[i]]:
            i += 1
        if j < n_new and (i >= n_old or n_order[j] < o_int[0, i]):
            for c in range(o_int.shape[0]):
                out_int[c, k] = n_int[c, j]
            for c in range(o_flt.shape[0]):
                out_flt[c, k] = n_flt[c, j]
            for x in range(n_res_ptr[j], n_res_ptr[j + 1]):
                res_idx[r] = n_res_idx[x]
                r += 1
            new_of[n_old + p[j]] = k
            j += 1
        else:
            for c in range(o_int.shape[0]):
                out_int[c, k] = o_int[c, i]
            for c in range(o_flt.shape[0]):
                out_flt[c, k] = o_flt[c, i]
            for x in range(o_res_ptr[i], o_res_ptr[i + 1]):
                res_idx[r] = o_res_idx[x]
                r += 1
            new_of[i] = k
            i += 1
        k += 1
        res_ptr[k] = r
    return out_int, out_flt, res_ptr, res_idx, new_of


@njit(cache=True)
def _merge_deps_kernel(o_task: np.ndarray, o_on: np.ndarray, o_owner: np.ndarray, drop: np.ndarray,
                       n_task: np.ndarray, n_on: np.ndarray, n_owner: np.ndarray, new_of: np.ndarray,
                       total: int) -> tuple[np.ndarray, ...]:  # pragma: no cover
    """One pass of ``merge_reference``'s dependency merge and CSR; returns (task, on, owner, ptr, idx)."""
    k = n_task.shape[0]
    nt = np.empty(k, dtype=np.int64)
    no = np.empty(k, dtype=np.int64)
    for x in range(k):
        nt[x] = new_of[n_task[x]]
        no[x] = new_of[n_on[x]]
    s = np.argsort(nt * total + no, kind="mergesort")
    n_kept = 0
    for x in range(o_task.shape[0]):
        if not drop[o_owner[x]]:
            n_kept += 1
    m = n_kept + k
    out_t = np.empty(m, dtype=np.int64)
    out_o = np.empty(m, dtype=np.int64)
    out_w = np.empty(m, dtype=np.int64)
    ptr = np.zeros(total + 1, dtype=np.int64)
    idx = np.empty(m, dtype=np.int64)
    n_idx = 0
    i, j = 0, 0
    last_t, last_o = -1, -1
    for y in range(m):
        while i < o_task.shape[0] and drop[o_owner[i]]:
            i += 1
        take_new = False
        if j < k:
            if i >= o_task.shape[0]:
                take_new = True
            else:
                kt, ko = new_of[o_task[i]], new_of[o_on[i]]
                jt, jo = nt[s[j]], no[s[j]]
                take_new = jt < kt or (jt == kt and jo < ko)
        if take_new:
            t, o, w = nt[s[j]], no[s[j]], n_owner[s[j]]
            j += 1
        else:
            t, o, w = new_of[o_task[i]], new_of[o_on[i]], o_owner[i]
            i += 1
        out_t[y], out_o[y], out_w[y] = t, o, w
        if t != last_t or o != last_o:
            ptr[t + 1] += 1
            idx[n_idx] = o
            n_idx += 1
            last_t, last_o = t, o
    for t in range(total):
        ptr[t + 1] += ptr[t]
    return out_t, out_o, out_w, ptr, idx[:n_idx]


def merge_kernel(old: Tasks, old_deps: Deps, drop: np.ndarray, new: Tasks, new_deps: Deps) -> Merged:
    """``merge_reference`` in two compiled passes (the same result; a test asserts it)."""
    p = np.argsort(new.order)
    new = new.take(p)
    out_int, out_flt, res_ptr, res_idx, new_of = _merge_tasks_kernel(
        old.ints, old.floats, old.res_ptr, old.res_idx, old.owner, drop, new.ints, new.floats, new.res_ptr,
        new.res_idx, new.order, p)
    total = out_int.shape[1]
    task, on, owner, ptr, idx = _merge_deps_kernel(*old_deps, drop, *new_deps, new_of, total)
    return Merged(Tasks(out_int, out_flt, res_ptr, res_idx), task, on, owner, ptr, idx, new_of)
