"""The policy's settings (:class:`PolicyConfig`): every problem named at once, the checkpoint dict (a
fixed-head config stays in the layout older checkpoints have), the shipped checkpoint's config, and
state dicts of an earlier key layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agents.checkpoint import load_checkpoint, policy_from_checkpoint
from agents.networks import PolicyConfig, PolicyError, StrategyPolicy
from agents.planner import PRETRAINED
from heterog.errors import HeterogError

F_OP, F_DEV, M = 6, 3, 3
SMALL = {"hidden": 16, "gat_layers": 1, "gat_heads": 2, "txl_layers": 1, "txl_heads": 2, "segment_len": 4,
         "mem_len": 4}


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(PolicyError) as raised:
        PolicyConfig(F_OP, F_DEV, 4, hidden=100, gat_heads=8, txl_heads=3, segment_len=0, dropout=1.0,
                     gat_conv="gcn")
    assert str(raised.value) == (
        "bad policy settings: n_actions must be M + 4 for M >= 1 devices, got 4; dropout must be in [0, 1), "
        "got 1.0; unknown GAT conv 'gcn' (choose one of ['gat', 'gatv2']); hidden size 100 is not divisible "
        "by 8 GAT heads; hidden size 100 is not divisible by 3 Transformer-XL heads; segment_len must be at "
        "least 1, got 0")
    assert isinstance(raised.value, HeterogError) and isinstance(raised.value, ValueError)


def test_the_heads_own_settings_are_checked_with_the_rest() -> None:
    with pytest.raises(PolicyError) as raised:
        PolicyConfig(0, F_DEV, 20, hidden=36, gat_heads=4, txl_heads=4, head="tokens", autoregressive=True,
                     device_layers=-1, mem_len=-2)
    assert str(raised.value) == (
        "bad policy settings: op_feature_dim must be at least 1, got 0; the tokens head is not autoregressive; "
        "autoregressive=True takes head fixed; device token layers must be at least 0, got -1; mem_len must "
        "be at least 0, got -2")
    with pytest.raises(PolicyError, match=r"unknown policy head 'pointer' \(choose one of \['fixed', 'tokens'\]\)"):
        PolicyConfig(F_OP, F_DEV, 20, head="pointer")


def test_a_fixed_head_config_keeps_the_checkpoint_layout_of_older_checkpoints() -> None:
    fixed = PolicyConfig(F_OP, F_DEV, M + 4, **SMALL)
    stored = fixed.to_dict()
    assert list(stored) == ["op_feature_dim", "device_feature_dim", "n_actions", "hidden", "gat_layers",
                            "gat_heads", "txl_layers", "txl_heads", "segment_len", "mem_len", "dropout", "gat_conv",
                            "group_activation", "detach_mem", "autoregressive"]
    assert PolicyConfig.from_dict(stored) == fixed and fixed.n_devices == M
    tokens = fixed.replace(n_actions=20, op_feature_dim=7, head="tokens", device_layers=2)
    assert tokens.to_dict() == {**stored, "n_actions": 20, "op_feature_dim": 7, "head": "tokens", "device_layers": 2}
    assert PolicyConfig.from_dict(tokens.to_dict()) == tokens and tokens.n_devices == 16


def test_configs_are_frozen_and_changes_are_checked_again() -> None:
    config = PolicyConfig(F_OP, F_DEV, M + 4, **SMALL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden = 32
    with pytest.raises(PolicyError, match="hidden size 100 is not divisible by 8 GAT heads"):
        config.replace(hidden=100, gat_heads=8)


def test_a_stored_config_with_unknown_or_missing_settings_is_refused() -> None:
    with pytest.raises(PolicyError) as raised:
        PolicyConfig.from_dict({"op_feature_dim": F_OP, "device_feature_dim": F_DEV, "hiden": 16})
    assert str(raised.value) == ("bad policy config: unknown policy setting 'hiden'; policy setting 'n_actions' "
                                 "is missing")
    with pytest.raises(PolicyError, match="a policy is built from a PolicyConfig, got dict"):
        StrategyPolicy({"op_feature_dim": F_OP, "device_feature_dim": F_DEV, "n_actions": M + 4})
    built = StrategyPolicy.from_config({"op_feature_dim": F_OP, "device_feature_dim": F_DEV, "n_actions": M + 4})
    assert built.settings == PolicyConfig(F_OP, F_DEV, M + 4) and built.config == built.settings.to_dict()


def test_the_shipped_checkpoint_config_round_trips_and_its_weights_load_strictly() -> None:
    """Every stored weight loads; the plan-level heads, which the shipped policy predates, are the only
    parameters it lacks and keep their initial values."""
    state = load_checkpoint(PRETRAINED)
    config = PolicyConfig.from_dict(state["policy_config"])
    assert config.to_dict() == state["policy_config"] and config.head == "tokens"
    policy = policy_from_checkpoint(state)
    assert policy.settings == config and policy.config == state["policy_config"]
    new = [k for k in policy.state_dict() if k not in state["policy_state"]]
    assert new == ["head.plan.recompute.weight", "head.plan.recompute.bias", "head.plan.micro.weight",
                   "head.plan.micro.bias"]
    assert [k for k in policy.state_dict() if k not in new] == list(state["policy_state"])
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in state["policy_state"].items())
    fresh = StrategyPolicy(config)
    assert all(torch.equal(policy.state_dict()[k], fresh.state_dict()[k]) for k in new)


def test_an_autoregressive_state_dict_with_the_earlier_action_embedding_key_loads() -> None:
    """Autoregressive checkpoints keep the action embedding under ``action_emb.weight``; it now lives in the
    decoder and loads from either key, with the parameter order (and so the optimizer state) unchanged."""
    config = PolicyConfig(F_OP, F_DEV, M + 4, autoregressive=True, **SMALL)
    torch.manual_seed(0)
    trained = StrategyPolicy(config)
    earlier = {("action_emb.weight" if k == "decoder.action_emb.weight" else k): v
               for k, v in trained.state_dict().items()}
    assert list(earlier)[-1] == "action_emb.weight"
    torch.manual_seed(1)
    fresh = StrategyPolicy(config)
    fresh.load_state_dict(earlier)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.state_dict().values()))
    assert [name for name, _ in fresh.named_parameters()][-1] == "decoder.action_emb.weight"
