"""Lowering the ops of groups split beyond the batch (docs/design.md, "Splits beyond the batch").

A split op runs on every device of its split config over the whole batch (or micro-batch), each device
on its part of the op's split dimension: ``Compute.local`` gives the kernel its local size arguments and
transform (``heterog.graph.shard_exec``). The compiler's ``OpPlacements.op_option`` says which of the
op's options (``OpGraph.splits``) runs, and ``splits`` its devices and split weights; each device's
integer share of the option's extent is ``split_shares_of(extent, weights)``.

Values (placements: ``heterog.placement``, parsed once from the graph's options into ``SplitOp``):
  - a split op's output, or the view of it another op reads, is held per device as its option says:
    a shard (``Shard``), a partial sum (``Partial``) or the whole value (``Replicate``); parameters, buffers
    and optimizer state of a split op are held as the shard of their option from the start
    (``RankProgram.persist_parts``), graph inputs whole;
  - a split consumer whose producer runs over the same devices (and groups, and samples) reads its input as
    ``heterog.placement.conversion`` says: LOCAL where it is, SLICE its part of a whole copy held here, PAD
    its shard in zeros where it needs partial sums (``Derive``), REDUCE_SCATTER and ALL_TO_ALL its shard by
    that collective over its group (``heterog.runtime.split_collectives``); ALL_GATHER and ALL_REDUCE are
    lowered as the value made whole (``whole``: all-gather of shards, all-reduce of partial sums) and the
    consumer's part of it taken; a consumer over other devices reads it that way too; a placement needed of
    no tensor (a shape read by a non-shape op) is read whole;
  - an op that is not split reads a split producer's output made whole on its device (and re-laid out
    along the batch as usual); an op that reads only a value's shape reads zeros of it.
A value is made whole on the producer's devices by one collective over them (``collective``): the shards
all-gathered (``AllGather``, uneven shards padded for NCCL), the partial sums all-reduced (``AllReduce``),
issued by every member at one key so that a subgroup's collectives run in the same order on each; a device
outside them receives it from the best-connected one. Shards join in device order and every member sums in
the same order, so the copies of a whole value agree exactly. The final parameters are the holders' parts
put back together (``Lowered.parts``).

Grids (``ParallelConfig.split_grid``): each group of the config runs its samples (``ranges``) as a data-parallel
replica does (batch values at its share, ``heterog.runtime.scaling``), each device of it on its part; values
are made whole inside a group, by a collective over the group's devices, over the group's samples. A
partial result of the step (a non-batch output of a batch op: a weight gradient, the loss) is summed over
the groups before it is read: the devices at the same position of every group all-reduce their parts,
weighted by their groups' shares (``group_sum``). A consumer
whose samples differ from the producer's group (another grid, or no grid) reads the value re-laid out along
the batch first, from every group its samples overlap.

Micro-batches: a split op runs once per micro-batch on each device; its partial results of the whole
step (weight gradients) accumulate on each device over the micro-batches (``held``); a value of the whole
step read by a micro-batch's instance is scaled as ``heterog.runtime.scaling`` says; a split factor that
counts batch rows scales with the micro-batch (``_at``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from heterog.compiler.compile import VALUE_FREE_TARGETS
from heterog.compiler.registries import entry_rows
from heterog.errors import HeterogError
from heterog.graph.shard_exec import combine, part_of
from heterog.graph.sharding import SplitOption, splits_from_json
from heterog.placement import Conversion, Partial, Placement, R, Shard, conversion, parse, same_units, text
from heterog.runtime.instructions import (
    END,
    AllGather,
    AllReduce,
    Combine,
    Compute,
    Derive,
    Env,
    Input,
    Instruction,
    Local,
    Lowered,
    Part,
    Recv,
    Source,
    Stash,
    Zeros,
    env_name,
)
from heterog.runtime.kernel import Kernel
from heterog.runtime.layout import in_memory_order
from heterog.runtime.rng import block_batches
from heterog.runtime.split_collectives import rescatter
from heterog.shares import split_shares_of

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.compiler import CompiledPlan
    from heterog.cost import CostModel
    from heterog.graph.opgraph import OpGraph
    from heterog.runtime.instructions import RankProgram
    from heterog.runtime.scaling import Exponents
    from heterog.runtime.stepprog import LeafInfo, Read, StepProgram

Key = tuple[str, int | None]


@dataclass(frozen=True)
class SplitOp:
    """One split op as the runtime runs it: its devices, its option (None: whole on every device) and
    each device's integer share of the option's extent (empty when nothing is divided in units)."""

    devices: tuple[int, ...]
    option: SplitOption | None
    shares: tuple[int, ...]
    inputs: dict[Key, Placement | None]
    exits: dict[Key, Placement]
    outputs: tuple[Placement | None, ...]
    groups: tuple[tuple[int, ...], ...] = ()

    def group(self, dev: int) -> tuple[int, ...]:
        """The devices of ``dev``'s group (a grid's row of the batch; all the devices of a 1-D split)."""
        return next((g for g in self.groups if dev in g), self.groups[0] if self.groups else self.devices)

    def rank(self, dev: int) -> int:
        """``dev``'s position in its group: which part of a split dimension it holds."""
        return self.group(dev).index(dev)

    @property
    def grid(self) -> bool:
        return len(self.groups) > 1

    @property
    def extent(self) -> int | None:
        return self.option.extent if self.option is not None else None

    def need(self, r: Read) -> Placement:
        """The placement the op needs of what ``r`` reads (no tensor, nothing but its shape: reads it whole)."""
        p = self.inputs.get((r.node, r.tuple_index), self.inputs.get((r.node, None), R))
        return R if p is None else p

    def holds(self, node: str, index: int | None) -> Placement:
        return self.exits.get((node, index), self.exits.get((node, None), R))

    def output(self, k: int) -> Placement | None:
        return self.outputs[k] if k < len(self.outputs) else R

    def part(self, placement: Placement | None, rank: int) -> Part | None:
        """Device ``rank``'s part of a value under ``placement`` (None: the whole of it)."""
        return None if placement is None or placement == R else Part(str(placement), self.extent, self.shares, rank)

    def local(self, rank: int) -> Local | None:
        o = self.option
        if o is None or (not o.size_args and o.transform is None):
            return None
        share, offset = (self.shares[rank], sum(self.shares[:rank])) if o.extent is not None else (1, 0)
        return Local(tuple((a.node, a.arg, a.index) for a in o.size_args), o.transform, o.transform_node, share,
                     offset, o.extent)

    def same_units(self, other: SplitOp) -> bool:
        return (self.devices, self.groups) == (other.devices, other.groups) and same_units(
            self.extent, other.extent, self.shares, other.shares)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> float:
    return float(math.prod(shape) * dtype.itemsize)


