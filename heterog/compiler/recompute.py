"""Recomputation: the forward activations of a group freed after its forward and computed again before its
backward (docs/design.md, "Recomputation"), as RECOMPUTE tasks added to a plan's tasks.

Which ops are recomputed is the placement's (``Placement.recompute``, ``heterog.compiler.place.recomputed_ops``).
For every instance x of such an op, a RECOMPUTE task r(x) runs on x's device for x's time and allocates
x's outputs. It reads what x reads: r(y) where x reads a recomputed op y of its group, the kept value
elsewhere (a checkpoint's inputs), but a value provided again for backward (``Providers.again``: a stage-3
parameter's backward gather) from there. The group's backward ops read r(x) instead of x
(``heterog.compiler.place.recompute_edges``), so x's outputs are freed after their last forward reader and
r(x)'s after their last backward one.

When: the recomputed instances of a group's entry i wait for a zero-time SYNC task, the group's *trigger*,
which waits for the entry's forward instances it recomputes and for what the group's first backward op
that reads a recomputed value (instance i) reads besides them, i.e. the gradient arriving from later
layers: the recomputation runs when the backward reaches the group, as ``torch.utils.checkpoint`` does.
The trigger holds no memory.

Order keys: (that first backward op, the "recompute" stage, class 0 for the trigger and 1 for the
recomputed instances, the recomputed op's first tensor, the entry), so every recomputed instance comes
after its inputs and its trigger and before the backward ops that read it.
"""
from __future__ import annotations

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.place import Placement, first_recomputed_reads
from heterog.compiler.tasks import Providers, TaskBatch, TaskCategory, TaskKind, ragged_gather


def add_recompute(ctx: CompileContext, batch: TaskBatch, place: Placement, prov: Providers) -> None:
    """Add the RECOMPUTE tasks, their triggers and dependencies of ``place.recompute`` to ``batch``, which
    holds every other task of the plan from id 0 (``prov``: its providers), and rewire the backward
    readers of recomputed values to the recomputed instances."""
    rc = place.recompute
    if rc is None:
        return
    if batch.first_id != 0:
        raise AssertionError("recomputation is added to a whole plan's tasks")
    gi, phase = ctx.index, ctx.graph.phase_index
    op_group = place.grouping.op_group
    tasks = batch.tasks()
    dep_task, dep_on, _ = batch.dependencies()
    x = np.nonzero((tasks.kind == TaskKind.COMPUTE) & rc[tasks.op])[0]         # the recomputed instances
    x_op = tasks.op[x]
    x_local = x - prov.inst_start[x_op]
    x_group = op_group[x_op]
    # each group's first backward op that reads a recomputed value: what triggers the group's recomputation
    first_back = first_recomputed_reads(ctx, op_group, rc)
    x_trigger_op = first_back[x_group]
    # one trigger per (group, entry): it waits for what that entry's first backward op reads, but recomputed values
    pair = x_group * (int(x_local.max()) + 1) + x_local
    pairs, first_x, x_pair = np.unique(pair, return_index=True, return_inverse=True)
    trig_op = x_trigger_op[first_x]
    trig_local = x_local[first_x]
    trig = batch.add(dur=np.zeros(len(pairs)), kind=TaskKind.SYNC, op=trig_op, dev=tasks.dev[x[first_x]], alloc=0.0,
                     cat=TaskCategory.SYNC, prio_op=trig_op, stage="recompute", cls=0, tensor=0, sub=trig_local,
                     owner=trig_op, res_len=0, res_idx=np.zeros(0, dtype=np.int64))
    trig_of = np.full(tasks.n, -1, dtype=np.int64)                # instance of a first backward op -> its trigger
    trig_of[prov.inst_start[trig_op] + trig_local] = trig
    is_x = np.zeros(tasks.n, dtype=bool)
    is_x[x] = True
    waits = (trig_of[dep_task] >= 0) & ~is_x[dep_on]
    batch.deps(trig_of[dep_task[waits]], dep_on[waits], tasks.op[dep_task[waits]])
    batch.deps(trig[x_pair], x, x_op)                 # and for the forward instances it recomputes

    # the recomputed instances: x's time, device and allocation, after x's inputs and the trigger
    t_first = np.full(gi.n_ops, gi.n_tensors, dtype=np.int64)
    np.minimum.at(t_first, gi.t_op, np.arange(gi.n_tensors))
    res_len = tasks.res_len[x]
    r = batch.add(dur=tasks.dur[x], kind=TaskKind.RECOMPUTE, op=x_op, dev=tasks.dev[x], alloc=tasks.alloc[x],
                  cat=TaskCategory.RECOMPUTE, prio_op=x_trigger_op, stage="recompute", cls=1, tensor=t_first[x_op],
                  sub=x_local, owner=x_op, res_len=res_len,
                  res_idx=tasks.res_idx[ragged_gather(tasks.res_ptr[x], res_len)], micro=tasks.micro[x])
    r_of = np.full(tasks.n, -1, dtype=np.int64)
    r_of[x] = r
    own_group = is_x[dep_on] & (op_group[tasks.op[dep_on]] == op_group[tasks.op[dep_task]])
    inputs = is_x[dep_task]
    read = dep_on[inputs]
    if prov.again:                                    # values provided again in backward (a stage-3 parameter)
        read = np.array([prov.again.get(t, t) for t in read.tolist()], dtype=np.int64)
    batch.deps(r_of[dep_task[inputs]], np.where(own_group[inputs], r_of[dep_on[inputs]], read),
               tasks.op[dep_task[inputs]])
    batch.deps(r, trig[x_pair], x_op)
    # the group's backward instances read the recomputed values
    reader = np.nonzero(own_group & (tasks.kind[dep_task] == TaskKind.COMPUTE) & (phase[tasks.op[dep_task]] > 0))[0]
    on = batch.dependencies()[1]                    # the dependencies as emitted come first, in the same order
    on[reader] = r_of[dep_on[reader]]
    batch.rewire(on)
