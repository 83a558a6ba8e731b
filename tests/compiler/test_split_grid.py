"""2-D splits (``ParallelConfig.split_grid``): the batch over groups of devices, the ops divided beyond the batch
inside each group. A Megatron-style MLP block on a 2 x 2 grid has one all-reduce of activations per group each
way and one all-reduce per divided weight gradient over the devices at the same position of the groups; a
grid of one group is the one-dimensional split; grids refuse what they cannot express; MCMC starts from them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from heterog.baselines.chains import grid_configs, split_action_configs
from heterog.cluster.loader import cluster_from_dict
from heterog.compiler import TaskKind
from heterog.compiler.plan import resident_bytes
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.graph.capture import capture
from heterog.shares import grid_micro_shares
from heterog.strategy import ParallelConfig, Strategy, most_micro_batches
from tests.compiler.test_compile import two_gpu
from tests.compiler.test_splits import B, Block, D, SplitCost, mlp_groups, op_id, strategy

GRID = ParallelConfig.split_grid([(0, 1), (2, 3)], (1, 1), (4, 4))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return capture(Block(), (torch.randn(B, D), torch.randn(B, D)))


def servers(n_servers: int, per: int, peaks: tuple[float, ...]) -> object:
    """``n_servers`` servers of ``per`` GPUs each, server k's GPUs of ``peaks[k]`` TFLOP/s."""
    return cluster_from_dict({"name": f"test-{n_servers}x{per}", "switch": {"bandwidth": "100 Gbit/s"}, "servers": [{
        "name": f"s{k}", "gpus": [{"name": f"G{k}", "peak_tflops": peaks[k], "memory_bandwidth": "500 GB/s",
                                   "memory": "16 GiB"}] * per,
        "intra": {"kind": "pcie", "bandwidth": "10 GB/s", "latency_us": 5},
        "nic": {"bandwidth": "50 Gbit/s", "latency_us": 10}} for k in range(n_servers)]})


def collectives(g, plan):
    coll = np.nonzero(plan.task_kind == TaskKind.COLLECTIVE)[0]
    return sorted((g.ops[o].name, g.ops[o].phase, float(d)) for o, d in zip(plan.task_op[coll], plan.tg.duration[coll]))


def test_megatron_mlp_on_a_two_by_two_grid(block):
    g, c = block, two_gpu(n=4)
    ev = Evaluator(g, c, SplitCost(c, slow=(1.0, 1.0, 1.0, 1.0)))
    s = strategy(g, c, [ParallelConfig.single(0, B), GRID], mlp_groups(g))
    plan = ev.evaluate(s).plan
    half_rows = B // 2 * D * 4                       # a group's activations: 4 samples x D floats
    shard = 4 * D * D // 2 * 4                       # half a 4D x D weight (its gradient)
    ar = 2 * 1 / 2 * 1e-9                            # FakeCost's AllReduce of two devices, per byte
    # each group all-reduces fc2's partial sums (forward) and fc1's input gradient (backward) of its 4 samples;
    # fc1's and fc2's weight gradients are summed over the groups by the devices holding the same shard
    assert collectives(g, plan) == sorted(
        [("mm_2", "forward", half_rows * ar)] * 2 + [("mm_6", "backward", half_rows * ar)] * 2
        + [("mm_3", "backward", shard * ar)] * 2 + [("mm_5", "backward", shard * ar)] * 2)
    # every matmul of fc1 and fc2 runs on all four devices: half the batch, half the features
    for name in ("mm_1", "mm_2", "mm_3", "mm_4", "mm_5", "mm_6"):
        o = op_id(g, name)
        inst = np.nonzero((plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE))[0]
        assert sorted(plan.task_device[inst].tolist()) == [0, 1, 2, 3]
        assert plan.tg.duration[inst].tolist() == [g.ops[o].flops / 4] * 4
    # the k-th devices of both groups hold the same half of fc1's and fc2's weights and gradients
    st = ev.compiler.compile_state(s)
    held = resident_bytes(ev.compiler.context, ev.compiler.layouts, st.placement.op_lay, st.placement.out_split)
    res_b = ev.compiler.context.index.resident_bytes
    fc = res_b[op_id(g, "arg1_1")] + res_b[op_id(g, "arg2_1")]
    assert held.tolist() == [res_b[op_id(g, "arg0_1")] + fc / 2, fc / 2, fc / 2, fc / 2]


