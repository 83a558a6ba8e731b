"""The settings a policy network is built from, declared once and checked together: :class:`PolicyConfig`,
stored in checkpoints as a plain dict (:meth:`PolicyConfig.to_dict`, :meth:`PolicyConfig.from_dict`)."""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from agents.networks.common import raise_problems
from agents.networks.encoders import GATEncoder, GroupPooling
from agents.networks.heads import HEADS
from agents.networks.transformer_xl import TransformerXL
from heterog.actions import N_DP_ACTIONS

FIXED_HEAD = "fixed"
# Left out of a fixed-head config's dict: checkpoints made before there were other heads have neither, and
# the fixed head reads neither.
NOT_STORED_FOR_FIXED_HEAD = ("head", "device_layers")


@dataclass(frozen=True)
class PolicyConfig:
    """How a :class:`StrategyPolicy` is built: every setting is declared here once and checked when the
    config is made, all problems named in one :class:`PolicyError` (e.g. ``PolicyConfig(F_op, F_dev, M + 4,
    hidden=100, gat_heads=8)``: "hidden size 100 is not divisible by 8 GAT heads")."""

    op_feature_dim: int
    """Per-op feature size ``F_op`` (``envs.features.op_feature_dim`` of the head's feature layout)."""
    device_feature_dim: int
    """Per-device feature size ``F_dev``."""
    n_actions: int
    """``M + 4`` for a cluster of ``M`` devices (tokens head: for clusters of at most ``M`` devices); with
    ``split_actions`` the head gives ``3 M + 6`` logits (``heterog.actions.n_actions``)."""
    hidden: int = 64
    """Embedding size of ops, groups, device tokens and the Transformer-XL; even."""
    gat_layers: int = 2
    """GAT layers (the paper: 12)."""
    gat_heads: int = 4
    """Attention heads per GAT layer, dividing ``hidden`` (the paper: 8)."""
    txl_layers: int = 2
    """Transformer-XL layers (the paper: 8)."""
    txl_heads: int = 4
    """Attention heads per Transformer-XL layer (and of the device-token mixing), dividing ``hidden``."""
    segment_len: int = 64
    """Groups per Transformer-XL segment."""
    mem_len: int = 64
    """Earlier positions each Transformer-XL layer keeps as memory (0: none)."""
    dropout: float = 0.0
    """Dropout everywhere, in [0, 1) (0 for policy-gradient training)."""
    gat_conv: str = "gat"
    """``"gat"`` (GATConv, the paper) or ``"gatv2"`` (GATv2Conv)."""
    group_activation: str = "sigmoid"
    """``sigma`` of the group pooling: ``"sigmoid"`` (the paper) or ``"tanh"``."""
    detach_mem: bool = True
    """Detach the Transformer-XL memory (gradients stay within a segment)."""
    autoregressive: bool = False
    """Condition each group's choice on the earlier groups' actions (a head that allows it)."""
    head: str = FIXED_HEAD
    """The head, a name in ``HEADS``: ``"fixed"`` (the paper's linear head) or ``"tokens"`` (device tokens)."""
    device_layers: int = 1
    """Self-attention blocks among the device tokens (``head="tokens"`` only)."""
    split_actions: bool = False
    """The action space with splits beyond the batch: ``3 M + 6`` logits per group (``M + 4`` and ``M + 5``
    divide the group's parameters over all devices, evenly or in proportion, then one even and one
    proportional pointer per device for its server; ``heterog.actions.decode_split_action``)."""

    state_actions: bool = False
    """The action space with state actions: ``2 N_STATE_CHOICES`` more logits per group after the others,
    DP-even-AR and DP-proportional-AR keeping sharded state (``heterog.actions.state_action``), each the
    AllReduce action's logit plus a learnt offset (``PlanHead.state``, which starts at ``STATE_PRIOR``, so
    a policy trained without them never picks one greedily)."""

    def __post_init__(self) -> None:
        problems = [f"{name} must be at least 1, got {getattr(self, name)}"
                    for name in ("op_feature_dim", "device_feature_dim") if getattr(self, name) < 1]
        if self.n_actions < N_DP_ACTIONS + 1:
            problems.append(f"n_actions must be M + {N_DP_ACTIONS} for M >= 1 devices, got {self.n_actions}")
        if self.hidden < 2:
            problems.append(f"hidden size must be at least 2, got {self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        head = HEADS.get(self.head)
        if head is None:
            problems.append(f"unknown policy head {self.head!r} (choose one of {list(HEADS)})")
        else:
            if self.autoregressive and not head.autoregressive:
                takers = " or ".join(name for name, cls in HEADS.items() if cls.autoregressive)
                problems.append(f"the {self.head} head is not autoregressive; autoregressive=True takes head {takers}")
            problems += head.problems(self)
        problems += GATEncoder.problems(self.hidden, self.gat_layers, self.gat_heads, self.gat_conv)
        problems += GroupPooling.problems(self.group_activation)
        problems += TransformerXL.problems(self.hidden, self.txl_layers, self.txl_heads, self.segment_len,
                                           self.mem_len)
        raise_problems(problems, "bad policy settings")

    @property
    def n_devices(self) -> int:
        """``M``, the devices the action space is built for (tokens head: the most devices)."""
        return self.n_actions - N_DP_ACTIONS

    def replace(self, **changes: Any) -> PolicyConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The plain dict checkpoints store (``policy_config``): every field, except that a fixed-head
        config leaves out ``NOT_STORED_FOR_FIXED_HEAD``, as checkpoints made before other heads did, and
        ``split_actions`` and ``state_actions`` are stored only when True."""
        settings = asdict(self)
        if self.head == FIXED_HEAD:
            for name in NOT_STORED_FOR_FIXED_HEAD:
                del settings[name]
        if not self.split_actions:          # as checkpoints made before the split actions existed
            del settings["split_actions"]
        if not self.state_actions:          # as checkpoints made before the state actions existed
            del settings["state_actions"]
        return settings

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> PolicyConfig:
        """The config of a checkpoint's ``policy_config`` (missing optional fields take their defaults);
        unknown or missing required names are a :class:`PolicyError`."""
        names = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if f.default is MISSING]
        problems = [f"unknown policy setting {name!r}" for name in settings if name not in names]
        problems += [f"policy setting {name!r} is missing" for name in required if name not in settings]
        raise_problems(problems, "bad policy config")
        return cls(**settings)
