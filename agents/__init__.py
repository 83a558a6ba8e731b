"""The learning agent: the GAT + Transformer-XL policy network (and, alongside it, trainers and
checkpoints that use it)."""

from agents.networks import (
    GATEncoder,
    GroupPooling,
    MaskedCategorical,
    PolicyError,
    RelativeMultiHeadAttention,
    StrategyPolicy,
    TransformerXL,
    TransformerXLLayer,
)

__all__ = [
    "GATEncoder",
    "GroupPooling",
    "MaskedCategorical",
    "PolicyError",
    "RelativeMultiHeadAttention",
    "StrategyPolicy",
    "TransformerXL",
    "TransformerXLLayer",
]
