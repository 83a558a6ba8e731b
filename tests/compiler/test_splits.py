"""Splits beyond the batch (heterog.compiler.shards, reshard): a Megatron-style MLP block split column then row
over two devices has one all-reduce in forward and one in backward and half its weight memory per device;
proportional shares on a fast and a slow device finish together; the choice of options and the strategy format."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from heterog.compiler import TaskKind
from heterog.compiler.plan import resident_bytes
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.graph.capture import capture
from heterog.strategy import ParallelConfig, Strategy
from tests.compiler.test_compile import FakeCost, two_gpu

D, B = 16, 8


class Block(nn.Module):
    """pre (D -> D) -> fc1 (D -> 4D) -> relu -> fc2 (4D -> D), mean squared error; no biases."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D, bias=False)
        self.fc1 = nn.Linear(D, 4 * D, bias=False)
        self.fc2 = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(torch.relu(self.fc1(self.pre(x)))) - y) ** 2).mean()


class SplitCost(FakeCost):
    """FakeCost (an op takes its FLOPs in seconds) with device ``d`` ``slow[d]`` times slower, shards taking
    their share of the time, and a ring all-gather or reduce-scatter of uneven shards taking (n - 1) x the
    largest shard x 1e-9 s."""

    def __init__(self, cluster, slow=(1.0, 1.0)):
        super().__init__(cluster)
        self.slow = np.asarray(slow, dtype=np.float64)

    def op_times(self, graph, ops, devices, fractions, splits=None):
        t = super().op_times(graph, ops, devices, fractions) * self.slow[np.asarray(devices)]
        return t if splits is None else t * np.asarray(splits)

    def full_batch_times(self, graph):
        return super().full_batch_times(graph) * self.slow[None, :]

    def sharded_ring_times(self, devices, shard_bytes):
        x = np.atleast_2d(shard_bytes)
        return (len(devices) - 1) * x.max(axis=1) * 1e-9


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return capture(Block(), (torch.randn(B, D), torch.randn(B, D)))


def op_id(graph, name):
    return next(i for i, op in enumerate(graph.ops) if op.name == name)


def mlp_groups(graph):
    """Group 1: fc1, relu, fc2 and their backward and update ops; group 0: the rest."""
    return np.array([1 if op.module_path in ("fc1", "fc2") or op.target in (
        "aten.relu.default", "aten.threshold_backward.default") else 0 for op in graph.ops], dtype=np.int64)


def strategy(graph, cluster, configs, group_of):
    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, B, group_of, configs)


def test_megatron_mlp_one_allreduce_each_way_and_half_the_weights(block):
    g, c = block, two_gpu()
    cost = SplitCost(c)
    ev = Evaluator(g, c, cost)
    s = strategy(g, c, [ParallelConfig.single(0, B), ParallelConfig.split_over((0, 1), (1, 1), B)], mlp_groups(g))
    res = ev.evaluate(s)
    plan = res.plan
    coll = np.nonzero(plan.task_kind == TaskKind.COLLECTIVE)[0]
    # forward: fc2's partial sums (row split) all-reduced; backward: fc1's input gradient (column split)
    assert sorted(g.ops[o].name for o in plan.task_op[coll]) == ["mm_2", "mm_6"]
    assert [g.ops[o].phase for o in plan.task_op[coll]] == ["forward", "backward"]
    nbytes = B * D * 4
    assert np.allclose(plan.tg.duration[coll], 2 * 1 / 2 * nbytes * 1e-9, rtol=1e-12)   # FakeCost's AllReduce
    # every matmul of fc1 and fc2 runs half on each device: half its FLOPs in seconds
    for name in ("mm_1", "mm_2", "mm_3", "mm_4", "mm_5", "mm_6"):
        o = op_id(g, name)
        inst = np.nonzero((plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE))[0]
        assert sorted(plan.task_device[inst].tolist()) == [0, 1]
        assert plan.tg.duration[inst].tolist() == [g.ops[o].flops / 2] * 2
    # fc1 and fc2's weights: half on each device; pre's whole on device 0 (gradients are allocated where made)
    st = ev.compiler.compile_state(s)
    held = resident_bytes(ev.compiler.context, ev.compiler.layouts, st.placement.op_lay, st.placement.out_split)
    res_b = ev.compiler.context.index.resident_bytes
    fc = res_b[op_id(g, "arg1_1")] + res_b[op_id(g, "arg2_1")]
    assert fc == 2 * 4 * D * D * 4                           # two weights of 4D x D floats
    assert held.tolist() == [res_b[op_id(g, "arg0_1")] + fc / 2, fc / 2]
    # the step is device 0's work (the pre layer, half the block, the loss) plus at most the communication
    work0 = sum(plan.tg.duration[(plan.task_device == 0) & (plan.task_kind == TaskKind.COMPUTE)])
    assert work0 == pytest.approx(60033.0, abs=1e-9)
    assert 60033.0 <= res.iteration_time_s <= 60033.0 + 8 * nbytes * 1e-9


