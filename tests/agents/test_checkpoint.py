"""Checkpoints: exact resumption (N rounds = N/2 + resume + N/2), atomic writes, refusal of another
action space or of a foreign file."""
from __future__ import annotations

import pytest
import torch

from agents.checkpoint import check_fits, load_checkpoint, policy_from_checkpoint, save_checkpoint
from agents.networks import PolicyConfig, StrategyPolicy
from agents.tasks import make_task
from agents.trainer import Trainer, TrainerSettings
from envs import DEVICE_FEATURE_DIM, op_feature_dim
from heterog.cluster import load_cluster
from heterog.errors import CheckpointError
from heterog.graph.cache import capture_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tasks():
    cluster = load_cluster("paper-8gpu")
    return [make_task(capture_model("tiny_mlp", 16), cluster), make_task(capture_model("tiny_cnn", 16), cluster)]


def tiny_policy(seed: int = 0) -> StrategyPolicy:
    torch.manual_seed(seed)
    return StrategyPolicy(PolicyConfig(op_feature_dim(8), DEVICE_FEATURE_DIM, 12, hidden=16, gat_layers=1, gat_heads=2,
                                       txl_layers=1, txl_heads=2, segment_len=8, mem_len=8))


@pytest.mark.parametrize("algorithm", ["reinforce", "ppo"])
def test_resuming_gives_the_same_weights_as_training_straight(tasks, tmp_path, algorithm):
    settings = {"algorithm": algorithm, "samples_per_graph": 3, "explore_samples": 1, "mutate_samples": 1,
                "graphs_per_round": 1,
                "replay_pool_size": 4, "replay_samples": 2, "ppo_epochs": 2, "seed": 7}
    straight = Trainer(tiny_policy(), tasks, TrainerSettings(**settings))
    straight.train(rounds=6)

    first = Trainer(tiny_policy(), tasks, TrainerSettings(**settings))
    first.train(rounds=3, checkpoint_path=tmp_path / "agent.pt")
    state = load_checkpoint(tmp_path / "agent.pt")
    resumed = Trainer(policy_from_checkpoint(state), tasks, TrainerSettings.from_dict(state["settings"]))
    resumed.load_state_dict(state)
    resumed.train(rounds=3)

    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)
    assert resumed.rounds == straight.rounds == 6 and resumed.episodes == straight.episodes
    for t in tasks:
        s, r = straight.states[t.key], resumed.states[t.key]
        assert (s.baseline, s.reward_var, s.best_actions, s.pool) == (r.baseline, r.reward_var, r.best_actions,
                                                                      r.pool)
    opt_s, opt_r = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_s[k]["exp_avg"], opt_r[k]["exp_avg"]) for k in opt_s)


def test_checkpoint_holds_everything_a_run_needs(tasks, tmp_path):
    trainer = Trainer(tiny_policy(), tasks, TrainerSettings(samples_per_graph=2, explore_samples=1, mutate_samples=0))
    trainer.train(rounds=2)
    path = trainer.save(tmp_path / "a.pt")
    state = load_checkpoint(path)
    assert set(state) >= {"format", "version", "policy_config", "policy_state", "optimizer_state", "settings",
                          "tasks", "best_strategies", "counters", "rng"}
    assert set(state["rng"]) == {"torch_generator", "torch_global", "numpy", "python"}
    assert state["counters"]["rounds"] == 2 and state["counters"]["episodes"] == 8
    for t in tasks:
        saved = state["best_strategies"][t.key]
        assert saved["format"] == "heterog-strategy" and saved["meta"]["actions"] == \
            trainer.states[t.key].best_actions
        assert state["tasks"][t.key]["baseline"] == trainer.states[t.key].baseline


def test_a_checkpoint_for_another_action_space_is_refused(tasks, tmp_path):
    torch.manual_seed(0)
    other = StrategyPolicy(PolicyConfig(op_feature_dim(4), DEVICE_FEATURE_DIM, 8, hidden=16, gat_layers=1, gat_heads=2,
                                        txl_layers=1, txl_heads=2))
    save_checkpoint(tmp_path / "m4.pt", {"policy_config": other.config, "policy_state": other.state_dict()})
    state = load_checkpoint(tmp_path / "m4.pt")
    with pytest.raises(CheckpointError, match=r"an action space of 8 actions \(4 devices\); this cluster needs "
                                              r"12 actions \(8 devices\)"):
        check_fits(state, 8, op_feature_dim(8), DEVICE_FEATURE_DIM)
    check_fits(state, 4, op_feature_dim(4), DEVICE_FEATURE_DIM)


def test_a_failed_write_keeps_the_previous_checkpoint(tasks, tmp_path, monkeypatch):
    settings = TrainerSettings(samples_per_graph=2, explore_samples=0, mutate_samples=0)
    trainer = Trainer(tiny_policy(), tasks[:1], settings)
    trainer.train(rounds=1)
    path = trainer.save(tmp_path / "agent.pt")
    before = path.read_bytes()
    trainer.train(rounds=1)

    monkeypatch.setattr("heterog.atomic.os.replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        trainer.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.pt"]


def test_foreign_or_missing_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a heterog agent checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
