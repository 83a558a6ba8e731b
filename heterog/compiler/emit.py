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

from dataclasses import dataclass

import numpy as np

from heterog.compiler import offload, sharded_state, sync_stats
from heterog.compiler.context import CompileContext
from heterog.compiler.place import Placement
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
    if place.synced is not None:   # synced batch statistics: their all-reduce after the op's instances
        sync_stats.emit_statistics(ctx, layouts, batch, ops, place.op_lay, place.synced, prov)
    if place.state is not None:    # stages 1-2: the updated parameters (copied up from the host) all-gathered
        ups = offload.emit_uploads(ctx, layouts, batch, ops, place.op_lay, place.state, prov) \
            if offload.offloads(place.state) else None
        sharded_state.emit_update_gathers(ctx, layouts, batch, ops, place.op_lay, place.state, prov, ups)
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
    _aggregate_ps(ctx, layouts, batch, tensors[is_ps], place, prov)
    _aggregate_ar(ctx, layouts, batch, tensors[~is_ps], place, prov)


def _aggregate_ps(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, tensors: np.ndarray,
                  place: Placement, prov: Providers) -> None:
    """Workers push partial results to the PS, which aggregates them; the value then lives on the PS."""
    if not len(tensors):
        return
    gi, cost, paths = ctx.index, ctx.cost, ctx.paths
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
        src_task = (prov.inst_start[sel_op][:, None] + last[workers][None, :]).ravel()
        src_dev = np.tile(devs[workers], len(sel))
        bytes_ = np.repeat(nb, len(workers))
        op_rep = np.repeat(sel_op, len(workers))
        rlen, ridx = paths.resources(src_dev, np.full(len(src_dev), p))
        push = batch.add(dur=cost.transfer_times(src_dev, np.full(len(src_dev), p), bytes_), kind=TaskKind.PUSH,
                         op=op_rep, dev=p, alloc=bytes_, cat=TaskCategory.PS, prio_op=op_rep, stage="push", cls=0,
                         tensor=np.repeat(sel, len(workers)), sub=np.tile(np.arange(len(workers)), len(sel)),
                         owner=op_rep, res_len=rlen, res_idx=ridx,
                         lag=cost.transfer_latencies(src_dev, p, bytes_))
        batch.deps(push, src_task, op_rep)
        aggr = batch.add(dur=cost.aggregate_times(p, nb, np.full(len(nb), len(devs))), kind=TaskKind.AGGREGATE,
                         op=sel_op, dev=p, alloc=nb, cat=TaskCategory.PS,
                         prio_op=sel_op, stage="aggregate", cls=0, tensor=sel, sub=0, owner=sel_op, res_len=1,
                         res_idx=np.full(len(sel), p))
        batch.deps(np.repeat(aggr, len(workers)), push, op_rep)
        if np.any(devs == p):                            # the PS's own partial result
            batch.deps(aggr, prov.inst_start[sel_op] + int(last[np.nonzero(devs == p)[0][0]]), sel_op)
        prov.at[sel] = -1
        prov.at[sel, p] = aggr
        prov.layout[sel] = p                    # layout p: device p alone (LayoutTable)


