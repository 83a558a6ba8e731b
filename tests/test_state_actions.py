"""The state actions of the action encoding (heterog.actions): AllReduce data parallelism keeping sharded
state, their offsets, names and decoding, and plans with sharded state encoded into actions and decoded
back to equal Strategies."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from heterog.actions import (
    N_STATE_CHOICES,
    STATE_CHOICES,
    base_actions,
    decode_action,
    devices_of,
    encode_strategy,
    n_actions,
    state_action,
    state_action_name,
    state_of,
    strategy_from_actions,
    with_state,
)
from heterog.baselines.fit import sharded_variants
from heterog.cluster import load_cluster
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.sharded import ShardedState
from heterog.strategy import ParallelConfig
from tests.baselines.helpers import layered_graph


@pytest.fixture(scope="module")
def paper8():
    return load_cluster("paper-8gpu")


@pytest.fixture(scope="module")
def ev(paper8):
    return Evaluator(layered_graph(6, 1 << 16, batch=32), paper8)


def test_the_state_actions_follow_the_others_and_round_trip():
    assert N_STATE_CHOICES == 21 and len(set(STATE_CHOICES)) == 21
    assert STATE_CHOICES[0] == (1, "even", "none") and STATE_CHOICES[4] == (2, "memory", "none")
    assert STATE_CHOICES[9 + 8] == (3, "speed", "optimizer") and STATE_CHOICES[18 + 1] == (3, "memory", "parameters")
    for m, splits in ((8, False), (8, True), (3, True), (1, False)):
        first = n_actions(m, splits)
        assert n_actions(m, splits, states=True) == first + 42
        assert devices_of(n_actions(m, splits, states=True), splits, states=True) == m
        seen = set()
        for base in (m + 1, m + 3):
            for s in range(N_STATE_CHOICES):
                a = state_action(m, base, s, splits)
                assert state_of(a, m, splits) == (base, s)
                seen.add(a)
        assert seen == set(range(first, first + 42))
        assert state_of(first - 1, m, splits) is None
        with pytest.raises(StrategyError, match="out of range"):
            state_of(first + 42, m, splits)
    with pytest.raises(StrategyError, match="no state action"):
        state_action(8, 8, 0)                        # DP-even-PS keeps no sharded state
    assert state_action(8, 9, 0) == 12 and state_action(8, 11, 20) == 12 + 41
    assert state_action_name(12 + 4, 8) == "dp-even-ar:s2-memory"
    assert state_action_name(12 + 21 + 17, 8) == "dp-prop-ar:s3-speed+offload"
    assert state_action_name(12 + 19, 8) == "dp-even-ar:s3-memory+offload-params"
    assert state_action_name(9, 8) == "dp-even-ar" and state_action_name(5, 8, splits=True) == "mp:5"
    plain, choices = base_actions([0, 9, 12, 12 + 21 + 5], 8)
    assert plain.tolist() == [0, 9, 9, 11] and choices.tolist() == [-1, -1, 0, 5]


def test_a_state_action_decodes_to_its_allreduce_config_keeping_the_state(paper8):
    m = paper8.n_devices
    strategy = strategy_from_actions([state_action(m, m + 3, 9 + 3 + 1, False)], np.zeros(1, dtype=np.int64),
                                     layered_graph(2, 1 << 10, batch=32), paper8, states=True)
    cfg = strategy.configs[0]
    assert cfg.sync == "allreduce" and cfg.shares == decode_action(m + 3, m, 32, paper8.power).shares
    # stage 2, shards by memory (paper-8gpu: 2 x 16 GiB, 4 x 11 GiB, 2 x 12 GiB), the optimizer state offloaded
    assert cfg.sharded == ShardedState(2, (16, 16, 11, 11, 11, 11, 12, 12), "optimizer")
    assert strategy.meta["sharded"] == [cfg.sharded.to_dict()]
    assert strategy.meta["actions"] == [12 + 21 + 13]
    # a config of one replica keeps none: the state choice is dropped
    single = ParallelConfig.single(0, 32)
    assert with_state(single, 5, paper8) is single


def test_plans_with_sharded_state_encode_into_actions_and_decode_to_equal_strategies(ev, paper8):
    m, g = paper8.n_devices, ev.n_groups
    rng = np.random.default_rng(0)
    for trial in range(4):
        actions = rng.integers(0, n_actions(m, states=True), size=g)
        actions[:2] = [state_action(m, m + 1, trial), state_action(m, m + 3, 17 - trial)]
        strategy = strategy_from_actions(actions, ev.group_of, ev.graph, paper8, states=True)
        assert strategy.configs[0].sharded is not None and strategy.configs[1].sharded is not None
        again = strategy_from_actions(encode_strategy(strategy, paper8, states=True), ev.group_of, ev.graph, paper8,
                                      states=True)
        assert again.configs == strategy.configs
        assert again.meta.get("sharded") == strategy.meta.get("sharded")
    # every stage and offload of the planners' sharded state (fit.sharded_variants), each group its own
    plain = decode_action(m + 3, m, ev.graph.batch_size, paper8.power)
    variants = sharded_variants(plain, paper8) + [dataclasses.replace(v, sharded=dataclasses.replace(
        v.sharded, offload="optimizer")) for v in sharded_variants(plain, paper8)]
    assert {(v.sharded.stage, v.sharded.offload) for v in variants} == {(s, o) for s in (1, 2, 3)
                                                                       for o in ("none", "optimizer")} | {
        (3, "parameters")}
    base = strategy_from_actions(np.full(g, m + 1), ev.group_of, ev.graph, paper8)
    for k in range(0, len(variants), g):
        chosen = variants[k:k + g]
        configs = chosen + list(base.configs[len(chosen):])
        strategy = dataclasses.replace(base, configs=configs)
        actions = encode_strategy(strategy, paper8, states=True)
        assert (actions[:len(chosen)] >= n_actions(m)).all()
        decoded = strategy_from_actions(actions, ev.group_of, ev.graph, paper8, states=True)
        assert decoded.configs == configs
    # a plan with sharded state has no actions in a space without state actions
    with pytest.raises(StrategyError, match="no action's decoding"):
        encode_strategy(dataclasses.replace(base, configs=[variants[0]] * g), paper8)
