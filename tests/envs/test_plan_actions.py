"""The plan action of the env: group configs, recompute bits and the micro-batch choice, decoded into
exactly the Strategy they describe; actions of the configs alone; clipping and refusals."""
from __future__ import annotations

import numpy as np
import pytest

from envs import MICRO_CHOICES, PlacementEnv, full_plan, plan_strategy
from envs.actions import micro_batches
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


def hand_plan(env: PlacementEnv, n_groups: int, recompute: list[int], micro_index: int) -> np.ndarray:
    action = np.zeros(env.action_length, dtype=np.int64)
    action[:n_groups] = np.arange(n_groups) % 12
    action[[env.max_groups + g for g in recompute]] = 1
    action[-1] = micro_index
    return action


def test_a_hand_written_plan_decodes_into_exactly_its_strategy(tiny_mlp, paper8):
    env = PlacementEnv(tiny_mlp, paper8, max_groups=30, render_mode="ansi")
    _, info = env.reset(seed=0)
    g = info["n_groups"]
    assert env.action_length == 61 and env.action_space.nvec.tolist() == [12] * 30 + [2] * 30 + [5]
    action = hand_plan(env, g, [1, 4, 7], micro_index=2)                # MICRO_CHOICES[2] = 4 micro-batches
    action[env.max_groups + g:env.max_groups + 30] = 1                  # padding groups' bits are ignored
    strategy = plan_strategy(env.evaluators[0], action, "env", n_slots=env.max_groups)
    assert strategy.micro_batches == (4, 4, 4, 4) and strategy.schedule == "1f1b"
    assert strategy.recompute == (1, 4, 7)
    ev = Evaluator(tiny_mlp, paper8, max_groups=30)
    expected = ev.strategy(np.arange(g) % 12).with_recompute([1, 4, 7]).with_micro_batches(4, "1f1b")
    assert [c.to_dict() for c in strategy.configs] == [c.to_dict() for c in expected.configs]
    assert strategy.meta["micro_batches"] == 4 and strategy.meta["recomputed_groups"] == 3
    assert strategy.meta["actions"] == [*(np.arange(g) % 12).tolist(), *[int(i in (1, 4, 7)) for i in range(g)], 2]
    _, r, _, _, step = env.step(action)
    result = ev.evaluate(expected)
    assert step["iteration_time_s"] == pytest.approx(result.iteration_time_s, rel=1e-12)
    assert r == pytest.approx(-np.sqrt(result.iteration_time_s), rel=1e-12)
    assert step["micro_batches"] == 4 and step["recomputed_groups"] == 3
    assert f"4 micro-batches, 3 of {g} groups recomputed" in env.render()
    # the plan differs from the plain one in time: micro-batches and recomputation are priced
    env.reset(seed=0)
    _, r_plain, _, _, plain = env.step(action[:env.max_groups])
    assert plain["micro_batches"] == 1 and plain["recomputed_groups"] == 0 and r_plain != r


def test_an_action_of_the_configs_alone_is_one_micro_batch_without_recomputation(tiny_mlp, tiny_cnn, paper8):
    env = PlacementEnv([tiny_mlp, tiny_cnn], paper8, max_groups=40)
    for name in ("tiny_mlp", "tiny_cnn"):
        env.reset(options={"graph": name})
        configs = np.full(40, 9)
        _, r_old, _, _, old = env.step(configs)
        env.reset(options={"graph": name})
        _, r_full, _, _, full = env.step(full_plan(configs, 40))
        assert r_old == r_full and old["iteration_time_s"] == full["iteration_time_s"]
        assert (old["micro_batches"], old["recomputed_groups"]) == (full["micro_batches"], full["recomputed_groups"]) \
            == (1, 0)
    assert full_plan([3, 4], 2).tolist() == [3, 4, 0, 0, 0]
    with pytest.raises(StrategyError, match=r"length 2 \(configs\) or 5"):
        full_plan([1, 2, 3], 2)


def test_micro_batch_choices_above_the_batch_are_clipped(paper8):
    assert [micro_batches(i, 16) for i in range(len(MICRO_CHOICES))] == [1, 2, 4, 8, 16]
    assert [micro_batches(i, 6) for i in range(len(MICRO_CHOICES))] == [1, 2, 4, 6, 6]
    small = capture_model("tiny_mlp", 8)
    env = PlacementEnv(small, paper8)
    _, info = env.reset(seed=0)
    action = hand_plan(env, info["n_groups"], [], micro_index=4)        # 16 micro-batches of a batch of 8
    strategy = plan_strategy(env.evaluators[0], action, n_slots=env.max_groups)
    assert strategy.micro_batches == (1,) * 8 and strategy.recompute == ()
    assert env.step(action)[4]["micro_batches"] == 8


def test_bad_recompute_bits_and_micro_batch_choices_are_refused(tiny_mlp, paper8):
    env = PlacementEnv(tiny_mlp, paper8)
    env.reset(seed=0)
    action = np.zeros(env.action_length, dtype=np.int64)
    action[env.max_groups + 2] = 2
    with pytest.raises(StrategyError, match=r"recompute bit 2 of group 2 is neither 0 \(keep\) nor 1"):
        env.step(action)
    action[env.max_groups + 2], action[-1] = 0, len(MICRO_CHOICES)
    with pytest.raises(StrategyError, match=r"micro-batch choice 5 is out of range 0..4"):
        env.step(action)
    with pytest.raises(StrategyError, match=rf"shape \({env.action_length},\) .* or \({env.max_groups},\)"):
        env.step(np.zeros(env.max_groups + 1, dtype=np.int64))