def _aggregate_ar(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, tensors: np.ndarray,
                  place: Placement, prov: Providers) -> None:
    """One AllReduce per partial tensor over its replicas; it holds the links of its algorithm (and the
    members that drive their own communication)."""
    if not len(tensors):
        return
    rs = sharded_state.reduce_scattered(ctx, place.state, tensors)
    if rs.any():                   # sharded gradients (stage >= 2): reduce-scatter instead
        assert place.state is not None
        sharded_state.emit_reduce_scatter(ctx, layouts, batch, tensors[rs], place.op_lay, place.state, prov)
        tensors = tensors[~rs]
    gi = ctx.index
    ops = gi.t_op[tensors]
    lays = place.op_lay[ops]
    for lay in np.unique(lays).tolist():
        pick = lays == lay
        sel, sel_op = tensors[pick], ops[pick]
        devs = layouts.unique_devices(lay)
        last = layouts.last_entries(lay)                 # each device's last entry: its accumulated result
        costs = ctx.allreduce(devs)
        code = costs.algo[sel]
        nccl = (ctx.nccl_resource,) if ctx.nccl_resource >= 0 else ()
        res = [costs.links[a] + nccl + costs.hosts for a in range(len(costs.names))]
        ar = batch.add(dur=costs.times_s[sel], kind=TaskKind.ALLREDUCE, op=sel_op, dev=-1, alloc=0.0,
                       cat=TaskCategory.ALLREDUCE, prio_op=sel_op, stage="aggregate", cls=0, tensor=sel, sub=0,
                       owner=sel_op,
                       res_len=np.array([len(r) for r in res], dtype=np.int64)[code],
                       res_idx=np.array([x for a in code.tolist() for x in res[a]], dtype=np.int64))
        k = len(devs)
        batch.deps(np.repeat(ar, k), (prov.inst_start[sel_op][:, None] + last[None, :]).ravel(),
                   np.repeat(sel_op, k))
        prov.at[np.repeat(sel, k), np.tile(np.array(devs), len(sel))] = np.repeat(ar, k)


# ----------------------------------------------------------------------------------- connections
def emit_connections(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, edges: np.ndarray,
                     place: Placement, prov: Providers) -> None:
    """Dependencies and communication of ``edges`` (ascending; every edge of each tensor they carry):
    (a) a batch tensor under the same layout feeds replica k to replica k; (b) a non-batch value is
    moved once per (tensor, device) that lacks it; (c) a batch tensor under another layout is split,
    moved and concatenated once per (tensor, consumer layout), unless its producer has no batch dimension
    and a copy of the whole value on every consumer device (then each replica reads its own copy)."""
    gi = ctx.index
    if not len(edges):
        return
    if offload.offloads(place.state):              # tensors read by the host step: copied down, then as any edge
        assert place.state is not None
        down = offload.host_read_edges(ctx, place.state, edges)
        if down.any():
            offload.connect_host_reads(ctx, layouts, batch, edges[down], place.op_lay, place.state, prov)
    if place.op_shard is not None:                 # edges touching an op split beyond the batch
        touch = (place.op_shard[gi.e_src[edges]] >= 0) | (place.op_shard[gi.e_dst[edges]] >= 0)
        connect_split(ctx, layouts, batch, edges[touch], place, prov)
        edges = edges[~touch]
        if not len(edges):
            return
    gathered = sharded_state.gathered_edges(ctx, place.state, edges)
    if gathered.any():                             # stage-3 parameters read in forward or backward
        assert place.state is not None
        sharded_state.connect_gathered(ctx, layouts, batch, edges[gathered], place.op_lay, place.state, prov,
                                       offload.shard_uploads if offload.offloads(place.state) else None)
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
        _connect_nonbatch(ctx, layouts, batch, e, place, prov)
    e = edges[batch_edge & ~same]
    if len(e):
        local = _local_broadcast(ctx, layouts, e, place, prov)
        if local.any():
            _connect_local(ctx, layouts, batch, e[local], place, prov)
        e = e[~local]
    if len(e):
        _connect_relayout(ctx, layouts, batch, e, place, prov)


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


