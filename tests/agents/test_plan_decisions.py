"""The policy's plan-level decisions (recompute bit per group, number of micro-batches): their heads and
initialisation, the log probability and entropy of whole plans, greedy plans, loading weights and trainer
checkpoints saved without them, the search's moves on them and training them."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from agents.checkpoint import policy_from_checkpoint
from agents.networks import PolicyConfig, StrategyPolicy
from agents.networks.plan import PLAN_PRIOR, PlanDistribution, plan_log_prob_parts
from agents.planner import PRETRAINED, zero_shot
from agents.tasks import make_task
from agents.trainer import Trainer, TrainerSettings, plan_columns, policy_loss
from envs import DEVICE_FEATURE_DIM, MICRO_CHOICES, op_feature_dim
from envs.actions import plan_strategy
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model

torch.set_num_threads(1)
PLAN_KEYS = ["head.plan.recompute.weight", "head.plan.recompute.bias", "head.plan.micro.weight",
             "head.plan.micro.bias"]


@pytest.fixture(scope="module")
def paper8():
    return load_cluster("paper-8gpu")


@pytest.fixture(scope="module")
def task(paper8):
    return make_task(capture_model("tiny_mlp", 16), paper8)


def tiny_policy(seed: int = 0, autoregressive: bool = False, head: str = "fixed") -> StrategyPolicy:
    torch.manual_seed(seed)
    layout = "per-device" if head == "fixed" else "device-free"
    return StrategyPolicy(PolicyConfig(op_feature_dim(8, layout), DEVICE_FEATURE_DIM, 12, hidden=16, gat_layers=1,
                                       gat_heads=2, txl_layers=1, txl_heads=2, segment_len=8, mem_len=8,
                                       autoregressive=autoregressive, head=head))


def scramble_plan_head(policy: StrategyPolicy, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in PLAN_KEYS:
            parameter = policy.get_parameter(name)
            parameter.copy_(torch.randn(parameter.shape, generator=gen))


@pytest.mark.parametrize("head", ["fixed", "tokens"])
def test_fresh_plan_heads_mildly_prefer_one_micro_batch_without_recomputation(paper8, head):
    policy = tiny_policy(head=head)
    t = make_task(capture_model("tiny_mlp", 16), paper8, layout=policy.feature_layout)
    assert all(not policy.get_parameter(k).any() for k in ("head.plan.recompute.weight", "head.plan.micro.weight"))
    with torch.no_grad():
        emb = policy.embed_groups(*t.inputs.args())
        devices = policy.embed_devices(t.inputs.dev_x, t.inputs.dev_mask)
        logits = policy.plan_logits_from_group_embeddings(emb, t.inputs.group_mask, devices)
        greedy = policy.sample_plans(emb, t.inputs.group_mask, 1, greedy=True, devices=devices)[0]
        drawn = policy.sample_plans(emb, t.inputs.group_mask, 400, generator=torch.Generator().manual_seed(0),
                                    devices=devices)
    g = t.n_groups
    assert torch.equal(logits.recompute, torch.tensor([[PLAN_PRIOR, 0.0]]).expand(g, 2))
    assert torch.equal(logits.micro, torch.tensor([PLAN_PRIOR] + [0.0] * (len(MICRO_CHOICES) - 1)))
    assert greedy.shape == (2 * g + 1,) and not greedy[g:].any()
    recompute_share = drawn[:, g:-1].float().mean().item()
    assert recompute_share == pytest.approx(1 / (1 + np.e), abs=0.02)                 # 0.27
    assert (drawn[:, -1] == 0).float().mean().item() == pytest.approx(np.e / (np.e + 4), abs=0.07)   # 0.40
    assert set(drawn[:, -1].tolist()) == set(range(len(MICRO_CHOICES)))


@pytest.mark.parametrize("autoregressive", [False, True])
def test_log_prob_of_a_sampled_plan_is_the_sum_of_its_parts(task, autoregressive):
    policy = tiny_policy(autoregressive=autoregressive)
    scramble_plan_head(policy)
    g, mask = task.n_groups, task.inputs.group_mask
    with torch.no_grad():
        emb = policy.embed_groups(*task.inputs.args())
        plans = policy.sample_plans(emb, mask, 3, generator=torch.Generator().manual_seed(2))
        logits = policy.plan_logits(emb, mask, plans)
    assert plans.shape == (3, 2 * g + 1) and logits.micro.shape == (3, len(MICRO_CHOICES))
    for k, plan in enumerate(plans.tolist()):
        by_hand = sum(torch.log_softmax(logits.groups[k, i], -1)[plan[i]].item()
                      + torch.log_softmax(logits.recompute[k, i], -1)[plan[g + i]].item() for i in range(g))
        by_hand += torch.log_softmax(logits.micro[k], -1)[plan[-1]].item()
        assert plan_log_prob_parts(logits, plans)[k].sum().item() == pytest.approx(by_hand, rel=1e-5)
    if not autoregressive:           # one set of logits for every plan: the plan distribution agrees
        once = policy.plan_logits_from_group_embeddings(emb, mask)
        dist = PlanDistribution(once, mask)
        assert torch.allclose(dist.log_prob(plans), plan_log_prob_parts(logits, plans).sum(-1))
        entropy = sum(-(x.softmax(-1) * x.log_softmax(-1)).sum(-1).mean() for x in (once.groups, once.recompute))
        entropy = entropy - (once.micro.softmax(-1) * once.micro.log_softmax(-1)).sum()
        assert dist.entropy().item() == pytest.approx(entropy.item(), rel=1e-6)
        assert torch.equal(dist.mode, policy.sample_plans(emb, mask, 1, greedy=True)[0])


def test_greedy_plans_take_the_most_likely_bits_and_micro_batches(task):
    policy = tiny_policy(autoregressive=True)
    scramble_plan_head(policy, seed=3)
    g, mask = task.n_groups, task.inputs.group_mask
    with torch.no_grad():
        emb = policy.embed_groups(*task.inputs.args())
        greedy = policy.sample_plans(emb, mask, 2, greedy=True)
        along = policy.plan_logits(emb, mask, greedy)
    assert torch.equal(greedy[0], greedy[1])
    assert torch.equal(greedy[0, g:-1], along.recompute[0].argmax(-1)) and greedy[0, -1] == along.micro[0].argmax()


def test_weights_saved_without_the_plan_heads_load_with_fresh_heads(task, caplog):
    trained = tiny_policy(seed=4)
    scramble_plan_head(trained)
    old = {k: v for k, v in trained.state_dict().items() if not k.startswith("head.plan.")}
    assert len(old) == len(trained.state_dict()) - 4
    with caplog.at_level(logging.INFO, logger="agents.networks.policy"):
        loaded = policy_from_checkpoint({"policy_config": trained.config, "policy_state": old})
    assert "without the plan-level heads" in caplog.text and "head.plan.micro.bias" in caplog.text
    fresh = tiny_policy(seed=9)
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in old.items())
    assert all(torch.equal(state[k], fresh.state_dict()[k]) for k in PLAN_KEYS)
    with pytest.raises(RuntimeError, match='Missing key.*"head.weight"'):    # other missing keys still fail
        StrategyPolicy.from_config(trained.config).load_state_dict({k: v for k, v in old.items()
                                                                    if "head.weight" not in k})


def test_a_trainer_checkpoint_saved_without_the_plan_heads_resumes(task):
    settings = TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1, seed=2)
    trainer = Trainer(tiny_policy(), [task], settings)
    trainer.train(rounds=2)
    state = trainer.state_dict()
    names = [n for n, _ in trainer.policy.named_parameters()]
    kept = [i for i, n in enumerate(names) if not n.startswith("head.plan.")]
    g = task.n_groups
    opt = state["optimizer_state"]
    old = {**state,
           "policy_state": {k: v for k, v in state["policy_state"].items() if not k.startswith("head.plan.")},
           "optimizer_state": {"state": {j: opt["state"][i] for j, i in enumerate(kept)},
                               "param_groups": [{**opt["param_groups"][0], "params": list(range(len(kept)))}]},
           "tasks": {key: {**d, "best_actions": d["best_actions"][:g], "pool": [(r, a[:g]) for r, a in d["pool"]]}
                     for key, d in state["tasks"].items()}}
    resumed = Trainer(tiny_policy(seed=5), [task], settings)
    resumed.load_state_dict(old)
    best = resumed.states[task.key].best_actions
    assert best == [*state["tasks"][task.key]["best_actions"][:g], *[0] * (g + 1)]
    assert all(len(a) == 2 * g + 1 for _, a in resumed.states[task.key].pool)
    new_state = resumed.optimizer.state_dict()["state"]
    for j, i in enumerate(kept):
        assert torch.equal(new_state[i]["exp_avg"], opt["state"][i]["exp_avg"]), names[i]
    assert all(i not in new_state for i, n in enumerate(names) if n.startswith("head.plan."))
    resumed.train(rounds=1)
    assert resumed.rounds == 3


def test_the_shipped_checkpoint_plans_with_its_fresh_plan_heads(paper8):
    """The shipped policy predates the plan-level heads: it loads, and its zero-shot plan is one micro-batch
    without recomputation, reported in the plan's meta."""
    ev = Evaluator(capture_model("tiny_mlp", 16), paper8)
    strategy = zero_shot(ev, PRETRAINED)
    assert strategy.meta["micro_batches"] == 1 == strategy.n_micro
    assert strategy.meta["recomputed_groups"] == 0 and strategy.recompute == ()
    assert len(strategy.meta["actions"]) == 2 * ev.n_groups + 1
    assert ev.iteration_time(strategy)[0] == pytest.approx(strategy.meta["best_iteration_time_s"])


