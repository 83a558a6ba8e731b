"""Policy network of the learning agent: a GAT encoder over the op graph, sigma-pooled group embeddings and
a Transformer-XL strategy network giving (M+4)-way logits per group through a head.

Modules: ``config`` (:class:`PolicyConfig`, the settings), ``encoders`` (GAT, group pooling, device
tokens), ``transformer_xl``, ``heads`` (:class:`PolicyHead` and the heads by name, :data:`HEADS`),
``decoding`` (independent or autoregressive choice of the groups' actions), ``distributions`` (masked
categorical, greedy decisions, drawing strategies), ``plan`` (the plan-level decisions: a recompute bit
per group and the number of micro-batches) and ``policy`` (:class:`StrategyPolicy`)."""

from agents.networks.common import N_MICRO_CHOICES, PolicyError
from agents.networks.config import PolicyConfig
from agents.networks.decoding import AutoregressiveDecoder, GroupDecoder, IndependentDecoder
from agents.networks.distributions import MaskedCategorical, draw_actions, draw_strategies, most_likely_actions
from agents.networks.encoders import (
    GAT_CONVS,
    GROUP_ACTIVATIONS,
    DeviceTokenEncoder,
    DeviceTokens,
    GATEncoder,
    GroupPooling,
    masked_mean,
)
from agents.networks.heads import HEADS, FixedPolicyHead, PolicyHead, TokenPolicyHead
from agents.networks.plan import PlanDistribution, PlanHead, PlanLogits, plan_log_prob, plan_log_prob_parts
from agents.networks.policy import StrategyPolicy
from agents.networks.transformer_xl import (
    RelativeMultiHeadAttention,
    TransformerXL,
    TransformerXLLayer,
    sinusoid_embedding,
)

__all__ = [
    "GAT_CONVS",
    "GROUP_ACTIVATIONS",
    "HEADS",
    "N_MICRO_CHOICES",
    "AutoregressiveDecoder",
    "DeviceTokenEncoder",
    "DeviceTokens",
    "FixedPolicyHead",
    "GATEncoder",
    "GroupDecoder",
    "GroupPooling",
    "IndependentDecoder",
    "MaskedCategorical",
    "PlanDistribution",
    "PlanHead",
    "PlanLogits",
    "PolicyConfig",
    "PolicyError",
    "PolicyHead",
    "RelativeMultiHeadAttention",
    "StrategyPolicy",
    "TokenPolicyHead",
    "TransformerXL",
    "TransformerXLLayer",
    "draw_actions",
    "draw_strategies",
    "masked_mean",
    "most_likely_actions",
    "plan_log_prob",
    "plan_log_prob_parts",
    "sinusoid_embedding",
]
