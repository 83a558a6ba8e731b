"""Delta compilation: patch a compiled plan for a strategy that differs from its own in a few groups.

A group *changes* when its config does or when the PS choice (a greedy over every PS group of the plan,
``heterog.compiler.ps``, run again for every strategy) moves its PS device. Its ops are re-emitted
(instances and aggregation), and so are the edges of every tensor that a changed op produces or
consumes; every other task and dependency of the base plan is kept. Tasks have distinct canonical order
keys (``heterog.compiler.tasks``), so the kept tasks (already in order) and the new ones (sorted) merge
into exactly the task list, and the dependency lists, that compiling the strategy from scratch gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.emit import emit_aggregation, emit_connections, emit_instances
from heterog.compiler.tasks import TaskBatch, Tasks, ragged_gather

if TYPE_CHECKING:  # pragma: no cover
    from heterog.compiler.compile import Compiler, Placement, PlanState
    from heterog.strategy import Strategy


@dataclass(frozen=True)
class Dirty:
    """What a strategy change touches: ``groups`` (G,), ``ops`` (n_ops,) whose instances and aggregation
    are re-emitted, ``tensors`` (n_tensors,) whose edges are, and ``owners`` (n_ops + n_tensors,) the
    emission units (``heterog.compiler.tasks``) whose tasks and dependencies are dropped from the base."""

    groups: np.ndarray
    ops: np.ndarray
    tensors: np.ndarray
    owners: np.ndarray


def dirty_units(c: Compiler, base: Placement, new: Placement) -> Dirty | None:
    """The units to re-emit to go from placement ``base`` to ``new`` (same grouping), None if none."""
    groups = (base.group_cfg != new.group_cfg) | (base.group_ps != new.group_ps)
    if not groups.any():
        return None
    gi = c.gi
    ops = groups[c.grouping.op_group]
    tensors = ops[gi.t_op].copy()
    tensors[gi.e_tensor[ops[gi.e_dst]]] = True
    return Dirty(groups, ops, tensors, np.concatenate([ops, tensors]))


def _merge_positions(kept_keys: np.ndarray, new_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Positions of the kept and of the new items in the merged order, both inputs sorted."""
    total = len(kept_keys) + len(new_keys)
    pos_new = np.searchsorted(kept_keys, new_keys) + np.arange(len(new_keys))
    is_new = np.zeros(total, dtype=bool)
    is_new[pos_new] = True
    return np.nonzero(~is_new)[0], pos_new, total


def merge_tasks(old: Tasks, kept: np.ndarray, new: Tasks, pos_kept: np.ndarray, pos_new: np.ndarray,
                total: int) -> Tasks:
    """Tasks ``kept`` of ``old`` at ``pos_kept`` and all of ``new`` (already in order) at ``pos_new``."""
    cols = {}
    for name in ("order", "owner", "kind", "op", "dev", "cat", "prio_op", "dur", "lag", "alloc"):
        a, b = getattr(old, name), getattr(new, name)
        out = np.empty(total, dtype=a.dtype)
        out[pos_kept] = a[kept]
        out[pos_new] = b
        cols[name] = out
    res_len = np.empty(total, dtype=np.int64)
    res_len[pos_kept] = old.res_ptr[kept + 1] - old.res_ptr[kept]
    res_len[pos_new] = np.diff(new.res_ptr)
    start = np.empty(total, dtype=np.int64)
    start[pos_kept] = old.res_ptr[kept]
    start[pos_new] = len(old.res_idx) + new.res_ptr[:-1]
    res_ptr = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(res_len, out=res_ptr[1:])
    res_idx = np.concatenate([old.res_idx, new.res_idx])[ragged_gather(start, res_len)]
    return Tasks(**cols, res_ptr=res_ptr, res_idx=res_idx)


def patch_plan(c: Compiler, base: PlanState, strategy: Strategy, place: Placement, dirty: Dirty) -> PlanState:
    """The plan of ``strategy`` (placed as ``place``) from ``base``: re-emit the dirty units, keep the rest."""
    from heterog.compiler.compile import aggregated_of, assemble

    gi = c.gi
    n_base = base.tasks.n
    prov = base.providers.copy()
    batch = TaskBatch(n_base, c.order_key)
    ops = np.nonzero(dirty.ops)[0]
    emit_instances(c, batch, ops, place, prov)
    agg = np.nonzero(place.aggregate & dirty.ops[gi.t_op])[0]
    algo_new = emit_aggregation(c, batch, agg, place, prov)
    emit_connections(c, batch, np.nonzero(dirty.tensors[gi.e_tensor])[0], place, prov)

    # tasks: the kept ones stay in order, the new ones are sorted and merged in
    new = batch.tasks()
    p = np.argsort(new.order)
    new = new.take(p)
    kept = np.nonzero(~dirty.owners[base.tasks.owner])[0]
    pos_kept, pos_new, total = _merge_positions(base.tasks.order[kept], new.order)
    tasks = merge_tasks(base.tasks, kept, new, pos_kept, pos_new, total)
    new_of = np.full(n_base + new.n + 1, -1, dtype=np.int64)        # provisional id -> id; index -1 -> -1
    new_of[kept] = pos_kept
    new_of[n_base + p] = pos_new

    # dependencies: the kept ones stay sorted by (task, on) (ids map monotonically), the new ones merge in
    keep = ~dirty.owners[base.dep_owner]
    k_task, k_on, k_owner = new_of[base.dep_task[keep]], new_of[base.dep_on[keep]], base.dep_owner[keep]
    n_task, n_on, n_owner = batch.dependencies()
    n_task, n_on = new_of[n_task], new_of[n_on]
    s = np.lexsort((n_on, n_task))
    n_task, n_on, n_owner = n_task[s], n_on[s], n_owner[s]
    d_kept, d_new, n_dep = _merge_positions(k_task * total + k_on, n_task * total + n_on)
    dep = []
    for a, b in ((k_task, n_task), (k_on, n_on), (k_owner, n_owner)):
        out = np.empty(n_dep, dtype=np.int64)
        out[d_kept] = a
        out[d_new] = b
        dep.append(out)

    prov.inst_start = new_of[prov.inst_start]
    prov.at = new_of[prov.at]
    algo = dict(base.allreduce_algo)
    aggregated = dict(base.aggregated)
    for o in ops.tolist():
        algo.pop(o, None)
    for t in np.nonzero(dirty.ops[gi.t_op] & base.placement.aggregate)[0].tolist():
        aggregated.pop(t, None)
    algo.update(algo_new)
    aggregated.update(aggregated_of(c, place, agg))
    # the TaskGraph's own checks ran on the kept tasks when they were first compiled; the new ones get
    # the checks that the compiler's construction does not guarantee
    if not np.all((new.dur >= 0) & (new.dur < np.inf) & (new.lag >= 0) & (new.lag < np.inf)):
        raise ValueError("compiler produced a task with a negative or infinite duration or lag")
    return assemble(c, strategy, tasks, dep[0], dep[1], dep[2], place, prov, algo, aggregated, validate=False)
