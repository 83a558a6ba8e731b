"""The policy's heads: what turns each group's Transformer-XL state into logits over the actions. Every
head implements :class:`PolicyHead`, the interface the policy calls, and is chosen by its name in
:data:`HEADS` (``PolicyConfig.head``); a new head plugs in by subclassing it and adding itself there."""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agents.networks.common import PolicyError, layer, raise_problems
from agents.networks.encoders import DeviceTokenEncoder, DeviceTokens
from agents.networks.plan import PlanHead
from heterog import actions as action_space
from heterog.actions import N_CLUSTER_SPLIT_ACTIONS, N_DP_ACTIONS


class HeadSettings(Protocol):
    """What a head reads of the policy's settings (``agents.networks.config.PolicyConfig`` has them)."""

    @property
    def hidden(self) -> int: ...
    @property
    def n_actions(self) -> int: ...
    @property
    def split_actions(self) -> bool: ...
    @property
    def state_actions(self) -> bool: ...
    @property
    def device_feature_dim(self) -> int: ...
    @property
    def device_layers(self) -> int: ...
    @property
    def txl_heads(self) -> int: ...


def _size_problems(hidden: int, init_scale: float) -> list[str]:
    problems = [] if hidden >= 1 else [f"hidden size must be at least 1, got {hidden}"]
    if init_scale <= 0:
        problems.append(f"init_scale must be positive, got {init_scale}")
    return problems


