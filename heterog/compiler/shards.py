"""Which split option each op takes under a split config (docs/design.md, "Splits beyond the batch").

A split config (``ParallelConfig.split``) divides its ops beyond the batch among its devices. Each op has
split options (``OpGraph.splits``, from ``heterog.graph.sharding``): a dimension divided, what it needs of
each input and gives on each output, as placements (``heterog.placement``: shards, whole, partial sums). Which
option an op takes is chosen here, once per (graph, devices, split shares, kind) for the *whole graph*, as
if every group ran under that config: adjacent groups under the same config then agree on their
placements, and only the edges into and out of the split region convert (``heterog.compiler.reshard``).

The choice minimises, per op, its compute time (the slowest device's share of it) plus the estimated
time of the conversions on its edges, given its neighbours' choices (iterated conditional modes):
  1. compute ops in topological order, each by its inputs alone; a parameter (or buffer) counts as laid
     out as its reader needs, where it has such a layout;
  2. placeholders by their consumers (under a "parameter" split a parameter is held divided where it
     has a divided layout: that is what saves memory); then its optimizer state and the update ops that
     give the next step's values, laid out as the parameter;
  3. up to two sweeps of the same by inputs and outputs, until nothing changes.
An op without a usable option runs whole on every device (``REPLICATE``: its inputs gathered whole, its
outputs whole): ops that draw random values, and the loss, for example. Conversions between a producer's
placement and what its consumer needs (same view of the tensor) are ``heterog.placement.conversion``'s; an
edge costs its costliest view's, slice and pad moving nothing.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from heterog.caches import DerivedCache
from heterog.compiler.context import CompileContext
from heterog.compiler.index import output_bytes
from heterog.compiler.shard_search import FORBIDDEN, solve
from heterog.placement import Conversion, Placement, R, Shard, conversion, is_shard, parse, same_units
from heterog.shares import split_shares_of

if TYPE_CHECKING:  # pragma: no cover
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import ParallelConfig

REPLICATE = -1                                     # option index: the whole op on every device
ALLOWED = {"parameter": ("parameter", "attribute", "partial"), "attribute": ("attribute", "partial"),
           "tensor": ("parameter", "attribute", "partial")}


@dataclass(frozen=True)
class _Option:
    """A split option as the compiler reads it: placements parsed once from the graph's text form (None: no
    tensor there)."""

    kind: str
    extent: int | None
    inputs: tuple[Placement | None, ...]        # per input ref of the op
    exits: tuple[Placement | None, ...]         # per exit of the op
    outputs: tuple[Placement | None, ...]       # per output of the op

    @classmethod
    def from_json(cls, o: dict) -> _Option:
        return cls(o["kind"], o["extent"], tuple(parse(p) for p in o["inputs"]), tuple(parse(p) for p in o["exits"]),
                   tuple(parse(p) for p in o["outputs"]))


class SplitTable:
    """A graph's split options as the compiler reads them (cached on the graph by ``split_table``):
    ``options[o]`` the op's options (those that divide beyond the batch), ``original[o]`` the index of each in
    the op's whole option list (``OpGraph.splits``); ``pairs[e]`` per edge the (consumer input ref, producer
    exit) index pairs of the tensor it carries (one per view of it the consumer reads); ``signature[o]`` one
    number per distinct option list and ``edge_class[e]`` one per distinct (signatures of the edge's ends,
    pairs): what an edge's conversions depend on of the graph."""

    def __init__(self, ctx: CompileContext) -> None:
        graph = ctx.graph
        splits: list[dict | None] = list(graph.splits) if graph.splits else [None] * graph.n_ops
        self.options: list[list[_Option]] = []
        self.original: list[list[int]] = []
        refs: list[list[tuple[str, int | None, int, int]]] = []
        exits: list[dict[tuple[str, int | None], int]] = []
        parsed: dict[tuple, _Option] = {}          # one object per option text: layers repeat the same options
        for s in splits:
            if s is None:
                self.options.append([])
                self.original.append([])
                refs.append([])
                exits.append({})
                continue
            opts = []
            for o in s["options"]:
                if o["kind"] == "batch":
                    continue
                key = (o["kind"], o["extent"], tuple(o["inputs"]), tuple(o["exits"]), tuple(o["outputs"]))
                hit = parsed.get(key)
                if hit is None:
                    hit = parsed[key] = _Option.from_json(o)
                opts.append(hit)
            self.options.append(opts)
            self.original.append([k for k, o in enumerate(s["options"]) if o["kind"] != "batch"])
            refs.append([(n, i, int(src), int(k)) for n, i, src, k in s["inputs"]])
            exits.append({(n, i): j for j, (n, i, _) in enumerate(s["exits"])})
        gi = ctx.index
        self.pairs: list[tuple[tuple[int, int], ...]] = []
        for u, v, e in zip(gi.e_src.tolist(), gi.e_dst.tolist(), range(len(gi.e_src))):
            k = int(graph.edges[e].src_output)
            self.pairs.append(tuple((j, exits[u][(n, i)]) for j, (n, i, src, out) in enumerate(refs[v])
                                    if src == u and out == k and (n, i) in exits[u]))
        self.splittable = np.array([bool(o) for o in self.options], dtype=bool)
        # ops with equal option lists share a signature: an edge's conversions depend on its ends' signatures,
        # the views it carries and the options allowed at each end, which repeat layer after layer (equal
        # options are one object, so a list is known by its objects' identities)
        interned: dict[tuple[int, ...], int] = {}
        self.signature = np.array([interned.setdefault(tuple(map(id, o)), len(interned)) for o in self.options],
                                  dtype=np.int64)
        # edges alike in their ends' signatures and the views they carry share a class
        classes: dict[tuple, int] = {}
        sig = self.signature.tolist()
        self.edge_class = np.array([classes.setdefault((sig[u], sig[v], pr), len(classes)) for u, v, pr in
                                    zip(gi.e_src.tolist(), gi.e_dst.tolist(), self.pairs)], dtype=np.int64)
        # per op, the bytes of each of its outputs at the graph's batch
        self.output_bytes = [np.array(output_bytes(op)) for op in graph.ops]


