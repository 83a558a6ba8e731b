"""The learning agent: the GAT + Transformer-XL policy network, its inputs, the REINFORCE/PPO trainer
with its candidate search and reporting, checkpoints, and the planner entry used by
``heterog plan --method agent``."""

from typing import Any

from agents.networks import (
    DeviceTokenEncoder,
    DeviceTokens,
    GATEncoder,
    GroupPooling,
    MaskedCategorical,
    PolicyError,
    RelativeMultiHeadAttention,
    StrategyPolicy,
    TokenPolicyHead,
    TransformerXL,
    TransformerXLLayer,
)

__all__ = [
    "DeviceTokenEncoder",
    "DeviceTokens",
    "GATEncoder",
    "GraphTask",
    "GroupPooling",
    "MaskedCategorical",
    "PolicyError",
    "PolicyInputs",
    "RelativeMultiHeadAttention",
    "StrategyPolicy",
    "Trainer",
    "TokenPolicyHead",
    "TrainerSettings",
    "TransformerXL",
    "TransformerXLLayer",
    "load_checkpoint",
    "make_task",
    "plan",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    """Trainer, checkpoints, inputs and planner load on first use (they pull in envs and the simulator)."""
    lazy = {"GraphTask": "agents.tasks", "Trainer": "agents.trainer", "TrainerSettings": "agents.trainer",
            "make_task": "agents.tasks", "PolicyInputs": "agents.features", "load_checkpoint": "agents.checkpoint",
            "save_checkpoint": "agents.checkpoint", "plan": "agents.planner"}
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module 'agents' has no attribute {name!r}")
