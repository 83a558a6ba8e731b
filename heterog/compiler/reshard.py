"""Phase 6 for the edges that touch an op split beyond the batch (docs/design.md, "Splits beyond the
batch"): the collectives and transfers that give each consumer instance the placement it reads.

Per tensor made by an op of a split config (its instances on the config's devices, in config order):
  - a consumer under the same config reads it as its option needs (``ShardChoice.conv``): locally, from
    the producer instance on its own device; or after one collective over the config's devices:
    all-gather or all-reduce (the tensor made whole, once per tensor, shared by every reader of it whole),
    reduce-scatter or all-to-all (once per tensor and consumer shares);
  - any other consumer reads it whole: made whole on the config's devices as above, then each consumer
    instance reads it there, or moved to its device from the best-connected one (its batch share of it for
    a batch op, the shard it needs for an op of another split config); where every device of another split
    config's group reads the same whole value, it may instead move partitioned over the group and be
    all-gathered there (``Engine.partitioned``, when the cost model says that is faster).
A tensor made by an op of no split config and read by an op of one: each consumer instance gets, from
every producer instance (each batch piece) or from the best-connected holder of a whole value, what it
reads: all of it, or for a divided input its share of it. A split grid's partial result is first summed over
its groups by the devices at the same position (``_sum_over_groups``).

This module decides who needs what; the tasks, their prices and resources are the conversion engine's
(``heterog.compiler.convert``): a collective over the config's devices whose result lands on each device as a
zero-time task that allocates it, transfers from the best-connected holder. In the canonical order
(``heterog.compiler.tasks``) a tensor's collectives take the stage "split", its landings and transfers
"transfer" (numbered as made, so a transfer of a landed value comes after its landing), all before the first
consumer they serve.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.convert import Engine
from heterog.compiler.index import GraphIndex
from heterog.compiler.place import Placement
from heterog.compiler.registries import LayoutTable, entry_rows
from heterog.compiler.tasks import Providers, ragged
from heterog.placement import Conversion, P, R, Shard, conversion

HAVE = (R, Shard(0), P)          # a producer's placement class (``ShardChoice.have``) as a placement


def connect_split(ctx: CompileContext, layouts: LayoutTable, conv: Engine, edges: np.ndarray, place: Placement,
                  prov: Providers) -> None:
    """Dependencies, collectives and transfers of ``edges`` (every edge of each tensor they carry that
    touches an op of a split config; module docstring), made by ``conv``."""
    if not len(edges):
        return
    gi = ctx.index
    assert place.op_shard is not None
    local = own_shard_reads(ctx, layouts, edges, place)
    _connect_own_shards(ctx, layouts, conv, edges[local], place, prov)
    rest = edges[~local]
    tensor = gi.e_tensor[edges]
    carried = np.isin(tensor, gi.e_tensor[rest])          # the edges of the tensors an edge of rest carries
    by_tensor: dict[int, list[int]] = defaultdict(list)
    for e, t in zip(edges[carried].tolist(), tensor[carried].tolist()):
        by_tensor[t].append(e)
    todo: dict[int, list[int]] = defaultdict(list)
    for e, t in zip(rest.tolist(), gi.e_tensor[rest].tolist()):
        todo[t].append(e)
    seen = _Layouts(layouts)
    for t, es in by_tensor.items():
        if place.op_shard[gi.t_op[t]] < 0:
            _into_split(ctx, layouts, conv, t, es, place, prov)
        else:
            _from_split(ctx, layouts, conv, t, es, todo[t], place, prov, seen)


def own_shard_reads(ctx: CompileContext, layouts: LayoutTable, edges: np.ndarray, place: Placement) -> np.ndarray:
    """(len(edges),) the edges whose every consumer instance reads one producer instance on its own device and
    moves nothing (``_from_split``'s local reads of one source key an entry, ``_keys_read``): producer and
    consumer under the same split config with a conversion that is no collective, a value read (not a shape),
    not a reader of every micro-batch at once (a coupled op), and no grid's partial result summed over its
    groups first."""
    gi = ctx.index
    assert place.op_shard is not None
    layouts.refresh()
    t = gi.e_tensor[edges]
    u, v = gi.t_op[t], gi.e_dst[edges]
    region = place.op_shard[u]
    out = (region >= 0) & (place.op_shard[v] == region) & ~gi.e_value_free[edges]
    if place.n_micro > 1:                          # a reader over the whole batch reads every micro-batch's
        whole = np.maximum.reduceat(layouts.shares_flat, layouts.ptr[:-1]) >= ctx.batch_size
        out &= ~(gi.e_batch[edges] & gi.has_batch[u] & gi.has_batch[v] & whole[place.op_lay[v]])
    for r in np.unique(region[out]).tolist():
        at = out & (region == r)
        choice = place.shards[r]
        code = choice.conv[edges[at]]
        keep = (code < Conversion.ALL_GATHER) | (code > Conversion.ALL_TO_ALL)       # no collective
        if len(choice.groups) > 1:
            keep &= ~gi.t_needs_agg[t[at]]
        out[np.flatnonzero(at)[~keep]] = False
    return out


def _connect_own_shards(ctx: CompileContext, layouts: LayoutTable, conv: Engine, edges: np.ndarray,
                        place: Placement, prov: Providers) -> None:
    """The dependencies of ``edges`` (``own_shard_reads``), all at once: each consumer instance waits for the
    producer's instance on its device of the source key it reads (``_source_key``): the same micro-batch's
    where both carry the batch over several micro-batches, the device's last where only the producer does (a
    partial result), else the only one."""
    if not len(edges):
        return
    gi = ctx.index
    t = gi.e_tensor[edges]
    u, v = gi.t_op[t], gi.e_dst[edges]
    lay_u, lay_v = place.op_lay[u], place.op_lay[v]
    rows, row_of = np.unique(lay_u, return_inverse=True)
    m, k = ctx.n_devices, max(place.n_micro, 1)
    entry = np.full((len(rows), m, k + 1), -1, dtype=np.int64)   # (producer layout, device, micro-batch | last)
    for i, lay in enumerate(rows.tolist()):
        lo, hi = int(layouts.ptr[lay]), int(layouts.ptr[lay + 1])
        local = np.arange(hi - lo)
        entry[i, layouts.dev_flat[lo:hi], layouts.micro_flat[lo:hi]] = local
        last = layouts.last_flat[lo:hi]
        entry[i, layouts.dev_flat[lo:hi][last], k] = local[last]
    row, j = ragged(layouts.length[lay_v])
    flat = layouts.ptr[lay_v][row] + j
    hu, hv = gi.has_batch[u][row], gi.has_batch[v][row]
    key = np.where(hu & hv, layouts.micro_flat[flat], np.where(hu, k, 0))
    on = entry[row_of[row], layouts.dev_flat[flat], key]
    assert (on >= 0).all(), "a consumer instance reads an instance its producer's layout does not have"
    conv.deps(prov.inst_start[v][row] + j, prov.inst_start[u][row] + on, gi.n_ops + t[row])


_LayoutView = tuple[tuple[int, ...], dict[Hashable, Sequence[int]], dict[int, int], dict[int, float]]


class _Layouts:
    """What ``_from_split`` reads of a layout, found once per layout in one ``connect_split``: its devices,
    entries (``_entries``), each device's position, and each device's split share (of its last entry)."""

    def __init__(self, layouts: LayoutTable) -> None:
        self.layouts = layouts
        self._of: dict[int, _LayoutView] = {}

    def of(self, lay: int) -> _LayoutView:
        hit = self._of.get(lay)
        if hit is None:
            devs, ent = _entries(self.layouts, lay)
            split = self.layouts.split[lay]
            hit = self._of[lay] = (devs, ent, {d: i for i, d in enumerate(devs)},
                                   dict(zip(devs, (split[j] for j in ent["last"]))))
        return hit


def _collective(conv: Engine, kind: Conversion, t: int, u: int, devs: tuple[int, ...], nbytes: float,
                f_u: np.ndarray, f_out: np.ndarray, sources: list[int], prio: int) -> list[int]:
    """One collective ``kind`` of ``nbytes`` (the whole value of tensor ``t``, one micro-batch's of a batch tensor)
    over ``devs`` after ``sources`` (the producer's instances), one of the producer's layer's own; its result
    lands on each device, allocating ``f_out[i]`` of it there. Returns the landing tasks, in device order."""
    owner = conv.ctx.index.n_ops + t
    coll = conv.collective_one(kind, devs, nbytes, sources, op=u, tensor=t, prio_op=prio, stage="split", cls=1,
                               owner=owner, have=f_u, need=f_out, in_layer=True)
    return conv.land(coll, devs, nbytes, f_out, op=u, tensor=t, prio_op=prio, cls=1, owner=owner).tolist()


def _entries(layouts: LayoutTable, lay: int) -> tuple[tuple[int, ...], dict[Hashable, Sequence[int]]]:
    """A layout's devices (each once, in order) and its entries for each micro-batch in that order
    (``LayoutTable.micro_entries``), and under ``"last"`` each device's last entry (where partial results
    accumulate over micro-batches)."""
    out: dict[Hashable, Sequence[int]] = {m: e for m, e in layouts.micro_entries(lay).items()}
    out["last"] = layouts.last_entries(lay).tolist()
    return layouts.unique_devices(lay), out


def _source_key(gi: GraphIndex, u: int, v: int, micro: int) -> Hashable:
    """Which instances of ``u`` an instance of ``v`` for micro-batch ``micro`` reads: those of the same
    micro-batch (both batch ops), each device's last (a partial result read once), or its only ones."""
    if not gi.has_batch[u]:
        return 0
    return micro if gi.has_batch[v] else "last"


def _keys_read(ctx: CompileContext, place: Placement, layouts: LayoutTable, keys: Iterable[Hashable],
               carries_batch: bool, u: int, v: int) -> tuple[Hashable | None, list[list[Hashable]]]:
    """For each entry of reader ``v``'s layout, the source keys (of ``keys``, the producer ``u``'s) it reads: its
    micro-batch's (``_source_key``), or every micro-batch's for a consumer over the whole step (a coupled op,
    ``heterog.compiler.coupled``, reading the whole batch of a micro-batched plan); and first the one key every
    entry reads alone, if there is one (else None)."""
    gi = ctx.index
    lay_v = int(place.op_lay[v])
    micro = layouts.micro[lay_v]
    if not gi.has_batch[u] or not gi.has_batch[v] or place.n_micro == 1:     # one key for every entry
        key = _source_key(gi, u, v, 0)
        return key, [[key]] * len(micro)
    every = [k for k in keys if k != "last"] if carries_batch else []
    return None, [every if carries_batch and s == ctx.batch_size else [int(m)]
                  for s, m in zip(layouts.shares[lay_v], micro)]


def _entry_rows(layouts: LayoutTable, lay: int, groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, int]]:
    """``entry_rows`` of layout ``lay``."""
    return entry_rows(layouts.devices[lay], layouts.shares[lay], layouts.micro[lay], groups)