def split_table(ctx: CompileContext) -> SplitTable:
    """The ``SplitTable`` of the context's graph (built once per graph object)."""
    return _SPLIT_TABLES.get(ctx.graph, lambda: SplitTable(ctx))


@dataclass(frozen=True)
class ShardChoice:
    """Every op's option under one split config (as if the whole graph ran under it).

    ``option`` (n_ops,) option index into ``SplitTable.options[o]``, ``REPLICATE`` for the whole op on every
    device; ``frac`` (n_ops, n) the share of its split dimension on each of the config's devices (1 where
    it runs whole, also for partial-sum options); ``out_split`` (n_ops,) the fraction of its output bytes held
    in shards; ``conv`` (E,) the conversion of each edge between its ends' choices (a ``Conversion``, LOCAL for
    those that move nothing: slice and pad too); ``have`` (E,) the
    producer's placement class of the edge's tensor and ``need`` (E,) the consumer's (0 whole, 1 divided,
    2 partial sums, 3 nothing: a shape read), for edges whose other end is not under this config;
    ``devices`` and ``weights`` the config's devices and split shares; ``original`` (n_ops,) each op's option
    as an index into its whole option list (``OpGraph.splits``; ``REPLICATE`` as above), what the runtime
    reads; ``copied`` (E,) edges whose consumer reads its part of a value held whole on its device and the
    part is not dense in it (divided along a dimension after the first, or in strided blocks): the runtime
    copies the part out before the instance (``heterog.compiler.memory.part_copies``)."""

    option: np.ndarray
    frac: np.ndarray
    out_split: np.ndarray
    conv: np.ndarray
    have: np.ndarray
    need: np.ndarray
    devices: tuple[int, ...] = ()
    weights: tuple[int, ...] = ()
    original: np.ndarray | None = None
    groups: tuple[tuple[int, ...], ...] = ()
    copied: np.ndarray | None = None

    def group_of(self, device: int) -> tuple[int, ...]:
        """The devices of ``device``'s group (a grid's row; all of them for a one-dimensional split)."""
        return next(g for g in self.groups if device in g)


def _cls(p: Placement | None) -> int:
    return 3 if p is None else 0 if p == R else 1 if isinstance(p, Shard) else 2


