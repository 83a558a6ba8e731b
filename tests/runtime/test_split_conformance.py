"""Conformance of plans that divide groups beyond the batch (``heterog.runtime.split_lowering``): every model of
the equivalence suite trains under random plans whose groups are divided along parameter or attribute
dimensions (uneven shares, over all or some devices, mixed with data-parallel and single-device groups, with
and without micro-batches) exactly as in one process, on local-cpu-2 and local-cpu-3; the programs lowered
for NCCL compute the same step in one process; divided parameters are held as shards, and values are put
together on the split's devices by collectives."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.evaluate import Evaluator
from heterog.graph.shard_exec import combine, padded, part_of, shard_of
from heterog.placement import Shard
from heterog.runtime import compare_values, prepare, run_prepared, train_single_process
from heterog.runtime.instructions import AllGather, AllReduce, Combine, Post
from heterog.runtime.split_lowering import _at, part_shape
from heterog.strategy import ParallelConfig, Strategy
from tests.runtime import conformance_models as cm
from tests.runtime.test_conformance import (
    ATOL,
    POOLS,
    RTOL,
    STEPS,
    captured,
    cluster_of,
    plan,
    reference,
    with_micro_batches,
)

MODELS = cm.DIVIDED_MODELS


def with_splits(strategy: Strategy, n_devices: int, seed: int) -> Strategy:
    """``strategy`` with about 60% of its groups divided beyond the batch: over a random set of at least two
    devices, in random integer weights 1-3, along parameter or attribute dimensions."""
    rng = np.random.default_rng(3000 + seed)
    configs = list(strategy.configs)
    for g in range(len(configs)):
        if rng.random() < 0.6:
            k = int(rng.integers(2, n_devices + 1))
            devs = tuple(sorted(rng.choice(n_devices, size=k, replace=False).tolist()))
            weights = tuple(int(x) for x in rng.integers(1, 4, size=k))
            kind = ("parameter", "attribute")[int(rng.integers(2))]
            configs[g] = ParallelConfig.split_over(devs, weights, strategy.batch_size, kind=kind)
    return dataclasses.replace(strategy, configs=configs)


def split_plan(name: str, cluster_name: str, seed: int, micro: bool) -> Strategy:
    """The first random split plan from ``seed`` on (seeds 100 apart) that divides a compute op beyond the
    batch (random groups of some models hold only ops that run whole)."""
    m, cluster = captured(name), cluster_of(cluster_name)
    compute = np.array(m.prog.op_kind) == "compute"
    for k in range(10):
        s = with_splits(plan(m, cluster, "random", seed + 100 * k), cluster.n_devices, seed + 100 * k)
        s = with_micro_batches(s, seed) if micro else s
        option = Evaluator(m.graph, cluster).compile(s).placements.op_option
        if option is not None and np.any(option[compute] >= 0):
            return s
    raise AssertionError(f"{name}: no random split plan divides a compute op")


@pytest.mark.parametrize("name,cluster_name,micro", cm.divided_cases(("local-cpu-2", "local-cpu-3"), (False, True)),
                         ids=lambda v: {False: "whole-batch", True: "micro-batches"}.get(v, v))
def test_random_split_plans_train_like_one_process(name, cluster_name, micro, request) -> None:
    m, cluster = captured(name), cluster_of(cluster_name)
    seed = 1 if micro else 0
    strategy = split_plan(name, cluster_name, seed, micro)
    prepared = prepare(m, cluster, strategy)
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=request.getfixturevalue(POOLS[cluster_name]))
    ref_losses, ref_values = reference(name)
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{name} on {cluster_name} (micro-batches {strategy.micro_batches}): {bad[:4]} differ " \
               f"(max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)


@pytest.mark.parametrize("name", MODELS)
def test_split_programs_lowered_for_nccl_compute_one_step_like_one_process(name) -> None:
    """NCCL's programs (receives posted in message order) of a random split plan on local-cpu-3, run in one
    process (``heterog.runtime.check``), give one step of single-process training."""
    m, cluster = captured(name), cluster_of("local-cpu-3")
    prepared = prepare(m, cluster, split_plan(name, "local-cpu-3", 2, False), backend="nccl", check=False)
    assert any(isinstance(ins, Post) for rp in prepared.lowered.ranks for ins in rp.instrs)
    assert_one_step_like_one_process(name, prepared)


def assert_one_step_like_one_process(name: str, prepared) -> None:
    """``prepared``'s programs, run in one process (``heterog.runtime.check``), give one step of
    single-process training of model ``name``: parameters and loss."""
    from heterog.runtime.check import check_prepared

    m = captured(name)
    dry = check_prepared(prepared)
    assert dry is not None
    losses, want = train_single_process(m, [m.example_inputs], 1)
    ok, diff, bad = compare_values(m, dry.values, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{name}: {bad[:4]} differ (max |diff| {diff:.3g})"
    assert dry.loss == pytest.approx(losses[0], rel=RTOL)


def test_a_parameter_split_holds_each_weight_once_in_shares(request) -> None:
    """Every group divided along parameters over both devices in weights 3:1: the divided weights are held
    as shards whose sizes follow the shares and add up to the whole; training still matches one process."""
    name = "residual_glu"
    m, cluster = captured(name), cluster_of("local-cpu-2")
    cfg = ParallelConfig.split_over((0, 1), (3, 1), m.batch_size)
    s = Strategy(m.graph.fingerprint, cluster.name, 2, m.batch_size, np.zeros(m.graph.n_ops, dtype=np.int64), [cfg])
    prepared = prepare(m, cluster, s)
    parts = prepared.lowered.parts
    assert parts, "no parameter is held divided"
    init = m.initial_values()
    for ph, (placement, devs) in parts.items():
        got = [prepared.lowered.ranks[d].persist_parts[ph] for d in devs]
        sizes = [part_shape(tuple(init[ph].shape), placement, p.extent, p.shares, p.rank) for p in got]
        dim = int(placement[1:].split(":")[0])
        assert sum(sz[dim] for sz in sizes) == init[ph].shape[dim]
        assert sizes[0][dim] > sizes[1][dim]                  # the 3:1 shares
    held = [sum(int(np.prod(part_shape(tuple(init[ph].shape), *_part_args(rp, ph)))) for ph in rp.persist)
            for rp in prepared.lowered.ranks]
    whole = sum(int(init[ph].numel()) for ph in prepared.lowered.ranks[0].persist)
    assert max(held) < whole
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=request.getfixturevalue("pool2"))
    ok, diff, bad = compare_values(m, result.values, reference(name)[1], rtol=RTOL, atol=ATOL)
    assert ok, f"{bad[:4]} differ (max |diff| {diff:.3g})"
    # values put together whole on the two devices of the split: by collectives, never by a Combine of messages
    instrs = [ins for rp in prepared.lowered.ranks for ins in rp.instrs]
    assert any(isinstance(ins, (AllGather, AllReduce)) and ins.key[0] == "w" for ins in instrs)
    assert not any(isinstance(ins, Combine) for ins in instrs)


def _part_args(rp, ph):
    p = rp.persist_parts.get(ph)
    return ("R", None, (), 0) if p is None else (p.placement, p.extent, p.shares, p.rank)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_parts_shards_and_padding_put_the_whole_value_back(data) -> None:
    """For any shape, divided dim, split factor and uneven shares: the shards concatenate to the value, the
    padded shards sum to it, ``part_of`` gives the shard (or the whole, or rank 0's partial sum), and the
    message shape of each shard is its real shape."""
    ndim = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, ndim - 1))
    sf = data.draw(st.integers(1, 3))
    extent = data.draw(st.integers(1, 5))
    unit = data.draw(st.integers(1, 2))
    n = data.draw(st.integers(1, min(3, extent)))
    shares = data.draw(st.lists(st.integers(1, extent), min_size=n, max_size=n).filter(lambda s: sum(s) == extent))
    shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = sf * extent * unit
    value = torch.randn(*shape)
    placement = f"S{dim}:{sf}" if sf > 1 else f"S{dim}"
    parts = [shard_of(value, placement, extent, shares, r) for r in range(n)]
    assert [tuple(p.shape) for p in parts] == [part_shape(tuple(shape), placement, extent, tuple(shares), r)
                                               for r in range(n)]
    assert torch.equal(combine(parts, placement), value)
    assert torch.equal(sum(padded(p, placement, extent, shares, r) for r, p in enumerate(parts)), value)
    for r in range(n):
        assert torch.equal(part_of(value, placement, extent, shares, r), parts[r])
        assert torch.equal(part_of(value, "P", None, (), r), value if r == 0 else torch.zeros_like(value))
    assert part_of(value, "R", None, (), 1) is value


def test_a_split_factor_counting_batch_rows_scales_with_the_micro_batch() -> None:
    """Heads inside a (batch * heads) dim: S0:6 at batch 6 is S0:2 for a micro-batch of 2 samples; a
    placement whose units would change with the batch is refused."""
    assert _at(Shard(0, 6), (48, 5), (16, 5)) == Shard(0, 2)
    assert _at(Shard(1), (6, 8), (2, 8)) == Shard(1)
    assert _at(Shard(1, 4), (6, 8), (2, 8)) == Shard(1, 4)
    from heterog.errors import HeterogError

    with pytest.raises(HeterogError, match="does not carry over"):
        _at(Shard(0, 8), (48,), (8,))
