"""The agent's state actions (``PolicyConfig.state_actions``, ``plan(sharded=True)``): the policy's logits of
AllReduce data parallelism keeping sharded state, the shipped checkpoint gaining them untrained (its greedy
plans unchanged), and a short training run that finds the only plans that fit in a memory-bound case."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from agents.checkpoint import load_checkpoint, policy_from_checkpoint
from agents.networks import StrategyPolicy
from agents.networks.config import PolicyConfig
from agents.networks.plan import STATE_PRIOR
from agents.planner import PRETRAINED, build_policy, plan, strongest_first, zero_shot
from agents.settings import TrainerSettings
from agents.tasks import GraphTask
from heterog.actions import N_STATE_CHOICES, n_actions, state_action
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from tests.envs.test_state_actions_env import P, adam_graph, tight_cluster

TINY_AGENT = {"hidden": 16, "gat_layers": 1, "gat_heads": 2, "txl_layers": 1, "txl_heads": 2,
              "segment_len": 8, "mem_len": 8}


@pytest.mark.parametrize("head", ["fixed", "tokens"])
def test_state_logits_are_the_allreduce_logits_plus_an_offset_that_starts_at_the_prior(head):
    ev = Evaluator(adam_graph(), tight_cluster(43 * P // 2))
    policy = build_policy(2, "small", seed=0, head=head, max_devices=2, state_actions=True, **TINY_AGENT)
    task = GraphTask.from_evaluator(ev, layout=policy.feature_layout)
    with torch.no_grad():
        emb = policy.embed_groups(*task.inputs.args())
        devices = policy.embed_devices(task.inputs.dev_x, task.inputs.dev_mask)
        logits = policy.logits_from_group_embeddings(emb, task.inputs.group_mask, devices)
        plans = policy.sample_plans(emb, task.inputs.group_mask, 1, greedy=True, devices=devices)
    real = task.inputs.group_mask
    assert logits.shape[-1] == n_actions(2, states=True) == 6 + 2 * N_STATE_CHOICES
    first = n_actions(2)
    for k, base in enumerate((3, 5)):
        block = logits[real][:, first + k * N_STATE_CHOICES:first + (k + 1) * N_STATE_CHOICES]
        assert torch.allclose(block, logits[real][:, base:base + 1] + STATE_PRIOR)
    assert (plans[0, :ev.n_groups] < first).all()          # a fresh policy never picks one greedily
    assert "state_actions" not in policy.settings.replace(state_actions=False).to_dict()
    assert PolicyConfig.from_dict(policy.settings.to_dict()).state_actions


def test_the_shipped_checkpoint_gains_the_state_actions_with_its_greedy_plans_unchanged():
    state = load_checkpoint(PRETRAINED)
    plain, with_states = policy_from_checkpoint(state), policy_from_checkpoint(state, state_actions=True)
    assert isinstance(with_states, StrategyPolicy) and with_states.state_actions and not plain.state_actions
    ev = Evaluator(capture_model("tiny_mlp", 16), load_cluster("paper-8gpu"))
    # zero-shot's first second already spent: both compare the candidates always compared, whatever the load
    spent = time.perf_counter() - 10.0
    before, after = zero_shot(ev, PRETRAINED, t0=spent), zero_shot(ev, PRETRAINED, states=True, t0=spent)
    assert after.meta["policy_plan_s"] == before.meta["policy_plan_s"]
    assert after.meta["kept"] == before.meta["kept"] and after.configs == before.configs
    m = ev.cluster.n_devices
    assert all(a < n_actions(m) for a in after.meta["actions"][:ev.n_groups])


def test_zero_shot_with_state_actions_finds_a_plan_that_fits_where_no_plain_one_does():
    ev = Evaluator(adam_graph(), tight_cluster(43 * P // 2))
    assert plan(ev, budget_s=0, progress=False).meta["oom"]
    found = plan(ev, budget_s=0, progress=False, sharded=True)
    # stage 3 on the GPUs, or any stage with the optimizer state offloaded (tests/envs/test_state_actions_env.py)
    assert not found.meta["oom"] and found.meta["sharded"]
    base, choice = found.meta["kept"].split(":")
    assert base in ("ev-ar", "cp-ar") and "-memory" in choice and (choice.startswith("s3") or "+offload" in choice)
    assert ev.iteration_time(found) == (found.meta["best_iteration_time_s"], False)


def test_zero_shot_compares_more_than_the_data_parallel_plans_only_in_its_time_or_while_none_fits(monkeypatch):
    import agents.planner
    from agents.candidates import promising_uniform

    monkeypatch.setattr(agents.planner, "ZERO_SHOT_S", 0.0)            # the time is spent at once
    roomy = Evaluator(capture_model("tiny_mlp", 16), load_cluster("paper-8gpu"))
    found = plan(roomy, budget_s=0, progress=False, sharded=True)
    assert found.meta["compared"] == ["policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar"] and not found.meta["oom"]
    # where no data-parallel plan fits, every state choice is compared (each scheme's strongest first), and the
    # fastest that fits kept
    tight = Evaluator(adam_graph(), tight_cluster(43 * P // 2))
    found = plan(tight, budget_s=0, progress=False, sharded=True)
    states = list(promising_uniform(tight.cluster.n_devices, states=True))[4:]
    assert found.meta["compared"] == ["policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar", *strongest_first(states)]
    assert not found.meta["oom"] and found.meta["kept"] in states
    # where even a scheme's strongest choice is out of memory, none of its others is compared
    hopeless = Evaluator(adam_graph(), tight_cluster(P))
    found = plan(hopeless, budget_s=0, progress=False, sharded=True)
    assert found.meta["oom"]
    assert found.meta["compared"] == ["policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "ev-ar:s3-memory+offload-params",
                                      "cp-ar:s3-memory+offload-params"]
    monkeypatch.setattr(agents.planner, "ZERO_SHOT_S", 1e9)
    every = plan(roomy, budget_s=0, progress=False, sharded=True).meta["compared"]
    assert every == ["policy", *promising_uniform(roomy.cluster.n_devices, states=True)]


def test_a_short_training_run_with_state_actions_keeps_sharded_state_where_only_that_fits():
    ev = Evaluator(adam_graph(), tight_cluster(43 * P // 2))
    settings = TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1, seed=0)
    found = plan(ev, "scratch", episodes=12, seed=0, progress=False, settings=settings, sharded=True, seeds=())
    assert found.meta["rounds"] >= 2 and not found.meta["oom"] and found.meta["sharded"]
    t, oom = ev.iteration_time(found)
    assert not oom and t == pytest.approx(found.meta["best_iteration_time_s"])
    actions = np.asarray(found.meta["actions"][:ev.n_groups])
    assert (actions >= n_actions(2)).any()
    assert all(c.sharded is not None for c, a in zip(found.configs, actions) if a >= n_actions(2))
    assert state_action(2, 3, 0) == n_actions(2)


def test_an_autoregressive_policy_with_state_actions_decodes_and_scores_its_plans():
    ev = Evaluator(adam_graph(), tight_cluster(43 * P // 2))
    policy = build_policy(2, "small", seed=0, autoregressive=True, state_actions=True, **TINY_AGENT)
    task = GraphTask.from_evaluator(ev, layout=policy.feature_layout)
    mask = task.inputs.group_mask
    with torch.no_grad():
        emb = policy.embed_groups(*task.inputs.args())
        plans = policy.sample_plans(emb, mask, 64, generator=torch.Generator().manual_seed(0))
        logits = policy.plan_logits(emb, mask, plans)
    assert logits.groups.shape == (64, mask.shape[0], n_actions(2, states=True))
    assert (plans[:, :ev.n_groups] >= n_actions(2)).any()        # sampled, state actions occur
    # each drawn state action's logit is its AllReduce action's plus the prior, along the plan drawn
    first = n_actions(2)
    assert torch.allclose(logits.groups[..., first:first + N_STATE_CHOICES], logits.groups[..., 3:4] + STATE_PRIOR)


def test_fine_tuning_the_shipped_checkpoint_with_state_actions_finds_a_plan_that_fits():
    ev = Evaluator(adam_graph(), tight_cluster(43 * P // 2))
    settings = TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1, seed=0)
    found = plan(ev, episodes=8, seed=0, progress=False, settings=settings, sharded=True, seeds=())
    assert found.meta["checkpoint"] == str(PRETRAINED)
    assert not found.meta["oom"] and found.meta["sharded"] and ev.iteration_time(found)[1] is False