class PolicyHead(nn.Module, metaclass=ABCMeta):
    """Logits over one group's actions from its state: the interface :class:`StrategyPolicy` calls.

    The actions of a cluster of ``M`` devices are ``0..M-1`` model parallel on that device and ``M..M+3`` the four
    data-parallel schemes (DP-even-PS, DP-even-AR, DP-proportional-PS, DP-proportional-AR); a head with split
    actions (``splits``, ``PolicyConfig.split_actions``) adds ``M+4``, ``M+5`` (the group's parameters divided over
    all devices, even or proportional) and ``M+6+d``, ``2M+6+d`` (divided over device d's server, even or
    proportional). A head says, as class attributes, its name (``kind``: ``PolicyConfig.head``), the op feature
    layout the policy reads with it (``feature_layout``, ``envs.features.op_feature_dim``) and whether an
    autoregressive policy may use it (``autoregressive``). It builds itself from the policy's config
    (:meth:`from_config`), names the device encoder it needs, if any (:meth:`device_encoder`: its
    :class:`DeviceTokens` reach :meth:`forward` as ``devices``), checks the config's settings that only it reads
    (:meth:`problems`) and the clusters it scores (:meth:`device_problem`), and moves its data-parallel logits
    (:meth:`add_data_parallel_bias`).

    A head with state actions (``states``, ``PolicyConfig.state_actions``) ends every row with the
    ``2 N_STATE_CHOICES`` state actions (:meth:`PlanHead.with_state_logits`).

    Every head also gives the plan-level decisions (:meth:`plan_logits`, its :class:`PlanHead` ``plan``):
    a 2-way recompute logit per group from the group's state and one logit per number of micro-batches
    from the masked mean of the groups' states.

    Shapes:
        states ``(..., G, hidden)``, devices :class:`DeviceTokens` of ``M`` real devices or None
        (heads without a device encoder) -> ``(..., G, M + 4)`` (``(..., G, 3 M + 6)`` with ``splits``).
    """

    kind: ClassVar[str]
    splits: bool = False
    states: bool = False
    feature_layout: ClassVar[str] = "per-device"
    autoregressive: ClassVar[bool] = False
    plan: PlanHead

    def plan_logits(self, states: Tensor, group_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The recompute logits ``(..., G, 2)`` (padding groups zero) and the micro-batch logits
        ``(..., N_MICRO)`` of the group states ``(..., G, hidden)``."""
        return self.plan(states, group_mask)

    def with_state_logits(self, logits: Tensor, states: Tensor) -> Tensor:
        """``logits`` (of ``M`` devices) followed by the state actions' where the head has them."""
        if not self.states:
            return logits
        m = action_space.devices_of(logits.shape[-1], self.splits)
        return self.plan.with_state_logits(logits, states, m)

    @classmethod
    @abstractmethod
    def from_config(cls, config: HeadSettings) -> PolicyHead:
        """The head of a policy with these settings."""

    @classmethod
    def device_encoder(cls, config: HeadSettings) -> DeviceTokenEncoder | None:
        """The encoder of the device tokens this head reads (None: it reads none)."""
        return None

    @classmethod
    def problems(cls, config: HeadSettings) -> list[str]:
        """What is wrong with the settings that only this head reads (empty when they fit)."""
        return []

    @abstractmethod
    def device_problem(self, n_real: int, n_rows: int) -> str | None:
        """Why this head cannot score a cluster of ``n_real`` devices given in ``n_rows`` device rows (the
        rest padding), or None when it can."""

    @abstractmethod
    def forward(self, states: Tensor, devices: DeviceTokens | None) -> Tensor:
        ...

    @abstractmethod
    def add_data_parallel_bias(self, bias: float) -> None:
        """Add ``bias`` to the four data-parallel logits (in place, no gradient)."""

    @abstractmethod
    def reset_parameters(self) -> None:
        """The initial weights: the output starts near zero, so a fresh policy is close to uniform."""


class FixedPolicyHead(PolicyHead):
    """The paper's head: a linear layer to the ``M + 4`` actions of one cluster size ``M``.

    ``logits = W s_g + b``, ``M + 4`` of them, or ``3 M + 6`` with ``splits``. :meth:`reset_parameters` (which the
    policy calls once it is built) sets ``W`` orthogonal with gain ``init_scale`` and ``b`` to zero; until then the
    layer holds torch's default linear initialisation, drawn as a plain ``nn.Linear`` draws it (so a seeded
    policy's weights stay what they were when its head was one).

    Args:
        hidden: size of the group states.
        n_actions: ``M + 4``.
        init_scale: gain of the orthogonal initialisation of ``W``.
        splits: add the split actions.

    Shapes:
        states ``(..., G, hidden)``, devices ignored -> ``(..., G, M + 4)`` (``3 M + 6`` with ``splits``).
    """

    kind = "fixed"
    feature_layout = "per-device"
    autoregressive = True

    def __init__(self, hidden: int, n_actions: int, init_scale: float = 0.01, splits: bool = False,
                 states: bool = False) -> None:
        super().__init__()
        problems = _size_problems(hidden, init_scale)
        if n_actions <= N_DP_ACTIONS:
            problems.append(f"n_actions must be M + {N_DP_ACTIONS} for M >= 1 devices, got {n_actions}")
        raise_problems(problems)
        self.hidden, self.n_actions, self.init_scale, self.splits = hidden, n_actions, init_scale, splits
        self.states = states
        linear = nn.Linear(hidden, action_space.n_actions(n_actions - N_DP_ACTIONS, splits))
        self.weight, self.bias = linear.weight, linear.bias
        self.plan = PlanHead(hidden, states)

    @classmethod
    def from_config(cls, config: HeadSettings) -> FixedPolicyHead:
        return cls(config.hidden, config.n_actions, splits=config.split_actions, states=config.state_actions)

    def device_problem(self, n_real: int, n_rows: int) -> str | None:
        if n_real != n_rows:
            return f"the fixed head takes no padded devices, got dev_mask with {n_real} of {n_rows} real"
        if n_real + N_DP_ACTIONS != self.n_actions:
            return (f"dev_x has {n_real} devices, so {n_real + N_DP_ACTIONS} actions; this policy has "
                    f"{self.n_actions} (built for {self.n_actions - N_DP_ACTIONS} devices)")
        return None

    def forward(self, states: Tensor, devices: DeviceTokens | None = None) -> Tensor:
        return self.with_state_logits(F.linear(states, self.weight, self.bias), states)

    def add_data_parallel_bias(self, bias: float) -> None:
        with torch.no_grad():
            self.bias[self.n_actions - N_DP_ACTIONS:self.n_actions] += bias

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.weight, gain=self.init_scale)
        nn.init.zeros_(self.bias)
        self.plan.reset_parameters()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.hidden}->{self.weight.shape[0]}, linear over M + {N_DP_ACTIONS} "
                f"actions{' and the split actions' if self.splits else ''})")