class _Chooser:
    """Iterated conditional modes over the graph's ops for one split config (module docstring)."""

    def __init__(self, ctx: CompileContext, table: SplitTable, config: ParallelConfig) -> None:
        self.ctx, self.table = ctx, table
        groups = config.groups              # a grid's groups divide alike: one group's positions decide
        self.weights = tuple(config.split_shares[:config.group_size])
        self.n = n = config.group_size
        rings = [(g[i], g[(i + 1) % n]) for g in groups for i in range(n)] if n > 1 else []
        self.bw = min(float(ctx.bandwidth_Bps[a, b]) for a, b in rings) if n > 1 else np.inf
        self.lat = max(float(ctx.latency_s[a, b]) for a, b in rings) if n > 1 else 0.0
        # a grid sums each partial result of the step over its groups (one AllReduce per position of what the
        # position holds, all positions of a server sharing its links): priced per byte held
        self.sum_s_per_byte, self.sum_fixed_s = self._group_sum_rate(ctx, groups) if len(groups) > 1 else (0.0, 0.0)
        full = ctx.cost.full_batch_times(ctx.graph)
        B = float(config.batch_size)
        scale = [np.where(ctx.index.has_batch, int(config.shares[config.devices.index(g[0])]) / B, 1.0)[:, None]
                 for g in groups]                   # a group runs its batch share of each batch op
        self.full = np.max([full[:, list(g)] * f for g, f in zip(groups, scale)], axis=0)    # (n_ops, n)
        allowed = ALLOWED[str(config.split)]
        self.allowed = [[REPLICATE] + [k for k, o in enumerate(opts)     # no device without a unit of the dim
                                       if o.kind in allowed and (o.extent is None or o.extent >= n)]
                        for opts in table.options]
        self.anchor = _anchors(ctx)
        self.param = ctx.index.placeholder_resident & (ctx.index.resident_bytes > 0) & (self.anchor < 0)
        self.fixed_params = config.split == "tensor"
        if config.split == "parameter":         # a parameter with a divided layout is held divided
            for o in np.nonzero(self.param)[0].tolist():
                divided = [k for k in self.allowed[o] if k != REPLICATE and table.options[o][k].kind == "parameter"]
                self.allowed[o] = divided or self.allowed[o]
        self._fracs: dict[int | None, np.ndarray] = {None: np.ones(n)}
        self._shares: dict[int, tuple[int, ...]] = {}
        self._conv: dict[tuple[int, int, int], Conversion] = {}
        self.e_bytes = ctx.index.e_bytes
        if self.fixed_params:       # held in shards where a reader computes with them so, else whole; read as held
            readers: dict[int, list[int]] = {}
            for e, (u, v) in enumerate(zip(ctx.index.e_src.tolist(), ctx.index.e_dst.tolist())):
                if ctx.graph.ops[v].phase != "update":
                    readers.setdefault(u, []).append(e)
            for o in np.nonzero(self.param)[0].tolist():
                self.allowed[o] = [k for k in self.allowed[o] if k != REPLICATE
                                   and table.options[o][k].kind == "parameter"
                                   and any(self.edge_conv(e, k, kv) == Conversion.LOCAL
                                           for e in readers.get(o, ()) for kv in self.allowed[
                                               int(ctx.index.e_dst[e])] if kv != REPLICATE)] or [REPLICATE]
        self.resident = ctx.index.resident_bytes

    @staticmethod
    def _group_sum_rate(ctx: CompileContext, groups: tuple[tuple[int, ...], ...]) -> tuple[float, float]:
        """(seconds per byte a position holds, fixed seconds) of a ring AllReduce over the groups' first
        devices, its bandwidth shared by the positions of a group that share a server."""
        firsts = [g[0] for g in groups]
        hops = list(zip(firsts, firsts[1:] + firsts[:1]))
        bw = min(float(ctx.bandwidth_Bps[a, b]) for a, b in hops)
        lat = max(float(ctx.latency_s[a, b]) for a, b in hops)
        server = ctx.cluster.server_of
        sharing = max(sum(server[d] == server[g[0]] for d in g) for g in groups)
        k = len(groups)
        return 2.0 * (k - 1) / k * sharing / bw, 2.0 * (k - 1) * lat

    def frac(self, extent: int | None) -> np.ndarray:
        hit = self._fracs.get(extent)
        if hit is None:
            assert extent is not None
            hit = self._fracs[extent] = np.asarray(self.shares(extent), dtype=np.float64) / extent
        return hit

    def shares(self, extent: int | None) -> tuple[int, ...]:
        """The devices' integer shares of a dimension of ``extent`` units (cached per extent)."""
        if extent is None:
            return ()
        hit = self._shares.get(extent)
        if hit is None:
            hit = self._shares[extent] = tuple(split_shares_of(extent, self.weights))
        return hit

    def option_frac(self, o: int, k: int) -> np.ndarray:
        if k == REPLICATE:
            return self._fracs[None]
        opt = self.table.options[o][k]
        return self.frac(opt.extent) if opt.kind != "partial" else self._fracs[None]

    def placements(self, e: int, u_opt: int, v_opt: int
                   ) -> tuple[list[tuple[Placement | None, Placement | None]], bool]:
        """(have, need) per view of edge ``e``'s tensor, and whether both ends divide it in the same units."""
        t = self.table
        u, v = int(self.ctx.index.e_src[e]), int(self.ctx.index.e_dst[e])
        ou = t.options[u][u_opt] if u_opt != REPLICATE else None
        ov = t.options[v][v_opt] if v_opt != REPLICATE else None
        pairs = [((ou.exits[i] if ou is not None else R), (ov.inputs[j] if ov is not None else R))
                 for j, i in t.pairs[e]]
        same = ou is not None and ov is not None and same_units(ou.extent, ov.extent, self.shares(ou.extent),
                                                                self.shares(ov.extent))
        return pairs, same

    def edge_conv(self, e: int, u_opt: int, v_opt: int) -> Conversion:
        key = (e, u_opt, v_opt)
        hit = self._conv.get(key)
        if hit is not None:
            return hit
        pairs, same = self.placements(e, u_opt, v_opt)
        worst = Conversion.LOCAL
        for h, n in pairs:
            c = conversion(h, n, same)
            if _CONV_WEIGHT[c] > _CONV_WEIGHT[worst]:
                worst = c
        self._conv[key] = worst
        return worst

    def compute_costs(self, ops: np.ndarray, options: list[int]) -> np.ndarray:
        """(len(ops), K) the slowest device's share of each of ``ops`` (ops with one option list) under each of
        ``options`` (and a tie-break: hold less of a resident tensor); on a grid, plus the sum over its groups of
        the partial results it makes (a weight gradient held in shards moves its shards, held whole or as partial
        sums, all of it)."""
        o = int(ops[0])
        f = np.stack([self.option_frac(o, k) for k in options])             # (K, n)
        most = f.max(axis=1)
        cost = (self.full[ops][:, None, :] * f[None]).max(axis=2) + \
            1e-18 * self.resident[ops].astype(np.float64)[:, None] * most[None]
        partial = self.ctx.index.partial_bytes[ops].astype(np.float64)
        summed = np.nonzero(partial > 0)[0] if self.sum_s_per_byte else ()
        if len(summed):
            held = np.where([is_shard(self.out_placement(o, k)) for k in options], most, 1.0)
            cost[summed] = cost[summed] + (partial[summed, None] * held[None] * self.sum_s_per_byte
                                           + self.sum_fixed_s)
        return cost

    def conv_costs(self, conv: np.ndarray, nbytes: np.ndarray, from_param: np.ndarray) -> np.ndarray:
        """(len(nbytes), Ku, Kv) edges' conversion times for every pair of their producer's and consumer's options:
        ``conv`` (Ku, Kv) the pairs' conversions (``Conversion`` codes; the edges alike in them), ``nbytes`` each
        edge's bytes, ``from_param`` whether its producer is a parameter; ``FORBIDDEN`` where such a parameter held
        in shards would move (a "tensor" split reads it where it lies)."""
        collective = _COLLECTIVE[conv]
        if self.n < 2:
            cost = np.zeros((len(nbytes), *conv.shape))
        else:
            n = self.n
            cost = np.where(collective[None], (nbytes * (n - 1) / n)[:, None, None] * _CONV_WEIGHTS[conv][None]
                            / self.bw + (n - 1) * self.lat, 0.0)
        rows = np.nonzero(from_param)[0] if self.fixed_params else ()
        if len(rows):
            moved = cost[rows]
            moved[:, collective] = FORBIDDEN
            cost[rows] = moved
        return cost

    def out_placement(self, o: int, k: int) -> Placement | None:
        return R if k == REPLICATE else (self.table.options[o][k].outputs or (R,))[0]

    def choose(self) -> np.ndarray:
        """Every op's option: the labelling ``heterog.compiler.shard_search.solve`` finds for ``problem``."""
        labels = solve(*self.problem())
        return np.array([self.allowed[o][int(k)] for o, k in enumerate(labels.tolist())], dtype=np.int64)

    def problem(self) -> tuple[list[np.ndarray], list[int], list[int], list[np.ndarray]]:
        """The labelling problem (unary, src, dst, pair; ``solve``'s arguments) over the ops' allowed options:
        each op's ``compute_costs``, each edge's ``conv_costs`` and, for each op laid out as its parameter
        (``_anchors``), an edge from the parameter that allows only the options giving the parameter's
        placement (the whole op where none does). Edges alike in their ends' options, the views they carry and
        the options allowed share one table of conversions."""
        gi = self.ctx.index
        cands = self.allowed
        allowed, n_allowed = _alike(map(tuple, cands))
        # ops alike in their options and the options allowed: one table of compute costs
        ops_alike, n_alike = _alike(zip(self.table.signature.tolist(), allowed.tolist()))
        unary: list[np.ndarray] = [np.zeros(0)] * gi.n_ops
        for ops in _members(ops_alike, n_alike):
            for o, row in zip(ops.tolist(), self.compute_costs(ops, cands[int(ops[0])])):
                unary[o] = row
        kept = np.nonzero(self.anchor[gi.e_dst] != gi.e_src)[0]     # the anchor edge below says all there is
        eu, ev = gi.e_src[kept], gi.e_dst[kept]
        _, edges_alike = np.unique((self.table.edge_class[kept] * n_allowed + allowed[eu]) * n_allowed + allowed[ev],
                                   return_inverse=True)
        pair: list[np.ndarray] = [np.zeros(0)] * len(kept)
        for alike in _members(edges_alike.reshape(-1), int(edges_alike.max()) + 1 if len(kept) else 0):
            e = int(kept[alike[0]])
            u, v = int(gi.e_src[e]), int(gi.e_dst[e])
            conv = np.array([[self.edge_conv(e, ku, kv) for kv in cands[v]] for ku in cands[u]],
                            dtype=np.int64).reshape(len(cands[u]), len(cands[v]))
            es = kept[alike]
            for i, costs in zip(alike.tolist(), self.conv_costs(conv, self.e_bytes[es].astype(np.float64),
                                                                  self.param[gi.e_src[es]])):
                pair[i] = costs
        src, dst = eu.tolist(), ev.tolist()
        for o in np.nonzero(self.anchor >= 0)[0].tolist():
            a = int(self.anchor[o])
            m = np.full((len(cands[a]), len(cands[o])), FORBIDDEN)
            for i, ka in enumerate(cands[a]):
                want = self.out_placement(a, ka)
                ok = [j for j, k in enumerate(cands[o]) if self.out_placement(o, k) == want]
                m[i, ok or [cands[o].index(REPLICATE)]] = 0.0
            src.append(a)
            dst.append(o)
            pair.append(m)
        return unary, src, dst, pair


