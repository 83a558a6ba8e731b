"""Reduce-scatter and all-to-all of uneven shards (``heterog.runtime.resharding``, ``Transport``): over gloo
with three ranks (uneven shares, split factors, float32 and float64) every member gets exactly the reference
computed here (partial sums added in member order, shards cut from the whole value); the pieces put back
together exactly for any pair of layouts; NCCL's padded and split flat buffers, run through a model of the
collectives, give the same shards."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.graph.shard_exec import shard_of
from heterog.runtime.layout import in_memory_order
from heterog.runtime.resharding import (
    Sharding,
    a2a_assemble,
    a2a_piece,
    pack_padded,
    pack_split,
    rs_pieces,
    sum_in_order,
    unpack_padded,
    unpack_split,
)

MEMBERS = (0, 1, 2)
ORDER = (2, 0, 1)                   # part order: rank 2 holds the first part
SHAPE = (4, 12, 3)
# dim 1 of 12 in 6 units: shares 3:1:2 without split factor, or 2 blocks of 6, 3 units shared 1:1:1
RS_NEEDS = [Sharding("S1", 6, (3, 1, 2)), Sharding("S1:2", 3, (1, 1, 1)), Sharding("S0", 4, (2, 1, 1))]
A2A = [(Sharding("S0", 4, (2, 1, 1)), Sharding("S1", 6, (3, 1, 2))),       # another dimension
       (Sharding("S1", 6, (3, 1, 2)), Sharding("S1:2", 3, (2, 0, 1))),     # the same one, other units
       (Sharding("S1:2", 3, (1, 1, 1)), Sharding("S1", 4, (1, 2, 1)))]


def _value(seed: int, dtype: torch.dtype, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 10 ** (seed % 3)).to(dtype)    # magnitudes differ: order matters


def _partial(rank: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return _value(100 * rank + k, dtype)


def _rs_want(need: Sharding, k: int, dtype: torch.dtype, me: int) -> torch.Tensor:
    whole = sum_in_order([_partial(m, k, dtype) for m in MEMBERS])
    return shard_of(whole, need.placement, need.extent, need.shares, ORDER.index(me))


class _Job:
    """Runs on every rank of the pool (picklable): every reduce-scatter of ``RS_NEEDS`` and all-to-all of
    ``A2A`` in both dtypes started on one subgroup, then finished in reverse order."""

    def __init__(self, emulate: bool) -> None:
        self.emulate = emulate

    def __call__(self, rank: int, device) -> dict:
        from heterog.runtime.transport import NullStatus, Transport

        group = dist.new_group(list(MEMBERS))
        tr = Transport(device, self.emulate, NullStatus(), rank)
        out = {}
        try:
            pending = []
            for dtype in (torch.float32, torch.float64):
                for k, need in enumerate(RS_NEEDS):
                    pending.append((("rs", k, dtype), tr.reduce_scatter(_partial(rank, k, dtype), 0, group, MEMBERS,
                                                                        rank, ORDER, need, 1e-4)))
                for k, (have, need) in enumerate(A2A):
                    mine = shard_of(_value(k, dtype), have.placement, have.extent, have.shares, ORDER.index(rank))
                    pending.append((("a2a", k, dtype), tr.all_to_all(mine.clone(), 0, group, MEMBERS, rank, ORDER,
                                                                     SHAPE, have, need, 1e-4)))
            for key, p in reversed(pending):
                out[key] = tr.finish(p).clone()
            tr.flush()
        finally:
            dist.destroy_process_group(group)
        return out


def test_gloo_reduce_scatter_and_all_to_all_give_every_member_its_exact_shard(pool3) -> None:
    for emulate in (False, True):
        results = pool3.run([_Job(emulate)] * 3)
        for me in MEMBERS:
            i = ORDER.index(me)
            for dtype in (torch.float32, torch.float64):
                for k, need in enumerate(RS_NEEDS):
                    got = results[me][("rs", k, dtype)]
                    assert got.dtype == dtype and torch.equal(got, _rs_want(need, k, dtype, me)), (emulate, me, k)
                for k, (_, need) in enumerate(A2A):
                    got = results[me][("a2a", k, dtype)]
                    want = shard_of(_value(k, dtype), need.placement, need.extent, need.shares, i)
                    assert got.dtype == dtype and torch.equal(got, want), (emulate, me, k)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_all_to_all_pieces_rebuild_every_shard_of_any_layout_pair(data) -> None:
    """For any two divisions of a value (dims, split factors, extents, uneven shares over n members), the
    pieces every part sends put each new part together exactly, in the memory order asked for."""
    ndim = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(1, 3))
    shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]

    def sharding(dim: int) -> Sharding:
        sf = data.draw(st.integers(1, 2))
        extent = data.draw(st.integers(n, 5))
        cuts = sorted(data.draw(st.lists(st.integers(0, extent), min_size=n - 1, max_size=n - 1)))
        shares = tuple(b - a for a, b in zip([0, *cuts], [*cuts, extent]))
        placement = f"S{dim}:{sf}" if sf > 1 else f"S{dim}"
        return Sharding(placement, extent, shares)

    have = sharding(data.draw(st.integers(0, ndim - 1)))
    need = sharding(data.draw(st.integers(0, ndim - 1)))
    for sh in (have, need):
        p = sh.shard
        shape[p.dim] = int(np.lcm(shape[p.dim], p.sf * sh.extent))
    if have.shard.dim == need.shard.dim:
        a, b = have.shard.sf * have.extent, need.shard.sf * need.extent
        shape[have.shard.dim] = int(np.lcm(a, b)) * data.draw(st.integers(1, 2))
    value = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    shards = [shard_of(value, have.placement, have.extent, have.shares, i) for i in range(n)]
    order = tuple(reversed(range(ndim)))
    for j in range(n):
        pieces = [a2a_piece(shards[i], shape, have, need, i, j) for i in range(n)]
        got = a2a_assemble(pieces, shape, have, need, j, order)
        assert torch.equal(got, shard_of(value, need.placement, need.extent, need.shares, j))
        assert got.numel() == 0 or in_memory_order(got, order) is got       # already laid out so


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nccl_padded_reduce_scatter_and_split_all_to_all_buffers_give_the_shards(dtype) -> None:
    """NCCL's reduce-scatter (``reduce_scatter_single``: slot r of every member's input summed into member
    r's output) and all-to-all (``all_to_all_single``: member r's input split j lands in member j's output
    split r) modelled here on the flat buffers the transport packs: trimmed and unpacked, every member gets
    its shard; the padding is zeros."""
    ranks = (0, 1, 2)                                    # the process group's rank order
    for k, need in enumerate(RS_NEEDS):
        inputs = {m: pack_padded([rs_pieces(_partial(m, k, dtype), need)[ORDER.index(r)] for r in ranks])
                  for m in ranks}
        slot = inputs[0].numel() // len(ranks)
        for r in ranks:
            out = sum_in_order([inputs[m][r * slot:(r + 1) * slot] for m in ranks])
            shape = need.shape(SHAPE, ORDER.index(r))
            got = unpack_padded(out, [shape])[0]
            assert torch.allclose(got, _rs_want(need, k, dtype, r), rtol=1e-6, atol=1e-6)
            assert torch.count_nonzero(out[got.numel():]) == 0
    for k, (have, need) in enumerate(A2A):
        value = _value(k, dtype)
        shards = {m: shard_of(value, have.placement, have.extent, have.shares, ORDER.index(m)) for m in ranks}
        sent = {m: pack_split([a2a_piece(shards[m], SHAPE, have, need, ORDER.index(m), ORDER.index(r)) for r in ranks])
                for m in ranks}
        for r in ranks:
            chunks = []
            for m in ranks:
                flat, sizes = sent[m]
                chunks.append(flat[sum(sizes[:r]):sum(sizes[:r + 1])])
            shapes = [tuple(a2a_piece(shards[m], SHAPE, have, need, ORDER.index(m), ORDER.index(r)).shape)
                      for m in ranks]
            pieces = dict(zip(ranks, unpack_split(torch.cat(chunks), shapes)))
            got = a2a_assemble([pieces[m] for m in ORDER], SHAPE, have, need, ORDER.index(r), None)
            assert torch.equal(got, shard_of(value, need.placement, need.extent, need.shares, ORDER.index(r)))