class TokenPolicyHead(PolicyHead):
    """Logits over ``[M model-parallel, 4 data-parallel]`` for a cluster of any size ``M``.

    Model parallelism on device ``d`` is a pointer: ``(W_q s_g) . (W_k t_d) / sqrt(hidden)`` from a
    group's state ``s_g`` to device token ``t_d`` (of :class:`DeviceTokenEncoder`). The four DP schemes
    are scored by an MLP of ``[s_g; c]`` with ``c`` the pooled cluster embedding. Padding devices get
    ``-inf`` (never any probability) and are dropped from the output, so column ``d < M`` is the
    ``d``-th real device. With ``splits`` the two cluster-wide splits are scored by a second MLP of
    ``[s_g; c]``, and the even and the proportional split over device d's server by two more pointers
    (their own queries, the same keys). The output layers start near zero (``init_scale``), so a fresh policy is
    close to uniform. The op features it goes with must not depend on the cluster (layout
    ``"device-free"``), and it is not autoregressive.

    Args:
        hidden: size of group states and device tokens.
        init_scale: gain of the output layers' orthogonal initialisation.
        max_devices: the most real devices a cluster may have (None: no limit).
        splits: add the split actions.

    Shapes:
        states ``(..., G, hidden)``, devices tokens ``(D, hidden)`` with ``M`` real ones
        -> ``(..., G, M + 4)`` (``(..., G, 3 M + 6)`` with ``splits``).
    """

    kind = "tokens"
    feature_layout = "device-free"
    autoregressive = False

    def __init__(self, hidden: int, init_scale: float = 0.01, max_devices: int | None = None,
                 splits: bool = False, states: bool = False) -> None:
        super().__init__()
        problems = _size_problems(hidden, init_scale)
        if max_devices is not None and max_devices < 1:
            problems.append(f"max_devices must be at least 1 or None, got {max_devices}")
        raise_problems(problems)
        self.hidden, self.init_scale, self.max_devices, self.splits = hidden, init_scale, max_devices, splits
        self.states = states
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.dp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ELU(), nn.Linear(hidden, N_DP_ACTIONS))
        if splits:
            self.split = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ELU(),
                                       nn.Linear(hidden, N_CLUSTER_SPLIT_ACTIONS))
            self.split_query = nn.Linear(hidden, 2 * hidden)         # the even and the proportional pointer
        self.plan = PlanHead(hidden, states)
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: HeadSettings) -> TokenPolicyHead:
        return cls(config.hidden, max_devices=config.n_actions - N_DP_ACTIONS, splits=config.split_actions,
                   states=config.state_actions)

    @classmethod
    def device_encoder(cls, config: HeadSettings) -> DeviceTokenEncoder:
        return DeviceTokenEncoder(config.device_feature_dim, config.hidden, config.txl_heads, config.device_layers)

    @classmethod
    def problems(cls, config: HeadSettings) -> list[str]:
        return DeviceTokenEncoder.problems(config.device_feature_dim, config.hidden, config.txl_heads,
                                           config.device_layers)

    @property
    def dp_bias(self) -> Tensor:
        """The bias of the four data-parallel logits."""
        return layer(self.dp, -1, nn.Linear).bias

    def device_problem(self, n_real: int, n_rows: int) -> str | None:
        limit = n_rows if self.max_devices is None else self.max_devices
        if 1 <= n_real <= limit and n_rows <= limit:
            return None
        return (f"dev_x has {n_real} real devices in {n_rows} rows; this device-token policy takes 1 to "
                f"{limit} devices")

    def add_data_parallel_bias(self, bias: float) -> None:
        with torch.no_grad():
            self.dp_bias.add_(bias)

    def reset_parameters(self) -> None:
        self.key.reset_parameters()
        layer(self.dp, 0, nn.Linear).reset_parameters()
        nn.init.orthogonal_(self.query.weight, gain=self.init_scale)
        nn.init.zeros_(self.query.bias)
        nn.init.orthogonal_(layer(self.dp, -1, nn.Linear).weight, gain=self.init_scale)
        nn.init.zeros_(layer(self.dp, -1, nn.Linear).bias)
        if self.splits:
            layer(self.split, 0, nn.Linear).reset_parameters()
            for out in (layer(self.split, -1, nn.Linear), self.split_query):
                nn.init.orthogonal_(out.weight, gain=self.init_scale)
                nn.init.zeros_(out.bias)
        self.plan.reset_parameters()

    def forward(self, states: Tensor, devices: DeviceTokens | None) -> Tensor:
        if devices is None:
            raise PolicyError("the device-token head needs devices=policy.embed_devices(dev_x, dev_mask)")
        keys = self.key(devices.tokens)
        real = devices.mask.nonzero().squeeze(1)

        def pointer(query: Tensor) -> Tensor:
            scores = torch.einsum("...gh,dh->...gd", query, keys) / math.sqrt(self.hidden)
            return scores.masked_fill(~devices.mask, float("-inf"))[..., real]

        cluster = torch.cat([states, devices.pooled.expand(*states.shape[:-1], self.hidden)], dim=-1)
        parts = [pointer(self.query(states)), self.dp(cluster)]
        if self.splits:
            even, prop = self.split_query(states).chunk(2, dim=-1)
            parts += [self.split(cluster), pointer(even), pointer(prop)]
        return self.with_state_logits(torch.cat(parts, dim=-1), states)

    def __repr__(self) -> str:
        splits = ", split scores and pointers" if self.splits else ""
        return f"{type(self).__name__}({self.hidden}, pointer over device tokens + {N_DP_ACTIONS} DP scores{splits})"


HEADS: dict[str, type[PolicyHead]] = {head.kind: head for head in (FixedPolicyHead, TokenPolicyHead)}
"""The heads by name (``PolicyConfig.head``): ``fixed``, a linear (M+4)-way head for one cluster size;
``tokens``, a pointer over device tokens for any cluster up to a size."""