def _alike(keys: Iterable[Hashable]) -> tuple[np.ndarray, int]:
    """For each key, one number per distinct key (in order of first appearance); and how many there are."""
    ids: dict[Hashable, int] = {}
    return np.array([ids.setdefault(k, len(ids)) for k in keys], dtype=np.int64), len(ids)


def _members(ids: np.ndarray, n: int) -> list[np.ndarray]:
    """For each number 0..n-1, the positions of ``ids`` holding it, in increasing order."""
    order = np.argsort(ids, kind="stable")
    return np.split(order, np.cumsum(np.bincount(ids, minlength=n))[:-1]) if n else []


class ChoiceKey(NamedTuple):
    """What a ``ShardChoice`` depends on of its split config."""

    devices: tuple[int, ...]
    split_shares: tuple[int, ...]
    split: str | None
    shares: tuple[int, ...]
    grid: int


_SPLIT_TABLES: DerivedCache[OpGraph, SplitTable] = DerivedCache("SplitTable of each graph")
_CHOICES: DerivedCache[CompileContext, dict[ChoiceKey, ShardChoice]] = DerivedCache(
    "ShardChoice of each split config, per compile context")

# relative bytes each conversion moves per device (of the tensor's, times (n - 1) / n)
_CONV_WEIGHT = {Conversion.LOCAL: 0.0, Conversion.SLICE: 0.0, Conversion.PAD: 0.0, Conversion.ALL_GATHER: 1.0,
                Conversion.REDUCE_SCATTER: 1.0, Conversion.ALL_REDUCE: 2.0, Conversion.ALL_TO_ALL: 0.25}
