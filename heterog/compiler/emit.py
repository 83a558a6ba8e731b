"""Phases 4-6 of a compilation: the tasks of op instances, of gradient aggregation and of the edges
between them, for a set of ops or tensors.

Semantics: docs/design.md, "Replication, re-layout and aggregation". Each phase emits the tasks of a
*set* of ops or tensors (all of them when a plan is compiled at once, those a strategy change touches
when it is patched), vectorised with numpy: Python loops run over distinct layouts and layout pairs,
never over replicas x edges. Task ids of ops and tensors outside the set come from ``Providers`` (the
plan being patched). Every phase reads the ``CompileContext``, the ``LayoutTable`` that the placement's
layout ids index, and the ``Placement``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from heterog.compiler import offload, sharded_state, sync_stats
from heterog.compiler.context import CompileContext
from heterog.compiler.convert import Engine
from heterog.compiler.place import Placement, first_recomputed_reads
from heterog.compiler.registries import LayoutTable
from heterog.compiler.reshard import connect_split
from heterog.compiler.tasks import Providers, TaskBatch, TaskCategory, TaskKind, ragged


# ----------------------------------------------------------------------------------- instances
def emit_instances(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, ops: np.ndarray,
                   place: Placement, prov: Providers) -> None:
    """One task per layout entry of each op in ``ops`` (ascending): compute on its device at its share of
    a micro-batch, or a placeholder (graph input, parameter) that takes no time. An entry of an op with
    partial results (weight gradients, the loss) after another entry on its device adds its result to
    that entry's (gradient accumulation over micro-batches). Their outputs become the providers of the
    ops' tensors, on each device its last entry's."""
    gi, lay = ctx.index, layouts
    op_lay = place.op_lay[ops]
    counts = lay.length[op_lay]
    rows, local = ragged(counts)
    inst_op = ops[rows]
    flat = lay.ptr[op_lay][rows] + local
    inst_dev = lay.dev_flat[flat]
    inst_frac = lay.frac_flat[flat]
    comp = gi.is_compute[inst_op]
    alloc = gi.out_fixed_bytes[inst_op] + gi.out_batch_bytes[inst_op] * inst_frac
    if place.out_split is None:
        dur = ctx.cost.op_times(ctx.graph, inst_op, inst_dev, inst_frac)
    else:                          # ops split beyond the batch: each instance runs and holds its shard
        inst_split = lay.split_flat[flat]
        dur = ctx.cost.op_times(ctx.graph, inst_op, inst_dev, inst_frac, inst_split)
        w = place.out_split[inst_op]
        alloc = np.where(w > 0, alloc * (1.0 - w + w * inst_split), alloc)
    res = inst_dev
    if place.state is not None:    # sharded state: update ops at each replica's part, full local gradients
        dur, alloc = sharded_state.scale_instances(ctx, place.state, inst_op, inst_dev, dur, alloc)
        if offload.offloads(place.state):      # offloaded state: its update ops on the host CPU
            dur, alloc, res = offload.host_instances(ctx, place.state, inst_op, inst_dev, dur, alloc)
    prev = lay.prev_flat[flat]
    accumulates = (prev >= 0) & gi.has_partial[inst_op]
    if accumulates.any():
        add = ctx.cost.aggregate_times(inst_dev, gi.partial_bytes[inst_op], np.full(len(inst_dev), 2))
        dur = dur + np.where(accumulates, add, 0.0)
    ids = batch.add(dur=dur, kind=np.where(comp, int(TaskKind.COMPUTE), int(TaskKind.PLACEHOLDER)), op=inst_op,
                    dev=inst_dev, alloc=alloc,
                    cat=gi.category[inst_op], prio_op=inst_op, stage="compute", cls=0, tensor=0, sub=local,
                    owner=inst_op, res_len=comp.astype(np.int64), res_idx=res[comp],
                    micro=np.where(gi.has_batch[inst_op], lay.micro_flat[flat], -1))
    start = ids[np.concatenate([[0], np.cumsum(counts)])[:-1]] if len(ops) else ids
    prov.inst_start[ops] = start
    conv = Engine(ctx, batch)
    if place.synced is not None:   # synced batch statistics: their all-reduce after the op's instances
        sync_stats.emit_statistics(ctx, layouts, conv, ops, place.op_lay, place.synced, prov)
    if place.state is not None:    # stages 1-2: the updated parameters (copied up from the host) all-gathered
        ups = offload.emit_uploads(ctx, layouts, conv, ops, place.op_lay, place.state, prov) \
            if offload.offloads(place.state) else None
        sharded_state.emit_update_gathers(ctx, layouts, conv, ops, place.op_lay, place.state, prov, ups)
    conv.flush()
    if accumulates.any():
        acc = np.nonzero(accumulates)[0]
        batch.deps(ids[acc], start[rows[acc]] + (prev[acc] - lay.ptr[op_lay[rows[acc]]]), inst_op[acc])
    # the ops' tensors: read where their producer's instances are (a device's last entry)
    pos = np.full(gi.n_ops, -1, dtype=np.int64)
    pos[ops] = np.arange(len(ops))
    rows_at = np.full((len(ops), ctx.n_devices), -1, dtype=np.int64)
    last = lay.last_flat[flat]
    rows_at[rows[last], inst_dev[last]] = ids[last]
    tensors = np.nonzero(pos[gi.t_op] >= 0)[0]
    prov.at[tensors] = rows_at[pos[gi.t_op[tensors]]]
    prov.layout[tensors] = place.op_lay[gi.t_op[tensors]]


# ----------------------------------------------------------------------------------- aggregation
def emit_aggregation(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, tensors: np.ndarray,
                     place: Placement, prov: Providers) -> None:
    """Aggregate the partial results ``tensors`` (ascending; all their producers' partial results):
    under PS, pushes to the group's PS and an aggregation there; under AllReduce, one collective per
    tensor (``heterog.compiler.plan.aggregation_of`` records which)."""
    if not len(tensors):
        return
    is_ps = place.op_ps[ctx.index.t_op[tensors]]
    conv = Engine(ctx, batch)
    _aggregate_ps(ctx, layouts, conv, tensors[is_ps], place, prov)
    _aggregate_ar(ctx, layouts, conv, tensors[~is_ps], place, prov)
    conv.flush()


def _aggregate_ps(ctx: CompileContext, layouts: LayoutTable, conv: Engine, tensors: np.ndarray,
                  place: Placement, prov: Providers) -> None:
    """Workers push partial results to the PS, which aggregates them; the value then lives on the PS."""
    if not len(tensors):
        return
    gi, cost, batch = ctx.index, ctx.cost, conv.batch
    ops = gi.t_op[tensors]
    ps = place.group_ps[place.grouping.op_group[ops]]
    lays = place.op_lay[ops]
    for lay, p in sorted(set(zip(lays.tolist(), ps.tolist()))):
        pick = (lays == lay) & (ps == p)
        sel, sel_op = tensors[pick], ops[pick]
        devs = np.array(layouts.unique_devices(lay), dtype=np.int64)
        last = layouts.last_entries(lay)                 # each device's last entry: its accumulated result
        workers = np.nonzero(devs != p)[0]
        nb = gi.t_bytes[sel]
        # push tasks: (tensor, worker) pairs
        op_rep = np.repeat(sel_op, len(workers))
        src_dev = np.tile(devs[workers], len(sel))
        push = conv.transfers((prov.inst_start[sel_op][:, None] + last[workers][None, :]).ravel(), src_dev,
                              np.full(len(src_dev), p), np.repeat(nb, len(workers)), op=op_rep, prio_op=op_rep,
                              stage="push", cls=0, tensor=np.repeat(sel, len(workers)),
                              sub=np.tile(np.arange(len(workers)), len(sel)), owner=op_rep, kind=TaskKind.PUSH,
                              cat=TaskCategory.PS, dev=p)
        aggr = conv.add(dur=cost.aggregate_times(p, nb, np.full(len(nb), len(devs))), kind=TaskKind.AGGREGATE,
                        op=sel_op, dev=p, alloc=nb, cat=TaskCategory.PS,
                        prio_op=sel_op, stage="aggregate", cls=0, tensor=sel, sub=0, owner=sel_op, res_len=1,
                        res_idx=np.full(len(sel), p))
        batch.deps(np.repeat(aggr, len(workers)), push, op_rep)
        if np.any(devs == p):                            # the PS's own partial result
            batch.deps(aggr, prov.inst_start[sel_op] + int(last[np.nonzero(devs == p)[0][0]]), sel_op)
        prov.at[sel] = -1
        prov.at[sel, p] = aggr
        prov.layout[sel] = p                    # layout p: device p alone (LayoutTable)


def _aggregate_ar(ctx: CompileContext, layouts: LayoutTable, conv: Engine, tensors: np.ndarray,
                  place: Placement, prov: Providers) -> None:
    """One AllReduce per partial tensor over its replicas (``Engine.allreduce``), or under sharded gradients
    (stage >= 2) one reduce-scatter (``heterog.compiler.sharded_state``)."""
    if not len(tensors):
        return
    rs = sharded_state.reduce_scattered(ctx, place.state, tensors)
    if rs.any():                   # sharded gradients (stage >= 2): reduce-scatter instead
        assert place.state is not None
        sharded_state.emit_reduce_scatter(ctx, layouts, conv, tensors[rs], place.op_lay, place.state, prov)
        tensors = tensors[~rs]
    ops = ctx.index.t_op[tensors]
    lays = place.op_lay[ops]
    for lay in np.unique(lays).tolist():
        pick = lays == lay
        sel, sel_op = tensors[pick], ops[pick]
        devs = layouts.unique_devices(lay)
        last = layouts.last_entries(lay)                 # each device's last entry: its accumulated result
        ar = conv.allreduce(sel, sel_op, devs, prov.inst_start[sel_op][:, None] + last[None, :])
        k = len(devs)
        prov.at[np.repeat(sel, k), np.tile(np.array(devs), len(sel))] = np.repeat(ar, k)


# ----------------------------------------------------------------------------------- connections
def emit_connections(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, edges: np.ndarray,
                     place: Placement, prov: Providers) -> None:
    """Dependencies and communication of ``edges`` (ascending; every edge of each tensor they carry):
    (a) a batch tensor under the same layout feeds replica k to replica k; (b) a non-batch value is
    moved once per (tensor, device) that lacks it; (c) a batch tensor under another layout is re-laid out
    (cut, moved and joined) once per (tensor, consumer layout), unless its producer has no batch dimension
    and a copy of the whole value on every consumer device (then each replica reads its own copy); edges
    of values divided beyond the batch, of stage-3 parameters and of values the host reads are connected by
    their own modules. Every conversion task is the engine's (``heterog.compiler.convert``)."""
    if not len(edges):
        return
    conv = Engine(ctx, batch)
    _connect(ctx, layouts, conv, edges, place, prov)
    conv.flush()


def _connect(ctx: CompileContext, layouts: LayoutTable, conv: Engine, edges: np.ndarray, place: Placement,
             prov: Providers) -> None:
    """``emit_connections``' work: each edge to the module that knows what its reader needs."""
    gi, batch = ctx.index, conv.batch
    if offload.offloads(place.state):              # tensors read by the host step: copied down, then as any edge
        assert place.state is not None
        down = offload.host_read_edges(ctx, place.state, edges)
        if down.any():
            offload.connect_host_reads(ctx, layouts, conv, edges[down], place.op_lay, place.state, prov)
    if place.op_shard is not None:                 # edges touching an op split beyond the batch
        touch = (place.op_shard[gi.e_src[edges]] >= 0) | (place.op_shard[gi.e_dst[edges]] >= 0)
        connect_split(ctx, layouts, conv, edges[touch], place, prov)
        edges = edges[~touch]
        if not len(edges):
            return
    gathered = sharded_state.gathered_edges(ctx, place.state, edges)
    if gathered.any():                             # stage-3 parameters read in forward or backward
        assert place.state is not None
        again = None if place.recompute is None else \
            (place.recompute, place.grouping.op_group,
             first_recomputed_reads(ctx, place.grouping.op_group, place.recompute))
        sharded_state.connect_gathered(ctx, layouts, conv, edges[gathered], place.op_lay, place.state, prov,
                                       offload.shard_uploads if offload.offloads(place.state) else None, again)
        edges = edges[~gathered]
        if not len(edges):
            return
    src, dst = gi.e_src[edges], gi.e_dst[edges]
    lay_u, lay_v = place.op_lay[src], place.op_lay[dst]
    batch_edge = gi.e_batch[edges]
    same = batch_edge & (lay_u == lay_v)
    e = edges[same]
    if len(e):
        rows, loc = ragged(layouts.length[place.op_lay[gi.e_dst[e]]])
        batch.deps(prov.inst_start[gi.e_dst[e][rows]] + loc, prov.inst_start[gi.e_src[e][rows]] + loc,
                   gi.n_ops + gi.e_tensor[e][rows])
    e = edges[~batch_edge]
    if len(e):
        _connect_nonbatch(ctx, layouts, conv, e, place, prov)
    e = edges[batch_edge & ~same]
    shape = gi.e_value_free[e]
    if shape.any():     # a shape read under another layout: each instance waits for the first producer's, nothing moves
        rows, loc = ragged(layouts.length[place.op_lay[gi.e_dst[e[shape]]]])
        batch.deps(prov.inst_start[gi.e_dst[e[shape]][rows]] + loc, prov.inst_start[gi.e_src[e[shape]][rows]],
                   gi.n_ops + gi.e_tensor[e[shape]][rows])
        e = e[~shape]
    if len(e):
        local = _local_broadcast(ctx, layouts, e, place, prov)
        if local.any():
            _connect_local(ctx, layouts, batch, e[local], place, prov)
        e = e[~local]
    if len(e):
        _connect_relayout(ctx, layouts, conv, e, place, prov)


def _local_broadcast(ctx: CompileContext, layouts: LayoutTable, e: np.ndarray, place: Placement,
                     prov: Providers) -> np.ndarray:
    """(len(e),) bool: batch edges whose producer has no batch dimension (a value broadcast along the
    batch by fused view/expand ops, e.g. a positional projection) and already holds the whole value on
    every device the consumer runs on; each consumer replica then reads its own device's copy."""
    gi, lay = ctx.index, layouts
    src, dst = gi.e_src[e], gi.e_dst[e]
    out = ~gi.has_batch[src]
    if not out.any():
        return out
    cand = np.nonzero(out)[0]
    held = prov.at[gi.e_tensor[e[cand]]] >= 0                               # (k, M) devices holding it
    need = lay.dev_mask[place.op_lay[dst[cand]]]                            # (k, M) consumer devices
    out[cand] = np.all(held | ~need, axis=1)
    return out


def _connect_local(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, e: np.ndarray,
                   place: Placement, prov: Providers) -> None:
    """Each consumer replica depends on the producer's copy on its own device (``_local_broadcast``)."""
    gi, lay = ctx.index, layouts
    k = lay.length[place.op_lay[gi.e_dst[e]]]
    rows, loc = ragged(k)
    er = e[rows]
    d = lay.dev_flat[lay.ptr[place.op_lay[gi.e_dst[er]]] + loc]
    t = gi.e_tensor[er]
    batch.deps(prov.inst_start[gi.e_dst[er]] + loc, prov.at[t, d], gi.n_ops + t)


def _connect_nonbatch(ctx: CompileContext, layouts: LayoutTable, conv: Engine, e: np.ndarray,
                      place: Placement, prov: Providers) -> None:
    """Non-batch values: a consumer replica reads its device's copy; a missing copy is moved once per
    (tensor, device) from the best-connected holder (``Engine.copies``); a consumer that reads only the shape
    moves nothing."""
    gi, lay, n_ops, batch = ctx.index, layouts, ctx.index.n_ops, conv.batch
    k = lay.length[place.op_lay[gi.e_dst[e]]]
    rows, loc = ragged(k)
    er = e[rows]
    u, v, t = gi.e_src[er], gi.e_dst[er], gi.e_tensor[er]
    # a batch statistic read by a batch op of its producer's layout: each instance reads its own
    own = gi.t_statistic[t] & gi.has_batch[v] & (place.op_lay[u] == place.op_lay[v])
    if own.any():
        batch.deps(prov.inst_start[v[own]] + loc[own], prov.inst_start[u[own]] + loc[own], n_ops + t[own])
        er, loc, u, v, t = er[~own], loc[~own], u[~own], v[~own], t[~own]
    d = lay.dev_flat[lay.ptr[place.op_lay[v]] + loc]
    consumer = prov.inst_start[v] + loc
    have = prov.at[t, d]
    # a shape-only read of a value made over several micro-batches waits for one instance only: the first on the
    # consumer's device, or on its holder (``_shape_holders``)
    early = gi.e_value_free[er] & lay.repeats[place.op_lay[u]]
    if early.any():
        have[early] = prov.inst_start[u[early]] + _first_entries(layouts, place.op_lay[u[early]],
                                                                 _shape_holders(layouts, place.op_lay[u[early]],
                                                                                place.op_lay[v[early]], d[early]))
    local = have >= 0
    batch.deps(consumer[local], have[local], n_ops + t[local])
    miss = ~local
    vf = miss & gi.e_value_free[er]
    if vf.any():  # shape-only consumer: depend on its holder's copy, nothing moves
        held = _shape_holders(layouts, prov.layout[t[vf]], place.op_lay[v[vf]], d[vf])
        batch.deps(consumer[vf], prov.at[t[vf], held], n_ops + t[vf])
    need = miss & ~gi.e_value_free[er]
    if need.any():
        tensor = t[need]
        moved = conv.copies(tensor, u[need], d[need], gi.t_bytes[tensor], v[need], lay.dev_mask[prov.layout[tensor]],
                            prov.at)
        batch.deps(consumer[need], moved, n_ops + tensor)


def shape_holders(holders: Sequence[int], readers: Sequence[int]) -> dict[int, int]:
    """Reader device -> the device whose copy of a value held by ``holders`` it waits for when it reads only the
    value's shape: itself where it holds one, else the holder at its place among the holders (the i-th of n
    readers waits for holder ``i m // n`` of m), so that replicas alike wait alike (``heterog.compose``)."""
    return {r: r if r in holders else holders[i * len(holders) // len(readers)] for i, r in enumerate(readers)}


def _shape_holders(layouts: LayoutTable, lay_u: np.ndarray, lay_v: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(x,) ``shape_holders`` of a consumer on device ``d[i]`` of layout ``lay_v[i]``, the value held by the devices
    of layout ``lay_u[i]``."""
    out = np.asarray(d, dtype=np.int64).copy()
    pairs: dict[tuple[int, int], dict[int, int]] = {}
    for k, (a, b, x) in enumerate(zip(lay_u.tolist(), lay_v.tolist(), out.tolist())):
        held = pairs.get((a, b))
        if held is None:
            held = pairs[(a, b)] = shape_holders(layouts.unique_devices(a), layouts.unique_devices(b))
        out[k] = held[x]
    return out


def _first_entries(layouts: LayoutTable, lay: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(x,) the local index of device ``d[i]``'s first entry in layout ``lay[i]``."""
    first: dict[int, dict[int, int]] = {}
    for a in set(lay.tolist()):
        first[a] = {}
        for j, x in enumerate(layouts.devices[a]):
            first[a].setdefault(x, j)
    return np.array([first[a][x] for a, x in zip(lay.tolist(), d.tolist())], dtype=np.int64)


def _connect_relayout(ctx: CompileContext, layouts: LayoutTable, conv: Engine, e: np.ndarray,
                      place: Placement, prov: Providers) -> None:
    """Batch tensors consumed under another layout: re-laid out once per (tensor, consumer layout)
    (``Engine.relayout``), vectorised over all such re-layouts at once; each consumer entry reads its piece."""
    gi, n_ops = ctx.index, ctx.index.n_ops
    src, dst = gi.e_src[e], gi.e_dst[e]
    op_lay = place.op_lay
    n_lay = len(layouts.devices)
    uniq, first_idx, inv = np.unique(gi.e_tensor[e] * n_lay + op_lay[dst], return_index=True, return_inverse=True)
    first_consumer = np.full(len(uniq), np.iinfo(np.int64).max)
    np.minimum.at(first_consumer, inv, dst)
    r_u = src[first_idx]
    tensor = uniq // n_lay
    out_task = conv.relayout(layouts, tensor, r_u, op_lay[r_u], op_lay[dst[first_idx]], gi.t_bytes[tensor],
                             first_consumer, prov.inst_start[r_u])
    # consumers: entry j of each edge's consumer depends on the re-layout's output j
    er, loc = ragged(layouts.length[op_lay[dst]])
    conv.deps(prov.inst_start[dst[er]] + loc, out_task[inv[er], loc], n_ops + gi.e_tensor[e][er])
