"""The device-token head (``head="tokens"``): masked padding devices, permutation equivariance over
devices, one policy for clusters of 2, 8 and 12 devices, checkpoints that record the head (a fixed head
refuses another cluster size, a tokens head accepts it), the env's padded device tokens, and learning on
a tiny graph."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401 - registers the env ids
from agents.checkpoint import check_fits, checkpoint_head, load_checkpoint, policy_from_checkpoint, save_checkpoint
from agents.features import PolicyInputs
from agents.networks import DeviceTokenEncoder, PolicyConfig, PolicyError, StrategyPolicy, TokenPolicyHead
from agents.planner import build_policy
from agents.tasks import make_task
from agents.trainer import Trainer, TrainerSettings, bias_towards_data_parallel
from envs import DEVICE_FEATURE_DIM, op_feature_dim
from heterog.cluster import load_cluster
from heterog.errors import CheckpointError
from heterog.graph.cache import capture_model

torch.set_num_threads(1)
MAX_DEVICES = 16
F_OP = op_feature_dim(MAX_DEVICES, "device-free")


def token_policy(seed: int = 0, max_devices: int = MAX_DEVICES) -> StrategyPolicy:
    torch.manual_seed(seed)
    return StrategyPolicy(PolicyConfig(F_OP, DEVICE_FEATURE_DIM, max_devices + 4, hidden=16, gat_layers=1,
                                       gat_heads=2, txl_layers=1, txl_heads=2, segment_len=8, mem_len=8,
                                       head="tokens"))


def trained_like(policy: StrategyPolicy, seed: int = 1) -> StrategyPolicy:
    """Move every weight away from its initialisation (the head starts near zero: too easy to pass)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return policy.eval()


@pytest.fixture(scope="module")
def mlp():
    return capture_model("tiny_mlp", 16)


@pytest.fixture(scope="module")
def clusters():
    return {m: load_cluster(name) for m, name in ((2, "local-cpu-2"), (8, "paper-8gpu"), (12, "paper-12gpu"))}


@pytest.fixture(scope="module")
def token_tasks(mlp, clusters):
    return {m: make_task(mlp, c, layout="device-free") for m, c in clusters.items()}


def logits(policy: StrategyPolicy, inputs: PolicyInputs) -> torch.Tensor:
    with torch.no_grad():
        return policy(*inputs.args())


# ------------------------------------------------------------------------------------------ layers
def test_layers_reject_bad_settings_and_describe_themselves():
    with pytest.raises(PolicyError, match="not divisible by 3 device token heads"):
        DeviceTokenEncoder(DEVICE_FEATURE_DIM, 16, 3)
    with pytest.raises(PolicyError, match="unknown policy head 'pointer'"):
        PolicyConfig(F_OP, DEVICE_FEATURE_DIM, 20, head="pointer")
    with pytest.raises(PolicyError, match="not autoregressive"):
        PolicyConfig(F_OP, DEVICE_FEATURE_DIM, 20, head="tokens", autoregressive=True)
    assert "pointer over device tokens" in repr(TokenPolicyHead(8))
    assert "heads=2, layers=1" in repr(DeviceTokenEncoder(DEVICE_FEATURE_DIM, 16, 2))
    assert "head=tokens" in repr(token_policy())


def test_reset_parameters_restores_a_near_uniform_head(token_tasks):
    policy = trained_like(token_policy())
    policy.reset_parameters()
    out = logits(policy, token_tasks[8].inputs)
    assert out.shape == (token_tasks[8].n_groups, 12) and out.abs().max() < 0.1


# -------------------------------------------------------------------------------------------- masks
def test_padded_devices_never_get_probability(token_tasks):
    """Garbage padding rows behind dev_mask change nothing: the logits have M + 4 entries, the same as
    without the padding, and every action of the distribution is a real one."""
    policy, inputs = trained_like(token_policy()), token_tasks[8].inputs
    m = inputs.n_devices
    garbage = torch.randn(MAX_DEVICES - m, DEVICE_FEATURE_DIM) * 5
    padded = PolicyInputs(*inputs.args()[:6], torch.cat([inputs.dev_x, garbage]),
                          torch.arange(MAX_DEVICES) < m)
    assert padded.n_devices == m
    plain, masked = logits(policy, inputs), logits(policy, padded)
    assert masked.shape == (inputs.n_groups, m + 4)
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-5)
    draws = policy.distribution(*padded.args()).sample(200)
    assert int(draws.max()) < m + 4