def _connect_nonbatch(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, e: np.ndarray,
                      place: Placement, prov: Providers) -> None:
    """Non-batch values: a consumer replica reads its device's copy; a missing copy is moved once per
    (tensor, device) from the best-connected holder; a consumer that reads only the shape moves nothing."""
    gi, lay, n_ops = ctx.index, layouts, ctx.index.n_ops
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
    # a shape-only read of a value made over several micro-batches waits for its first instance only
    early = gi.e_value_free[er] & lay.repeats[place.op_lay[u]]
    have[early] = prov.inst_start[u[early]]
    local = have >= 0
    batch.deps(consumer[local], have[local], n_ops + t[local])
    miss = ~local
    vf = miss & gi.e_value_free[er]
    if vf.any():  # shape-only consumer: depend on any holder, nothing moves
        first = lay.dev_flat[lay.ptr[prov.layout[t[vf]]]]
        batch.deps(consumer[vf], prov.at[t[vf], first], n_ops + t[vf])
    need = miss & ~gi.e_value_free[er]
    if not need.any():
        return
    u, d, v, consumer, tensor = u[need], d[need], v[need], consumer[need], t[need]
    m = ctx.n_devices
    # best holder: highest bandwidth to d, then lowest latency, then lowest id
    holders = lay.dev_mask[prov.layout[tensor]]                               # (x, m)
    score_bw = np.where(holders, ctx.bandwidth_Bps[:, d].T, -np.inf)
    best_bw = score_bw.max(axis=1, keepdims=True)
    score_lat = np.where(score_bw == best_bw, ctx.latency_s[:, d].T, np.inf)
    s = np.argmin(score_lat, axis=1)
    # one transfer per (tensor, destination device)
    tkey = tensor * m + d
    uniq, first_idx, inv = np.unique(tkey, return_index=True, return_inverse=True)
    first_consumer = np.full(len(uniq), np.iinfo(np.int64).max)
    np.minimum.at(first_consumer, inv, v)
    tu, ts, td, tt = u[first_idx], s[first_idx], d[first_idx], tensor[first_idx]
    nb = gi.e_bytes[er[need][first_idx]]
    rlen, ridx = ctx.paths.resources(ts, td)
    tr = batch.add(dur=ctx.cost.transfer_times(ts, td, nb), kind=TaskKind.TRANSFER, op=tu, dev=td, alloc=nb,
                   cat=TaskCategory.TRANSFER, prio_op=first_consumer, stage="transfer", cls=0, tensor=tt, sub=td,
                   owner=n_ops + tt, res_len=rlen, res_idx=ridx, lag=ctx.cost.transfer_latencies(ts, td, nb))
    batch.deps(tr, prov.at[tt, ts], n_ops + tt)
    batch.deps(consumer, tr[inv], n_ops + tensor)


@dataclass(frozen=True)
class _Pattern:
    """How a batch tensor laid out as (devs_u, shares_u) is re-laid out as (devs_v, shares_v)."""

    pi: np.ndarray        # (P,) producer replica of each piece
    pj: np.ndarray        # (P,) consumer replica of each piece
    pov: np.ndarray       # (P,) samples in the piece
    remote: np.ndarray    # (P,) piece crosses devices -> transfer
    split_i: np.ndarray   # (S,) producer replicas cut into several pieces
    split_slot: np.ndarray  # (P,) index into split_i of the piece's producer, -1 if not split
    concat_j: np.ndarray  # (C,) consumer replicas assembled from several pieces
    concat_slot: np.ndarray  # (P,) index into concat_j of the piece's consumer, -1 if single piece


_PATTERNS: dict[tuple[tuple[int, ...], ...], _Pattern] = {}


def relayout_pattern(devs_u: tuple[int, ...], shares_u: tuple[int, ...], devs_v: tuple[int, ...],
                     shares_v: tuple[int, ...]) -> _Pattern:
    """Pieces (i, j, overlap) where replica i of the producer and replica j of the consumer overlap
    (cached: the same layouts recur across strategies)."""
    key = (devs_u, shares_u, devs_v, shares_v)
    pat = _PATTERNS.get(key)
    if pat is not None:
        return pat
    cu = np.concatenate([[0], np.cumsum(shares_u)])
    cv = np.concatenate([[0], np.cumsum(shares_v)])
    ov = np.minimum(cu[1:, None], cv[None, 1:]) - np.maximum(cu[:-1, None], cv[None, :-1])   # (nu, nv)
    pi, pj = np.nonzero(ov > 0)
    n_i = np.bincount(pi, minlength=len(devs_u))
    n_j = np.bincount(pj, minlength=len(devs_v))
    split_i, concat_j = np.nonzero(n_i > 1)[0], np.nonzero(n_j > 1)[0]
    slot_i = np.full(len(devs_u), -1)
    slot_i[split_i] = np.arange(len(split_i))
    slot_j = np.full(len(devs_v), -1)
    slot_j[concat_j] = np.arange(len(concat_j))
    pat = _Pattern(pi, pj, ov[pi, pj].astype(np.float64), np.asarray(devs_u)[pi] != np.asarray(devs_v)[pj],
                   split_i, slot_i[pi], concat_j, slot_j[pj])
    if len(_PATTERNS) > 4096:
        _PATTERNS.clear()
    _PATTERNS[key] = pat
    return pat