def _at(p: Placement | None, whole: tuple[int, ...], local: tuple[int, ...]) -> Placement | None:
    """``placement`` (of a value of shape ``whole`` at the graph's batch) for the value's shape ``local`` at
    a micro-batch: a split factor counts the outer rows of its dimension (batch rows among them, e.g. heads
    inside ``batch * heads``), so it scales with that dimension's size."""
    if not isinstance(p, Shard) or p.sf == 1 or whole[p.dim] == local[p.dim]:
        return p
    if (p.sf * local[p.dim]) % whole[p.dim]:
        raise HeterogError(f"placement {p} of a dimension of {whole[p.dim]} does not carry over to "
                           f"{local[p.dim]} (a micro-batch): its units are not independent of the batch")
    return Shard(p.dim, p.sf * local[p.dim] // whole[p.dim])


def part_shape(shape: tuple[int, ...], placement: Placement | str | None, extent: int | None,
               shares: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The shape of device ``rank``'s part of a value of ``shape`` (``heterog.graph.shard_exec.shard_of``)."""
    p = parse(placement) if isinstance(placement, str) else placement
    if not isinstance(p, Shard):
        return shape
    assert extent is not None
    out = list(shape)
    out[p.dim] = p.sf * (shape[p.dim] // p.sf // extent * shares[rank])
    return tuple(out)


def held_part(value: torch.Tensor, part: Part | None) -> torch.Tensor:
    """A device's part of a placeholder's whole initial value (``RankProgram.persist_parts``)."""
    return value if part is None else part_of(value, part.placement, part.extent, part.shares, part.rank)


def whole_values(lowered: Lowered, per_rank: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The final placeholder values from what each rank reports (rank order): one holder's copy, or the
    parts of a value held divided put back together (``Lowered.parts``)."""
    out: dict[str, torch.Tensor] = {}
    for values in per_rank:
        for ph, v in values.items():
            if ph not in lowered.parts:
                out.setdefault(ph, v)
    for ph, (placement, devs) in lowered.parts.items():
        if all(ph in per_rank[d] for d in devs):
            out[ph] = combine([per_rank[d][ph] for d in devs], placement)
    return out


class Builder(Protocol):
    """What the split lowering uses of the plan's lowering (``heterog.runtime.lowering``)."""

    prog: StepProgram
    graph: OpGraph
    cluster: Cluster
    plan: CompiledPlan
    exps: Exponents
    op_layout: np.ndarray
    ranks: list[RankProgram]
    memo: dict[Any, Any]
    deps: dict[int, list[list]]
    nominal: CostModel
    emulate: bool
    B: int

    def leaf(self, leaf: tuple[int, int]) -> LeafInfo: ...
    def subgroup(self, devices: tuple[int, ...]) -> int: ...
    def producer_source(self, leaf: LeafInfo, dev: int, micro: int = 0) -> Source: ...
    def inst_key(self, op: int, dev: int, micro: int = 0, recompute: bool = False) -> tuple: ...
    def emit(self, rank: int, key: tuple, instr: Instruction) -> list: ...
    def pull(self, item: list, key: tuple) -> None: ...
    def export(self, op: int, dev: int, micro: int, name: str, recomputed: bool = False) -> None: ...
    def send(self, src_dev: int, dst_dev: int, key: tuple, source: Source, slice_: Any, scale: float,
             shape: tuple, dtype: torch.dtype) -> int: ...
    def device_sums(self, leaf_id: tuple[int, int]) -> list[tuple[int, Source, float, tuple]]: ...
    def read_source(self, op: int, r: Read, dev: int, micro: int, b: int, key: tuple, recompute: bool = False
                    ) -> tuple[Source, tuple[str, ...], float]: ...


class SplitLowering:
    """The split ops of one plan, lowered into the builder's rank programs (module docstring)."""

    def __init__(self, b: Builder) -> None:
        self.b = b
        self.ops: dict[int, SplitOp] = {}
        placed, graph, prog = b.plan.placements, b.graph, b.prog
        if placed.op_split is None or not np.any(placed.op_split >= 0):
            self.layouts: set[int] = set()
            return
        if graph.splits is None or placed.op_option is None:
            raise HeterogError(f"graph {graph.name!r} carries no split options; it cannot run a split plan")
        splits = splits_from_json(graph.splits)
        for o in np.nonzero(placed.op_split >= 0)[0].tolist():
            config = placed.splits[int(placed.op_split[o])]
            devs, weights, groups = config.devices, config.weights, config.groups
            weights = weights[:len(groups[0])]            # a grid's groups divide alike
            k = int(placed.op_option[o])
            opt = splits[o].options[k] if k >= 0 else None
            whole = opt is None or prog.op_kind[o] == "input"      # graph inputs are held whole everywhere
            shares = tuple(split_shares_of(opt.extent, weights)) if opt is not None and opt.extent is not None \
                else ()
            s = splits[o]

            def typed(texts: Sequence[str], whole: bool = whole) -> list[Placement | None]:
                return [R if whole else parse(t) for t in texts]

            self.ops[o] = SplitOp(
                tuple(int(d) for d in devs), opt, shares,
                dict(zip(((r.node, r.index) for r in s.inputs), typed(opt.inputs))) if opt else {},
                {(r.node, r.index): p or R for r, p in zip(s.exits, typed(opt.exits))} if opt else {},
                tuple(typed(opt.outputs)) if opt else (),
                tuple(tuple(int(d) for d in g) for g in groups))
        self.layouts = {int(placed.op_layout[o]) for o in self.ops}
        self.lay_groups = {int(placed.op_layout[o]): so.groups for o, so in self.ops.items()}

    def __contains__(self, op: int) -> bool:
        return op in self.ops

    def ranges(self, lay: int) -> list[tuple[int, int, int, int]]:
        """(device, first sample, end sample, micro-batch) of each entry of a split op's layout: every
        device of a group over the group's samples of each micro-batch (one group: all of them)."""
        layout = self.b.plan.placements.layouts[lay]
        devs, shares, micro = layout.devices, layout.shares, layout.micro
        rows = entry_rows(devs, shares, micro, self.lay_groups[lay])
        size: dict[int, int] = {}
        for (_, hi), m in zip(rows, micro):
            size[int(m)] = max(size.get(int(m), 0), hi)
        start, lo = {}, 0
        for m in sorted(size):
            start[m] = lo
            lo += size[m]
        return [(int(d), start[int(m)] + r0, start[int(m)] + r1, int(m)) for d, (r0, r1), m in zip(devs, rows, micro)]

    def holders(self, op: int) -> tuple[int, ...]:
        """The devices whose parts of split op ``op``'s placeholder put it together (one group of a grid)."""
        so = self.ops[op]
        return so.groups[0] if so.grid else so.devices

    # ------------------------------------------------------------------ values
    @staticmethod
    def whole_key(leaf_id: tuple[int, int], dev: int, micro: int, group: tuple[int, ...] | None = None) -> tuple:
        """The memo key of ``whole``'s result (``group``: another group's samples than ``dev``'s own)."""
        return ("whole", leaf_id, dev, micro) if group is None else ("whole", leaf_id, dev, micro, group)

    def whole(self, leaf_id: tuple[int, int], dev: int, micro: int, key: tuple, of: int | None = None) -> Source:
        """A split op's output put together whole on ``dev`` (its own copy where it holds it whole), over the
        samples of the group of device ``of`` (default: ``dev``'s group, or the only one): by one collective
        over the group's devices (``collective``) where ``dev`` is one of them, else received from the
        best-connected of them."""
        b = self.b
        u = leaf_id[0]
        su, leaf = self.ops[u], b.leaf(leaf_id)
        if leaf.node in b.prog.consts:
            return b.producer_source(leaf, dev, micro)
        micro = 0 if self.accumulated(leaf_id) else micro
        group = su.group(dev if of is None else of)
        other = group if (su.grid and dev not in group) else None
        p = su.output(leaf.k)
        if p == R and dev in group:
            return self.held(leaf_id, dev, micro)[0]
        memo_key = self.whole_key(leaf_id, dev, micro, other)
        if p != R:
            stash_key, after = self.collective(leaf_id, micro, group)
        item = b.memo.get(memo_key)
        if item is None:            # outside the group: a copy from its best-connected device
            h = b.cluster.best_source(group, dev)
            src, after = self.held(leaf_id, h, micro) if p == R else (Stash(stash_key), after)
            shape = leaf.local_shape(self.samples(u, micro, group[0])) if leaf.batch_dim is not None else leaf.shape
            msg = b.send(h, dev, after, src, None, 1.0, shape, leaf.dtype)
            stash = ("w", leaf.read_node, micro) if other is None else ("w", leaf.read_node, micro, other)
            item = b.emit(dev, key + (-1,), Combine(stash, (Recv(msg),), str(R), leaf.memory_order))
            b.memo[memo_key] = item
        b.pull(item, key + (-1,))
        return Stash(item[2].key)

    def collective(self, leaf_id: tuple[int, int], micro: int, group: tuple[int, ...]) -> tuple[tuple, tuple]:
        """A split op's output of shards or partial sums made whole on every device of ``group`` (of the op's
        config) by one collective over them (once per value: ``AllGather`` of the shards, ``AllReduce`` of the
        partial sums), issued by every member at one key, after its last member holds its part (so every
        member issues the collectives of a subgroup in the same order, as the gradient AllReduce). Returns the
        result's stash key and the key after the collective."""
        b = self.b
        memo_key = ("collective", leaf_id, micro, group)
        got = b.memo.get(memo_key)
        if got is not None:
            return got
        u = leaf_id[0]
        su, leaf = self.ops[u], b.leaf(leaf_id)
        shape = leaf.local_shape(self.samples(u, micro, group[0])) if leaf.batch_dim is not None else leaf.shape
        p = _at(su.output(leaf.k), leaf.shape, shape)
        held = [self.held(leaf_id, h, micro) for h in group]
        at = max(after for _, after in held)
        g = b.subgroup(group)
        stash_key = ("w", leaf.read_node, micro)
        instrs: list[Instruction]

        def nbytes(shape: tuple[int, ...]) -> float:
            return _nbytes(shape, leaf.dtype)

        if isinstance(p, Partial):
            emu = float(b.nominal.allreduce_times(group, np.array([nbytes(shape)]))[0][0]) if b.emulate else 0.0
            instrs = [AllReduce(stash_key, g, src, 1.0, emu, leaf.memory_order) for src, _ in held]
        else:
            shapes = [part_shape(shape, p, su.extent, su.shares, i) for i in range(len(group))]
            emu = float(b.nominal.sharded_ring_times(group, np.array([[nbytes(s) for s in shapes]]))[0]) \
                if b.emulate else 0.0
            parts = tuple(zip(group, shapes))
            instrs = [AllGather(stash_key, g, src, text(p), parts, emu, leaf.memory_order) for src, _ in held]
        items = [b.emit(h, at, ins) for h, ins in zip(group, instrs)]
        for h, item in zip(group, items):
            b.memo[("whole", leaf_id, h, micro)] = item
            b.deps[id(item)] = [other for other in items if other is not item]    # moved together (``pull``)
        got = b.memo[memo_key] = (stash_key, at + (1,))
        return got

    def rows(self, op: int, dev: int, micro: int) -> tuple[int, int] | None:
        """The samples (first, end) split op ``op`` runs on ``dev`` for micro-batch ``micro`` (None: none)."""
        return next(((lo, hi) for d, lo, hi, m in self.ranges(int(self.b.op_layout[op])) if d == dev and m == micro),
                    None)

    def samples(self, op: int, micro: int, dev: int | None = None) -> int:
        """Samples of micro-batch ``micro`` that split op ``op`` runs on ``dev`` (default: its first device)."""
        return next(hi - lo for d, lo, hi, m in self.ranges(int(self.b.op_layout[op]))
                    if m == micro and (dev is None or d == dev))

    def over_groups(self, leaf_id: tuple[int, int]) -> bool:
        """A grid's partial result (a non-batch output of a batch op, not a statistic of each group's samples):
        summed over its groups before it is read."""
        b = self.b
        u = leaf_id[0]
        return (self.ops[u].grid and b.prog.op_has_batch[u] and b.leaf(leaf_id).batch_dim is None
                and leaf_id not in b.exps.statistics)

    def accumulated(self, leaf_id: tuple[int, int]) -> bool:
        """A split op's partial result summed over several micro-batches or a grid's groups: a non-batch
        output of a batch op (a weight gradient, not a statistic of each micro-batch's samples)."""
        b = self.b
        return self.over_groups(leaf_id) or (
            b.plan.n_micro > 1 and b.prog.op_has_batch[leaf_id[0]] and b.leaf(leaf_id).batch_dim is None
            and leaf_id not in b.exps.statistics)

    def held(self, leaf_id: tuple[int, int], dev: int, micro: int) -> tuple[Source, tuple]:
        """A split op's value of a leaf on ``dev`` (for micro-batch ``micro``; summed over them, and over a
        grid's groups, where ``accumulated``) and the key after which it exists."""
        b = self.b
        if self.over_groups(leaf_id):
            return self.group_sum(leaf_id, dev)
        if self.accumulated(leaf_id):
            for d, src, w, after in b.device_sums(leaf_id):
                if d == dev:
                    assert w == 1.0, "a partial result of several micro-batches is accumulated with their weights"
                    return src, after
        return b.producer_source(b.leaf(leaf_id), dev, micro), b.inst_key(leaf_id[0], dev, micro) + (1,)

    def held_after(self, leaf_id: tuple[int, int], dev: int, micro: int) -> tuple:
        """The key after which ``held``'s value exists on ``dev``, without asking for the value itself (which
        keeps a producer's output for a reader: an output no instruction reads would be held to the step's
        end)."""
        if self.over_groups(leaf_id) or self.accumulated(leaf_id):
            return self.held(leaf_id, dev, micro)[1]
        return self.b.inst_key(leaf_id[0], dev, micro) + (1,)

    def group_sum(self, leaf_id: tuple[int, int], dev: int) -> tuple[Source, tuple]:
        """A grid's partial result on ``dev`` summed over the groups, each group's weighted by its share as
        data-parallel replicas' are (``heterog.runtime.scaling``): one ``AllReduce`` over the devices at
        ``dev``'s position in every group, of their parts (shards, whole copies or partial sums, which stay
        what they were in the group), issued by each at one key as ``collective``'s are."""
        b = self.b
        memo_key = ("group-sum", leaf_id, dev)
        got = b.memo.get(memo_key)
        if got is None:
            su, leaf = self.ops[leaf_id[0]], b.leaf(leaf_id)
            members = tuple(g[su.rank(dev)] for g in su.groups)
            sums = {d: (src, w, after) for d, src, w, after in b.device_sums(leaf_id)}
            at = max(sums[d][2] for d in members)             # once every part exists
            g = b.subgroup(members)
            shape = part_shape(leaf.shape, su.output(leaf.k), su.extent, su.shares, su.rank(dev))
            emu = float(b.nominal.allreduce_times(members, np.array([_nbytes(shape, leaf.dtype)])
                                                  )[0][0]) if b.emulate else 0.0
            stash = ("gs", leaf.node)
            items = [b.emit(d, at, AllReduce(stash, g, sums[d][0], sums[d][1], emu, leaf.memory_order))
                     for d in members]
            for d, item in zip(members, items):
                b.memo[("group-sum", leaf_id, d)] = (Stash(stash), at + (1,), item)
                b.deps[id(item)] = [other for other in items if other is not item]
            got = b.memo[memo_key]
        b.pull(got[2], got[1])
        return got[0], got[1]

    def shape_of(self, r: Read, batch: int) -> tuple[int, ...]:
        """The shape of what ``r`` reads at ``batch`` samples (its leaf's view chain run on the meta device)."""
        b = self.b
        leaf = b.leaf(r.leaf)
        base = leaf.local_shape(batch) if leaf.batch_dim is not None else leaf.shape
        if not r.chain:
            return base
        memo_key = ("shape", r.node, r.leaf, batch)
        got = b.memo.get(memo_key)
        if got is None:
            env = {leaf.read_node: in_memory_order(torch.empty(base, dtype=leaf.dtype, device="meta"),
                                                   leaf.memory_order)}
            Kernel([b.prog.view_calls[c] for c in r.chain])(env, b.prog.sizes_at(batch))
            got = b.memo[memo_key] = tuple(env[r.chain[-1]].shape)
        return got

    def part_at(self, part: Part | None, r: Read, batch: int) -> Part | None:
        """``part`` of what ``r`` reads at ``batch`` samples: a split factor that counts batch rows scaled
        (``_at``)."""
        if part is None or batch == self.b.B or ":" not in part.placement:
            return part
        at = _at(parse(part.placement), self.shape_of(r, self.b.B), self.shape_of(r, batch))
        return replace(part, placement=text(at))

    def derive(self, dev: int, key: tuple, source: Source, leaf: str, chain: tuple[str, ...], batch: int,
               local: Local | None, part: Part | None, scale: float, name: str, micro: int,
               after: list | None, pad: Part | None = None, index: int | None = None) -> Stash:
        """``Derive`` on ``dev`` before ``key`` (one per value, part and rank: shared by its readers; a dense part
        or a padded copy: one per reader, made before it and freed after it, so that a device holds its part of
        a value it holds whole only while an instance reads it, as the simulator counts it: the whole value to
        its last reader, no copy beside it); ``after``: the instruction that makes ``source`` here, if any."""
        b = self.b
        reader = key if part is not None or pad is not None else None
        stash_key = ("d", name, micro, part, local is not None, pad, scale, source, reader)
        memo_key = ("derive", dev, stash_key)
        item = b.memo.get(memo_key)
        if item is None:
            item = b.emit(dev, key + (-1,), Derive(stash_key, source, scale, leaf, chain, batch, local, part, pad,
                                                   index))
            b.memo[memo_key] = item
            if after is not None:
                b.deps.setdefault(id(item), []).append(after)
        b.pull(item, key + (-1,))
        return Stash(stash_key)

    def _local(self, u: int, r: Read, dev: int, micro: int, batch: int, part: Part | None, key: tuple,
               scale: float, pad: Part | None = None) -> Input:
        """What split op ``u`` holds of ``r``'s node on ``dev`` (its part of it: ``part``; put in zeros of
        the whole shape: ``pad``)."""
        b = self.b
        su, leaf = self.ops[u], b.leaf(r.leaf)
        part, pad = self.part_at(part, r, batch), self.part_at(pad, r, batch)
        if b.prog.op_kind[u] == "compute" and not self.accumulated(r.leaf):
            node = r.held_node(leaf)
            b.export(u, dev, micro, node)
            if part is None and pad is None:
                return Input(r.node, Env(env_name(node, micro)), node, (), scale, r.tuple_index)
            return Input(r.node, self.derive(dev, key, Env(env_name(node, micro)), node, (), batch, None, part, scale,
                                             r.node, micro, None, pad), None, (), 1.0, r.tuple_index)
        src = self.held(r.leaf, dev, micro)[0]    # a placeholder's or a partial result's: its view chain runs here
        local = su.local(su.rank(dev))
        if part is None and pad is None and (local is None or not r.chain):
            return Input(r.node, src, leaf.node, r.chain, scale, r.tuple_index)
        if pad is not None and r.chain:                    # padded where the consumer reads it, after the views
            src = self.derive(dev, key, src, leaf.read_node, r.chain, batch, local, None, scale, r.node, micro, None)
            return Input(r.node, self.derive(dev, key, src, r.node, (), batch, None, None, 1.0, r.node + ":pad", micro,
                                             None, pad), None, (), 1.0, r.tuple_index)
        return Input(r.node, self.derive(dev, key, src, leaf.read_node, r.chain, batch, local, part, scale, r.node,
                                         micro, None, pad), None, (), 1.0, r.tuple_index)

    # ------------------------------------------------------------------ ops
    def read(self, op: int, r: Read, dev: int, micro: int, batch: int, key: tuple) -> Input:
        """What split op ``op``'s instance on ``dev`` reads for ``r`` (module docstring)."""
        b = self.b
        so = self.ops[op]
        rank = so.rank(dev)
        need = so.need(r)
        u = r.leaf[0]
        mu = micro if b.prog.op_has_batch[u] else 0
        su = self.ops.get(u)
        leaf = b.leaf(r.leaf)
        if b.prog.op_target[op] in VALUE_FREE_TARGETS:      # a shape read: zeros of the whole value, its part
            batch_u = self.samples(u, mu) if su is not None and not (
                (su.grid or so.grid) and b.prog.op_has_batch[op]) else batch    # a grid: this instance's samples
            zeros = Zeros(leaf.local_shape(batch_u), leaf.dtype, leaf.memory_order)
            return Input(r.node, self.derive(dev, key, zeros, leaf.read_node, r.chain, batch, None,
                                             self.part_at(so.part(need, rank), r, batch), 1.0, r.node + ":shape", micro,
                                             None), None, (), 1.0,
                         r.tuple_index)
        scale = 1.0        # a whole-step value read by a micro-batch's instance (``heterog.runtime.scaling``)
        if leaf.batch_dim is None and b.prog.op_has_batch[op] and batch != b.B and r.leaf not in b.exps.statistics:
            scale = float((batch / b.B) ** b.exps[r.leaf])
        same_rows = su is None or leaf.batch_dim is None or not (su.grid or so.grid) \
            or self.rows(u, dev, mu) == self.rows(op, dev, micro)
        if su is not None and su.devices == so.devices and su.groups == so.groups and same_rows:
            have = su.holds(r.node, r.tuple_index)
            c = conversion(have, need, su.same_units(so))
            if c == Conversion.LOCAL:
                return self._local(u, r, dev, mu, batch, None, key, scale)
            if c == Conversion.SLICE:
                return self._local(u, r, dev, mu, batch, so.part(need, rank), key, scale)
            if c == Conversion.PAD:                     # a shard is a partial sum: zeros elsewhere
                return self._local(u, r, dev, mu, batch, None, key, scale, pad=su.part(have, rank))
            if c in (Conversion.REDUCE_SCATTER, Conversion.ALL_TO_ALL):     # a shard from partial sums or shards
                return rescatter(self, op, r, dev, micro, batch, scale)
        # another collective (or another config's value): made whole, then this device's part of it taken
        part = self.part_at(so.part(need, rank), r, batch)
        whole = su is not None and same_rows
        if whole:                       # put together here (a grid's batch value: if this group's samples)
            src, chain = self.whole(r.leaf, dev, mu, key), r.chain
        else:                           # re-laid out along the batch first
            src, chain, scale = b.read_source(op, r, dev, micro, batch, key)
        if part is None:
            return Input(r.node, src, leaf.node, chain, scale, r.tuple_index)
        after = b.memo.get(("whole", r.leaf, dev, 0 if self.accumulated(r.leaf) else mu)) if whole else None
        return Input(r.node, self.derive(dev, key, src, leaf.read_node, chain, batch, None, part, scale, r.node, micro,
                                         after, index=r.tuple_index), None, (), 1.0, r.tuple_index)

    def compute(self, op: int, dev: int, first: int, end: int, micro: int) -> None:
        """Split op ``op``'s instance on ``dev`` over samples ``first .. end`` (micro-batch ``micro``)."""
        b = self.b
        so = self.ops[op]
        batch = end - first
        key = b.inst_key(op, dev, micro)
        inputs = tuple(self.read(op, r, dev, micro, batch, key) for r in b.prog.reads[op])
        b.ranks[dev].batches.add(batch)
        if b.prog.op_draws(op):
            b.ranks[dev].batches.update(block_batches(b.B))
        b.emit(dev, key + (0,), Compute(op, batch, inputs, (), first, micro, False, so.local(so.rank(dev))))

    def held_part(self, op: int, dev: int) -> Part | None:
        """The part of a placeholder of split op ``op`` that ``dev`` holds (None: all of it)."""
        so = self.ops.get(op)
        return so.part(so.output(0), so.rank(dev)) if so is not None else None

    def update(self, ph: str, out: str, leaf_id: tuple[int, int], dev: int, whole: Source) -> Source:
        """The next value of placeholder ``ph`` on ``dev`` from step output ``out`` (leaf ``leaf_id``):
        ``whole`` is its whole value here when the producer is not divided."""
        b = self.b
        ph_op, u = b.prog.node_op[ph], leaf_id[0]
        part = self.held_part(ph_op, dev)
        su = self.ops.get(u)
        if su is not None:
            sp = self.ops.get(ph_op)
            have = su.output(leaf_id[1])
            want = parse(part.placement) if part is not None else R
            if dev in su.devices and conversion(have, want, sp is not None and su.same_units(sp)) == Conversion.LOCAL:
                return b.producer_source(b.leaf(leaf_id), dev, 0)
            whole = self.whole(leaf_id, dev, 0, END)
        if part is None:
            return whole
        after = b.memo.get(("whole", leaf_id, dev, 0)) if su is not None else None
        return self.derive(dev, END, whole, out, (), b.B, None, part, 1.0, out, 0, after)
