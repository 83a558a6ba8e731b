"""Policy inputs from env observations and from features: trimming, batching, and the same logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.features import PolicyInputs, pad_actions
from agents.networks import PolicyConfig, StrategyPolicy
from envs import DEVICE_FEATURE_DIM, PlacementEnv, graph_features, op_feature_dim
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


@pytest.fixture(scope="module")
def setup():
    cluster = load_cluster("paper-8gpu")
    graphs = [capture_model("tiny_mlp", 16), capture_model("tiny_cnn", 16)]
    env = PlacementEnv(graphs, cluster)
    torch.manual_seed(0)
    policy = StrategyPolicy(PolicyConfig(op_feature_dim(8), DEVICE_FEATURE_DIM, 12, hidden=16, gat_layers=1,
                                         gat_heads=2, txl_layers=1, txl_heads=2, segment_len=8, mem_len=8)).eval()
    return cluster, graphs, env, policy


def test_trimmed_and_padded_observations_give_the_same_logits(setup):
    _, graphs, env, policy = setup
    obs, info = env.reset(options={"graph": "tiny_mlp"})
    trimmed, padded = PolicyInputs.from_observation(obs), PolicyInputs.from_observation(obs, trim=False)
    g = info["n_groups"]
    assert trimmed.op_x.shape[0] == graphs[0].n_ops and padded.op_x.shape[0] == env.max_ops
    assert trimmed.n_groups == padded.n_groups == g
    with torch.no_grad():
        a, b = policy(*trimmed.args()), policy(*padded.args())
    assert torch.allclose(a, b[:g], atol=1e-5)
    assert (b[g:] == 0).all()


def test_from_features_equals_the_trimmed_observation(setup):
    cluster, graphs, env, _ = setup
    ev = Evaluator(graphs[1], cluster)
    direct = PolicyInputs.from_features(graph_features(graphs[1], cluster, ev.cost, ev.group_of))
    obs, _ = env.reset(options={"graph": "tiny_cnn"})
    via_env = PolicyInputs.from_observation(obs)
    for x, y in zip(direct.args(), via_env.args()):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_batched_observation_splits_per_sub_env(setup):
    _, graphs, env, _ = setup
    obs = [env.reset(options={"graph": i})[0] for i in range(2)]
    batched = {k: np.stack([o[k] for o in obs]) for k in obs[0]}
    parts = PolicyInputs.from_batched_observation(batched)
    assert [p.op_x.shape[0] for p in parts] == [g.n_ops for g in graphs]
    assert pad_actions(np.array([[1, 2], [3, 4]]), 4).tolist() == [[1, 2, 0, 0], [3, 4, 0, 0]]