def _sum_over_groups(ctx: CompileContext, conv: Engine, t: int, u: int, groups: tuple[tuple[int, ...], ...],
                     have: int, sources: dict[int, int], f_u: dict[int, float], prio: int) -> dict[int, int]:
    """A split grid's partial result ``t`` summed over its groups: the devices at the same position of every
    group all-reduce what they hold (a shard, a whole copy or partial sums, which stay partial sums in the
    group), priced as a step's partial results. In place, like a gradient AllReduce. Returns each device's
    result."""
    nbytes = float(ctx.index.t_bytes[t])
    out: dict[int, int] = {}
    for devs in (tuple(g[i] for g in groups) for i in range(len(groups[0]))):
        part = nbytes * (f_u[devs[0]] if have == 1 else 1.0)
        ar = conv.collective_one(conversion(P, R, True), devs, part, [sources[d] for d in devs], op=u, tensor=t,
                                 prio_op=prio, stage="split", cls=1, owner=ctx.index.n_ops + t, gradient=True)
        out.update(dict.fromkeys(devs, ar))
    return out


def _from_split(ctx: CompileContext, layouts: LayoutTable, conv: Engine, t: int, es: list[int], todo: list[int],
                place: Placement, prov: Providers, seen: _Layouts) -> None:
    """What the readers of tensor ``t`` (made under a split config; ``es``: every edge carrying it) need, for the
    edges ``todo`` of ``es`` (the others connected by ``_connect_own_shards``)."""
    gi = ctx.index
    assert place.op_shard is not None
    u = int(gi.t_op[t])
    region = int(place.op_shard[u])
    choice = place.shards[region]
    lay_u = int(place.op_lay[u])
    devs, ent, pos, f_u = seen.of(lay_u)
    groups = choice.groups or (devs,)
    prio = min(int(gi.e_dst[e]) for e in es)
    owner = gi.n_ops + t
    carries_batch = bool(gi.e_batch[es[0]])
    have = max(int(choice.have[e]) for e in es)

    start_u = int(prov.inst_start[u])
    insts: dict[Hashable, dict[int, int]] = {}
    reduced = None
    if len(groups) > 1 and gi.t_needs_agg[t]:          # a grid's partial result: summed over its groups first
        reduced = _sum_over_groups(ctx, conv, t, u, groups, have, {d: start_u + int(ent["last"][pos[d]])
                                                                 for d in devs}, f_u, prio)

    def inst(key: Hashable) -> dict[int, int]:
        hit = insts.get(key)
        if hit is None:
            hit = insts[key] = reduced if key == "last" and reduced is not None else \
                {d: start_u + int(ent[key][pos[d]]) for d in devs}
        return hit

    def nbytes(key: Hashable, g: tuple[int, ...]) -> float:   # the tensor of one group's micro-batch, or whole
        share = layouts.shares[lay_u][ent[key][pos[g[0]]]]
        return float(gi.t_bytes[t]) * (share / ctx.batch_size if carries_batch else 1.0)

    whole: dict[Hashable, dict[int, int]] = {}

    def made_whole(key: Hashable) -> dict[int, int]:
        if key not in whole:
            if have == 0:
                whole[key] = inst(key)
            else:
                whole[key] = {}
                for g in groups:
                    whole[key].update(zip(g, _collective(
                        conv, conversion(HAVE[have], R, True), t, u, g, nbytes(key, g), np.array([f_u[d] for d in g]),
                        np.ones(len(g)), [inst(key)[d] for d in g], prio)))
        return whole[key]

    rows_u: list[tuple[int, int]] | None = None
    scattered: dict[tuple[Hashable, int, tuple[float, ...], tuple[int, ...]], dict[int, int]] = {}
    moved: dict[tuple, int] = {}
    gathered: dict[tuple, dict[int, int] | None] = {}
    whole_on: set[tuple[Hashable, int]] | None = None
    for e in todo:
        v = int(gi.e_dst[e])
        lay_v = int(place.op_lay[v])
        start_v = int(prov.inst_start[v])
        same = int(place.op_shard[v]) == region
        c = Conversion(int(choice.conv[e])) if same else Conversion.LOCAL
        split_v = int(place.op_shard[v]) >= 0
        choice_v = place.shards[int(place.op_shard[v])] if split_v else None
        need_shard = choice_v is not None and int(choice_v.need[e]) == 1
        rows_v = None
        value_free, local = bool(gi.e_value_free[e]), same and not c.collective
        one, keys_of = _keys_read(ctx, place, layouts, ent, carries_batch, u, v)
        devices_v = layouts.devices[lay_v]
        if local and not value_free and (one is not None or all(len(k) == 1 for k in keys_of)):
            # each entry reads its own shard: every dependency at once
            on = list(map(inst(one).__getitem__, devices_v)) if one is not None else \
                [inst(k[0])[d] for k, d in zip(keys_of, devices_v)]
            conv.dep_each(range(start_v, start_v + len(devices_v)), on, owner)
            continue
        f_v = seen.of(lay_v)[3]
        for j, d in enumerate(devices_v):
            for key in keys_of[j]:                                     # several: a coupled op
                if value_free:                         # a shape read: the first instance, nothing moves
                    conv.dep(start_v + j, start_u + int(ent[0][0]), owner)
                elif local:                                        # same config, the option reads its own shard
                    conv.dep(start_v + j, inst(key)[d], owner)
                elif same and c in (Conversion.REDUCE_SCATTER, Conversion.ALL_TO_ALL):
                    g = choice.group_of(d)
                    fg = tuple(f_v[x] for x in g)
                    if (key, c, fg, g) not in scattered:
                        scattered[(key, c, fg, g)] = dict(zip(g, _collective(
                            conv, c, t, u, g, nbytes(key, g), np.array([f_u[x] for x in g]), np.asarray(fg),
                            [inst(key)[x] for x in g], prio)))
                    conv.dep(start_v + j, scattered[(key, c, fg, g)][d], owner)
                elif same or (d in devs and (not carries_batch or len(groups) == 1)):
                    conv.dep(start_v + j, made_whole(key)[d], owner)      # read whole where it was made whole
                else:          # moved whole, its batch share or the shard it reads, from the best-connected holder
                    if whole_on is None:
                        whole_on = _read_whole_elsewhere(ctx, place, es, region, layouts, u, ent)
                    whole_here = (key, d) in whole_on       # a shard reader slices the whole value another brings
                    split = layouts.split[lay_v][j] if need_shard and not whole_here else 1.0
                    if not carries_batch:
                        pieces = [(devs, 1.0)]
                    else:
                        rows_u = rows_u or _entry_rows(layouts, lay_u, groups)
                        rows_v = rows_v or _entry_rows(layouts, lay_v, choice_v.groups if choice_v else ())
                        lo, hi = rows_v[j] if gi.has_batch[v] else (0, ctx.batch_size)
                        pieces = []
                        for g in groups:
                            glo, ghi = rows_u[int(ent[key][pos[g[0]]])]
                            if min(hi, ghi) > max(lo, glo):
                                pieces.append((g, (min(hi, ghi) - max(lo, glo)) / ctx.batch_size))
                    g_v = choice_v.group_of(d) if choice_v is not None and (whole_here or not need_shard) else (d,)
                    for g, part in pieces:
                        if d in g:
                            conv.dep(start_v + j, made_whole(key)[d], owner)
                            continue
                        piece = float(gi.t_bytes[t]) * part * split
                        gkey = (key, part, g, g_v)
                        if gkey not in gathered and len(g_v) > 1 and not set(g_v) & set(g):
                            held = made_whole(key)
                            gathered[gkey] = conv.partitioned(t, u, g, g_v, piece, held.__getitem__, prio)
                        landed = gathered.get(gkey)
                        if landed is not None:
                            conv.dep(start_v + j, landed[d], owner)
                            continue
                        mkey = (key, d, part * split, g)
                        if mkey not in moved:
                            src = ctx.cluster.best_source(g, d)
                            moved[mkey] = conv.move(made_whole(key)[src], src, d, piece, op=u, prio_op=prio,
                                                   tensor=t)
                        conv.dep(start_v + j, moved[mkey], owner)