# by conversion code: its weight, and whether it is a collective (``Conversion.collective``)
_CONV_WEIGHTS = np.array([_CONV_WEIGHT[Conversion(c)] for c in range(len(Conversion))])
_COLLECTIVE = np.array([Conversion(c).collective for c in range(len(Conversion))])


def choose_shards(ctx: CompileContext, config: ParallelConfig) -> ShardChoice:
    """Each op's option under ``config`` (a split config), cached in the context per (devices, split
    shares, kind)."""
    choices = _CHOICES.get(ctx, dict)
    key = ChoiceKey(tuple(config.devices), tuple(config.split_shares), config.split, tuple(config.shares),
                    config.grid)
    hit = choices.get(key)
    if hit is not None:
        return hit
    table = split_table(ctx)
    ch = _Chooser(ctx, table, config)
    option = ch.choose()
    gi = ctx.index
    labels = option.tolist()
    # ops alike in their options and the option they take: one row of shares, one layout of their outputs
    chosen, n_chosen = _alike(zip(table.signature.tolist(), labels))
    frac = np.ones((gi.n_ops, ch.n))
    out_split = np.zeros(gi.n_ops)
    for ops in _members(chosen, n_chosen):
        o, k = int(ops[0]), labels[int(ops[0])]
        frac[ops] = ch.option_frac(o, k)
        if k == REPLICATE:
            continue
        outs = table.options[o][k].outputs
        divided = np.array([is_shard(p) for p in outs], dtype=bool)
        first = float(table.options[o][k].kind != "partial" and bool(outs) and is_shard(outs[0]))
        for x in ops.tolist():
            sizes = table.output_bytes[x]
            total = sizes.sum()
            out_split[x] = float(sizes[divided].sum() / total) if len(sizes) == len(outs) and total > 0 else first
    frac = np.tile(frac, (1, int(config.grid)))          # each group's k-th device alike
    E = len(gi.e_src)
    conv = np.zeros(E, dtype=np.int64)
    have = np.zeros(E, dtype=np.int64)
    need = np.zeros(E, dtype=np.int64)
    copied = np.zeros(E, dtype=bool)
    free = gi.e_value_free
    # edges alike in all that is read below (their class, their ends' options, a shape read)
    _, edges_alike = np.unique(((table.edge_class * n_chosen + chosen[gi.e_src]) * n_chosen + chosen[gi.e_dst]) * 2
                               + free, return_inverse=True)
    edges_alike = edges_alike.reshape(-1)
    for es in _members(edges_alike, int(edges_alike.max()) + 1 if E else 0):
        e = int(es[0])
        u, v = int(gi.e_src[e]), int(gi.e_dst[e])
        pairs, _ = ch.placements(e, labels[u], labels[v])
        hs = [_cls(h) for h, _ in pairs] or [0]
        ns = [_cls(n) for _, n in pairs] or [3 if free[e] else 0]
        conv[es] = int(ch.edge_conv(e, labels[u], labels[v]))
        copied[es] = not free[e] and any(h == R and isinstance(n, Shard) and (n.dim > 0 or n.sf > 1)
                                         for h, n in pairs)
        have[es] = 2 if 2 in hs else 1 if 1 in hs else 0
        need[es] = 0 if 0 in ns else 1 if 1 in ns else 2 if 2 in ns else 3
    original = np.array([table.original[o][k] if k != REPLICATE else REPLICATE for o, k in enumerate(labels)],
                        dtype=np.int64)
    out = choices[key] = ShardChoice(option, frac, out_split, conv, have, need, tuple(config.devices),
                                             tuple(config.split_shares), original, config.groups, copied)
    return out


def _anchors(ctx: CompileContext) -> np.ndarray:
    """(n_ops,) for the optimizer state placeholders of a parameter and the update ops that give the next
    step's parameter or state (no consumer), the parameter's placeholder; -1 for other ops. They must be laid
    out as the parameter is."""
    graph, gi = ctx.graph, ctx.index
    param_of = {op.param: i for i, op in enumerate(graph.ops) if op.kind == "param" and op.param is not None}
    n_consumers = np.bincount(gi.e_src, minlength=gi.n_ops) if len(gi.e_src) else np.zeros(gi.n_ops, np.int64)
    out = np.full(gi.n_ops, -1, dtype=np.int64)
    for i, op in enumerate(graph.ops):
        if op.param in param_of and (op.kind == "state" or (op.phase == "update" and op.kind == "compute"
                                                           and n_consumers[i] == 0)):
            out[i] = param_of[op.param]
    return out