def test_the_best_plan_is_decoded_with_its_micro_batches_and_recomputation(task):
    trainer = Trainer(tiny_policy(), [task], TrainerSettings(samples_per_graph=2, explore_samples=0, mutate_samples=0))
    g = task.n_groups
    trainer.states[task.key].best_actions = [9] * g + [1, 0, 1] + [0] * (g - 3) + [3]
    strategy = trainer.best_strategy(task)
    assert strategy.micro_batches == (2,) * 8 and strategy.recompute == (0, 2)
    assert strategy.meta["micro_batches"] == 8 and strategy.meta["recomputed_groups"] == 2
    assert strategy.to_dict()["meta"]["recomputed_groups"] == 2


def test_memory_mutations_change_the_micro_batches_or_some_recompute_bits(task):
    g = 10
    base = torch.cat([torch.arange(g) % 12, torch.tensor([0, 1] * 5), torch.tensor([2])])
    search = Trainer(tiny_policy(), [task], TrainerSettings(mutate_memory=1.0, mutate_groups=2)).search
    out = search.mutate_plans(base, g, 12, 200)
    assert out.shape == (200, 2 * g + 1) and (out[:, :g] == base[:g]).all()      # memory moves keep the configs
    micro = out[:, -1] != base[-1]
    flipped = (out[:, g:-1] != base[g:-1]).sum(dim=1)
    assert ((micro & (flipped == 0)) | (~micro & (flipped == 2))).all()
    assert 70 < int(micro.sum()) < 130 and set(out[micro, -1].tolist()) == {0, 1, 3, 4}
    plain = Trainer(tiny_policy(), [task], TrainerSettings(mutate_memory=0.0, mutate_groups=2)).search
    kept = plain.mutate_plans(base, g, 12, 50)
    assert (kept[:, g:] == base[g:]).all() and ((kept[:, :g] != base[:g]).sum(dim=1) == 2).all()


