"""The placement env: the Gymnasium contract (check_env, seeding, one-step episodes, vector envs),
reward and info against the evaluator, padding and action checks."""
from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs import PlacementEnv
from heterog.cluster import load_cluster
from heterog.errors import HeterogError, StrategyError
from heterog.evaluate import Evaluator

TINY = ("tiny_mlp", "tiny_cnn")


@pytest.fixture
def env(tiny_mlp, tiny_cnn, paper8):
    return PlacementEnv([tiny_mlp, tiny_cnn], paper8)


@pytest.mark.parametrize("env_id", envs.ENV_IDS)
def test_every_registered_id_passes_check_env(env_id):
    env = gym.make(env_id)
    check_env(env.unwrapped)
    env.close()


def test_default_make_builds_tiny_transformer_on_paper8():
    env = gym.make("HeteroG/Placement-v0")
    obs, info = env.reset(seed=0)
    assert info["graph"] == "tiny_transformer"
    assert env.unwrapped.cluster.name == "paper-8gpu"
    g = env.unwrapped.max_groups
    assert env.action_space == gym.spaces.MultiDiscrete([12] * g + [2] * g + [len(envs.MICRO_CHOICES)])
    assert obs["group_mask"].sum() == info["n_groups"] == env.unwrapped.max_groups


def test_one_step_episode_terminates_and_never_truncates(env):
    env.reset(seed=0)
    _, _, terminated, truncated, _ = env.step(env.action_space.sample())
    assert terminated is True and truncated is False
    with pytest.raises(gym.error.ResetNeeded):
        env.step(env.action_space.sample())


def test_same_seed_gives_the_same_rollout(tiny_mlp, tiny_cnn, paper8):
    def rollout(seed):
        e = PlacementEnv([tiny_mlp, tiny_cnn], paper8)
        e.action_space.seed(seed)
        e.reset(seed=seed)
        out = []
        for _ in range(6):
            obs, info = e.reset()
            action = e.action_space.sample()
            _, r, _, _, step_info = e.step(action)
            out.append((info["graph"], action.tolist(), r, step_info["iteration_time_s"], obs["op_mask"].sum()))
        return out

    a, b, c = rollout(3), rollout(3), rollout(4)
    assert a == b
    assert {x[0] for x in a} == set(TINY)          # both graphs are drawn
    assert a != c


def test_reward_and_info_match_the_evaluator(tiny_mlp, paper8):
    e = PlacementEnv(tiny_mlp, paper8)
    _, info = e.reset(seed=0)
    g = info["n_groups"]
    actions = np.arange(g) % 12
    _, r, _, _, step_info = e.step(actions)
    ev = Evaluator(tiny_mlp, paper8)
    result = ev.evaluate(ev.strategy(actions))
    assert step_info["iteration_time_s"] == pytest.approx(result.iteration_time_s, rel=1e-12)
    assert r == pytest.approx(-math.sqrt(result.iteration_time_s), rel=1e-12)
    assert step_info["peak_memory_bytes"] == result.peak_memory_bytes
    assert step_info["compute_time_s"] == pytest.approx(result.compute_time_s)
    assert step_info["comm_time_s"] == pytest.approx(result.comm_time_s)
    assert step_info["oom"] is False


def test_out_of_memory_multiplies_the_reward_by_the_factor(tiny_mlp, tmp_path):
    path = tmp_path / "tiny-memory.yaml"
    path.write_text("name: tiny-memory\nservers:\n  - gpus: [{type: V100-16GB, memory: 1 KB, count: 2}]\n"
                    "    intra: {kind: pcie, bandwidth: 12 GB/s}\n")
    cluster = load_cluster(str(path))
    for factor in (10.0, 3.0):
        e = PlacementEnv(tiny_mlp, cluster, oom_factor=factor)
        e.reset(seed=0)
        _, r, _, _, info = e.step(np.zeros(e.max_groups, dtype=np.int64))
        assert info["oom"] is True
        assert r == pytest.approx(-math.sqrt(info["iteration_time_s"]) * factor)


def test_padding_fits_two_graphs_and_padding_actions_are_ignored(tiny_mlp, tiny_cnn, paper8):
    e = PlacementEnv([tiny_mlp, tiny_cnn], paper8, max_ops=64, max_edges=100, max_groups=40)
    assert e.observation_space["op_x"].shape[0] == 64 and e.action_space.shape == (81,)
    for name, graph in (("tiny_mlp", tiny_mlp), ("tiny_cnn", tiny_cnn)):
        obs, info = e.reset(options={"graph": name})
        assert obs["op_mask"].sum() == graph.n_ops and obs["edge_mask"].sum() == len(graph.edges)
        g = info["n_groups"]
        assert obs["group_mask"].sum() == g and (obs["group_of"][graph.n_ops:] == -1).all()
        assert obs["group_of"][:graph.n_ops].max() == g - 1
        assert (obs["op_x"][graph.n_ops:] == 0).all()
        actions = np.full(40, 9)
        _, r0, _, _, _ = e.step(actions)
        actions[g:] = np.arange(40 - g) % 12   # change only padding entries
        e.reset(options={"graph": name})
        _, r1, _, _, _ = e.step(actions)
        assert r0 == r1


