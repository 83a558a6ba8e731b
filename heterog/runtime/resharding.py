"""The pieces that reduce-scatter and all-to-all move between the members of a collective (uneven shards,
split factors included), put back together exactly, and packed into the flat buffers of NCCL's collectives.

A member's shard under ``Sharding(placement, extent, shares)`` at part index i is
``heterog.graph.shard_exec.shard_of(value, placement, extent, shares, i)``: along the divided dimension it
holds a set of positions of the whole value (``positions``); all-to-all sends each member the positions
it needs of those this member holds.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from heterog.graph.shard_exec import shard_of
from heterog.placement import Shard, parse
from heterog.runtime.layout import in_memory_order


class Sharding(NamedTuple):
    """A value divided over the members of a collective in part order: ``placement`` ``"S<d>[:<f>]"``, its
    dimension's ``extent`` units shared ``shares`` (one per member)."""

    placement: str
    extent: int
    shares: tuple[int, ...]

    @property
    def shard(self) -> Shard:
        p = parse(self.placement)
        if not isinstance(p, Shard):
            raise ValueError(f"a collective's shards need a divided placement, got {self.placement!r}")
        return p

    def shape(self, whole: Sequence[int], i: int) -> tuple[int, ...]:
        """The shape of part ``i`` of a value of shape ``whole``."""
        p = self.shard
        out = list(whole)
        out[p.dim] = p.sf * (whole[p.dim] // p.sf // self.extent * self.shares[i])
        return tuple(out)


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dims from outermost to innermost in memory (``heterog.graph.shard_exec.dense_like``'s order)."""
    strides = t.stride()
    return tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], -d)))


def positions(sh: Sharding, i: int, dim: int, size: int) -> np.ndarray | None:
    """The positions of dimension ``dim`` (of ``size``) of the whole value that part ``i`` holds, in its
    order (None: all of them, ``dim`` is not divided)."""
    p = sh.shard
    if p.dim != dim:
        return None
    block = size // p.sf
    unit = block // sh.extent
    lo, hi = sum(sh.shares[:i]) * unit, sum(sh.shares[:i + 1]) * unit
    return (np.arange(p.sf)[:, None] * block + np.arange(lo, hi)[None, :]).reshape(-1)


def _overlap(shape: Sequence[int], have: Sharding, need: Sharding, src: int, dst: int
             ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per divided dimension, the indices in part ``src`` of ``have`` and in part ``dst`` of ``need`` of the
    positions both hold."""
    out = []
    for d in sorted({have.shard.dim, need.shard.dim}):
        a, b = positions(have, src, d, shape[d]), positions(need, dst, d, shape[d])
        common = np.intersect1d(a, b) if a is not None and b is not None else a if b is None else b
        assert common is not None                   # ``d`` is divided by one of them
        at_a = common if a is None else np.searchsorted(a, common)
        at_b = common if b is None else np.searchsorted(b, common)
        out.append((d, torch.from_numpy(at_a.astype(np.int64)), torch.from_numpy(at_b.astype(np.int64))))
    return out


def a2a_piece(t: torch.Tensor, shape: Sequence[int], have: Sharding, need: Sharding, src: int, dst: int
              ) -> torch.Tensor:
    """What part ``src`` (``t``, of ``have``) sends to part ``dst`` of ``need``: the entries of the whole
    value of ``shape`` both hold, a contiguous copy."""
    for d, at_src, _ in _overlap(shape, have, need, src, dst):
        t = t.index_select(d, at_src.to(t.device))
    return t.contiguous()


def a2a_piece_shape(shape: Sequence[int], have: Sharding, need: Sharding, src: int, dst: int) -> tuple[int, ...]:
    out = list(have.shape(shape, src))
    for d, at_src, _ in _overlap(shape, have, need, src, dst):
        out[d] = len(at_src)
    return tuple(out)


def a2a_assemble(pieces: Sequence[torch.Tensor], shape: Sequence[int], have: Sharding, need: Sharding, dst: int,
                 order: Sequence[int] | None) -> torch.Tensor:
    """Part ``dst`` of ``need`` from the pieces every part of ``have`` sent it (part order), in memory
    ``order``."""
    out = pieces[0].new_empty(need.shape(shape, dst))
    for src, piece in enumerate(pieces):
        ov = _overlap(shape, have, need, src, dst)
        dims = [d for d, _, _ in ov]
        index = [at.to(out.device) for _, _, at in ov]
        if len(index) == 2:
            index = [index[0][:, None], index[1][None, :]]
        front = list(range(len(dims)))
        out.movedim(dims, front)[tuple(index)] = piece.movedim(dims, front)
    return in_memory_order(out, order)


def rs_pieces(t: torch.Tensor, need: Sharding) -> list[torch.Tensor]:
    """A partial sum ``t`` of the whole value cut into the parts of ``need`` (views), in part order."""
    return [shard_of(t, need.placement, need.extent, need.shares, i) for i in range(len(need.shares))]


def sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` in that order (the same bits wherever the same parts are summed)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


# ---------------------------------------------------------------------------- NCCL's flat buffers
def pack_padded(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The pieces flattened (row-major), each padded with zeros to the largest, one after the other: the input
    of ``dist.reduce_scatter_single`` (``unpack_padded`` of its output trims the result).

    Shapes:
        pieces: any shapes; returns ``(len(pieces) * max numel,)``.
    """
    n = max((p.numel() for p in pieces), default=0)
    flat = pieces[0].new_zeros(len(pieces) * n)
    for i, p in enumerate(pieces):
        flat[i * n:i * n + p.numel()] = p.reshape(-1)
    return flat


def unpack_padded(buf: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """The pieces of a buffer of equal padded slots (``pack_padded``; an all-gather's output), each trimmed
    to its shape (views).

    Shapes:
        buf: ``(len(shapes) * slot,)``; returns ``shapes[i]`` each.
    """
    slot = buf.numel() // max(len(shapes), 1)
    return [buf[i * slot:i * slot + math.prod(s)].view(s) for i, s in enumerate(shapes)]


def pack_split(pieces: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The pieces flattened one after the other, and their sizes: the input of ``dist.all_to_all_single``
    with uneven splits."""
    return torch.cat([p.reshape(-1) for p in pieces]), [p.numel() for p in pieces]


def unpack_split(buf: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """The pieces of an ``all_to_all_single`` output of uneven splits, shaped (views)."""
    out, at = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(buf[at:at + n].view(s))
        at += n
    return out
