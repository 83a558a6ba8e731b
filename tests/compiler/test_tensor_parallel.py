"""Megatron's tensor parallelism as a "tensor" split: on a pre-LN decoder (the layout of Sailor's OPT-350M,
small), every block divides its attention by heads and its MLP by columns then rows, holds every Linear's
weight divided and its norms whole, moves no parameter, and synchronises twice forward and twice backward."""
from __future__ import annotations

import collections
import logging

import numpy as np
import pytest

from heterog import zoo
from heterog.baselines.expert import block_layers
from heterog.cluster import load_cluster
from heterog.compiler.shards import choose_shards
from heterog.evaluate import Evaluator
from heterog.graph.capture import capture
from heterog.placement import Conversion
from heterog.strategy import ParallelConfig, Strategy

BATCH = 4


@pytest.fixture(scope="module")
def decoder():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    module, inputs = zoo.build("opt_350m_megatron", BATCH, **zoo.small_overrides("opt_350m_megatron"))
    return capture(module, inputs, optimizer="adam")


@pytest.mark.parametrize("weights", [(1, 1, 1, 1), (1, 1, 2)])
def test_each_block_synchronises_twice_each_way_and_never_moves_a_parameter(decoder, weights):
    g = decoder
    cluster = load_cluster("clariden:nodes=1")
    ev = Evaluator(g, cluster)
    ctx = ev.compiler.context
    cfg = ParallelConfig.split_over(range(len(weights)), weights, BATCH, kind="tensor")
    choice = choose_shards(ctx, cfg)
    layer_of, n_blocks = block_layers(g)
    gi = ctx.index
    count: collections.Counter = collections.Counter()
    for e, (u, v) in enumerate(zip(gi.e_src.tolist(), gi.e_dst.tolist())):
        c = Conversion(int(choice.conv[e]))
        if gi.placeholder_resident[u]:
            assert not c.collective, f"parameter {g.ops[u].name} moves ({c.label}) to {g.ops[v].name}"
        if c.collective and 1 <= layer_of[v] <= n_blocks:
            count[int(layer_of[v]), g.ops[v].phase, c] += 1
    for block in range(1, n_blocks + 1):
        assert count[block, "forward", Conversion.ALL_REDUCE] == 2
        assert count[block, "backward", Conversion.ALL_REDUCE] == 2
        assert sum(n for (b, _, _), n in count.items() if b == block) == 4
    for o, op in enumerate(g.ops):         # every Linear's weight and bias in shards, the norms whole
        if op.kind == "param" and 1 <= layer_of[o] <= n_blocks:
            assert choice.out_split[o] == (0.0 if "layer_norm" in str(op.param) else 1.0), op.param


def test_a_plan_of_tensor_splits_simulates_faster_than_one_device(decoder):
    g = decoder
    cluster = load_cluster("clariden:nodes=1")
    ev = Evaluator(g, cluster)
    group = np.zeros(g.n_ops, dtype=np.int64)
    one = Strategy(g.fingerprint, cluster.name, cluster.n_devices, BATCH, group, [ParallelConfig.single(0, BATCH)])
    tp = Strategy(g.fingerprint, cluster.name, cluster.n_devices, BATCH, group,
                  [ParallelConfig.split_over(range(4), (1, 1, 1, 1), BATCH, kind="tensor")])
    res = ev.evaluate(tp)
    assert not res.oom
    assert res.iteration_time_s < ev.evaluate(one).iteration_time_s
