"""Conformance of 2-D splits (``ParallelConfig.split_grid``: the batch over groups of devices, the ops divided
beyond the batch inside each group): every model of the equivalence suite trains under random plans whose
groups are grids over local-cpu-4 (two groups of two devices in random order, random weights 1-3 and batch
shares, along parameters or activations, with and without micro-batches; the other groups data-parallel or on
one device) exactly as in one process; the programs lowered for NCCL compute the same step in one process."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from heterog.cluster import load_cluster
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.runtime import compare_values, prepare, run_prepared
from heterog.strategy import ParallelConfig, Strategy
from tests.runtime import conformance_models as cm
from tests.runtime.test_conformance import ATOL, RTOL, STEPS, captured, plan, reference, with_micro_batches
from tests.runtime.test_split_conformance import assert_one_step_like_one_process

MODELS = cm.DIVIDED_MODELS
CLUSTER = "local-cpu-4:slowdown=1,2,3,4"


@functools.cache
def cluster4():
    return load_cluster(CLUSTER)


def random_grid(rng: np.random.Generator, batch_size: int, kind: str) -> ParallelConfig:
    """Two groups of two of the four devices (random order), weights 1-3, batch shares of at least 2."""
    devs = rng.permutation(4).tolist()
    first = int(rng.integers(2, batch_size - 1))
    return ParallelConfig.split_grid([devs[:2], devs[2:]], [int(x) for x in rng.integers(1, 4, size=2)],
                                     (first, batch_size - first), kind)


def grid_plan(name: str, seed: int, micro: bool) -> Strategy:
    """The first random plan from ``seed`` on (seeds 100 apart) with about 60% of its groups on random grids
    that divides a compute op beyond the batch."""
    m, cluster = captured(name), cluster4()
    compute = np.array(m.prog.op_kind) == "compute"
    for k in range(10):
        rng = np.random.default_rng(5000 + seed + 100 * k)
        s = plan(m, cluster, "random", seed + 100 * k)
        kind = ("parameter", "attribute")[int(rng.integers(2))]
        configs = [random_grid(rng, s.batch_size, kind) if rng.random() < 0.6 else c for c in s.configs]
        s = dataclasses.replace(s, configs=configs)
        s = with_micro_batches(s, seed + 100 * k) if micro else s
        try:
            option = Evaluator(m.graph, cluster).compile(s).placements.op_option
        except StrategyError as exc:       # a micro-batch smaller than the groups: the next seed
            if "too small" in str(exc):
                continue
            raise
        if option is not None and np.any(option[compute] >= 0):
            return s
    raise AssertionError(f"{name}: no random grid plan divides a compute op")


@pytest.mark.parametrize("name,micro", cm.divided_cases((False, True)),
                         ids=lambda v: {False: "whole-batch", True: "micro-batches"}.get(v, v))
def test_random_grid_plans_train_like_one_process(name, micro, pool4) -> None:
    m = captured(name)
    strategy = grid_plan(name, 1 if micro else 0, micro)
    result = run_prepared(prepare(m, cluster4(), strategy), [m.example_inputs], STEPS, pool=pool4)
    ref_losses, ref_values = reference(name)
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{name} (micro-batches {strategy.micro_batches}): {bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)


@pytest.mark.parametrize("name", MODELS)
def test_grid_programs_lowered_for_nccl_compute_one_step_like_one_process(name) -> None:
    prepared = prepare(captured(name), cluster4(), grid_plan(name, 2, False), backend="nccl", check=False)
    assert_one_step_like_one_process(name, prepared)


def test_a_grid_holds_each_divided_weight_once_per_group(pool4) -> None:
    """A whole-graph 3:1 parameter grid: the k-th devices of both groups hold the same shard of each divided
    weight, 3:1 between the positions, and training still matches."""
    name = "residual_glu"
    m, cluster = captured(name), cluster4()
    g = m.graph
    cfg = ParallelConfig.split_grid([(0, 1), (2, 3)], (3, 1), (4, 2))
    s = Strategy(g.fingerprint, cluster.name, 4, g.batch_size, np.zeros(g.n_ops, dtype=np.int64), [cfg])
    prepared = prepare(m, cluster, s)
    parts = prepared.lowered.parts
    assert parts, "no weight is held divided"
    for ph, (_, holders) in parts.items():
        assert holders == (0, 1)
        shapes = [rp.persist_parts[ph] for rp in prepared.lowered.ranks]
        assert shapes[0] == shapes[2] and shapes[1] == shapes[3] and (shapes[0].rank, shapes[1].rank) == (0, 1)
        assert shapes[0].shares == shapes[1].shares and shapes[0].shares[0] >= shapes[0].shares[1]
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=pool4)
    ok, diff, bad = compare_values(m, result.values, reference(name)[1], rtol=RTOL, atol=ATOL)
    assert ok, f"{bad[:4]} differ (max |diff| {diff:.3g})"
