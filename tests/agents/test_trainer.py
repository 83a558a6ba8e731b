"""The trainer: the loss functions, baselines and advantages, its candidates (exploration, mutations, the
replay pool), determinism, learning on a tiny graph (REINFORCE and PPO), several graphs per round, and
TensorBoard output."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from agents.networks import PolicyConfig, StrategyPolicy
from agents.reporting import action_breakdown, time_to_quality
from agents.tasks import TaskState, make_task
from agents.trainer import (
    BudgetSpent,
    Trainer,
    TrainerSettings,
    bias_towards_data_parallel,
    imitation_weights,
    per_group_log_prob,
    policy_loss,
)
from envs import DEVICE_FEATURE_DIM, op_feature_dim
from envs.actions import full_plan
from heterog.baselines.chains import group_loads
from heterog.cluster import load_cluster
from heterog.errors import CheckpointError, HeterogError
from heterog.graph.cache import capture_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def paper8():
    return load_cluster("paper-8gpu")


@pytest.fixture(scope="module")
def tasks(paper8):
    return [make_task(capture_model("tiny_mlp", 16), paper8), make_task(capture_model("tiny_cnn", 16), paper8)]


def tiny_policy(seed: int = 0, n_devices: int = 8, autoregressive: bool = False) -> StrategyPolicy:
    torch.manual_seed(seed)
    return StrategyPolicy(PolicyConfig(op_feature_dim(n_devices), DEVICE_FEATURE_DIM, n_devices + 4, hidden=16,
                                       gat_layers=1, gat_heads=2, txl_layers=1, txl_heads=2, segment_len=8, mem_len=8,
                                       autoregressive=autoregressive))


def weights(policy):
    return torch.cat([p.detach().flatten() for p in policy.parameters()])


# ------------------------------------------------------------------------------------------- pieces
def test_settings_report_every_problem_at_once():
    with pytest.raises(HeterogError, match="algorithm 'a2c' is not one of .*; samples_per_graph must be positive, "
                                           "got 0.*replay_samples 9 exceeds replay_pool_size 8"):
        TrainerSettings(algorithm="a2c", samples_per_graph=0, replay_samples=9)
    with pytest.raises(HeterogError, match=r"explore_samples 2 \+ mutate_samples 26 must be in "
                                           r"0..samples_per_graph-1 \(3\)"):
        TrainerSettings(samples_per_graph=4)
    with pytest.raises(HeterogError, match=r"explore_samples 2 \+ mutate_samples 2 .*mutate_groups must be at least 1"):
        TrainerSettings(samples_per_graph=4, explore_samples=2, mutate_samples=2, mutate_groups=0)


def test_per_group_log_prob_picks_each_groups_action():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), 0.0]])
    lp = per_group_log_prob(logits, torch.tensor([[1, 0], [0, 1]]))
    assert lp.shape == (2, 2)
    assert torch.allclose(lp.exp(), torch.tensor([[0.75, 2 / 3], [0.25, 1 / 3]]))


def test_policy_loss_reinforce_and_ppo_agree_at_ratio_one_and_ppo_clips():
    log_p = torch.log(torch.tensor([[0.5, 0.25], [0.2, 0.4]])).requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    reinforce = policy_loss(log_p, log_p.detach(), adv, "reinforce", 0.2)
    assert reinforce.item() == pytest.approx(-(0.5 * (math.log(0.5) + math.log(0.25))
                                               - (math.log(0.2) + math.log(0.4))) / 2 * 1, rel=1e-6)
    g1 = torch.autograd.grad(reinforce, log_p)[0]
    g2 = torch.autograd.grad(policy_loss(log_p, log_p.detach(), adv, "ppo", 0.2), log_p)[0]
    assert torch.allclose(g1, g2)
    # ratio 2 with a positive advantage is clipped: no gradient pushes it further
    new = (log_p.detach() + math.log(2.0)).requires_grad_()
    g3 = torch.autograd.grad(policy_loss(new, log_p.detach(), torch.tensor([1.0, 1.0]), "ppo", 0.2), new)[0]
    assert (g3 == 0).all()


def test_advantages_use_the_baseline_before_the_round_then_move_it(tasks):
    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings(baseline_decay=0.5, normalize_advantage=False))
    state = TaskState()
    first = trainer.advantages(state, np.array([-1.0, -3.0]), np.zeros(0))
    assert first.tolist() == [1.0, -1.0] and state.baseline == -2.0
    second = trainer.advantages(state, np.array([-1.0, -1.0]), np.array([-0.5, -4.0]))
    assert second.tolist() == [1.0, 1.0, 1.5, 0.0]     # replayed strategies: clipped at 0
    assert state.baseline == pytest.approx(-1.5)
    normalised = Trainer(tiny_policy(), tasks[:1], TrainerSettings(baseline_decay=0.5))
    s2 = TaskState()
    adv = normalised.advantages(s2, np.array([-1.0, -3.0]), np.zeros(0))
    assert adv == pytest.approx([1.0, -1.0], rel=1e-3)   # divided by the reward std (1)


@pytest.mark.parametrize("autoregressive", [False, True])
def test_exploration_samples_share_one_logit_offset_per_strategy(tasks, autoregressive):
    def trainer(noise):
        torch.manual_seed(0)
        policy = StrategyPolicy(PolicyConfig(op_feature_dim(8), DEVICE_FEATURE_DIM, 12, hidden=16, gat_layers=1,
                                             gat_heads=2, txl_layers=1, txl_heads=2, segment_len=8, mem_len=8,
                                             autoregressive=autoregressive))
        return Trainer(policy, tasks[:1], TrainerSettings(explore_noise=noise))

    task = tasks[0]
    wild, calm = trainer(1e4), trainer(0.0)
    with torch.no_grad():
        group_emb = wild.policy.embed_groups(*task.inputs.args())

        def explore(t, n):
            offsets = t.search.explore_offsets(n)
            assert offsets.shape == (n, 12)
            return t.policy.sample_actions(group_emb, task.inputs.group_mask, n, generator=t.generator,
                                           offsets=offsets)

        actions = explore(wild, 6)
        assert actions.shape == (6, task.n_groups)
        # huge offsets: every group of a strategy takes that strategy's top action
        assert all(len(set(row.tolist())) == 1 for row in actions)
        assert len({row[0].item() for row in actions}) > 1
        # no offset: the fresh policy's near-uniform choice per group
        assert len(set(explore(calm, 4).flatten().tolist())) > 6
        assert explore(wild, 0).shape == (0, task.n_groups)


def test_mutations_change_that_many_groups_of_the_base_strategy(tasks):
    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings(mutate_groups=2))
    base = torch.arange(10) % 12
    out = trainer.search.mutate(base, 12, 50)
    assert out.shape == (50, 10) and out.min() >= 0 and out.max() < 12
    assert ((out != base).sum(dim=1) == 2).all()                  # two groups, each to another action
    assert len({tuple(r.tolist()) for r in out}) > 25
    assert trainer.search.mutate(base, 12, 0).shape == (0, 10)
    again = Trainer(tiny_policy(), tasks[:1], TrainerSettings(mutate_groups=2))
    assert torch.equal(again.search.mutate(base, 12, 50), out)


def test_guided_mutations_follow_the_policys_probabilities(tasks):
    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings(mutate_guided=0.5))
    base = torch.zeros(10, dtype=torch.long)
    guide = torch.zeros(10, 12)
    guide[:, 0] = 1.0                                  # the policy would keep every group ...
    guide[3] = torch.tensor([0.2] + [0.0] * 10 + [0.8])  # ... but group 3, which it would move to action 11
    out = trainer.search.mutate(base, 12, 400, guide)
    assert ((out != base).sum(dim=1) == 1).all()
    guided, uniform = out[:200], out[200:]             # the first half is guided
    assert (guided[:, 3] == 11).all() and (guided[:, [0, 1, 2, 4, 5, 6, 7, 8, 9]] == 0).all()
    assert (uniform != base).any(dim=0).all() and len(set(uniform[:, 3].tolist())) > 3
    with pytest.raises(HeterogError, match="mutate_guided"):
        TrainerSettings(mutate_guided=1.5)


def test_record_keeps_the_best_and_a_pool_of_distinct_strategies(tasks):
    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings(replay_pool_size=3, replay_samples=2))
    state = TaskState()
    g = tasks[0].n_groups

    def plans(*values: int) -> np.ndarray:                 # every group under one action, one plan per value
        return np.repeat(np.array(values)[:, None], g, axis=1)

    rewards = np.array([-2.0, -1.0, -2.0, -5.0, -3.0])
    trainer.record(tasks[0], state, plans(1, 2, 1, 3, 4), rewards, rewards ** 2, np.zeros(5, dtype=bool))
    assert state.best_actions == [2] * g and state.best_iteration_time_s == 1.0 and state.episodes == 5
    assert [a[0] for _, a in state.pool] == [2, 1, 4]
    trainer.record(tasks[0], state, plans(5), np.array([-0.5]), np.array([0.25]), np.zeros(1, bool))
    assert [a[0] for _, a in state.pool] == [5, 2, 1]
    assert [h[3] for h in state.history] == [1.0, 0.25]
    replay_actions, replay_rewards = trainer.search.replay(state)
    assert replay_actions.shape == (2, g) and set(replay_rewards) <= {-0.5, -1.0, -2.0}


def test_the_imitation_target_is_the_best_plan_the_policys_actions_hold(tasks):
    """Where the best plan lies beyond the policy's actions (a demonstrated pipeline, a server's rows), the
    imitation term and the distillation fit the best plan the actions hold, not nothing."""
    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings())
    task, g, a = tasks[0], tasks[0].n_groups, trainer.policy.n_actions
    state = trainer.states[task.key]
    assert trainer.imitation_target(task) is None                          # nothing recorded yet
    beyond = full_plan(np.full(g, a), g)                                    # an action the policy lacks
    held_worse, held_better = full_plan(np.full(g, 1), g), full_plan(np.full(g, 2), g)
    trainer.record(task, state, np.stack([beyond]), np.array([-0.5]), np.array([0.25]), np.zeros(1, bool))
    assert state.best_actions == beyond.tolist() and trainer.imitation_target(task) is None
    trainer.record(task, state, np.stack([held_worse, held_better]), np.array([-3.0, -2.0]), np.array([9.0, 4.0]),
                   np.zeros(2, bool))
    assert state.best_actions == beyond.tolist()                           # the search still starts from it
    assert trainer.imitation_target(task)[0].tolist() == held_better.tolist()
    trainer.record(task, state, np.stack([held_worse]), np.array([-0.1]), np.array([0.01]), np.zeros(1, bool))
    assert trainer.imitation_target(task)[0].tolist() == held_worse.tolist()   # now the best, and held


def test_time_to_quality_reads_the_history():
    history = [(1.0, 0.5, 16, 0.9), (4.0, 2.0, 64, 0.7), (9.0, 4.5, 128, 0.6)]
    assert time_to_quality(history, 0.7) == 4.0 and time_to_quality(history, 0.65, clock="cpu_s") == 4.5
    assert time_to_quality(history, 0.5) is None


def test_policy_for_another_cluster_size_is_refused(tasks):
    with pytest.raises(CheckpointError, match=r"policy has 6 actions \(2 devices\).*8 devices \(12 actions\)"):
        Trainer(tiny_policy(n_devices=2), tasks, TrainerSettings())


def test_dp_bias_raises_the_data_parallel_probability(tasks):
    policy = tiny_policy()
    bias_towards_data_parallel(policy, math.log(2.0))
    with torch.no_grad():
        probs = policy(*tasks[0].inputs.args()).softmax(-1)
    # 4 DP actions at twice the weight of 8 MP ones: P(DP) ~ 8 / 16 (head starts near zero)
    assert probs[:, 8:].sum(-1).mean().item() == pytest.approx(0.5, abs=0.05)


def test_action_breakdown_shares_sum_to_one(tasks):
    task = tasks[1]
    actions = np.arange(task.n_groups) % 12
    rows = action_breakdown(task, actions)
    assert sum(r["groups"] for r in rows) == task.n_groups
    assert sum(r["op_share"] for r in rows) == pytest.approx(1.0)
    assert sum(r["compute_share"] for r in rows) == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("autoregressive", [False, True])
def test_training_is_determined_by_the_seed(tasks, autoregressive):
    def run(seed):
        settings = TrainerSettings(seed=seed, samples_per_graph=4, explore_samples=1, mutate_samples=1)
        trainer = Trainer(tiny_policy(seed, autoregressive=autoregressive), tasks, settings)
        trainer.train(rounds=3)
        return weights(trainer.policy), trainer.summary()

    (w0, s0), (w1, s1), (w2, _) = run(0), run(0), run(1)
    assert torch.equal(w0, w1) and not torch.equal(w0, w2)
    assert {k: v["best_iteration_time_s"] for k, v in s0["graphs"].items()} == \
           {k: v["best_iteration_time_s"] for k, v in s1["graphs"].items()}


@pytest.mark.parametrize("algorithm, autoregressive", [("reinforce", False), ("ppo", False), ("reinforce", True)])
def test_training_lowers_the_sampled_iteration_time(tasks, algorithm, autoregressive):
    """On tiny_mlp everything on one GPU is fastest (transfers dwarf the compute); sampled plans move
    towards it."""
    settings = TrainerSettings(algorithm=algorithm, samples_per_graph=8, learning_rate=1e-2, seed=0,
                               ppo_epochs=2, mutate_samples=0)
    trainer = Trainer(tiny_policy(autoregressive=autoregressive), tasks[:1], settings)
    first = trainer.update()["reward_mean"]
    rewards = [trainer.update()["reward_mean"] for _ in range(30)]
    assert np.mean(rewards[-3:]) > 0.7 * first       # rewards are negative: mean -sqrt(T) up by 30%
    state = trainer.states[tasks[0].key]
    assert state.best_iteration_time_s < 0.5 * first ** 2


def test_graphs_per_round_updates_a_seeded_subset(tasks):
    trainer = Trainer(tiny_policy(), tasks, TrainerSettings(graphs_per_round=1, samples_per_graph=2, explore_samples=1,
                                                            mutate_samples=0))
    trainer.train(rounds=6)
    counts = [trainer.states[t.key].episodes for t in tasks]
    assert sum(counts) == 12 and all(c > 0 for c in counts)
    again = Trainer(tiny_policy(), tasks, TrainerSettings(graphs_per_round=1, samples_per_graph=2, explore_samples=1,
                                                            mutate_samples=0))
    again.train(rounds=6)
    assert [again.states[t.key].episodes for t in tasks] == counts


def test_train_stops_on_episodes_and_needs_a_limit(tasks):
    settings = TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=0)
    trainer = Trainer(tiny_policy(), tasks[:1], settings)
    summary = trainer.train(episodes=10)
    assert summary["episodes"] == 12 and summary["rounds"] == 3
    with pytest.raises(HeterogError, match="rounds, episodes or budget_s"):
        trainer.train()


def test_tensorboard_metrics_curve_and_gantt(tasks, tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    settings = TrainerSettings(samples_per_graph=2, explore_samples=1, mutate_samples=0, log_every=2)
    trainer = Trainer(tiny_policy(), tasks, settings, writer=writer, run_dir=tmp_path)
    trainer.train(rounds=3)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "histograms": 0, "tensors": 0}).Reload()
    tags = acc.Tags()
    for name in ("charts/reward_mean", "charts/reward_max", "losses/policy", "losses/entropy", "perf/sims_per_s",
                 *(f"charts/best_iteration_time_s/{t.name}" for t in tasks),
                 *(f"charts/baseline/{t.name}" for t in tasks)):
        assert name in tags["scalars"], name
    assert [e.step for e in acc.Scalars("charts/reward_mean")] == [1, 2, 3]
    best = acc.Scalars(f"charts/best_iteration_time_s/{tasks[0].name}")[-1].value
    assert best == pytest.approx(trainer.states[tasks[0].key].best_iteration_time_s, rel=1e-6)
    assert "actions/sampled" in tags["histograms"]
    assert {f"gantt/{t.name}" for t in tasks} <= set(tags["images"])
    assert any("actions/breakdown" in t for t in tags["tensors"])
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    assert (tmp_path / f"gantt_{tasks[1].name}.png").stat().st_size > 1000


def test_uniform_plans_seed_the_pool_before_the_first_samples(tasks):
    """Every group on GPU 0, ..., every group with one DP scheme (the DP baselines): simulated once before
    the first round, in the pool, the best of them the starting best; not counted as sampled episodes."""
    task = tasks[1]
    n_actions = task.inputs.n_devices + 4
    uniform = np.repeat(np.arange(n_actions)[:, None], task.n_groups, axis=1)
    times = [task.evaluator.iteration_time(task.evaluator.strategy(a, "u"))[0] for a in uniform]
    settings = TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1, replay_pool_size=16,
                               replay_samples=0)
    trainer = Trainer(tiny_policy(), [task], settings)
    trainer.update()
    state = trainer.states[task.key]
    assert state.episodes == trainer.episodes == 4
    assert state.best_iteration_time_s <= min(times)
    seeded = [h for h in state.history if h[2] == 0]        # recorded before any sample: the uniform plans
    assert seeded and seeded[-1][3] == min(times)
    pooled = {tuple(a) for _, a in state.pool}
    seeds = full_plan(uniform[np.argsort(times, kind="stable")[:8]], task.n_groups)   # one micro-batch, none recomputed
    assert {tuple(u) for u in seeds} <= pooled
    # off: the first best is one of the round's samples
    plain = Trainer(tiny_policy(), [task], TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1,
                                                           seed_uniform_plans=False))
    plain.update()
    assert plain.states[task.key].history[0][2] == 4


def test_each_round_scores_the_policys_greedy_plan_as_an_off_policy_sample(tasks):
    """greedy_samples=1: the sample after the policy's draws is its most likely plan (what zero-shot
    returns), scored every round and used like a replay (advantage clipped at 0); 0: only draws."""
    task = tasks[1]
    seen = []

    def trainer(greedy: int) -> Trainer:
        t = Trainer(tiny_policy(seed=3), [task], TrainerSettings(samples_per_graph=6, greedy_samples=greedy,
                                                                 explore_samples=1, mutate_samples=1, seed=4,
                                                                 seed_uniform_plans=False, replay_samples=0))
        score = t.evaluate
        t.evaluate = lambda tk, actions: (seen.append(actions.copy()), score(tk, actions))[1]
        return t

    t = trainer(1)
    with torch.no_grad():
        group_emb = t.policy.embed_groups(*task.inputs.args())
        mode = t.policy.sample_plans(group_emb, task.inputs.group_mask, 1, greedy=True)[0].numpy()
    assert (mode[task.n_groups:] == 0).all()          # a fresh policy's greedy plan: one micro-batch, no recompute
    sample = t.rollout(task)
    actions = seen[-1]
    assert actions.shape == (6, 2 * task.n_groups + 1)
    assert (actions[3] == mode).all()                                # after 6 - 1 greedy - 1 explore - 1 mutate draws
    assert not any((actions[i] == mode).all() for i in range(3))     # a fresh policy's draws are not its mode
    assert sample.advantages[3] >= 0                                 # off-policy from the greedy plan on
    with pytest.raises(HeterogError, match="greedy_samples must be 0 or 1, got 2"):
        TrainerSettings(greedy_samples=2)
    trainer(0).rollout(task)
    assert not any((a == mode).all() for a in seen[-1])


def test_block_mutations_set_one_coupled_block_to_one_new_action(tasks):
    """mutate_blocks=1: every mutation is the base with one block (drawn by its probability) set to one
    action; a block that holds one action everywhere gets another one."""
    from agents.candidates import BlockMoves

    blocks = BlockMoves([torch.tensor([1, 2, 3]), torch.tensor([5, 6])],
                        torch.tensor([0.75, 0.25], dtype=torch.float64), [1, 5])
    base = torch.tensor([0, 4, 4, 4, 0, 2, 9, 0, 0, 0])
    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings(mutate_blocks=1.0))
    out = trainer.search.mutate(base, 12, 400, blocks=blocks)
    first = 0
    for row in out:
        changed = set(torch.nonzero(row != base).flatten().tolist())
        assert changed <= {1, 2, 3} or changed <= {5, 6}
        block = [1, 2, 3] if changed & {1, 2, 3} or not changed else [5, 6]
        assert len(set(row[block].tolist())) == 1                      # the whole block on one action
        if block == [1, 2, 3]:
            assert row[1] != 4                                          # uniform before: a new action
            first += 1
    assert 240 < first < 360                                            # drawn by p (0.75)
    assert len({int(r[5]) for r in out if r[5] == r[6]}) > 6           # the block [5, 6]'s actions vary
    # off (or no blocks): the plain single-group mutations, draw for draw
    plain = Trainer(tiny_policy(), tasks[:1], TrainerSettings(mutate_blocks=0.0)).search.mutate(base, 12, 50,
                                                                                              blocks=blocks)
    assert torch.equal(plain, Trainer(tiny_policy(), tasks[:1], TrainerSettings()).search.mutate(base, 12, 50))
    with pytest.raises(HeterogError, match=r"mutate_blocks must be in \[0, 1\], got 1.5"):
        TrainerSettings(mutate_blocks=1.5)


def test_cp_ar_ps_small_seeds_the_search_with_the_uniform_plans(tasks, paper8):
    """MCMC's cp-ar-ps-small start (CP-AR, small gradients on CP-PS) is seeded beside the uniform plans:
    it is in the pool, and the best recorded before any sample is the best of all of them."""
    from heterog.baselines.mcmc import start_actions

    task = make_task(capture_model("tiny_transformer", 16), paper8)
    ev = task.evaluator
    hybrid = start_actions(ev, "cp-ar-ps-small", np.random.default_rng(0))
    uniform = np.repeat(np.arange(12)[:, None], task.n_groups, axis=1)
    assert not (uniform == hybrid).all(axis=1).any() and set(hybrid.tolist()) == {10, 11}
    times = [ev.iteration_time(ev.strategy(a, "u"))[0] for a in [*uniform, hybrid]]
    trainer = Trainer(tiny_policy(), [task], TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1,
                                                             replay_samples=0, replay_pool_size=32))
    trainer.update()
    state = trainer.states[task.key]
    assert full_plan(hybrid, task.n_groups).tolist() in [a for _, a in state.pool]
    seeded = [h for h in state.history if h[2] == 0]        # recorded before any sample: the uniform plans
    assert seeded and seeded[-1][3] == min(times)
    assert state.best_iteration_time_s <= min(times)


def test_block_tie_maps_each_group_to_its_blocks_leader():
    from agents.candidates import BlockMoves

    groups, p = [torch.tensor([2, 5, 7]), torch.tensor([3, 4])], torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert BlockMoves(groups, p, [2, 3]).tie(9).tolist() == [0, 1, 2, 3, 3, 2, 6, 2, 8]
    assert BlockMoves(groups, p, [7, 3]).tie(9).tolist() == [0, 1, 7, 3, 3, 7, 6, 7, 8]
    overlapping = BlockMoves([torch.tensor([1, 2, 3, 4]), torch.tensor([3, 4])], p, [1, 4])
    assert overlapping.tie(6).tolist() == [0, 1, 1, 4, 4, 5]                          # the later block wins


@pytest.mark.parametrize("tie_blocks", [True, False])
def test_tied_blocks_give_each_block_of_the_policys_samples_one_decision(paper8, tie_blocks):
    from agents.candidates import BlockMoves

    task = make_task(capture_model("tiny_transformer", 8), paper8)
    blocks = BlockMoves.of(task.evaluator).groups
    assert len(blocks) == 3                         # tiny_transformer's coupled blocks (9, 9 and 7 groups)
    settings = TrainerSettings(seed=1, tie_blocks=tie_blocks, greedy_samples=1, initial_dp_bias=0.0)
    t = Trainer(tiny_policy(0, n_devices=8), [task], settings)
    sample = t.rollout(task)
    own = sample.actions[:settings.samples_per_graph - settings.mutate_samples]     # draws, greedy, explore
    split = [bool((own[:, g] != own[:, g[:1]]).any()) for g in blocks]
    if not tie_blocks:
        assert sample.decisions is None and any(split)        # a uniform-ish fresh policy splits blocks
        return
    assert not any(split)
    tie = BlockMoves.of(task.evaluator).tie(task.evaluator.n_groups)
    followers = {g for g in range(task.evaluator.n_groups) if int(tie[g]) != g}
    assert len(followers) == sum(len(g) - 1 for g in blocks)                  # the three blocks are disjoint
    assert set(sample.decisions.tolist()) == set(range(task.evaluator.n_groups)) - followers
    t.update()                                                  # the loss runs over the decisions only
    assert t.rounds == 1


def test_ties_blocks_reads_the_trainer_settings_of_a_checkpoint():
    from agents.checkpoint import ties_blocks

    assert ties_blocks({"settings": {"tie_blocks": True}})
    assert ties_blocks({"provenance": {"settings": {"tie_blocks": True}}})
    assert not ties_blocks({"provenance": {"settings": {"mutate_blocks": 0.25}}})     # before the setting
    assert not ties_blocks({"settings": {"tie_blocks": False}})


def test_imitation_weights_mix_even_and_load_shares():
    w = imitation_weights(np.array([1.0, 1.0, 2.0]), np.array([0.0, 0.0, 4.0]), 0.5)
    # shares: FLOPs (1/4, 1/4, 1/2), gradient bytes (0, 0, 1); 0.5 + 0.5 * 3 * their mean
    assert torch.allclose(w, torch.tensor([0.6875, 0.6875, 1.625])) and w.mean().item() == pytest.approx(1.0)
    assert torch.allclose(imitation_weights(np.array([1.0, 3.0]), np.zeros(2), 1.0), torch.tensor([0.75, 1.25]))
    assert torch.equal(imitation_weights(np.array([1.0, 3.0]), np.zeros(2), 0.0), torch.ones(2))
    with pytest.raises(HeterogError, match="imitation_by_load must be in"):
        TrainerSettings(imitation_by_load=1.5)


@pytest.mark.parametrize("autoregressive", [False, True])
def test_imitation_term_is_the_cross_entropy_against_the_best_plan_and_pulls_towards_it(tasks, autoregressive):
    """imitation_coef: the round's loss adds -log pi(best plan found, this round's samples included), a
    mean over groups weighted by load (``imitation_by_load``); the round's statistic is that value before
    the step, and the step raises the best plan's likelihood more than the policy gradient alone does
    (both trainers draw the same round)."""
    import copy

    task = tasks[1]

    def trainer(coef: float) -> Trainer:
        return Trainer(tiny_policy(seed=2, autoregressive=autoregressive), [task],
                       TrainerSettings(imitation_coef=coef, seed=5, samples_per_graph=6, explore_samples=1,
                                       mutate_samples=2))

    weights = imitation_weights(*group_loads(task.evaluator.graph, np.asarray(task.evaluator.group_of)), 0.5)

    def log_likelihood(policy, best):          # configs and recompute bits by group weight, the micro-batches by 1
        g = task.n_groups
        with torch.no_grad():
            emb = policy.embed_groups(*task.inputs.args())
            logits = policy.plan_logits(emb, task.inputs.group_mask, best[None])
            configs = per_group_log_prob(logits.groups, best[None, :g])[0]
            bits = per_group_log_prob(logits.recompute, best[None, g:2 * g])[0]
            micro = logits.micro[0].log_softmax(-1)[best[-1]]
            return ((((configs + bits) * weights).sum() + micro) / weights.sum()).item()

    plain, imitating = trainer(0.0), trainer(10.0)
    before = copy.deepcopy(imitating.policy)
    stats_plain, stats = plain.update(), imitating.update()
    best = torch.as_tensor(imitating.states[task.key].best_actions)
    assert plain.states[task.key].best_actions == best.tolist()          # the same round was drawn
    assert stats_plain["loss_imitation"] == 0.0
    assert stats["loss_imitation"] == pytest.approx(-log_likelihood(before, best), rel=1e-5)
    assert log_likelihood(imitating.policy, best) > max(log_likelihood(plain.policy, best), -stats["loss_imitation"])
    with pytest.raises(HeterogError, match="imitation_coef must be non-negative, got -1"):
        TrainerSettings(imitation_coef=-1)


def test_distill_fits_the_policy_to_each_graphs_best_plan(tasks):
    """distill: imitation-only passes over the graphs; afterwards each graph's greedy plan is its best
    plan (here two different uniform plans, one per graph, which one policy must tell apart)."""
    trainer = Trainer(tiny_policy(seed=1), tasks, TrainerSettings(learning_rate=1e-2, seed=0))
    targets = {tasks[0].key: [3] * tasks[0].n_groups, tasks[1].key: [8 + 3] * tasks[1].n_groups}   # GPU 3; cp-ar
    for key, target in targets.items():
        trainer.states[key].best_actions = target
    losses = trainer.distill(100)              # the graphs are told apart after about 60 passes
    assert len(losses) == 100 and losses[-1] < 0.05 * losses[0]
    with torch.no_grad():
        for task in tasks:
            emb = trainer.policy.embed_groups(*task.inputs.args())
            greedy = trainer.policy.sample_actions(emb, task.inputs.group_mask, 1, greedy=True)[0]
            assert greedy.tolist() == targets[task.key]
    assert trainer.distill(0) == [] and trainer.cpu_s > 0
    with pytest.raises(HeterogError, match="distill epochs must be non-negative, got -1"):
        trainer.distill(-1)


def test_a_passed_deadline_scores_the_first_plan_only_and_ends_training_without_an_update(tasks):
    from heterog.baselines.mcmc import start_actions

    task = tasks[1]
    n_actions = task.inputs.n_devices + 4
    plans = full_plan(np.repeat(np.arange(n_actions)[:, None], task.n_groups, axis=1), task.n_groups)
    settings = TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1)
    trainer = Trainer(tiny_policy(), [task], settings)
    rewards, times, _ = trainer.scorer.score(task, plans[:3], deadline=time.perf_counter() - 1.0)
    assert len(rewards) == 1 and trainer.n_sims == 1
    # cached plans cost nothing: the first two are scored (one cached, one simulated), then the deadline holds
    rewards, times, _ = trainer.scorer.score(task, plans[:3], deadline=time.perf_counter() - 1.0)
    assert len(rewards) == 2 and trainer.n_sims == 2
    _, times, _ = trainer.scorer.score(task, plans[:3])
    assert len(times) == 3 and trainer.n_sims == 3                                        # no deadline: all
    before = weights(trainer.policy)
    summary = trainer.train(budget_s=1e-9)        # the uniform seeding: its first plan (cp-ar-ps-small) only
    state = trainer.states[task.key]
    assert summary["rounds"] == 0 and state.episodes == 0 and trainer.deadline is None and trainer.n_sims == 4
    hybrid = full_plan(start_actions(task.evaluator, "cp-ar-ps-small", np.random.default_rng(0)), task.n_groups)
    assert [a for _, a in state.pool] == [hybrid.tolist()]                                  # the plan scored
    assert state.best_iteration_time_s == trainer.scorer.score(task, hybrid[None])[1][0] and trainer.n_sims == 4
    assert torch.equal(weights(trainer.policy), before)
    assert trainer.best_strategy(task) is not None
    with pytest.raises(BudgetSpent, match="2 of 3 plans left"):
        trainer.deadline = time.perf_counter() - 1.0
        trainer.score_and_record(task, state, plans[5:8])


def test_mutations_of_an_extended_plan_keep_its_rows_and_move_among_every_micro_batch_choice(tasks):
    from agents.candidates import in_policy
    from envs.actions import EXTENDED_MICRO_CHOICES, MICRO_CHOICES

    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings(mutate_groups=1, mutate_memory=1.0,
                                                                mutate_guided=0.5))
    g, m, a = 4, 3, 12
    base = torch.tensor([0, 14, 14, 5,  0, 1, 0, 0,  7,  1, 2, 0,  3, 3, 3,  3, 3, 3,  0, 0, 0])  # rows of 3
    guide = torch.full((g, a), 1.0 / a)
    out = trainer.search.mutate_plans(base, g, a, 300, guide, micro_choices=len(EXTENDED_MICRO_CHOICES))
    assert out.shape == (300, 2 * g + 1 + g * m)
    assert (out[:, 2 * g + 1:] == base[2 * g + 1:]).all()                     # rows kept
    micro = out[:, 2 * g]
    assert (micro >= 0).all() and (micro < len(EXTENDED_MICRO_CHOICES)).all() and (micro >= len(MICRO_CHOICES)).any()
    changed = out[:, :g] != base[:g]
    assert (out[:, :g][changed] < a).all()                 # a group changes to one of the policy's actions
    assert in_policy(base[None], g, a).tolist() == [False]
    plain = base.clone()
    plain[1:3], plain[2 * g] = 2, 4
    assert in_policy(plain[None], g, a).tolist() == [True]
    plain[2 * g] = len(MICRO_CHOICES)                      # every count under 1F1B, beyond the policy's five
    assert in_policy(plain[None], g, a).tolist() == [False]


def test_mutations_of_an_extended_plan_step_its_micro_batches_to_a_neighbouring_choice(tasks):
    from envs.actions import EXTENDED_MICRO_CHOICES, micro_neighbours

    trainer = Trainer(tiny_policy(), tasks[:1], TrainerSettings(mutate_groups=1, mutate_memory=1.0))
    g, a = 4, 12
    index = EXTENDED_MICRO_CHOICES.index((8, "gpipe"))
    base = torch.tensor([0, 1, 2, 5,  0, 1, 0, 0,  index,  3, 3, 3,  3, 3, 3,  3, 3, 3,  0, 0, 0])
    out = trainer.search.mutate_plans(base, g, a, 300, micro_moves=lambda i: micro_neighbours(i, 48))
    moved = out[:, 2 * g] != index
    assert {EXTENDED_MICRO_CHOICES[i] for i in out[moved, 2 * g].tolist()} == {
        (4, "gpipe"), (16, "gpipe"), (7, "gpipe"), (9, "gpipe"), (8, "1f1b")}
    assert 100 < int(moved.sum()) < 200 and (out[moved, :2 * g] == base[:2 * g]).all()
    # where no other count is possible, a memory move flips recompute bits
    alone = trainer.search.mutate_plans(base, g, a, 50, micro_moves=lambda i: [])
    assert (alone[:, 2 * g] == index).all() and ((alone[:, g:2 * g] != base[g:2 * g]).sum(dim=1) == 1).all()


def test_the_promising_uniform_plans_come_first_and_the_rest_take_a_share_of_the_time_left(tasks, monkeypatch):
    import agents.candidates as candidates_module
    import agents.trainer as trainer_module
    from agents.candidates import promising_uniform

    class Clock:                                   # every simulation takes 10 s of this clock, nothing else any
        now = 0.0

        def perf_counter(self):
            return self.now

        def process_time(self):
            return self.now

    clock = Clock()
    for module in (trainer_module, candidates_module):
        monkeypatch.setattr(module, "time", clock)
    task = tasks[1]
    trainer = Trainer(tiny_policy(), [task], TrainerSettings())
    simulate = trainer.scorer.simulate

    def slow(t, actions):
        clock.now += 10.0 * len(actions)
        return simulate(t, actions)

    monkeypatch.setattr(trainer.scorer, "simulate", slow)
    state = trainer.states[task.key]
    trainer.deadline = 100.0
    trainer.seed_uniform(task, state)
    first = 1 + len(promising_uniform(task.inputs.n_devices))       # cp-ar-ps-small and the DP plans: 50 s
    # the rest may start until 50 + 0.25 * (100 - 50) = 62.5 s: the one at 50 s and the one at 60 s
    assert len(state.pool) == first + 2 and clock.now == 70.0 and trainer.deadline == 100.0
    assert {tuple(a[:task.n_groups]) for _, a in state.pool} >= {(task.inputs.n_devices + k,) * task.n_groups
                                                                 for k in range(4)}
