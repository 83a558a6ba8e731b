"""Heads and decoders behind the policy's interfaces: a new head plugs in by name (with or without
autoregression), the fixed and token heads answer the interface as the policy needs, and the decoder
follows the config."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from agents.networks import (
    HEADS,
    AutoregressiveDecoder,
    DeviceTokens,
    FixedPolicyHead,
    IndependentDecoder,
    PolicyConfig,
    PolicyError,
    PolicyHead,
    StrategyPolicy,
    TokenPolicyHead,
    most_likely_actions,
)
from heterog.actions import N_DP_ACTIONS

F_OP, F_DEV, M = 6, 3, 3
SMALL = {"hidden": 16, "gat_layers": 1, "gat_heads": 2, "txl_layers": 1, "txl_heads": 2, "segment_len": 3,
         "mem_len": 4}


class SharedDataParallelHead(PolicyHead):
    """A head made for these tests: a linear layer scores the devices, one learned logit is shared by the four
    data-parallel schemes."""

    kind = "shared-dp"
    feature_layout = "per-device"
    autoregressive = True

    def __init__(self, hidden: int, n_devices: int) -> None:
        super().__init__()
        self.n_devices = n_devices
        self.device_scores = nn.Linear(hidden, n_devices)
        self.dp_logit = nn.Parameter(torch.zeros(()))

    @classmethod
    def from_config(cls, config: PolicyConfig) -> SharedDataParallelHead:
        return cls(config.hidden, config.n_devices)

    @classmethod
    def problems(cls, config: PolicyConfig) -> list[str]:
        return [] if config.hidden >= 8 else [f"the shared-dp head needs hidden >= 8, got {config.hidden}"]

    def device_problem(self, n_real: int, n_rows: int) -> str | None:
        return None if n_real == n_rows == self.n_devices else f"the shared-dp head takes {self.n_devices} devices"

    def forward(self, states: Tensor, devices: DeviceTokens | None) -> Tensor:
        dp = self.dp_logit.expand(*states.shape[:-1], N_DP_ACTIONS)
        return torch.cat([self.device_scores(states), dp], dim=-1)

    def add_data_parallel_bias(self, bias: float) -> None:
        with torch.no_grad():
            self.dp_logit.add_(bias)

    def reset_parameters(self) -> None:
        self.device_scores.reset_parameters()
        nn.init.zeros_(self.dp_logit)


@pytest.fixture
def shared_dp(monkeypatch):
    monkeypatch.setitem(HEADS, SharedDataParallelHead.kind, SharedDataParallelHead)
    return SharedDataParallelHead


def graph(n_ops: int = 14, n_groups: int = 5, seed: int = 0) -> dict[str, Tensor]:
    """An unpadded observation in which every group has an op."""
    gen = torch.Generator().manual_seed(seed)
    group_of = torch.cat([torch.arange(n_groups), torch.randint(0, n_groups, (n_ops - n_groups,), generator=gen)])
    return {"op_x": torch.randn(n_ops, F_OP, generator=gen), "op_mask": torch.ones(n_ops, dtype=torch.bool),
            "edge_index": torch.randint(0, n_ops, (2, 20), generator=gen),
            "edge_mask": torch.ones(20, dtype=torch.bool), "group_of": group_of,
            "group_mask": torch.ones(n_groups, dtype=torch.bool), "dev_x": torch.randn(M, F_DEV, generator=gen)}


# ------------------------------------------------------------------------------------------ a new head
def test_a_new_head_plugs_in_by_name(shared_dp) -> None:
    torch.manual_seed(0)
    config = PolicyConfig(F_OP, F_DEV, M + N_DP_ACTIONS, head="shared-dp", **SMALL)
    assert config.to_dict()["head"] == "shared-dp" and PolicyConfig.from_dict(config.to_dict()) == config
    policy = StrategyPolicy(config).eval()
    assert isinstance(policy.head, shared_dp) and policy.head_kind == "shared-dp"
    assert policy.feature_layout == "per-device" and policy.devices is None
    assert policy.fits_devices(M) and not policy.fits_devices(M + 1)
    policy.add_data_parallel_bias(2.0)
    obs = graph()
    with torch.no_grad():
        logits = policy(**obs)
        states = policy.encode_strategy(policy.embed_groups(**obs), obs["group_mask"])
        expected = torch.cat([policy.head.device_scores(states), torch.full((5, N_DP_ACTIONS), 2.0)], dim=-1)
    assert torch.equal(logits, expected)
    with pytest.raises(PolicyError, match="the shared-dp head takes 3 devices"):
        policy(**{**obs, "dev_x": torch.randn(M + 1, F_DEV)})
    with pytest.raises(PolicyError, match="the shared-dp head needs hidden >= 8, got 4"):
        config.replace(hidden=4)


def test_a_new_autoregressive_head_decodes_and_others_say_which_heads_can(shared_dp) -> None:
    torch.manual_seed(0)
    policy = StrategyPolicy(PolicyConfig(F_OP, F_DEV, M + N_DP_ACTIONS, head="shared-dp", autoregressive=True,
                                         **SMALL)).eval()
    assert isinstance(policy.decoder, AutoregressiveDecoder) and policy.autoregressive
    obs = graph()
    with torch.no_grad():
        policy.head.device_scores.weight.mul_(100.0)                 # a peaked policy, so greedy is telling
        emb = policy.embed_groups(**obs)
        greedy = policy.sample_actions(emb, obs["group_mask"], 2, greedy=True)
        along = policy.action_logits(emb, obs["group_mask"], greedy)
    assert torch.equal(greedy[0], greedy[1]) and torch.equal(most_likely_actions(along[0]), greedy[0])
    with pytest.raises(PolicyError, match="the tokens head is not autoregressive; autoregressive=True takes "
                                          "head fixed or shared-dp"):
        PolicyConfig(F_OP, F_DEV, 20, head="tokens", autoregressive=True)


# -------------------------------------------------------------------------------------- the two heads
def test_the_registered_heads_are_fixed_and_tokens() -> None:
    assert HEADS == {"fixed": FixedPolicyHead, "tokens": TokenPolicyHead}
    assert [(h.feature_layout, h.autoregressive) for h in HEADS.values()] == [("per-device", True),
                                                                              ("device-free", False)]


def test_the_fixed_head_scores_one_cluster_size_and_starts_near_zero() -> None:
    torch.manual_seed(0)
    head = FixedPolicyHead(16, M + N_DP_ACTIONS)
    assert head.device_problem(M, M) is None
    assert head.device_problem(M, 5) == "the fixed head takes no padded devices, got dev_mask with 3 of 5 real"
    assert head.device_problem(5, 5) == "dev_x has 5 devices, so 9 actions; this policy has 7 (built for 3 devices)"
    head.reset_parameters()
    torch.testing.assert_close(head.weight @ head.weight.T, 1e-4 * torch.eye(M + N_DP_ACTIONS))
    head.add_data_parallel_bias(1.5)
    assert head.bias.tolist() == [0.0] * M + [1.5] * N_DP_ACTIONS
    states = torch.randn(2, 5, 16)
    assert torch.equal(head(states, None), states @ head.weight.T + head.bias)


def test_the_token_head_scores_any_cluster_up_to_its_size() -> None:
    head = TokenPolicyHead(16, max_devices=8)
    assert head.device_problem(2, 8) is None and head.device_problem(8, 8) is None
    assert head.device_problem(9, 9) == ("dev_x has 9 real devices in 9 rows; this device-token policy takes 1 "
                                         "to 8 devices")
    assert head.device_problem(0, 4) is not None
    with pytest.raises(PolicyError, match="needs devices=policy.embed_devices"):
        head(torch.randn(5, 16), None)
    config = PolicyConfig(F_OP, F_DEV, 12, head="tokens", **SMALL)
    assert TokenPolicyHead.device_encoder(config).layers == 1 and FixedPolicyHead.device_encoder(config) is None


# ------------------------------------------------------------------------------------------ decoders
def test_the_decoder_follows_the_config() -> None:
    torch.manual_seed(0)
    independent = StrategyPolicy(PolicyConfig(F_OP, F_DEV, M + N_DP_ACTIONS, **SMALL))
    autoregressive = StrategyPolicy(PolicyConfig(F_OP, F_DEV, M + N_DP_ACTIONS, autoregressive=True, **SMALL))
    assert isinstance(independent.decoder, IndependentDecoder) and not independent.autoregressive
    assert not any(k.startswith("decoder.") for k in independent.state_dict())
    assert [k for k in autoregressive.state_dict() if k.startswith("decoder.")] == ["decoder.action_emb.weight"]
    assert autoregressive.decoder.action_emb.weight.shape == (M + N_DP_ACTIONS + 1, 16)
    logits = torch.zeros(5, M + N_DP_ACTIONS)
    mask = torch.ones(5, dtype=torch.bool)
    assert independent.draw(logits, mask, 3, greedy=True).shape == (3, 5)
    with pytest.raises(PolicyError, match="draw gives action-independent logits"):
        autoregressive.draw(logits, mask, 3)