def test_plans_with_micro_batches_are_scored_as_their_strategies(task):
    trainer = Trainer(tiny_policy(), [task], TrainerSettings())
    g, ev = task.n_groups, task.evaluator
    plans = np.zeros((2, 2 * g + 1), dtype=np.int64)
    plans[:, :g] = 9
    plans[1, g:g + 4], plans[1, -1] = 1, 3
    _, times, _ = trainer.evaluate(task, plans)
    expected = ev.strategy(np.full(g, 9)).with_recompute([0, 1, 2, 3]).with_micro_batches(8, "1f1b")
    assert times[0] == ev.iteration_time(ev.strategy(np.full(g, 9)))[0]
    assert times[1] == ev.iteration_time(expected)[0] == ev.iteration_time(plan_strategy(ev, plans[1]))[0]
    assert times[1] != times[0]


def test_the_network_states_the_envs_choices_without_importing_the_env():
    import subprocess
    import sys

    from agents.networks import N_MICRO_CHOICES
    from agents.networks.common import KEEP_ACTIVATIONS
    from envs.actions import KEEP

    assert N_MICRO_CHOICES == len(MICRO_CHOICES) and KEEP_ACTIVATIONS == KEEP
    loaded = subprocess.run([sys.executable, "-c", "import sys, agents.networks; print('gymnasium' in sys.modules, "
                             "'envs' in sys.modules)"], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["False", "False"]


def test_a_policys_plan_steps_the_env_padded(task, paper8):
    from agents.features import PolicyInputs, pad_plans
    from envs import PlacementEnv

    env = PlacementEnv(capture_model("tiny_mlp", 16), paper8, max_groups=30)
    obs, info = env.reset(seed=0)
    g = info["n_groups"]
    policy = tiny_policy()
    scramble_plan_head(policy, seed=6)
    inputs = PolicyInputs.from_observation(obs)
    with torch.no_grad():
        emb = policy.embed_groups(*inputs.args())
        plan = policy.sample_plans(emb, inputs.group_mask, 1, generator=torch.Generator().manual_seed(1))[0].numpy()
    action = pad_plans(plan, g, 30)
    assert action.shape == (61,) and (action[g:30] == 0).all() and (action[30 + g:60] == 0).all()
    assert action[30:30 + g].tolist() == plan[g:2 * g].tolist() and action[-1] == plan[-1]
    step = env.step(action)[4]
    strategy = plan_strategy(env.evaluators[0], plan)
    assert step["micro_batches"] == strategy.n_micro and step["recomputed_groups"] == int(plan[g:2 * g].sum()) > 0
    assert step["iteration_time_s"] == pytest.approx(env.evaluators[0].iteration_time(strategy)[0], rel=1e-12)


def test_the_policy_loss_of_plans_weighs_each_decision_as_a_group():
    log_p = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.2, 0.4, 0.8]]))
    adv = torch.tensor([1.0, -2.0])
    assert policy_loss(log_p, log_p, adv, "reinforce", 0.2, per=2).item() == pytest.approx(
        -(log_p[0].sum() - 2 * log_p[1].sum()).item() / 2 / 2, rel=1e-6)
    assert plan_columns(torch.tensor([0, 2]), 4).tolist() == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("algorithm, autoregressive, head", [("reinforce", False, "fixed"), ("ppo", True, "fixed"),
                                                             ("reinforce", False, "tokens")])
def test_training_sends_gradients_to_the_plan_heads(paper8, algorithm, autoregressive, head):
    policy = tiny_policy(autoregressive=autoregressive, head=head)
    t = make_task(capture_model("tiny_mlp", 16), paper8, layout=policy.feature_layout)
    settings = TrainerSettings(algorithm=algorithm, samples_per_graph=4, explore_samples=1, mutate_samples=1,
                               ppo_epochs=2, imitation_coef=1.0, seed=3)
    trainer = Trainer(policy, [t], settings)
    before = {k: policy.get_parameter(k).detach().clone() for k in PLAN_KEYS}
    stats = trainer.update()
    for k in PLAN_KEYS:
        grad = policy.get_parameter(k).grad
        assert grad is not None and grad.abs().sum() > 0, k
        assert not torch.equal(policy.get_parameter(k), before[k]), k
    assert 0.0 <= stats["recompute_share"] <= 1.0 and len(stats["micro_choices"]) == 4
    trainer.train(rounds=2)
    best = trainer.best_strategy(t)
    assert len(trainer.states[t.key].best_actions) == 2 * t.n_groups + 1
    assert best.meta["micro_batches"] == best.n_micro and best.meta["recomputed_groups"] == len(best.recompute)