def test_max_groups_bounds_the_grouping(tiny_cnn, paper8):
    e = gym.make("HeteroG/Placement-v0", graph=tiny_cnn, cluster=paper8, max_groups=8).unwrapped
    obs, info = e.reset(seed=0)
    assert e.action_space.shape == (17,) and 1 <= info["n_groups"] <= 8
    assert obs["group_of"].max() == info["n_groups"] - 1


def test_bad_actions_and_options_are_refused(env):
    env.reset(seed=0)
    bad = np.zeros(env.max_groups, dtype=np.int64)
    bad[0] = 12
    with pytest.raises(StrategyError, match="action 12 of group 0 is out of range 0..11"):
        env.step(bad)
    with pytest.raises(StrategyError, match="shape"):
        env.step(np.zeros(3, dtype=np.int64))
    with pytest.raises(HeterogError, match="neither an index"):
        env.reset(options={"graph": "vgg19"})


def test_sync_vector_env_runs_parallel_rollouts(tiny_mlp, tiny_cnn, paper8):
    vec = gym.vector.SyncVectorEnv([lambda: PlacementEnv([tiny_mlp, tiny_cnn], paper8) for _ in range(3)])
    obs, infos = vec.reset(seed=[0, 1, 2])
    assert obs["op_x"].shape[0] == 3
    vec.action_space.seed(0)
    actions = vec.action_space.sample()
    _, rewards, terminated, truncated, infos = vec.step(actions)
    assert rewards.shape == (3,) and terminated.all() and not truncated.any()
    assert (rewards < 0).all() and infos["iteration_time_s"].shape == (3,)
    for i in range(3):   # each sub-env's reward is its own graph's evaluation
        single = PlacementEnv([tiny_mlp, tiny_cnn], paper8)
        single.reset(options={"graph": int(np.asarray(obs["op_mask"][i]).sum() != tiny_mlp.n_ops)})
        _, r, _, _, _ = single.step(actions[i])
        assert r == pytest.approx(rewards[i])
    vec.close()


def test_ansi_render_summarises_the_plan(tiny_mlp, paper8):
    e = PlacementEnv(tiny_mlp, paper8, render_mode="ansi")
    e.reset(seed=0)
    assert "no plan yet" in e.render()
    _, _, _, _, info = e.step(np.full(e.max_groups, 9))
    text = e.render()
    assert f"{info['iteration_time_s'] * 1e3:.2f} ms" in text and f"dp-even-ar={e.max_groups}" in text


def test_padded_device_tokens_give_one_space_for_clusters_of_any_size(tiny_mlp):
    """max_devices: device-free op features, dev_x padded to max_devices rows with dev_mask, the same
    observation space on 2 and 12 devices; the action space stays M + 4 per group."""
    made = {name: gym.make("HeteroG/Placement-v0", graph=tiny_mlp, cluster=name, max_devices=16).unwrapped
            for name in ("local-cpu-2", "paper-12gpu")}
    spaces = [env.observation_space for env in made.values()]
    assert spaces[0] == spaces[1]
    for env in made.values():
        check_env(env)
        obs, _ = env.reset(seed=0)
        m = env.n_devices
        assert obs["dev_x"].shape == (16, envs.DEVICE_FEATURE_DIM)
        assert obs["op_x"].shape[1] == envs.op_feature_dim(m, "device-free") == envs.op_feature_dim(16, "device-free")
        assert obs["dev_mask"].tolist() == [1] * m + [0] * (16 - m)
        assert not obs["dev_x"][m:].any()
        assert env.action_space.nvec.tolist() == [m + 4] * env.max_groups + [2] * env.max_groups + [5]
    plain = PlacementEnv(tiny_mlp, "paper-12gpu")
    assert "dev_mask" not in plain.observation_space.spaces


def test_device_free_op_features_summarise_the_per_device_columns(tiny_mlp, paper8):
    per_device = PlacementEnv(tiny_mlp, paper8).features[0].op_x
    free = PlacementEnv(tiny_mlp, paper8, max_devices=16).features[0].op_x
    full_batch = per_device[:, :8]                               # time_full_batch on each of the 8 devices
    np.testing.assert_allclose(free[:, 0], full_batch.mean(axis=1), rtol=1e-5)
    np.testing.assert_allclose(free[:, 1], full_batch.min(axis=1))
    np.testing.assert_allclose(free[:, 2], full_batch.max(axis=1))
    np.testing.assert_array_equal(free[:, 9:], per_device[:, 24:])   # everything after the per-device columns


def test_max_devices_below_the_cluster_is_refused(tiny_mlp):
    with pytest.raises(HeterogError, match="12 devices, more than max_devices=8"):
        PlacementEnv(tiny_mlp, "paper-12gpu", max_devices=8)