def test_uneven_shares_on_a_fast_and_a_slow_device_finish_together(block):
    g, c = block, two_gpu()
    cost = SplitCost(c, slow=(1.0, 3.0))                      # device 1 three times slower
    ev = Evaluator(g, c, cost)
    s = strategy(g, c, [ParallelConfig.split_over((0, 1), (3, 1), B)], np.zeros(g.n_ops, dtype=np.int64))
    plan = ev.evaluate(s).plan
    sim = ev.simulate_plan(plan)
    for name in ("mm", "mm_1"):                              # both start at once (their inputs are on both)
        o = op_id(g, name)
        inst = np.nonzero((plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE))[0]
        assert sorted(plan.task_device[inst].tolist()) == [0, 1]
        # shares 3 : 1 of the divided dimension, device 1 three times slower: 3/4 x t = 1/4 x t x 3
        assert plan.tg.duration[inst].tolist() == pytest.approx([0.75 * g.ops[o].flops] * 2, rel=1e-12)
    o = op_id(g, "mm")
    inst = np.nonzero((plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE))[0]
    assert sim.start[inst].tolist() == [0.0, 0.0] and sim.finish[inst[0]] == sim.finish[inst[1]]
    # even shares leave the fast device waiting: the slow one takes 1/2 x t x 3
    even = strategy(g, c, [ParallelConfig.split_over((0, 1), (1, 1), B)], np.zeros(g.n_ops, dtype=np.int64))
    assert ev.iteration_time(s)[0] < ev.iteration_time(even)[0]


def test_each_parameter_is_held_divided_and_updated_where_it_lives(block):
    g, c = block, two_gpu()
    ev = Evaluator(g, c, SplitCost(c))
    s = strategy(g, c, [ParallelConfig.split_over((0, 1), (1, 1), B)], np.zeros(g.n_ops, dtype=np.int64))
    st = ev.compiler.compile_state(s)
    pl = st.placement
    params = [i for i, op in enumerate(g.ops) if op.kind == "param"]
    assert pl.out_split[params].tolist() == [1.0] * 3
    updates = [i for i, op in enumerate(g.ops) if op.phase == "update"]
    assert pl.out_split[updates].tolist() == [1.0] * 3


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_split_groups_run_micro_batches(block, schedule):
    """With k micro-batches each device runs its shard of every micro-batch; compute-bound (FakeCost's times
    are linear in the samples), the step on device 0 takes as long as with one; one all-reduce per micro-batch
    each way; fc2's weight gradient accumulates over the micro-batches."""
    g, c = block, two_gpu()
    ev = Evaluator(g, c, SplitCost(c))
    s = strategy(g, c, [ParallelConfig.single(0, B), ParallelConfig.split_over((0, 1), (1, 1), B)], mlp_groups(g))
    one = ev.evaluate(s)
    for k in (2, 4):
        res = ev.evaluate(s.with_micro_batches(k, schedule))
        plan = res.plan
        assert res.iteration_time_s == pytest.approx(one.iteration_time_s, abs=64 * B * D * 4 * 1e-9)
        coll = plan.task_kind == TaskKind.COLLECTIVE
        assert sorted(g.ops[o].name for o in plan.task_op[coll]) == ["mm_2"] * k + ["mm_6"] * k
        o = op_id(g, "mm_3")                                 # fc2's weight gradient: k instances per device
        inst = (plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE)
        assert sorted(plan.task_device[inst].tolist()) == [0] * k + [1] * k


def test_split_strategies_round_trip_and_refuse_recomputation(block):
    g, c = block, two_gpu()
    cfg = ParallelConfig.split_over((0, 1), (3, 1), B)
    assert cfg.batch_size == B and cfg.shares == (B, B)
    s = strategy(g, c, [cfg], np.zeros(g.n_ops, dtype=np.int64))
    back = Strategy.from_dict(s.to_dict())
    assert back.configs[0] == cfg and back.configs[0].split == "parameter"
    with pytest.raises(StrategyError, match="not recomputed"):
        s.with_recompute([0])
    with pytest.raises(StrategyError, match="one positive split share per device"):
        ParallelConfig.split_over((0, 1), (1,), B)
    with pytest.raises(StrategyError, match="unknown split"):
        ParallelConfig.split_over((0, 1), (1, 1), B, kind="channels")


