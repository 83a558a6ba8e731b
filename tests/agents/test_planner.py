"""agents.planner.plan: the agent as a planner (from scratch, by episodes or budget, fine-tuning a
checkpoint, by default the shipped one), reproducible by seed, returning a strategy that fits the graph
and cluster."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from agents.planner import (
    PRETRAINED,
    SCRATCH,
    SEED_PLANNERS,
    best_of_seeds,
    build_policy,
    plan,
    seed_actions,
    start_checkpoint,
)
from agents.tasks import make_task
from agents.trainer import GraphTask, Trainer, TrainerSettings
from heterog import planners
from heterog.cluster import load_cluster
from heterog.errors import CheckpointError, HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model

torch.set_num_threads(1)
TINY_AGENT = {"hidden": 16, "gat_layers": 1, "gat_heads": 2, "txl_layers": 1, "txl_heads": 2,
              "segment_len": 8, "mem_len": 8}


@pytest.fixture(scope="module")
def graph():
    return capture_model("tiny_mlp", 16)


@pytest.fixture(scope="module")
def paper8():
    return load_cluster("paper-8gpu")


def test_plan_from_scratch_returns_the_best_strategy(graph, paper8):
    ev = Evaluator(graph, paper8)
    settings = TrainerSettings(samples_per_graph=8, mutate_samples=2)
    strategy = plan(ev, SCRATCH, episodes=48, seed=0, progress=True, settings=settings)
    strategy.check_fits(graph, paper8)
    assert strategy.method == "agent"
    meta = strategy.meta
    assert meta["episodes"] == 48 and meta["rounds"] == 6 and meta["search_time_s"] > 0 and meta["seed"] == 0
    assert meta["checkpoint"] is None
    t_s, oom = ev.iteration_time(strategy)
    assert t_s == pytest.approx(meta["best_iteration_time_s"]) and oom == meta["oom"]
    again = plan(Evaluator(graph, paper8), SCRATCH, episodes=48, seed=0, progress=False, settings=settings)
    assert again.meta["actions"] == meta["actions"]


def test_plan_stops_on_a_wall_clock_budget(graph, paper8):
    # no episode limit: only the budget ends the search, after the round that spends its share (how far past
    # it that round runs depends on the machine's load, so it is not asserted); the polish then ends at the
    # budget or where no group gains
    from agents.planner import POLISH_SHARE

    t0 = time.perf_counter()
    strategy = plan(Evaluator(graph, paper8), budget_s=3.0, progress=False)
    elapsed = time.perf_counter() - t0
    assert (1 - POLISH_SHARE) * 3.0 <= strategy.meta["search_time_s"] <= elapsed and strategy.meta["episodes"] > 0
    assert "polished" in strategy.meta
    assert strategy.meta["checkpoint"] == str(PRETRAINED)     # no checkpoint given: the shipped one


def test_polish_ends_where_no_group_gains_from_a_config_the_plan_holds(graph, paper8):
    from dataclasses import replace

    from agents.planner import polish
    from heterog import baselines
    from heterog.evaluate import reward

    ev = Evaluator(graph, paper8)
    one, dp = (baselines.run(name, graph, paper8, evaluator=ev) for name in ("single", "ev-ar"))
    start = replace(one, configs=[dp.configs[0]] + list(one.configs[1:]), meta={"best_seed_s": 1.0})
    before = ev.iteration_time(start)
    found = polish(ev, start, time.perf_counter() + 600)
    after = ev.iteration_time(found)
    assert reward(*after) > reward(*before) and found.meta["polished"] > 0
    assert found.meta["best_iteration_time_s"] == after[0] and found.meta["agent_added"] == 1.0 / after[0] - 1.0
    assert found.meta["polish_gain"] == pytest.approx(before[0] / after[0] - 1.0)
    held = {id(c): c for c in start.configs}.values()
    assert all(any(c == h for h in held) for c in found.configs)          # only configs the plan held
    for g in range(len(found.configs)):                                    # a local optimum: no single change gains
        for c in held:
            moved = replace(found, configs=found.configs[:g] + [c] + found.configs[g + 1:])
            assert reward(*ev.iteration_time(moved)) <= reward(*after)
    # a deadline passed: the plan as given, its time measured once
    n = ev.n_evaluations
    same = polish(ev, start, time.perf_counter() - 1.0)
    assert same.configs == start.configs and same.meta["polished"] == 0 and ev.n_evaluations == n + 1


def test_a_budget_the_seeds_spend_starts_no_round(graph, paper8, monkeypatch):
    import agents.planner

    seed_plans = agents.planner.seed_plans

    def slow_seeds(*args, **kwargs):
        out = seed_plans(*args, **kwargs)
        time.sleep(1.0)                                     # past the budget
        return out

    monkeypatch.setattr(agents.planner, "seed_plans", slow_seeds)
    monkeypatch.setattr(Trainer, "update", lambda self: pytest.fail("a round started past the budget"))
    ev = Evaluator(graph, paper8)
    strategy = plan(ev, budget_s=0.5, progress=False, seeds=("single", "ev-ar"))
    meta = strategy.meta
    assert meta["rounds"] == 0 and meta["episodes"] == 0
    assert ev.iteration_time(strategy)[0] == min(abs(t) for t in meta["seeds"].values())


def test_plan_fine_tunes_a_checkpoint_and_refuses_another_action_space(graph, paper8, tmp_path):
    policy = build_policy(8, "small", seed=1, **TINY_AGENT)
    settings = TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1)
    trainer = Trainer(policy, [make_task(capture_model("tiny_cnn", 16), paper8)], settings)
    trainer.train(rounds=2)
    path = trainer.save(tmp_path / "pretrained.pt")
    strategy = plan(Evaluator(graph, paper8), checkpoint=path, episodes=32, progress=False)
    assert strategy.meta["checkpoint"] == str(path) and strategy.meta["episodes"] == 32
    with pytest.raises(CheckpointError, match=r"12 actions \(8 devices\); this cluster needs 6 actions"):
        plan(Evaluator(graph, load_cluster("local-cpu-2")), checkpoint=path, episodes=4, progress=False)


def test_plan_rejects_bad_limits(graph, paper8):
    with pytest.raises(HeterogError, match="episodes must be at least 1"):
        plan(Evaluator(graph, paper8), episodes=0, progress=False)
    with pytest.raises(HeterogError, match="budget_s must be positive"):
        plan(Evaluator(graph, paper8), budget_s=-1, progress=False)


def test_zero_shot_plans_with_the_checkpoint_and_never_loses_to_data_parallelism(graph, paper8, tmp_path, capsys):
    import json

    from heterog import baselines
    from heterog.cli import main

    policy = build_policy(8, "small", seed=2, **TINY_AGENT)
    trainer = Trainer(policy, [make_task(capture_model("tiny_cnn", 16), paper8)],
                      TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1))
    trainer.train(rounds=2)
    path = trainer.save(tmp_path / "pretrained.pt")
    ev = Evaluator(graph, paper8)
    strategy = plan(ev, checkpoint=path, budget_s=0, progress=False)
    meta = strategy.meta
    assert meta["zero_shot"] and meta["episodes"] == 0 and meta["checkpoint"] == str(path)
    # the policy's own plan, scored independently: its greedy plan on this graph
    check = Trainer(policy, [make_task(graph, paper8)], TrainerSettings(samples_per_graph=4, explore_samples=1,
                                                                        mutate_samples=1))
    greedy = check.evaluate_policy(samples=0)
    assert meta["policy_plan_s"] == pytest.approx(next(iter(greedy.values()))["greedy_iteration_time_s"])
    t_s, oom = ev.iteration_time(strategy)
    assert t_s == pytest.approx(meta["best_iteration_time_s"]) and oom == meta["oom"]
    for dp in ("ev-ps", "ev-ar", "cp-ps", "cp-ar"):
        assert t_s <= ev.iteration_time(baselines.run(dp, graph, paper8, evaluator=ev))[0] + 1e-12
    assert t_s <= meta["policy_plan_s"] + 1e-12
    assert meta["kept"] in ("policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar")
    assert plan(ev, checkpoint=path, budget_s=0, progress=False).meta["actions"] == meta["actions"]
    # the command line: the policy's own plan in the JSON; zero-shot without a checkpoint is a clean error
    capsys.readouterr()
    argv = ["plan", "--graph", "tiny_mlp", "--batch-size", "16", "--cluster", "paper-8gpu", "-o",
            str(tmp_path / "s.json"), "--budget-s", "0", "--json"]
    assert main(argv + ["--agent", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policy_plan_s"] == pytest.approx(meta["policy_plan_s"]) and doc["kept"] == meta["kept"]
    assert doc["compared"] == ["policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar"]         # no splits, no state choices
    assert doc["iteration_time_s"] == pytest.approx(t_s)
    assert main(argv + ["--agent", "scratch"]) == 2 and "not from scratch" in capsys.readouterr().err


def test_zero_shot_needs_a_pretrained_policy(graph, paper8):
    with pytest.raises(HeterogError, match=r"zero-shot\) plans with a pretrained policy, not from scratch"):
        plan(Evaluator(graph, paper8), SCRATCH, budget_s=0, progress=False)


def test_the_shipped_checkpoint_is_the_default_start_where_it_fits(caplog):
    from agents.checkpoint import check_fits, checkpoint_head, load_checkpoint
    from envs.features import DEVICE_FEATURE_DIM

    state = load_checkpoint(PRETRAINED)        # loads with today's features (a layout change needs a retrain)
    assert checkpoint_head(state) == "tokens" and state["provenance"]["tasks"]
    for n in (1, 2, 8, 12, 16):
        check_fits(state, n, None, DEVICE_FEATURE_DIM)
        assert start_checkpoint(None, n) == PRETRAINED
    assert start_checkpoint(SCRATCH, 8) is None and start_checkpoint("x.pt", 8) == "x.pt"
    with caplog.at_level("WARNING"):
        assert start_checkpoint(None, 17) is None           # bigger than the policy's device tokens
    assert "training from scratch" in caplog.text and "at most 16 devices" in caplog.text
    with pytest.raises(HeterogError, match="zero-shot.*at most 16 devices; this cluster has 17.*--agent CKPT"):
        start_checkpoint(None, 17, required=True)


@pytest.mark.parametrize("cluster_name", ["paper-8gpu", "local-cpu-3", "gen-9"])
def test_the_shipped_checkpoint_plans_zero_shot_by_default(graph, cluster_name, capsys, tmp_path):
    import json

    from heterog import baselines
    from heterog.cli import main

    cluster = load_cluster(cluster_name)
    ev = Evaluator(graph, cluster)
    strategy = plan(ev, budget_s=0, progress=False)
    strategy.check_fits(graph, cluster)
    meta = strategy.meta
    assert meta["zero_shot"] and meta["checkpoint"] == str(PRETRAINED) and meta["policy_plan_s"] > 0
    t_s = ev.iteration_time(strategy)[0]
    assert t_s <= meta["policy_plan_s"] + 1e-12
    for dp in ("ev-ps", "ev-ar", "cp-ps", "cp-ar"):
        assert t_s <= ev.iteration_time(baselines.run(dp, graph, cluster, evaluator=ev))[0] + 1e-12
    capsys.readouterr()
    assert main(["plan", "--graph", "tiny_mlp", "--batch-size", "16", "--cluster", cluster_name, "-o",
                 str(tmp_path / "s.json"), "--budget-s", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policy_plan_s"] == pytest.approx(meta["policy_plan_s"])
    assert doc["iteration_time_s"] == pytest.approx(t_s)


def test_zero_shot_runs_with_the_collector_off_and_restores_it(graph, paper8, monkeypatch):
    import gc

    import agents.planner as planner_module

    seen: list[bool] = []
    real = planner_module.zero_shot
    monkeypatch.setattr(planner_module, "zero_shot", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    assert gc.isenabled()
    assert plan(Evaluator(graph, paper8), budget_s=0, progress=False).meta["zero_shot"]
    assert seen == [False] and gc.isenabled()


def test_zero_shot_scores_a_plan_once_where_two_candidates_decode_to_it(paper8, monkeypatch):
    from collections import Counter

    from agents.candidates import promising_uniform
    from envs.actions import full_plan, plan_strategy

    ev = Evaluator(capture_model("tiny_mlp", 8), paper8)     # one sample per device: even and proportional alike
    ar = {name: plan_strategy(ev, full_plan(np.full(ev.n_groups, a, dtype=np.int64), ev.n_groups), name)
          for name, a in promising_uniform(8, False, False).items() if name.endswith("-ar")}
    assert ar["ev-ar"].plan_key() == ar["cp-ar"].plan_key() and ar["ev-ar"].method != ar["cp-ar"].method
    seen: Counter[str] = Counter()
    real = ev.iteration_time
    monkeypatch.setattr(ev, "iteration_time", lambda s, *a, **k: seen.update([s.plan_key()]) or real(s, *a, **k))
    meta = plan(ev, budget_s=0, progress=False).meta
    assert {"ev-ar", "cp-ar"} <= set(meta["compared"]) and seen[ar["ev-ar"].plan_key()] == 1


def test_one_token_checkpoint_plans_zero_shot_on_other_clusters(graph, paper8, tmp_path):
    policy = build_policy(8, "small", seed=0, head="tokens", **TINY_AGENT)
    trainer = Trainer(policy, [make_task(capture_model("tiny_cnn", 16), paper8, layout=policy.feature_layout)],
                      TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1))
    trainer.train(rounds=1)
    path = trainer.save(tmp_path / "tokens.pt")
    for name in ("paper-12gpu", "local-cpu-2"):
        cluster = load_cluster(name)
        ev = Evaluator(graph, cluster)
        strategy = plan(ev, checkpoint=path, budget_s=0, progress=False)
        strategy.check_fits(graph, cluster)
        assert strategy.meta["zero_shot"] and ev.iteration_time(strategy)[0] <= strategy.meta["policy_plan_s"]


@pytest.mark.parametrize("tie_blocks", [True, False])
def test_zero_shot_plans_as_the_policy_was_trained_with_or_without_tied_blocks(paper8, tie_blocks):
    from agents.checkpoint import trainer_state
    from agents.planner import zero_shot

    graph = capture_model("tiny_transformer", 8)               # three coupled blocks
    policy = build_policy(8, "small", seed=2, **TINY_AGENT)
    trainer = Trainer(policy, [make_task(graph, paper8)],
                      TrainerSettings(samples_per_graph=4, explore_samples=1, mutate_samples=1, tie_blocks=tie_blocks))
    strategy = zero_shot(Evaluator(graph, paper8), trainer_state(trainer))
    greedy = next(iter(trainer.evaluate_policy(samples=0).values()))["greedy_iteration_time_s"]
    assert strategy.meta["policy_plan_s"] == pytest.approx(greedy)


def test_the_search_starts_from_other_planners_plans_and_returns_none_slower(graph, paper8):
    ev = Evaluator(graph, paper8)
    strategy = plan(ev, budget_s=2.0, progress=False)
    meta = strategy.meta
    assert list(meta["seeds"]) == list(SEED_PLANNERS)             # pipeline too: there is a budget
    # every seed is held, the pipeline's stages and the PS baselines' servers in the extended actions
    assert set(meta["seeds_in_actions"]) == set(SEED_PLANNERS) and meta["extended_plans"]
    t_s, oom = ev.iteration_time(strategy)
    fitting = [t for t in meta["seeds"].values() if t > 0]
    assert not oom and t_s <= min(fitting) and meta["best_seed_s"] == min(fitting)
    assert meta["agent_added"] == pytest.approx(min(fitting) / t_s - 1.0) and meta["agent_added"] >= 0
    assert strategy.method == "agent" and meta["best_iteration_time_s"] == pytest.approx(t_s)
    # without a budget the budgeted planners seed nothing; without seeds there is no seed meta
    settings = TrainerSettings(samples_per_graph=8, mutate_samples=2)
    by_episodes = plan(Evaluator(graph, paper8), episodes=16, progress=False, settings=settings)
    assert "pipeline" not in by_episodes.meta["seeds"] and "cp-ar" in by_episodes.meta["seeds"]
    bare = plan(Evaluator(graph, paper8), episodes=16, progress=False, settings=settings, seeds=())
    assert "seeds" not in bare.meta


def test_a_seed_faster_than_the_search_is_returned_as_the_agents_plan(graph, paper8):
    ev = Evaluator(graph, paper8)
    slow = ev.strategy([ev.cluster.n_devices + 1] * ev.n_groups, "agent")           # ev-ar everywhere
    seeded = {name: planners.plan(name, evaluator=ev) for name in ("single", "ev-ar")}
    scored = {name: ev.iteration_time(s) for name, s in seeded.items()}
    out = best_of_seeds(ev, slow, seeded, scored, {})
    t_single = ev.iteration_time(seeded["single"])[0]
    assert t_single < ev.iteration_time(slow)[0]                   # tiny_mlp: one GPU beats data parallelism
    assert out.method == "agent" and out.meta["from_seed"] == out.meta["best_seed"] == "single"
    assert out.configs == seeded["single"].configs and out.meta["agent_added"] == 0.0
    assert out.meta["best_iteration_time_s"] == t_single and seeded["single"].method == "single"
    kept = best_of_seeds(ev, seeded["single"], {"ev-ar": seeded["ev-ar"]}, {"ev-ar": scored["ev-ar"]}, {})
    assert kept.meta["from_seed"] == "" and kept.meta["agent_added"] > 0


def seeded_trainer(graph, cluster, name: str):
    """A trainer without uniform seeds, the task's evaluator, and planner ``name``'s plan in its actions."""
    ev = Evaluator(graph, cluster)
    policy = build_policy(8, "small", seed=1, head="tokens", **TINY_AGENT)
    task = GraphTask.from_evaluator(ev, layout=policy.feature_layout)
    trainer = Trainer(policy, [task], TrainerSettings(seed_uniform_plans=False))
    seed = planners.plan(name, evaluator=ev)
    return trainer, task, ev, seed, seed_actions(ev, {name: seed}, policy)


def test_seed_plans_are_recorded_as_the_best_so_far(graph, paper8):
    trainer, task, ev, single, held = seeded_trainer(graph, paper8, "single")
    trainer.seed_plans(task, np.stack([held["single"]]))
    state = trainer.states[task.key]
    assert state.best_iteration_time_s == pytest.approx(ev.iteration_time(single)[0]) and state.episodes == 0
    assert trainer.best_strategy(task).configs == single.configs


def test_a_primed_seed_is_recorded_without_another_simulation(graph, paper8):
    trainer, task, ev, expert, held = seeded_trainer(graph, paper8, "expert")
    assert expert.priorities is None
    known = ev.iteration_time(expert)
    # the decoding of its plan action simulates as the seed does (what priming relies on)
    assert trainer.scorer.simulate(task, held["expert"][None]) == [known]
    trainer.n_sims = 0
    trainer.scorer.prime(task, np.stack([held["expert"]]), [known])
    trainer.seed_plans(task, np.stack([held["expert"]]))
    assert trainer.n_sims == 0 and trainer.states[task.key].best_iteration_time_s == known[0]
