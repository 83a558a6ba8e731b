"""Random values under any plan: a replica's seeded block draws give its samples exactly what one device
draws for them; which calls draw at all; which samplers cannot be exact."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.graph.opgraph import DRAW_BLOCK_SAMPLES
from heterog.graph.random_ops import draws, inexact_reason
from heterog.runtime.rng import BatchArg, Draw, RandomNode, block_batches, blocks_drawn, call_random, draw_key

aten = torch.ops.aten
DROPOUT = RandomNode("dropout", (BatchArg(0, 0, 1),), (BatchArg(0, 0, 1), BatchArg(1, 0, 1)), (None, None))


def dropout_node(per_sample: int) -> RandomNode:
    arg = BatchArg(0, 0, per_sample)
    return RandomNode("dropout", (arg,), (arg, BatchArg(1, 0, per_sample)), (None, None))


def draw(batch: int, samples, step: int = 0, seed: int = 0) -> Draw:
    return Draw(seed, step, batch, samples, {n: {"n": n} for n in block_batches(batch)})


def dropout(x: torch.Tensor, node: RandomNode, d: Draw):
    return call_random(aten.native_dropout.default, node, lambda sizes: ((x, 0.5, True), {}), d)


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 30), per_sample=st.sampled_from([1, 3]), data=st.data())
def test_a_replica_draws_the_rows_one_device_draws_for_its_samples(batch, per_sample, data) -> None:
    lo = data.draw(st.integers(0, batch - 1))
    hi = data.draw(st.integers(lo + 1, batch))
    x = torch.randn(batch * per_sample, 5)
    node = dropout_node(per_sample)
    whole, whole_mask = dropout(x, node, draw(batch, range(batch)))
    part, part_mask = dropout(x[lo * per_sample:hi * per_sample], node, draw(batch, range(lo, hi)))
    assert torch.equal(part, whole[lo * per_sample:hi * per_sample])
    assert torch.equal(part_mask, whole_mask[lo * per_sample:hi * per_sample])
    assert 0 < int(whole_mask.sum()) < whole_mask.numel() or x.numel() < 20      # dropout is on


def test_the_same_samples_twice_draw_the_same_values_twice() -> None:
    """The scaling probe runs k samples, then the same k twice over: the doubled run repeats the values."""
    x = torch.randn(3, 4)
    once, _ = dropout(x, DROPOUT, draw(3, range(3)))
    twice, _ = dropout(torch.cat([x, x]), DROPOUT, draw(3, [0, 1, 2, 0, 1, 2]))
    assert torch.equal(twice, torch.cat([once, once]))


def test_factories_draw_at_each_blocks_size_and_keep_the_replicas_rows() -> None:
    """``rand(size)`` with the batch in its size: each block is drawn at its own sample count."""
    node = RandomNode("noise", (), (BatchArg(0, 0, 1),), (None,))

    def rand(d: Draw) -> torch.Tensor:
        return call_random(aten.rand.default, node, lambda sizes: (([sizes["n"], 2],), {}), d)

    whole = rand(draw(19, range(19)))
    assert whole.shape == (19, 2)
    assert torch.equal(rand(draw(19, range(5, 17))), whole[5:17])
    assert torch.equal(rand(draw(19, range(16, 19))), whole[16:19])


def test_draws_follow_the_step_and_the_node_and_leave_the_generator_alone() -> None:
    x = torch.ones(8, 16)
    state = torch.default_generator.get_state()
    a, _ = dropout(x, DROPOUT, draw(8, range(8), step=0))
    assert torch.equal(torch.default_generator.get_state(), state)
    b, _ = dropout(x, DROPOUT, draw(8, range(8), step=1))
    c, _ = dropout(x, DROPOUT, draw(8, range(8), step=0, seed=1))
    again, _ = dropout(x, DROPOUT, draw(8, range(8), step=0))
    assert torch.equal(a, again) and not torch.equal(a, b) and not torch.equal(a, c)
    assert draw_key(0, 0, "a") != draw_key(0, 0, "b") and draw_key(0, 0, "a") == draw_key(0, 0, "a")


def test_blocks_an_instance_draws() -> None:
    k = DRAW_BLOCK_SAMPLES
    assert [blocks_drawn(0, k), blocks_drawn(0, k + 1), blocks_drawn(k - 1, 2), blocks_drawn(3, 0)] == [1, 2, 2, 0]
    assert block_batches(19) == {8, 3} and block_batches(16) == {8} and block_batches(5) == {5}


def test_calls_that_draw() -> None:
    assert draws(aten.native_dropout.default, (None, 0.1, True), {})
    assert not draws(aten.native_dropout.default, (None, 0.0, True), {})
    assert not draws(aten.native_dropout.default, (None, 0.1, False), {})
    assert draws(aten.rand.default, ([2, 3],), {}) and draws(aten.randn_like.default, (None,), {})
    assert not draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (None, None, None), {})
    assert draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (None, None, None), {"dropout_p": 0.1})
    assert not draws(aten.mm.default, (None, None), {})


@pytest.mark.parametrize("target", ["op:aten::poisson.default", "op:aten::multinomial.default"])
def test_samplers_that_draw_by_value_are_named_inexact(target) -> None:
    assert "depends on its inputs" in inexact_reason(target)
    assert inexact_reason("op:aten::native_dropout.default") is None