def test_fixed_head_refuses_padded_devices(token_tasks):
    inputs = token_tasks[8].inputs
    torch.manual_seed(0)
    fixed = StrategyPolicy(PolicyConfig(F_OP, DEVICE_FEATURE_DIM, 12, hidden=16, gat_layers=1, gat_heads=2,
                                        txl_layers=1, txl_heads=2))
    dev_x = torch.cat([inputs.dev_x, torch.zeros(2, DEVICE_FEATURE_DIM)])
    with pytest.raises(PolicyError, match="takes no padded devices"):
        fixed(*inputs.args()[:6], dev_x, torch.arange(10) < 8)


def test_permuting_devices_permutes_model_parallel_logits_only(token_tasks):
    policy, inputs = trained_like(token_policy()), token_tasks[12].inputs
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    permuted = PolicyInputs(*inputs.args()[:6], inputs.dev_x[perm])
    base, out = logits(policy, inputs), logits(policy, permuted)
    torch.testing.assert_close(out[:, :12], base[:, :12][:, perm], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[:, 12:], base[:, 12:], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(base[:, :12], base[:, :12][:, perm])     # the devices do differ


def test_one_policy_scores_clusters_of_2_8_and_12_devices(token_tasks):
    policy = trained_like(token_policy())
    for m, task in token_tasks.items():
        out = logits(policy, task.inputs)
        assert out.shape == (task.n_groups, m + 4) and torch.isfinite(out).all()
        devices = policy.embed_devices(task.inputs.dev_x)
        assert policy.n_actions_for(devices) == m + 4


def test_too_many_devices_are_refused(token_tasks):
    policy, inputs = token_policy(max_devices=8), token_tasks[12].inputs
    with pytest.raises(PolicyError, match="takes 1 to 8 devices"):
        policy(*inputs.args())


def test_dp_bias_raises_the_token_heads_data_parallel_logits(token_tasks):
    policy, inputs = token_policy(), token_tasks[8].inputs
    before = logits(policy, inputs)
    bias_towards_data_parallel(policy, 2.0)
    after = logits(policy, inputs)
    torch.testing.assert_close(after[:, 8:] - before[:, 8:], torch.full_like(before[:, 8:], 2.0))
    torch.testing.assert_close(after[:, :8], before[:, :8])


# ------------------------------------------------------------------------------------------- the env
@pytest.mark.parametrize("cluster", ["local-cpu-2", "paper-12gpu"])
def test_env_with_device_tokens_passes_check_env_with_one_space_for_any_cluster(mlp, cluster):
    env = gym.make("HeteroG/Placement-v0", graph=mlp, cluster=cluster, max_devices=MAX_DEVICES).unwrapped
    check_env(env)
    obs, _ = env.reset(seed=0)
    m = env.n_devices
    assert obs["dev_x"].shape == (MAX_DEVICES, DEVICE_FEATURE_DIM) and obs["op_x"].shape[1] == F_OP
    assert obs["dev_mask"].tolist() == [1] * m + [0] * (MAX_DEVICES - m)
    assert env.action_space.nvec.tolist() == [m + 4] * env.max_groups + [2] * env.max_groups + [5]
    policy = trained_like(token_policy())
    trimmed = PolicyInputs.from_observation(obs)
    untrimmed = PolicyInputs.from_observation(obs, trim=False)
    assert trimmed.dev_mask is None and untrimmed.dev_mask is not None and untrimmed.n_devices == m
    out = logits(policy, untrimmed)
    assert out.shape[1] == m + 4
    torch.testing.assert_close(out[trimmed.group_mask], logits(policy, trimmed), rtol=1e-5, atol=1e-5)
    action = policy.distribution(*trimmed.args()).mode
    _, reward, terminated, _, info = env.step(np.pad(action.numpy(), (0, env.max_groups - len(action))))
    assert terminated and reward < 0 and info["iteration_time_s"] > 0


# ------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_records_the_head_and_tokens_fit_any_cluster_size(token_tasks, tmp_path):
    settings = TrainerSettings(seed=0, samples_per_graph=4, explore_samples=1, mutate_samples=1)
    trainer = Trainer(token_policy(), [token_tasks[8]], settings)
    trainer.train(rounds=1)
    path = save_checkpoint(tmp_path / "tokens.pt", trainer.state_dict())
    state = load_checkpoint(path)
    assert checkpoint_head(state) == "tokens"
    for m in (2, 8, 12):
        check_fits(state, m)
    with pytest.raises(CheckpointError, match="at most 16 devices; this cluster has 17"):
        check_fits(state, 17)
    policy = policy_from_checkpoint(state).eval()
    trainer.policy.eval()
    torch.testing.assert_close(logits(policy, token_tasks[12].inputs), logits(trainer.policy, token_tasks[12].inputs))


def test_the_agent_planner_runs_a_tokens_checkpoint_on_another_cluster_size(token_tasks, clusters, mlp):
    from agents.planner import plan
    from heterog.evaluate import Evaluator

    settings = TrainerSettings(seed=0, samples_per_graph=4, explore_samples=1, mutate_samples=1)
    trainer = Trainer(token_policy(), [token_tasks[8]], settings)
    trainer.train(rounds=1)
    strategy = plan(Evaluator(mlp, clusters[12]), checkpoint=trainer.state_dict(), episodes=4, progress=False,
                    settings=settings)
    assert strategy.method == "agent" and strategy.meta["best_iteration_time_s"] > 0


def test_fixed_head_checkpoint_refuses_another_cluster_size(mlp, clusters, tmp_path):
    policy = build_policy(8, "small", seed=0, hidden=16, gat_layers=1, gat_heads=2, txl_layers=1, txl_heads=2)
    trainer = Trainer(policy, [make_task(mlp, clusters[8])], TrainerSettings(seed=0, samples_per_graph=2,
                                                                               explore_samples=0, mutate_samples=0))
    state = load_checkpoint(save_checkpoint(tmp_path / "fixed.pt", trainer.state_dict()))
    assert checkpoint_head(state) == "fixed" and "head" not in state["policy_config"]
    check_fits(state, 8)
    with pytest.raises(CheckpointError, match=r"12 actions \(8 devices\); this cluster needs 16 actions "
                                              r"\(12 devices\).*agent.head=tokens"):
        check_fits(state, 12)


def test_trainer_takes_tokens_tasks_of_several_cluster_sizes(token_tasks):
    settings = TrainerSettings(seed=0, samples_per_graph=4, explore_samples=1, mutate_samples=1)
    trainer = Trainer(token_policy(), list(token_tasks.values()), settings)
    trainer.train(rounds=2)
    for m, task in token_tasks.items():
        best = trainer.states[task.key].best_actions
        assert best is not None and max(best) < m + 4
    with pytest.raises(CheckpointError, match="at most"):
        Trainer(token_policy(max_devices=8), [token_tasks[12]], settings)


# ------------------------------------------------------------------------------------------ learning
def test_training_the_token_head_lowers_the_sampled_iteration_time(token_tasks):
    """As for the fixed head (tests/agents/test_trainer.py): on tiny_mlp everything on one GPU is fastest,
    and sampled plans move towards it."""
    settings = TrainerSettings(samples_per_graph=8, learning_rate=1e-2, seed=0, mutate_samples=0)
    trainer = Trainer(token_policy(), [token_tasks[8]], settings)
    first = trainer.update()["reward_mean"]
    rewards = [trainer.update()["reward_mean"] for _ in range(30)]
    assert np.mean(rewards[-3:]) > 0.7 * first       # rewards are negative: mean -sqrt(T) up by 30%
    state = trainer.states[token_tasks[8].key]
    assert state.best_iteration_time_s < 0.5 * first ** 2
