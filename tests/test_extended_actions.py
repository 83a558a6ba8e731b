"""The extended actions (heterog.extended_actions, envs.actions): their offsets and decoding, and every
planner's plan encoded into a plan action and decoded back to the same configs per op, recomputation,
micro-batches and schedule (and the same simulated iteration time and memory)."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from envs.actions import (
    EXTENDED_MICRO_CHOICES,
    MICRO_CHOICES,
    encode_plan,
    micro_neighbours,
    plan_length,
    plan_nvec,
    plan_strategy,
    split_plan,
)
from envs.placement import PlacementEnv
from heterog import planners
from heterog.actions import (
    N_GRID_ACTIONS,
    N_ROW_ACTIONS,
    device_action_blocks,
    devices_of,
    extended_of,
    grid_action,
    n_actions,
    offload_action,
    ps_row_action,
    row_action,
    state_action,
)
from heterog.cluster import load_cluster
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.extended_actions import (
    OFFLOADED,
    decode_extended,
    decode_row,
    encode_configs,
    extended_action_name,
    grid_configs,
    regroup,
    row_levels,
)
from heterog.graph.cache import capture_model
from heterog.sharded import ShardedState
from heterog.strategy import ParallelConfig, Strategy


@pytest.fixture(scope="module")
def paper8():
    return load_cluster("paper-8gpu")


@pytest.fixture(scope="module")
def ev(paper8):
    return Evaluator(capture_model("tiny_transformer", 16), paper8)


def test_the_extended_actions_follow_the_others_and_name_their_families():
    for m, splits, states in ((8, False, False), (8, True, True), (3, True, False), (1, False, True)):
        first = n_actions(m, splits, states)
        total = n_actions(m, splits, states, extended=True)
        assert total == first + 2 * m + N_GRID_ACTIONS + N_ROW_ACTIONS
        assert devices_of(total, splits, states, extended=True) == m
        assert extended_of(first - 1, m, splits, states) is None
        assert [extended_of(offload_action(m, d, splits, states), m, splits, states) for d in range(m)] == [
            ("offload", d) for d in range(m)]
        assert extended_of(grid_action(m, True, splits, states), m, splits, states) == ("grid", 1)
        assert extended_of(row_action(m, N_ROW_ACTIONS - 1, splits, states), m, splits, states) == (
            "row", N_ROW_ACTIONS - 1)
        assert row_action(m, N_ROW_ACTIONS - 1, splits, states) == total - m - 1
        assert [extended_of(ps_row_action(m, d, splits, states), m, splits, states) for d in range(m)] == [
            ("ps", d) for d in range(m)]
        assert ps_row_action(m, m - 1, splits, states) == total - 1
        with pytest.raises(StrategyError, match="out of range"):
            extended_of(total, m, splits, states)
    # 8 devices, splits and states: 3*8+6 + 42 = 72 before them
    assert offload_action(8, 0, True, True) == 72 and grid_action(8, False, True, True) == 80
    assert row_action(8, 0, True, True) == 82
    assert device_action_blocks(8, True, True, extended=True)[-2:] == [(72, 80), (106, 114)]
    assert device_action_blocks(8, True) == device_action_blocks(8, True, True)       # unchanged without them
    names = [extended_action_name(a, 8, True, True) for a in (75, 80, 81, 82, 83, 84, 85 + 4, 106 + 6)]
    assert names == ["mp-offload:3", "tp-grid-even", "tp-grid-prop", "dp-row-ps", "dp-row-ar", "tp-row",
                     "dp-row-ar:s2-memory", "dp-row-ps@6"]


def test_rows_decode_to_their_devices_and_shares(paper8):
    row = [0, 3, 0, 5, 0, 0, 8, 0]
    cfg = decode_row(1, row, paper8, 16)
    assert cfg == ParallelConfig((1, 3, 6), (3, 5, 8), "allreduce")
    assert decode_row(0, row, paper8, 16).sync == "ps"
    assert decode_row(1, [0, 1, 0, 1, 0, 0, 2, 0], paper8, 16).shares == (4, 4, 8)   # in proportion
    assert decode_row(1, [0] * 8, paper8, 16) == ParallelConfig(tuple(range(8)), (2,) * 8)
    assert decode_row(2, row, paper8, 16) == ParallelConfig.split_over([1, 3, 6], [3, 5, 8], 16)
    assert decode_row(2, [0, 0, 7, 0, 0, 0, 0, 0], paper8, 16) == ParallelConfig.single(2, 16)
    kept = decode_row(3 + 9 + 3 + 1, row, paper8, 16)          # dp-row-ar keeping stage 2 by memory, offloaded
    assert (kept.sharded.stage, kept.sharded.offload) == (2, "optimizer")
    mem = np.asarray(paper8.memory_bytes, dtype=np.float64)[[1, 3, 6]]            # 16, 11 and 12 GB devices
    assert np.allclose(kept.sharded.fractions, mem / mem.sum(), rtol=1e-2)
    assert row_levels(16) == 1001 and row_levels(4096) == 4097
    with pytest.raises(StrategyError, match="a row has 8 entries"):
        decode_row(1, [0] * 7 + [1001], paper8, 16)
    m = paper8.n_devices
    off = decode_extended(offload_action(m, 5), [0] * m, paper8, 16)
    assert off == dataclasses.replace(ParallelConfig.single(5, 16), sharded=OFFLOADED)
    grids = [cfg for _, cfg in grid_configs(paper8, 16)]
    assert [decode_extended(grid_action(m, p), [0] * m, paper8, 16) for p in (False, True)] == grids
    assert grids[0].grid == 4 and grids[0].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    # no host on mixed-a100-v100-t4: the offloading action is model parallelism; servers of 4 devices: grids
    mixed = load_cluster("mixed-a100-v100-t4")
    assert decode_extended(offload_action(12, 2), [0] * 12, mixed, 16) == ParallelConfig.single(2, 16)
    assert decode_extended(grid_action(12, False), [0] * 12, mixed, 16).grid == 3


def test_a_micro_batch_step_moves_to_half_twice_one_fewer_one_more_or_the_other_schedule():
    index = {c: i for i, c in enumerate(EXTENDED_MICRO_CHOICES)}

    def near(k, schedule, batch):
        return [EXTENDED_MICRO_CHOICES[i] for i in micro_neighbours(index[k, schedule], batch)]

    assert near(8, "1f1b", 48) == [(4, "1f1b"), (16, "1f1b"), (7, "1f1b"), (9, "1f1b"), (8, "gpipe")]
    assert near(3, "gpipe", 48) == [(1, "gpipe"), (6, "gpipe"), (2, "gpipe"), (4, "gpipe"), (3, "1f1b")]
    # one micro-batch: the schedule is no choice; at the batch, nothing beyond it
    assert near(1, "1f1b", 48) == [(2, "1f1b")] and near(1, "gpipe", 48) == [(2, "gpipe")]
    assert near(48, "1f1b", 48) == [(24, "1f1b"), (47, "1f1b"), (48, "gpipe")]
    assert near(2, "1f1b", 2) == [(1, "1f1b"), (2, "gpipe")]
    # a count beyond the batch stands for the batch; a batch of one has no other count
    assert near(200, "1f1b", 48) == near(48, "1f1b", 48)
    assert near(4, "gpipe", 1) == [] and near(1, "1f1b", 1) == []
    # any count is some steps from any other
    seen, frontier = {(1, "1f1b")}, [(1, "1f1b")]
    while frontier:
        nxt = [c for k, s in frontier for c in near(k, s, 192) if c not in seen]
        seen.update(nxt)
        frontier = nxt
    assert seen == {(k, s) for k in range(1, 193) for s in ("1f1b", "gpipe")}


def test_the_plan_layout_and_its_micro_batch_choices():
    assert EXTENDED_MICRO_CHOICES[:len(MICRO_CHOICES)] == tuple((k, "1f1b") for k in MICRO_CHOICES)
    assert len(EXTENDED_MICRO_CHOICES) == 2 * 256 and EXTENDED_MICRO_CHOICES[256] == (1, "gpipe")
    assert {k for k, _ in EXTENDED_MICRO_CHOICES} == set(range(1, 257))
    assert plan_length(5) == 11 and plan_length(5, 8) == 51
    nvec = plan_nvec(8, 5, True, True, extended=True, batch_size=16)
    assert nvec.tolist() == [72 + 8 + 2 + 24 + 8] * 5 + [2] * 5 + [512] + [1001] * 40
    assert plan_nvec(8, 5).tolist() == [12] * 5 + [2] * 5 + [5]
    with pytest.raises(StrategyError, match="micro-batch choice 512 is out of range"):
        split_plan(np.r_[np.zeros(10), 512, np.zeros(40)], 5, 5, 8, True, True, extended=True)


def _same_plan(decoded: Strategy, plan: Strategy) -> None:
    ops = range(len(plan.group_of))
    assert [decoded.op_config(o) for o in ops] == [plan.op_config(o) for o in ops]
    rec = [np.isin(s.group_of, s.recompute).tolist() for s in (decoded, plan)]
    assert rec[0] == rec[1]
    assert decoded.micro == plan.micro and (plan.n_micro == 1 or decoded.schedule == plan.schedule)


def _round_trip(ev: Evaluator, plan: Strategy) -> np.ndarray:
    splits = ev.graph.splits is not None
    action = encode_plan(plan, ev.cluster, splits, states=True, group_of=ev.group_of)
    decoded = plan_strategy(ev, action, states=True, splits=splits, extended=True)
    _same_plan(decoded, plan)
    bare = dataclasses.replace(plan, priorities=None)      # the order of ops is no part of a plan action
    want, got = ev.evaluate(bare), ev.evaluate(decoded)
    assert got.iteration_time_s == pytest.approx(want.iteration_time_s, rel=1e-9)
    assert got.peak_memory_bytes == pytest.approx(want.peak_memory_bytes, rel=1e-9)
    return action


PLANNERS = [("single", {}), ("ev-ps", {}), ("ev-ar", {}), ("cp-ps", {}), ("cp-ar", {}), ("best-dp", {}),
            ("expert", {}), ("dpos", {}), ("random", {"seed": 1}),
            ("pipeline", {"budget_s": 1.0, "sharded": True, "schedule": "gpipe"}),
            ("mcmc", {"budget_s": 1.0, "splits": True, "sharded": True, "seed": 0})]
# make conformance: the agent zero-shot (20 s) and the searches on a cluster of three servers without hosts too
MORE = [("agent", {"budget_s": 0}), ("os-dpos", {"budget_s": 2.0}), ("pipeline", {"budget_s": 2.0, "splits": True}),
        ("mcmc", {"budget_s": 2.0, "splits": True, "sharded": True, "seed": 1})]


@pytest.mark.parametrize("method,options", PLANNERS, ids=[m for m, _ in PLANNERS])
def test_every_planners_plan_encodes_and_decodes_to_itself(ev, method, options):
    plan = planners.plan(method, evaluator=ev, **options)
    _round_trip(ev, plan)


@pytest.mark.skipif(not os.environ.get("HETEROG_PLANNER_ACTIONS"), reason="make conformance")
@pytest.mark.parametrize("cluster", ["paper-8gpu", "mixed-a100-v100-t4"])
@pytest.mark.parametrize("method,options", MORE, ids=[m for m, _ in MORE])
def test_more_planners_plans_encode_and_decode_to_themselves(ev, cluster, method, options):
    here = ev if cluster == "paper-8gpu" else Evaluator(ev.graph, load_cluster(cluster))
    _round_trip(here, planners.plan(method, evaluator=here, **options))


def test_what_the_old_actions_lacked_round_trips(ev, paper8):
    dpos = planners.plan("dpos", evaluator=ev)
    action = _round_trip(ev, dpos)
    g = ev.n_groups
    assert (action[:g] >= row_action(8, 0, True, True)).any()             # replicas on device subsets
    with pytest.raises(StrategyError, match="is no action's decoding"):
        encode_plan(dpos, paper8, True, True, extended=False, group_of=ev.group_of)
    base = planners.plan("cp-ar", evaluator=ev)
    m, b = paper8.n_devices, ev.graph.batch_size
    grid = grid_configs(paper8, b)[1][1]
    stage = ParallelConfig.of([(4, 5), (5, 11)])                          # a pipeline stage, uneven shares
    split = ParallelConfig.split_over([1, 2, 7], [333, 250, 417], b)       # a split over a device set
    kept = dataclasses.replace(stage, sharded=ShardedState(3, (1, 1), "none"))
    offloaded = dataclasses.replace(ParallelConfig.single(3, b), sharded=OFFLOADED)
    configs = [grid, stage, split, kept, offloaded] + list(base.configs[5:])
    # 3 micro-batches under GPipe: a grid of 4 groups takes at most 16 // 4
    plan = dataclasses.replace(base, configs=configs, recompute=(1, 4, 7)).with_micro_batches(3, "gpipe")
    action = _round_trip(ev, plan)
    assert action[:5].tolist() == [grid_action(m, True, True, True), row_action(m, 1, True, True),
                                   row_action(m, 2, True, True), row_action(m, 3 + 6, True, True),
                                   offload_action(m, 3, True, True)]
    rows = action[2 * g + 1:].reshape(g, m)
    assert rows[1].tolist() == [0, 0, 0, 0, 5, 11, 0, 0] and rows[2].tolist() == [0, 333, 250, 0, 0, 0, 0, 417]
    assert EXTENDED_MICRO_CHOICES[action[2 * g]] == (3, "gpipe")
    # the old layout keeps its meaning: cp-ar's plan is the same actions as before
    old = encode_plan(base, paper8, splits=False, states=False, extended=False)
    assert old.tolist() == [m + 3] * g + [0] * g + [0]
    assert encode_plan(base, paper8, True, True)[:2 * g + 1].tolist() == old.tolist()


def test_what_no_plan_action_holds_is_refused(ev, paper8):
    base = planners.plan("cp-ar", evaluator=ev)
    with pytest.raises(StrategyError, match="uneven sizes"):
        encode_plan(dataclasses.replace(base, micro_batches=(10, 6)), paper8)
    with pytest.raises(StrategyError, match="sync_batch_stats"):
        encode_plan(dataclasses.replace(base, sync_batch_stats=True), paper8)
    ring = ParallelConfig.of([(0, 8), (1, 8)], allreduce="ring")            # no planner picks the algorithm
    with pytest.raises(StrategyError, match="is no action's decoding"):
        encode_configs(dataclasses.replace(base, configs=[ring] * g_of(base)), paper8, True, True)
    served = ParallelConfig.of([(0, 8), (1, 8)], "ps", 1)                   # a PS on device 1: a PS row action
    actions, rows = encode_configs(dataclasses.replace(base, configs=[served] * g_of(base)), paper8, True, True)
    assert actions[0] == ps_row_action(8, 1, True, True) and rows[0].tolist() == [8, 8, 0, 0, 0, 0, 0, 0]
    two = dataclasses.replace(base, group_of=np.arange(len(base.group_of)) % 2,
                              configs=[ParallelConfig.single(0, 16), ParallelConfig.single(1, 16)])
    with pytest.raises(StrategyError, match="places differently"):
        regroup(two, np.zeros(len(base.group_of), dtype=np.int64))
    assert regroup(two, two.group_of) is two


def g_of(strategy: Strategy) -> int:
    return strategy.n_groups


def test_the_env_takes_extended_actions_behind_its_option(ev, paper8):
    env = PlacementEnv(ev.graph, paper8, splits=True, state_actions=True, extended_actions=True)
    plain = PlacementEnv(ev.graph, paper8, splits=True, state_actions=True)
    g = env.max_groups
    assert env.action_length == plan_length(g, 8) and plain.action_length == plan_length(g)
    assert env.action_space.nvec.tolist() == plan_nvec(8, g, True, True, True, 16).tolist()
    plan = planners.plan("dpos", evaluator=ev)
    action = encode_plan(plan, paper8, True, True, group_of=env.evaluators[0].group_of)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(action)
    want = ev.evaluate(dataclasses.replace(plan, priorities=None))
    assert terminated and info["iteration_time_s"] == pytest.approx(want.iteration_time_s, rel=1e-9)
    assert "dp-row-ar" in env.render() if env.render_mode else True
    plain.reset(seed=0)
    with pytest.raises(StrategyError, match="action must have shape"):
        plain.step(action)
    # an old plan action means the same in the extended space (its rows zero)
    old = np.r_[np.full(g, state_action(8, 9, 4, True)), np.zeros(g, dtype=np.int64), 3]
    env.reset(seed=0)
    plain.reset(seed=0)
    ext = np.r_[old, np.zeros(g * 8, dtype=np.int64)]
    assert env.step(ext)[4]["iteration_time_s"] == plain.step(old)[4]["iteration_time_s"]


def test_configs_equal_in_value_are_encoded_once(ev, paper8, monkeypatch):
    import heterog.extended_actions as ext

    calls: list[int] = []
    real = ext._encode_config
    monkeypatch.setattr(ext, "_encode_config", lambda g, *a: calls.append(g) or real(g, *a))
    # every group its own config object, two values: even data parallelism by PS and by AllReduce
    configs = [ParallelConfig.of([(d, 2) for d in range(8)], sync="allreduce" if g % 2 else "ps")
               for g in range(ev.n_groups)]
    plan = Strategy(ev.graph.fingerprint, paper8.name, 8, 16, ev.group_of, configs, "t")
    actions, rows = encode_configs(plan, paper8, splits=True, states=True)
    assert calls == [0, 1] and len({id(c) for c in configs}) == ev.n_groups
    assert (actions[::2] == 8).all() and (actions[1::2] == 9).all() and not rows.any()   # DP-even-PS, -AR
