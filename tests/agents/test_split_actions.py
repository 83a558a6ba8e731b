"""The split actions of the agent's action space (splits beyond the batch): their decoding into split
configs over the whole cluster or one server, the greedy decision over pointer blocks, both heads' logits,
the env's action space, and the agent planning with them (its seeds hold the homogeneous tensor-parallel
plan, so it never returns a slower one)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from agents.networks import PolicyConfig, StrategyPolicy, most_likely_actions
from agents.networks.common import pointer_blocks
from agents.planner import build_policy, plan
from envs import DEVICE_FEATURE_DIM, PlacementEnv, plan_strategy
from heterog.actions import (
    N_DP_ACTIONS,
    cluster_split_action,
    decode_split_action,
    device_action_blocks,
    devices_of,
    n_actions,
    server_split_action,
    split_action_name,
    strategy_from_actions,
)
from heterog.cluster.loader import cluster_from_dict
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.strategy import ParallelConfig

torch.set_num_threads(1)

# three servers: two A100s, one V100 alone, three T4s (devices 0-1, 2, 3-5)
UNEVEN = {"name": "uneven-servers", "switch": {"bandwidth": "100 Gbit/s"}, "servers": [
    {"name": "a", "gpus": [{"type": "A100-40GB", "count": 2}], "intra": {"kind": "nvlink", "bandwidth": "240 GB/s"},
     "nic": {"bandwidth": "100 Gbit/s"}},
    {"name": "b", "gpus": [{"type": "V100-16GB", "count": 1}], "intra": {"kind": "pcie", "bandwidth": "12 GB/s"},
     "nic": {"bandwidth": "100 Gbit/s"}},
    {"name": "c", "gpus": [{"type": "T4", "count": 3}], "intra": {"kind": "pcie", "bandwidth": "12 GB/s"},
     "nic": {"bandwidth": "50 Gbit/s"}}]}


@pytest.fixture(scope="module")
def cluster():
    return cluster_from_dict(UNEVEN)


@pytest.fixture(scope="module")
def mlp():
    return capture_model("tiny_mlp", 16)


def test_the_action_count_and_offsets_are_stated_once():
    for m in (1, 2, 6, 16):
        assert n_actions(m) == m + 4 and n_actions(m, splits=True) == 3 * m + 6
        assert devices_of(n_actions(m)) == m and devices_of(n_actions(m, splits=True), splits=True) == m
        assert cluster_split_action(m) == m + 4 and cluster_split_action(m, proportional=True) == m + 5
        assert server_split_action(m, 1) == m + 7 and server_split_action(m, 1, proportional=True) == 2 * m + 7
        assert device_action_blocks(m) == [(0, m)]
        assert device_action_blocks(m, splits=True) == [(0, m), (m + 6, 2 * m + 6), (2 * m + 6, 3 * m + 6)]
        assert pointer_blocks(n_actions(m, splits=True), splits=True) == device_action_blocks(m, splits=True)


def test_split_actions_decode_to_the_cluster_or_the_pointed_devices_server(cluster):
    m, batch = 6, 16
    power = np.asarray(cluster.power)
    prop = decode_split_action(m + 5, cluster, batch)
    assert decode_split_action(m + 4, cluster, batch) == ParallelConfig.split_over(range(6), [1] * 6, batch)
    assert prop.devices == tuple(range(6)) and prop.split == "parameter" and prop.shares == (batch,) * 6
    ratio = np.asarray(prop.split_shares) / np.asarray(prop.split_shares).sum()
    np.testing.assert_allclose(ratio, power / power.sum(), atol=2e-3)                  # thousandths
    for d, server in ((0, (0, 1)), (1, (0, 1)), (3, (3, 4, 5)), (5, (3, 4, 5))):
        even = decode_split_action(m + 6 + d, cluster, batch)
        assert even.devices == server and even.split_shares == (1,) * len(server)
        assert decode_split_action(2 * m + 6 + d, cluster, batch).devices == server
    # the V100's server holds it alone: both its splits are model parallelism on it
    assert decode_split_action(m + 6 + 2, cluster, batch) == ParallelConfig.single(2, batch)
    assert decode_split_action(2 * m + 6 + 2, cluster, batch) == ParallelConfig.single(2, batch)
    # proportional shares follow the given weights (a group's own speed) over the server's devices
    weights = np.array([1.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    assert decode_split_action(2 * m + 6 + 1, cluster, batch, weights).split_shares == (250, 750)
    names = [split_action_name(a, m) for a in range(n_actions(m, splits=True))]
    assert names[:12] == [f"mp:{d}" for d in range(6)] + ["dp-even-ps", "dp-even-ar", "dp-prop-ps", "dp-prop-ar",
                                                          "tp-even", "tp-prop"]
    assert names[12] == "tp-even:server-of-0" and names[-1] == "tp-prop:server-of-5"
    for bad in (m + 3, 3 * m + 6, -1):
        with pytest.raises(StrategyError, match="out of range"):
            decode_split_action(bad, cluster, batch)


def test_a_plan_of_split_actions_decodes_on_graphs_with_split_options_only(mlp, cluster):
    ev = Evaluator(mlp, cluster)
    actions = np.full(ev.n_groups, 6 + 6 + 3)                  # tp-even over device 3's server
    strategy = strategy_from_actions(actions, ev.group_of, mlp, cluster)
    assert all(c.devices == (3, 4, 5) and c.split == "parameter" for c in strategy.configs)
    bare = dataclasses.replace(mlp, splits=None)
    with pytest.raises(StrategyError, match="without the per-op split options"):
        strategy_from_actions(actions, ev.group_of, bare, cluster)
    with pytest.raises(StrategyError, match="out of range"):
        strategy_from_actions(np.full(ev.n_groups, 3 * 6 + 6), ev.group_of, mlp, cluster)


def test_the_greedy_decision_sums_each_pointer_block():
    m = 4                                                        # 18 logits: 4 mp, 4 dp, 2 tp, 4 + 4 pointers
    logits = torch.zeros(3, n_actions(m, splits=True))
    logits[0, 10:14] = torch.tensor([0.0, 0.5, 0.0, 0.0])      # tp-even pointers: 4 x ~e^0 beat dp's e^1
    logits[0, 5] = 1.0
    logits[1, 9] = 2.0                                           # tp-prop over the cluster, a single action
    logits[1, 14:18] = torch.log(torch.tensor([2.0, 2.0, 1.0, 2.0]))   # pointers sum to 7 < e^2 = 7.39
    logits[2, 0] = float(np.log(4.0))                            # the mp block sums to 7, every other to 4

    assert most_likely_actions(logits, splits=True).tolist() == [11, 9, 0]
    # without split actions the layout is M + 4: the last four columns are the DP schemes
    plain = torch.zeros(2, n_actions(8))
    plain[:, 8 + 1] = torch.tensor([3.0, 2.0])                   # e^3 = 20 beats the mp block's 8; e^2 does not
    assert most_likely_actions(plain).tolist() == [9, 0]


@pytest.mark.parametrize("head", ["fixed", "tokens"])
def test_both_heads_score_every_split_action(mlp, cluster, head):
    from agents.tasks import make_task

    policy = build_policy(6, head=head, split_actions=True, hidden=16, gat_layers=1, gat_heads=2, txl_layers=1,
                          txl_heads=2, segment_len=8, mem_len=8)
    assert policy.split_actions and policy.settings.n_actions == (16 if head == "tokens" else 6) + N_DP_ACTIONS
    task = make_task(mlp, cluster, layout=policy.feature_layout)
    with torch.no_grad():
        emb = policy.embed_groups(*task.inputs.args())
        devices = policy.embed_devices(task.inputs.dev_x, task.inputs.dev_mask)
        logits = policy.logits_from_group_embeddings(emb, task.inputs.group_mask, devices)
        plans = policy.sample_plans(emb, task.inputs.group_mask, 64, devices=devices,
                                    generator=torch.Generator().manual_seed(0))
    assert logits.shape == (task.n_groups, 3 * 6 + 6) and torch.isfinite(logits).all()
    assert policy.n_actions_for(devices) == 24
    configs = plans[:, :task.n_groups]
    assert int(configs.max()) >= 6 + 4 and int(configs.max()) < 24    # a fresh policy draws split actions too
    # the settings round-trip through a checkpoint's dict, and a policy without them keeps M + 4 logits
    assert PolicyConfig.from_dict(policy.config).split_actions
    if head == "fixed":                    # an autoregressive policy embeds every split action as an input
        chained = StrategyPolicy(policy.settings.replace(autoregressive=True))
        with torch.no_grad():
            drawn = chained.sample_actions(chained.embed_groups(*task.inputs.args()), task.inputs.group_mask, 8,
                                           generator=torch.Generator().manual_seed(0))
            assert chained.action_logits(chained.embed_groups(*task.inputs.args()), task.inputs.group_mask,
                                         drawn).shape == (8, task.n_groups, 24)
    plain = StrategyPolicy(policy.settings.replace(split_actions=False))
    with torch.no_grad():
        emb = plain.embed_groups(*task.inputs.args())
        assert plain.logits_from_group_embeddings(emb, task.inputs.group_mask,
                                                  plain.embed_devices(task.inputs.dev_x,
                                                                      task.inputs.dev_mask)).shape[-1] == 10


def test_the_env_offers_split_actions_only_when_asked(mlp, cluster):
    env = PlacementEnv(mlp, cluster, splits=True, render_mode="ansi")
    _, info = env.reset(seed=0)
    g = info["n_groups"]
    assert env.action_space.nvec[:g].tolist() == [24] * g
    action = np.zeros(env.action_length, dtype=np.int64)
    action[:g] = 6 + 4                                            # tp-even over all six devices
    action[env.max_groups:env.max_groups + g] = 1                 # recompute bits of split groups are ignored
    strategy = plan_strategy(env.evaluators[0], action, "env", n_slots=env.max_groups)
    assert strategy.recompute == () and all(c.split == "parameter" for c in strategy.configs)
    _, reward, done, _, step = env.step(action)
    assert done and step["recomputed_groups"] == 0
    assert step["iteration_time_s"] == pytest.approx(env.evaluators[0].evaluate(strategy).iteration_time_s, rel=1e-12)
    assert "tp-even=" in env.render()
    plain = PlacementEnv(mlp, cluster)
    plain.reset(seed=0)
    assert plain.action_space.nvec[0] == 10
    with pytest.raises(StrategyError, match="out of range"):
        plain.step(action)
    with pytest.raises(Exception, match="split options"):
        PlacementEnv(dataclasses.replace(mlp, splits=None), cluster, splits=True)


def test_the_agent_plans_with_split_actions_and_keeps_the_best_seed(mlp, cluster):
    ev = Evaluator(mlp, cluster)
    strategy = plan(ev, checkpoint="scratch", episodes=64, progress=False, splits=True, seed=3)
    tensor_parallel = ev.iteration_time(ev.strategy(np.full(ev.n_groups, 6 + 4)))[0]
    even_dp = ev.iteration_time(ev.strategy(np.full(ev.n_groups, 6 + 1)))[0]
    assert strategy.meta["best_iteration_time_s"] <= min(tensor_parallel, even_dp) + 1e-15
    assert strategy.meta["best_iteration_time_s"] == pytest.approx(ev.iteration_time(strategy)[0], rel=1e-9)
    # the search's plans have rows where a seed needs the extended actions (the PS baselines' servers here)
    width = cluster.n_devices if strategy.meta["extended_plans"] else 0
    assert len(strategy.meta["actions"]) == (2 + width) * ev.n_groups + 1


def test_the_shipped_policy_with_split_actions_places_the_model_no_gpu_holds():
    """The shipped checkpoint with split actions: where ``plan(splits=True)`` starts on any cluster of at most
    16 devices; its own zero-shot plan of big_embedding (a 26 GB embedding with Adam) on paper-8gpu (16 GB
    GPUs, where no plan that keeps a parameter whole fits) divides the groups and fits."""
    from agents.checkpoint import check_fits, checkpoint_head, load_checkpoint
    from agents.planner import PRETRAINED, PRETRAINED_SPLITS, start_checkpoint
    from heterog.cluster import load_cluster

    state = load_checkpoint(PRETRAINED_SPLITS)      # loads with today's features (a layout change needs a retrain)
    assert checkpoint_head(state) == "tokens" and state["policy_config"]["split_actions"] is True
    assert "big_embedding-b8@paper-8gpu" in state["provenance"]["tasks"]
    for n in (2, 8, 16):
        check_fits(state, n, None, DEVICE_FEATURE_DIM)
        assert start_checkpoint(None, n, splits=True) == PRETRAINED_SPLITS
        assert start_checkpoint(None, n) == PRETRAINED
    graph = capture_model("big_embedding", 8, "adam")
    paper8 = load_cluster("paper-8gpu")
    ev = Evaluator(graph, paper8)
    strategy = plan(ev, budget_s=0, progress=False, splits=True)
    meta = strategy.meta
    assert meta["checkpoint"] == str(PRETRAINED_SPLITS) and meta["kept"] == "policy"
    assert not meta["policy_plan_oom"] and not meta["oom"]
    assert sum(c.split is not None for c in strategy.configs) > strategy.n_groups // 2
    assert ev.iteration_time(strategy) == (pytest.approx(meta["best_iteration_time_s"], rel=1e-9), False)
    for dp in range(4):                          # every data-parallel plan is out of memory there
        assert ev.iteration_time(ev.strategy(np.full(ev.n_groups, 8 + dp)))[1]


def test_mcmcs_split_starts_seed_a_search_with_splits_in_the_extended_actions():
    from agents.checkpoint import load_checkpoint, policy_from_checkpoint
    from agents.planner import PRETRAINED_SPLITS, SEED_STARTS, seed_actions, seed_starts
    from heterog.baselines.chains import ActionSearch
    from heterog.baselines.mcmc import start_actions
    from heterog.cluster import load_cluster

    ev = Evaluator(capture_model("big_embedding", 8, "adam"), load_cluster("paper-8gpu"))
    found = seed_starts(ev, SEED_STARTS, splits=True)
    starts = {name: plan for name, (plan, _) in found.items()}
    assert list(starts) == list(SEED_STARTS) and all(s.method == n for n, s in starts.items())
    # each with its simulated result, as the evaluator gives it
    assert all(result == ev.iteration_time(starts[name]) for name, (_, result) in found.items())
    # tp-server: every group divided beyond the batch over one server (the fastest), the same as MCMC's start
    server = {c.devices for c in starts["tp-server"].configs}
    assert len(server) == 1 and len(next(iter(server))) == 2 and all(c.split for c in starts["tp-server"].configs)
    search = ActionSearch(ev, splits=True)
    mcmc_start = search.strategy(start_actions(ev, "tp-server", np.random.default_rng(0), search.cost))
    assert starts["tp-server"].configs == mcmc_start.configs
    assert {c.devices for c in starts["tp-grid"].configs} == {tuple(range(8))}
    # the search holds them: tp-server in the policy's own split actions (a split over one server's devices),
    # the grid in the extended ones
    policy = policy_from_checkpoint(load_checkpoint(PRETRAINED_SPLITS))
    assert list(seed_actions(ev, starts, policy)) == ["tp-server"]
    assert set(seed_actions(ev, starts, policy, extended=True)) == set(starts)
    assert seed_starts(ev, SEED_STARTS, splits=False) == {}


def test_split_starts_past_their_deadline_simulate_their_first_variant_only():
    import time

    from agents.planner import SEED_STARTS, seed_starts
    from heterog.baselines.mcmc import start_plan
    from heterog.cluster import load_cluster

    ev = Evaluator(capture_model("big_embedding", 8, "adam"), load_cluster("paper-8gpu"))
    before = ev.n_evaluations
    plan, result = start_plan(ev, "tp-server", splits=True, deadline=time.perf_counter() - 1.0)
    assert ev.n_evaluations - before == 1                     # the first server's, of paper-8gpu's four
    assert {c.devices for c in plan.configs} == {(0, 1)} and result == ev.iteration_time(plan)
    before = ev.n_evaluations
    start_plan(ev, "tp-server", splits=True)
    assert ev.n_evaluations - before == 4
    # the agent's seeds take its deadline: one simulation per start
    before = ev.n_evaluations
    assert list(seed_starts(ev, SEED_STARTS, splits=True, deadline=time.perf_counter() - 1.0)) == list(SEED_STARTS)
    assert ev.n_evaluations - before == len(SEED_STARTS)


def test_server_splits_divide_over_each_server_of_two_devices_or_more_the_most_power_first(cluster):
    from agents.candidates import server_splits

    # a: two A100s (2 x 19.5 TFLOP/s) before c: three T4s (3 x 8.1); b holds one device and has no split
    assert server_splits(cluster) == {"tp-server:a": server_split_action(6, 0),
                                      "tp-server:c": server_split_action(6, 3)}
    decoded = strategy_from_actions(np.full(1, server_split_action(6, 3)), np.zeros(3, dtype=np.int64),
                                    capture_model("tiny_mlp", 16), cluster)
    assert decoded.configs[0].devices == (3, 4, 5)


def test_zero_shot_compares_the_strongest_servers_split_always_the_other_splits_in_its_time(mlp, cluster,
                                                                                              monkeypatch):
    import agents.planner

    ev = Evaluator(mlp, cluster)
    dp = ["policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar"]
    monkeypatch.setattr(agents.planner, "ZERO_SHOT_S", 0.0)            # the time is spent at once
    found = plan(ev, budget_s=0, progress=False, splits=True)
    assert found.meta["compared"] == [*dp, "tp-server:a"]
    server_a = ev.iteration_time(ev.strategy(np.full(ev.n_groups, server_split_action(6, 0))))
    assert not server_a[1] and found.meta["best_iteration_time_s"] <= server_a[0]
    monkeypatch.setattr(agents.planner, "ZERO_SHOT_S", 1e9)
    found = plan(ev, budget_s=0, progress=False, splits=True)
    assert found.meta["compared"] == [*dp, "tp-server:a", "tp-server:c", "tp-even", "tp-prop"]
    assert ev.iteration_time(found) == (found.meta["best_iteration_time_s"], found.meta["oom"])


def test_zero_shot_compares_a_plan_beyond_the_fixed_ones_only_where_it_would_end_in_time(mlp, cluster, monkeypatch):
    import time

    import agents.planner

    clock = [1000.0]                        # each simulation takes 0.1 s of a clock nothing else moves
    ends: list[float] = []
    real = Evaluator.iteration_time

    def timed(self, *a, **k):
        clock[0] += 0.1
        ends.append(clock[0] - 1000.0)
        return real(self, *a, **k)

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(Evaluator, "iteration_time", timed)
    monkeypatch.setattr(agents.planner, "ZERO_SHOT_S", 0.75)
    found = plan(Evaluator(mlp, cluster), budget_s=0, progress=False, splits=True)
    fixed = ["policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "tp-server:a"]
    assert found.meta["compared"][:6] == fixed
    more = found.meta["compared"][6:]
    assert more == ["tp-server:c", "tp-even", "tp-prop"][:len(more)]
    # the six fixed comparisons end at 0.5 s where the policy's plan is one of the five others (simulated once),
    # else at 0.6 s; each split after them, taking 0.1 s as the last split took, is compared where it ends by
    # 0.75 s: two (0.6 and 0.7 s) or one (0.7 s); the next would end at 0.8 s, past 0.75 s, although 0.7 s is not
    fixed_end = ends[len(ends) - len(more) - 1]
    assert fixed_end == pytest.approx(0.5) or fixed_end == pytest.approx(0.6)
    assert len(more) == (2 if fixed_end == pytest.approx(0.5) else 1)
    assert clock[0] == pytest.approx(1000.7)