def test_mcmc_offers_and_starts_from_splits_only_when_asked(block):
    from heterog.baselines.chains import ActionSearch
    from heterog.baselines.mcmc import mcmc, start_actions

    g, c = block, two_gpu()
    ev = Evaluator(g, c, SplitCost(c))
    assert ActionSearch(ev).n_actions == c.n_devices + 4
    search = ActionSearch(ev, splits=True)
    assert search.split_names == ["tp-even", "tp-prop"] and search.n_actions == c.n_devices + 6
    start = start_actions(ev, "tp-even", np.random.default_rng(0))
    assert {cfg.split for cfg in search.strategy(start).configs} == {"parameter"}
    plain = mcmc(ev, max_evals=40, seed=0, max_micro_batches=1)
    assert all(cfg.split is None for cfg in plain.configs)
    split = mcmc(ev, max_evals=40, seed=0, max_micro_batches=1, splits=True)
    assert {ch["start"] for ch in split.meta["chains"]} >= {"tp-even", "tp-prop"}


def test_os_dpos_and_the_pipeline_planner_try_parameter_splits_when_asked(block):
    from heterog.baselines.dpos import os_dpos, split_configs
    from heterog.baselines.pipeline import pipeline

    g, c = block, two_gpu()
    ev = Evaluator(g, c, SplitCost(c, slow=(1.0, 3.0)))
    full = ev.cost.full_batch_times(g)[op_id(g, "mm_1")]
    cands = split_configs(full, B, channels=True)
    assert [cfg.split for cfg in cands] == [None, None, "parameter", "parameter"]
    assert [cfg.split_shares for cfg in cands[2:]] == [(1, 1), (750, 250)]     # even; by the op's speed
    assert all(cfg.split is None for cfg in split_configs(full, B))
    plan = os_dpos(ev, budget_s=20, splits=True)
    assert plan.meta["ops_split"] == len(plan.meta["splits"])
    for kept in plan.meta["splits"]:
        assert kept["split"] in ("batch", "parameter") and kept["gain_s"] > 0 and len(kept["devices"]) == 2
    tp = pipeline(ev, budget_s=20, splits=True)
    assert "stage_split" in tp.meta


def test_the_pipeline_planner_divides_stages_only_where_replicated_ones_do_not_fit(block):
    """With room for the replicated stage, splits change nothing (the same candidates, the same plan); in
    18 KiB per device, where a replicated stage of both devices does not fit, the stage divided between them
    fits and is faster than the best plan without splits."""
    from heterog.baselines.pipeline import pipeline

    g = block
    roomy = two_gpu()
    ev = Evaluator(g, roomy, SplitCost(roomy))
    plain, split = pipeline(ev, budget_s=60, splits=False), pipeline(ev, budget_s=60, splits=True)
    assert plain.meta["candidates"] == split.meta["candidates"]
    assert not split.meta["stage_split"] and ev.iteration_time(split) == ev.iteration_time(plain)
    tight = two_gpu(memory="18 KiB")
    ev = Evaluator(g, tight, SplitCost(tight))
    plain, split = pipeline(ev, budget_s=60, splits=False), pipeline(ev, budget_s=60, splits=True)
    assert split.meta["candidates"] > plain.meta["candidates"]
    assert split.meta["stage_split"] and split.meta["stages"] == [(0, 1)]
    (t_split, oom_split), (t_plain, oom_plain) = ev.iteration_time(split), ev.iteration_time(plain)
    assert not oom_split and not oom_plain and t_split < t_plain


def test_the_pipeline_planner_screens_divided_stages_after_every_replicated_candidate(block, monkeypatch):
    """A divided candidate simulates many times slower than a replicated one: the screen takes every
    replicated candidate of every k first, then the divided ones of the (k, grouping)s where no replicated
    candidate fits, so a short budget screens every grouping and k before any of them."""
    from heterog.baselines.pipeline import pipeline

    tight = two_gpu(memory="18 KiB")
    ev = Evaluator(block, tight, SplitCost(tight))
    order, real = [], ev.iteration_time

    def timed(strategy, *args, **kwargs):
        out = real(strategy, *args, **kwargs)
        order.append((strategy.meta.get("stage_split"), strategy.n_micro, len(strategy.meta["stages"]), out[1]))
        return out

    monkeypatch.setattr(ev, "iteration_time", timed)
    s = pipeline(ev, budget_s=60, splits=True, max_micro_batches=4)
    screened = order[:s.meta["candidates"]]
    divided = [i for i, (split, *_) in enumerate(screened) if split]
    assert divided and min(divided) > max(i for i, (split, *_) in enumerate(screened) if not split)
    # a divided candidate stands for a grouping of several devices with no replicated candidate that fits
    fits = {(k, n) for split, k, n, oom in screened if not split and not oom}
    # (the grouping of one stage over both devices is the one of several devices; at k = 1 it fits replicated)
    assert {(k, n) for split, k, n, _ in screened if split} == {(k, 1) for k in (1, 2, 4)} - fits == {(2, 1), (4, 1)}