def _read_whole_elsewhere(ctx: CompileContext, place: Placement, es: list[int], region: int,
                          layouts: LayoutTable, u: int, keys: Iterable[Hashable]) -> set[tuple[Hashable, int]]:
    """(source key, device) of the instances of readers outside the producer's config that read the value
    whole (``keys``: the producer's source keys): a reader of a shard on such a device takes its shard from that
    whole copy."""
    gi = ctx.index
    assert place.op_shard is not None
    carries_batch = bool(gi.e_batch[es[0]])
    out: set[tuple[Hashable, int]] = set()
    for e in es:
        v = int(gi.e_dst[e])
        shard_v = int(place.op_shard[v])
        if gi.e_value_free[e] or shard_v == region or (shard_v >= 0 and int(place.shards[shard_v].need[e]) == 1):
            continue
        lay_v = int(place.op_lay[v])
        keys_of = _keys_read(ctx, place, layouts, keys, carries_batch, u, v)[1]
        out.update((key, d) for j, d in enumerate(layouts.devices[lay_v]) for key in keys_of[j])
    return out


def _into_split(ctx: CompileContext, layouts: LayoutTable, conv: Engine, t: int, es: list[int], place: Placement,
                prov: Providers) -> None:
    gi = ctx.index
    assert place.op_shard is not None
    u = int(gi.t_op[t])
    owner = gi.n_ops + t
    nbytes = float(gi.t_bytes[t])
    prio = min(int(gi.e_dst[e]) for e in es)
    lay_u = int(place.op_lay[u])
    # batch pieces: a batch op's value not aggregated since, one piece per instance; else whole where held
    pieces = bool(gi.e_batch[es[0]]) and int(prov.layout[t]) == lay_u and \
        any(s < ctx.batch_size for s in layouts.shares[lay_u])
    holders = np.nonzero(prov.at[t] >= 0)[0].tolist()
    rows_u = _entry_rows(layouts, lay_u, ()) if pieces else []
    moved: dict[tuple[int, int, float, int], int] = {}
    for e in es:
        v = int(gi.e_dst[e])
        lay_v = int(place.op_lay[v])
        start_v = int(prov.inst_start[v])
        choice = place.shards[int(place.op_shard[v])]
        need = int(choice.need[e])
        grid = len(choice.groups) > 1 and gi.has_batch[v] and bool(gi.e_batch[e])   # a group reads its rows
        rows_v = _entry_rows(layouts, lay_v, choice.groups) if grid else []
        for j, (d, m) in enumerate(zip(layouts.devices[lay_v], layouts.micro[lay_v])):
            if need == 3 or gi.e_value_free[e]:           # a shape read: the first instance, nothing moves
                conv.dep(start_v + j, int(prov.inst_start[u]), owner)
                continue
            scale = layouts.split[lay_v][j] if need == 1 else 1.0
            lo, hi = rows_v[j] if grid else (0, ctx.batch_size)
            if pieces:                                 # the pieces of its micro-batch (of its group's rows)
                for k, (s, mk) in enumerate(zip(layouts.devices[lay_u], layouts.micro[lay_u])):
                    rows = min(hi, rows_u[k][1]) - max(lo, rows_u[k][0])
                    if mk != m or rows <= 0:
                        continue
                    src_task = int(prov.inst_start[u]) + k
                    if s == d:
                        conv.dep(start_v + j, src_task, owner)
                        continue
                    key = (k, d, float(scale), lo)
                    if key not in moved:
                        moved[key] = conv.move(src_task, s, d, nbytes * rows / ctx.batch_size * scale, op=u,
                                               prio_op=prio, tensor=t)
                    conv.dep(start_v + j, moved[key], owner)
            elif d in holders:
                conv.dep(start_v + j, int(prov.at[t, d]), owner)
            else:
                rows = hi - lo if grid else ctx.batch_size
                key = (-1, d, float(scale), lo if grid else -1)
                if key not in moved:
                    s = ctx.cluster.best_source(holders, d)
                    moved[key] = conv.move(int(prov.at[t, s]), s, d, nbytes * scale * rows / ctx.batch_size,
                                           op=u, prio_op=prio, tensor=t)
                conv.dep(start_v + j, moved[key], owner)