def test_a_grid_of_one_group_is_the_one_dimensional_split(block):
    g, c = block, two_gpu()
    ev = Evaluator(g, c, SplitCost(c, slow=(1.0, 3.0)))
    one = ParallelConfig.split_over((0, 1), (3, 1), B)
    grid = ParallelConfig.split_grid([(0, 1)], (3, 1), (B,))
    assert grid == one and grid.groups == ((0, 1),) and grid.batch_size == B
    zeros = np.zeros(g.n_ops, dtype=np.int64)
    assert ev.iteration_time(strategy(g, c, [grid], zeros)) == ev.iteration_time(strategy(g, c, [one], zeros))


def test_groups_with_proportional_batch_shares_finish_together(block):
    """Group (2, 3) is three times slower: 6 of the 8 samples on the fast group and 2 on the slow one give
    every matmul the same time on all four devices, and a faster step than an even batch."""
    g, c = block, two_gpu(n=4)
    ev = Evaluator(g, c, SplitCost(c, slow=(1.0, 1.0, 3.0, 3.0)))
    zeros = np.zeros(g.n_ops, dtype=np.int64)
    prop = strategy(g, c, [ParallelConfig.split_grid([(0, 1), (2, 3)], (1, 1), (6, 2))], zeros)
    even = strategy(g, c, [GRID], zeros)
    plan = ev.evaluate(prop).plan
    for name in ("mm_1", "mm_2"):
        o = op_id(g, name)
        inst = np.nonzero((plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE))[0]
        assert plan.tg.duration[inst].tolist() == pytest.approx([g.ops[o].flops * 6 / 8 / 2] * 4, rel=1e-12)
    assert ev.iteration_time(prop)[0] < ev.iteration_time(even)[0]


def test_grid_configs_refuse_what_they_cannot_express(block):
    with pytest.raises(StrategyError, match="equal size"):
        ParallelConfig.split_grid([(0, 1), (2,)], (1, 1), (4, 4))
    with pytest.raises(StrategyError, match="one batch share per group"):
        ParallelConfig.split_grid([(0, 1), (2, 3)], (1, 1), (8,))
    with pytest.raises(StrategyError, match="divide alike"):
        ParallelConfig((0, 1, 2, 3), (4, 4, 4, 4), split="parameter", split_shares=(1, 1, 2, 1), grid=2)
    with pytest.raises(StrategyError, match="equal within a group"):
        ParallelConfig((0, 1, 2, 3), (4, 3, 4, 4), split="parameter", split_shares=(1, 1, 1, 1), grid=2)
    with pytest.raises(StrategyError, match="needs a split config"):
        ParallelConfig((0, 1), (4, 4), grid=2)
    g, c = block, two_gpu(n=4)
    s = strategy(g, c, [GRID], np.zeros(g.n_ops, dtype=np.int64))
    back = Strategy.from_dict(s.to_dict())
    assert back.configs[0] == GRID and back.configs[0].groups == ((0, 1), (2, 3))
    assert "grid" not in ParallelConfig.split_over((0, 1), (1, 1), B).to_dict()
    ev = Evaluator(g, c, SplitCost(c, slow=(1.0,) * 4))
    uneven = strategy(g, c, [ParallelConfig.split_grid([(0, 1), (2, 3)], (1, 1), (7, 1))],
                      np.zeros(g.n_ops, dtype=np.int64))
    assert most_micro_batches(uneven) == B // 2
    with pytest.raises(StrategyError, match="too small"):                  # 8 micro-batches of 1 sample, 2 groups
        ev.evaluate(uneven.with_micro_batches(8, "1f1b"))
    # 4 micro-batches of 2: each group one sample of each (the 1-sample group runs 4 in all)
    assert grid_micro_shares((7, 1), (2, 2, 2, 2)) == [[1, 1]] * 4
    plan = ev.evaluate(uneven.with_micro_batches(4, "1f1b")).plan
    o = op_id(g, "mm_1")
    inst = (plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE)
    assert sorted(plan.task_device[inst].tolist()) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def test_grid_actions_and_the_mcmc_start(block):
    from heterog.baselines.mcmc import mcmc

    c = servers(2, 2, (20.0, 10.0))
    even, prop = (cfg for _, cfg in grid_configs(c, B))
    assert even.groups == prop.groups == ((0, 1), (2, 3))
    assert even.split_shares == (1, 1, 1, 1) and even.shares == (5, 5, 3, 3)     # batch by the groups' speed
    assert [n for n, _ in split_action_configs(c, B)][-2:] == ["tp-grid-even", "tp-grid-prop"]
    assert grid_configs(two_gpu(n=4), B) == [] and grid_configs(servers(2, 1, (1.0, 1.0)), B) == []
    g = block
    ev = Evaluator(g, c, SplitCost(c, slow=(1.0, 1.0, 2.0, 2.0)))
    plan = mcmc(ev, max_evals=30, seed=0, max_micro_batches=1, splits=True)
    assert "tp-grid" in {ch["start"] for ch in plan.meta["chains"]}
