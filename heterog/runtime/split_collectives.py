"""Shards read from shards: a divided op that needs its shard of a value that the same devices (same groups,
same samples) hold as partial sums reads it by one reduce-scatter, and of a value held in other shards
(another dimension, other units) by one all-to-all (docs/design.md, "Splits beyond the batch").

The collective runs over the consumer's group once per value, placement and micro-batch, issued by every
member at one key after the last member holds its part, as ``SplitLowering.collective``'s are; each member
contributes its part of what the reader reads (the producer's view chain run on its part, scaled where a
micro-batch reads a whole-step value) and gets its shard laid out in memory as a shard cut from the whole
value would be.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from heterog.runtime.instructions import (
    AllToAll,
    Env,
    Input,
    Instruction,
    Local,
    Part,
    ReduceScatter,
    Source,
    Stash,
    env_name,
)
from heterog.runtime.kernel import Kernel
from heterog.runtime.layout import in_memory_order
from heterog.runtime.resharding import Sharding, memory_order

if TYPE_CHECKING:  # pragma: no cover
    from heterog.runtime.stepprog import Read


class SplitHost(Protocol):
    """What the reads of shards use of ``heterog.runtime.split_lowering.SplitLowering`` (its builder and
    divided ops, typed there, are read as it reads them)."""

    @property
    def b(self) -> Any: ...

    @property
    def ops(self) -> Mapping[int, Any]: ...

    def accumulated(self, leaf_id: tuple[int, int]) -> bool: ...
    def part_at(self, part: Part | None, r: Read, batch: int) -> Part | None: ...
    def held(self, leaf_id: tuple[int, int], dev: int, micro: int) -> tuple[Source, tuple]: ...
    def held_after(self, leaf_id: tuple[int, int], dev: int, micro: int) -> tuple: ...
    def shape_of(self, r: Read, batch: int) -> tuple[int, ...]: ...
    def derive(self, dev: int, key: tuple, source: Source, leaf: str, chain: tuple[str, ...], batch: int,
               local: Local | None, part: Part | None, scale: float, name: str, micro: int, after: list | None,
               pad: Part | None = None, index: int | None = None) -> Stash: ...


def rescatter(sl: SplitHost, op: int, r: Read, dev: int, micro: int, batch: int, scale: float) -> Input:
    """What divided op ``op``'s instance on ``dev`` (micro-batch ``micro``, ``batch`` samples) reads for ``r``:
    its shard of the value, by a ``ReduceScatter`` of the producer's partial sums or an ``AllToAll`` of its
    shards over ``dev``'s group (module docstring)."""
    b = sl.b
    so, u = sl.ops[op], r.leaf[0]
    su = sl.ops[u]
    mu = 0 if sl.accumulated(r.leaf) else micro if b.prog.op_has_batch[u] else 0
    group = so.group(dev)
    need = sl.part_at(so.part(so.need(r), 0), r, batch)
    assert need is not None and so.extent is not None
    stash_key = ("c", r.node, r.tuple_index, mu, need.placement, so.extent, so.shares, scale)

    def memo(h: int) -> tuple:
        return ("rescatter", r.leaf, h, batch) + stash_key

    got = b.memo.get(memo(dev))
    if got is None:
        at = max(sl.held_after(r.leaf, h, mu) for h in group)
        srcs = [_part_here(sl, u, r, h, mu, batch, at, scale) for h in group]
        shape = sl.shape_of(r, batch)
        order = _order_of(sl, r, batch)
        itemsize = b.leaf(r.leaf).dtype.itemsize
        to = Sharding(need.placement, so.extent, so.shares)
        have = sl.part_at(su.part(su.holds(r.node, r.tuple_index), 0), r, batch)
        g = b.subgroup(group)
        instrs: list[Instruction]
        if have is None or have.placement == "P":
            sizes = [float(math.prod(to.shape(shape, i)) * itemsize) for i in range(len(group))]
            emu = float(b.nominal.sharded_ring_times(group, np.array([sizes]))[0]) if b.emulate else 0.0
            instrs = [ReduceScatter(stash_key, g, src, 1.0, group, to, emu, order) for src, _ in srcs]
        else:
            assert su.extent is not None
            fro = Sharding(have.placement, su.extent, su.shares)
            sizes = [float(math.prod(fro.shape(shape, i)) * itemsize) for i in range(len(group))]
            emu = float(b.nominal.alltoall_times(group, np.array([sizes]))[0]) if b.emulate else 0.0
            instrs = [AllToAll(stash_key, g, src, group, shape, fro, to, emu, order) for src, _ in srcs]
        items = [b.emit(h, at + (0,), ins) for h, ins in zip(group, instrs)]     # after the parts (``derive``)
        for h, item, (_, made) in zip(group, items, srcs):
            b.memo[memo(h)] = item
            b.deps[id(item)] = [other for other in items if other is not item] + ([made] if made else [])
        got = b.memo[memo(dev)]
    b.pull(got, b.inst_key(op, dev, micro) + (-1,))
    return Input(r.node, Stash(stash_key), None, (), 1.0, r.tuple_index)


def _order_of(sl: SplitHost, r: Read, batch: int) -> tuple[int, ...]:
    """The memory order of what ``r`` reads, whole at ``batch`` samples (its leaf's view chain run on the
    meta device), that a shard cut from it keeps (``heterog.graph.shard_exec.dense_like``)."""
    b = sl.b
    memo_key = ("order", r.node, r.leaf, batch)
    got: tuple[int, ...] | None = b.memo.get(memo_key)
    if got is None:
        leaf = b.leaf(r.leaf)
        base = leaf.local_shape(batch) if leaf.batch_dim is not None else leaf.shape
        env = {leaf.read_node: in_memory_order(torch.empty(base, dtype=leaf.dtype, device="meta"), leaf.memory_order)}
        if r.chain:
            Kernel([b.prog.view_calls[c] for c in r.chain])(env, b.prog.sizes_at(batch))
        got = b.memo[memo_key] = memory_order(env[r.chain[-1] if r.chain else leaf.read_node])
    return got


def _part_here(sl: SplitHost, u: int, r: Read, h: int, mu: int, batch: int, at: tuple, scale: float
               ) -> tuple[Source, list | None]:
    """What divided op ``u`` holds on ``h`` of ``r``'s node (its part: the view chain run on its part, scaled)
    before key ``at``, and the instruction that derives it there (None: none)."""
    b = sl.b
    su, leaf = sl.ops[u], b.leaf(r.leaf)
    if b.prog.op_kind[u] == "compute" and not sl.accumulated(r.leaf):
        node = r.held_node(leaf)
        b.export(u, h, mu, node)
        src: Source = Env(env_name(node, mu))
        chain: tuple[str, ...] = ()
        local = None
    else:
        src, node = sl.held(r.leaf, h, mu)[0], leaf.read_node
        chain, local = r.chain, su.local(su.rank(h))
    if not chain and scale == 1.0 and r.tuple_index is None:
        return src, None
    got = sl.derive(h, at, src, node, chain, batch, local, None, scale, r.node, mu, None, index=r.tuple_index)
    return got, b.memo[("derive", h, got.key)]