def _connect_relayout(ctx: CompileContext, layouts: LayoutTable, batch: TaskBatch, e: np.ndarray,
                      place: Placement, prov: Providers) -> None:
    """Split -> transfers -> concat for batch tensors consumed under another layout, once per
    (tensor, consumer layout); vectorised over all such re-layouts at once."""
    gi, lay, B, n_ops = ctx.index, layouts, ctx.batch_size, ctx.index.n_ops
    src, dst = gi.e_src[e], gi.e_dst[e]
    op_lay = place.op_lay
    n_lay = len(lay.devices)
    ukey = gi.e_tensor[e] * n_lay + op_lay[dst]
    uniq, first_idx, inv = np.unique(ukey, return_index=True, return_inverse=True)
    R = len(uniq)
    r_tensor = uniq // n_lay
    first_consumer = np.full(R, np.iinfo(np.int64).max)
    np.minimum.at(first_consumer, inv, dst)
    r_u = src[first_idx]
    r_lu, r_lv = op_lay[r_u], op_lay[dst[first_idx]]
    r_bytes = gi.e_bytes[e][first_idx]
    r_owner = n_ops + r_tensor
    # patterns used here, flattened: pattern k's pieces/splits/concats live at offsets in the flat arrays
    pair_key = r_lu * n_lay + r_lv
    pairs, r_pat = np.unique(pair_key, return_inverse=True)
    pats = [relayout_pattern(lay.devices[k // n_lay], lay.shares[k // n_lay], lay.devices[k % n_lay],
                             lay.shares[k % n_lay]) for k in pairs.tolist()]

    def flat(attr: str) -> np.ndarray:
        return np.concatenate([getattr(p, attr) for p in pats])

    def ptr(attr: str) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(getattr(p, attr)) for p in pats])]).astype(np.int64)

    P_ptr, S_ptr, C_ptr = ptr("pi"), ptr("split_i"), ptr("concat_j")
    f_pi, f_pj, f_pov, f_rem = flat("pi"), flat("pj"), flat("pov"), flat("remote")
    f_sslot, f_cslot, f_si, f_cj = flat("split_slot"), flat("concat_slot"), flat("split_i"), flat("concat_j")
    fu = lay.ptr[r_lu]                     # flat layout offsets of producer / consumer replicas
    fv = lay.ptr[r_lv]
    src_inst = prov.inst_start[r_u]

    # split tasks: (instance, producer replica cut into several pieces)
    n_s = S_ptr[r_pat + 1] - S_ptr[r_pat]
    s_r, s_k = ragged(n_s)
    s_i = f_si[S_ptr[r_pat[s_r]] + s_k]
    s_dev = lay.dev_flat[fu[s_r] + s_i]
    s_bytes = r_bytes[s_r] * (lay.shares_flat[lay.ptr[r_lu[s_r]] + s_i] / B)
    split_ids = batch.add(dur=ctx.cost.copy_times(s_dev, s_bytes), kind=TaskKind.RELAYOUT, op=r_u[s_r], dev=s_dev,
                          alloc=s_bytes, cat=TaskCategory.SPLIT_CONCAT, prio_op=first_consumer[s_r], stage="split",
                          cls=1, tensor=r_tensor[s_r], sub=s_k, owner=r_owner[s_r], res_len=1, res_idx=s_dev)
    batch.deps(split_ids, src_inst[s_r] + s_i, r_owner[s_r])
    split_base = np.concatenate([[0], np.cumsum(n_s)])[:-1] + (split_ids[0] if len(split_ids) else 0)

    # pieces: provider is the split task of its producer replica, else the producer instance itself
    n_p = P_ptr[r_pat + 1] - P_ptr[r_pat]
    p_r, p_k = ragged(n_p)
    fp = P_ptr[r_pat[p_r]] + p_k
    p_i, p_j, p_rem, p_ss, p_cs = f_pi[fp], f_pj[fp], f_rem[fp], f_sslot[fp], f_cslot[fp]
    piece_task = np.where(p_ss >= 0, split_base[p_r] + p_ss, src_inst[p_r] + p_i)
    rem = np.nonzero(p_rem)[0]
    if len(rem):
        t_src = lay.dev_flat[fu[p_r[rem]] + p_i[rem]]
        t_dst = lay.dev_flat[fv[p_r[rem]] + p_j[rem]]
        t_bytes = r_bytes[p_r[rem]] * f_pov[fp[rem]] / B
        rlen, ridx = ctx.paths.resources(t_src, t_dst)
        tr = batch.add(dur=ctx.cost.transfer_times(t_src, t_dst, t_bytes), kind=TaskKind.TRANSFER, op=r_u[p_r[rem]],
                       dev=t_dst, alloc=t_bytes, cat=TaskCategory.TRANSFER, prio_op=first_consumer[p_r[rem]],
                       stage="transfer", cls=1, tensor=r_tensor[p_r[rem]], sub=p_k[rem], owner=r_owner[p_r[rem]],
                       res_len=rlen, res_idx=ridx, lag=ctx.cost.transfer_latencies(t_src, t_dst, t_bytes))
        batch.deps(tr, piece_task[rem], r_owner[p_r[rem]])
        piece_task[rem] = tr

    # concat tasks: (instance, consumer replica assembled from several pieces)
    n_c = C_ptr[r_pat + 1] - C_ptr[r_pat]
    c_r, c_k = ragged(n_c)
    c_j = f_cj[C_ptr[r_pat[c_r]] + c_k]
    c_dev = lay.dev_flat[fv[c_r] + c_j]
    c_bytes = r_bytes[c_r] * (lay.shares_flat[lay.ptr[r_lv[c_r]] + c_j] / B)
    concat_ids = batch.add(dur=ctx.cost.copy_times(c_dev, c_bytes), kind=TaskKind.CONCAT, op=r_u[c_r], dev=c_dev,
                           alloc=c_bytes, cat=TaskCategory.SPLIT_CONCAT, prio_op=first_consumer[c_r],
                           stage="concat", cls=1, tensor=r_tensor[c_r], sub=c_k, owner=r_owner[c_r], res_len=1,
                           res_idx=c_dev)
    concat_base = np.concatenate([[0], np.cumsum(n_c)])[:-1] + (concat_ids[0] if len(concat_ids) else 0)
    in_concat = p_cs >= 0
    batch.deps(concat_base[p_r[in_concat]] + p_cs[in_concat], piece_task[in_concat], r_owner[p_r[in_concat]])

    # output of each (instance, consumer replica): its concat, else its single piece
    width = max(len(lay.devices[k]) for k in np.unique(r_lv).tolist())
    out_task = np.full((R, width), -1, dtype=np.int64)
    out_task[p_r[~in_concat], p_j[~in_concat]] = piece_task[~in_concat]
    out_task[c_r, c_j] = concat_base[c_r] + c_k
    # consumers: replica j of each edge's consumer depends on the re-layout output j
    er, loc = ragged(lay.length[op_lay[dst]])
    batch.deps(prov.inst_start[dst[er]] + loc, out_task[inv[er], loc], n_ops + gi.e_tensor[e][er])
