"""HeteroG's policy network, :class:`StrategyPolicy`: the encoders, the Transformer-XL, a head and a group
decoder put together, built from one :class:`PolicyConfig`, with the checks of its inputs."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from agents.networks.common import PolicyError, require
from agents.networks.config import PolicyConfig
from agents.networks.decoding import decoder_for, group_logits, plan_logits, strategy_states
from agents.networks.distributions import MaskedCategorical, draw_strategies
from agents.networks.encoders import DeviceTokens, GATEncoder, GroupPooling
from agents.networks.heads import HEADS
from agents.networks.plan import PlanDistribution, PlanLogits, draw_plans
from agents.networks.transformer_xl import TransformerXL
from heterog.actions import n_actions

log = logging.getLogger(__name__)
# state-dict keys of earlier layouts -> where those weights live now
LEGACY_KEYS = {"action_emb.weight": "decoder.action_emb.weight"}
# parameters that earlier layouts did not have: a state dict without them keeps their fresh initialisation
NEW_PARAMETERS = ("head.plan.",)


def _rename_legacy_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A load_state_dict pre-hook: the weights of an earlier layout (``LEGACY_KEYS``) under their new keys,
    and the parameters it lacks (``NEW_PARAMETERS``: the plan-level decisions) at their current values."""
    for old, new in LEGACY_KEYS.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
    missing = missing_new_parameters(module, state_dict, prefix)
    if missing:
        log.info("policy weights without the plan-level heads (%s): they keep their initial values",
                 ", ".join(missing))
        own = module.state_dict()
        for key in missing:
            state_dict[prefix + key] = own[key].detach().clone()


def missing_new_parameters(policy: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys of ``policy``'s state that ``state_dict`` lacks because they are ``NEW_PARAMETERS``."""
    return [key for key in policy.state_dict() if key.startswith(NEW_PARAMETERS) and prefix + key not in state_dict]


class StrategyPolicy(nn.Module):
    r"""HeteroG's policy: GAT op encoder -> group embeddings -> Transformer-XL -> (M+4) logits per group.

    1. :class:`GATEncoder` embeds every op from its features, its graph neighbourhood and the
       cluster (mean-pooled device embedding added to each op).
    2. :class:`GroupPooling` gives ``g_n = sigma(sum_{o in n} W e_o)`` per group.
    3. The real groups, in group-id order, form a dense sequence (padding groups are removed, so
       they never shift relative positions or enter attention) that :class:`TransformerXL` reads
       in segments with memory; the logits of group ``n`` depend on groups ``<= n`` only through
       the strategy network (the GAT is bidirectional over the graph).
    4. A head (:class:`PolicyHead`, by name ``settings.head``) gives ``M + 4`` logits per group: ``0..M-1``
       model parallel on that device, ``M..M+3`` DP-even-PS, DP-even-AR, DP-proportional-PS,
       DP-proportional-AR (with ``settings.split_actions`` also the splits beyond the batch: ``3 M + 6``
       logits, ``heterog.actions.decode_split_action``). It starts near zero, so the first policy is
       close to uniform. Padding groups
       get all-zero logits. The fixed head (:class:`FixedPolicyHead`, the paper's) is linear, for one
       cluster size. The tokens head (:class:`TokenPolicyHead`) points at the device tokens of
       :class:`DeviceTokenEncoder`: one policy scores clusters of any size up to ``n_actions - 4``
       devices (``dev_x`` may be padded, ``dev_mask`` marks the real devices; the op features must not
       depend on the cluster: ``envs.features`` layout ``"device-free"``). The action methods take
       ``devices=`` :meth:`embed_devices` of the cluster at hand (None for the fixed head).
    5. Every head also scores the plan-level decisions (:class:`agents.networks.plan.PlanHead`): a 2-way
       recompute logit per group from its state and one logit per number of micro-batches
       (``envs.actions.MICRO_CHOICES``) from the masked mean of the group states. A *plan* is the env's
       flat action ``(2 G + 1,)``: configs, recompute bits, micro-batch choice; :meth:`sample_plans`,
       :meth:`plan_logits` and :meth:`plan_distribution` work on plans, the other action methods on the
       configs alone. Weights saved before these heads existed load with the heads at their initial values.
    6. A decoder (:class:`GroupDecoder`) turns the logits into strategies. With
       ``settings.autoregressive`` the choices are made one group after another
       (:class:`AutoregressiveDecoder`): the Transformer-XL input of group ``n`` is ``g_n + E[a_{n-1}]``,
       so each group's logits depend on the actions of all earlier groups (how much each device already
       holds). Such a policy has no action-independent logits: use :meth:`sample_actions` (decoding,
       group by group) and :meth:`action_logits` (the logits along given strategies, all positions at
       once); ``forward``, ``distribution`` and ``draw`` refuse it.

    Args:
        config: the settings (:class:`PolicyConfig`, checked when made).

    Shapes:
        op_x ``(N, F_op)`` float, op_mask ``(N,)`` bool, edge_index ``(2, E)`` int64,
        edge_mask ``(E,)`` bool, group_of ``(N,)`` int64 (padding ops: any value, e.g. -1),
        group_mask ``(G,)`` bool, dev_x ``(D, F_dev)`` float, dev_mask ``(D,)`` bool or None (tokens
        head only; None: all real) -> logits ``(G, M + 4)`` for the ``M`` real devices.
    """

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        require(isinstance(config, PolicyConfig),
                f"a policy is built from a PolicyConfig, got {type(config).__name__} (see StrategyPolicy.from_config)")
        self._settings = c = config
        self.encoder = GATEncoder(c.op_feature_dim, c.device_feature_dim, c.hidden, c.gat_layers, c.gat_heads,
                                  c.dropout, c.gat_conv)
        self.pooling = GroupPooling(c.hidden, c.group_activation)
        self.strategy = TransformerXL(c.hidden, c.txl_layers, c.txl_heads, c.segment_len, c.mem_len, c.dropout,
                                      c.detach_mem)
        head = HEADS[c.head]
        self.devices = head.device_encoder(c)       # the device tokens the head reads (None: it reads none)
        self.head = head.from_config(c)
        self.decoder = decoder_for(c)
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)
        self.reset_parameters()

    # ---- construction
    @classmethod
    def paper(cls, op_feature_dim: int, device_feature_dim: int, n_actions: int,
              **overrides: Any) -> StrategyPolicy:
        """The paper's sizes: 12 GAT layers x 8 heads, 8 Transformer-XL layers (hidden 256, 8 heads;
        the paper does not give these, nor segment or memory length: 64 and 128 here)."""
        settings = {"hidden": 256, "gat_layers": 12, "gat_heads": 8, "txl_layers": 8, "txl_heads": 8,
                    "segment_len": 64, "mem_len": 128}
        return cls(PolicyConfig(op_feature_dim, device_feature_dim, n_actions, **{**settings, **overrides}))

    @classmethod
    def small(cls, op_feature_dim: int, device_feature_dim: int, n_actions: int,
              **overrides: Any) -> StrategyPolicy:
        """A CPU-sized policy: hidden 64, 2 GAT layers x 4 heads, 2 Transformer-XL layers x 4 heads."""
        settings = {"hidden": 64, "gat_layers": 2, "gat_heads": 4, "txl_layers": 2, "txl_heads": 4,
                    "segment_len": 64, "mem_len": 64}
        return cls(PolicyConfig(op_feature_dim, device_feature_dim, n_actions, **{**settings, **overrides}))

    @classmethod
    def from_config(cls, config: PolicyConfig | dict[str, Any]) -> StrategyPolicy:
        """Build from a :class:`PolicyConfig` or its dict (:meth:`PolicyConfig.to_dict`, as checkpoints
        store it next to the state dict)."""
        return cls(config if isinstance(config, PolicyConfig) else PolicyConfig.from_dict(config))

    @property
    def settings(self) -> PolicyConfig:
        """The settings this policy was built from."""
        return self._settings

    @property
    def config(self) -> dict[str, Any]:
        """The settings as the plain dict checkpoints store (:meth:`PolicyConfig.to_dict`)."""
        return self._settings.to_dict()

    @property
    def n_actions(self) -> int:
        """``M + 4``: the action space the policy is built for (tokens head: its largest)."""
        return self._settings.n_actions

    @property
    def n_devices(self) -> int:
        """``M``, the number of devices the action space is built for (tokens head: the most devices)."""
        return self._settings.n_devices

    @property
    def op_feature_dim(self) -> int:
        return self._settings.op_feature_dim

    @property
    def device_feature_dim(self) -> int:
        return self._settings.device_feature_dim

    @property
    def hidden(self) -> int:
        return self._settings.hidden

    @property
    def head_kind(self) -> str:
        """The head's name (``settings.head``): ``"fixed"`` or ``"tokens"``."""
        return self._settings.head

    @property
    def autoregressive(self) -> bool:
        """Whether each group's choice depends on the earlier groups' actions."""
        return self.decoder.autoregressive

    @property
    def feature_layout(self) -> str:
        """The op feature layout this policy reads (``envs.features.op_feature_dim``): per-device columns
        for the fixed head, device-free for the tokens head."""
        return self.head.feature_layout

    def fits_devices(self, n_devices: int) -> bool:
        """Whether this policy scores a cluster of ``n_devices`` (any size up to its maximum for tokens)."""
        return self.head.device_problem(n_devices, n_devices) is None

    def add_data_parallel_bias(self, bias: float) -> None:
        """Add ``bias`` to the four data-parallel logits' bias (in place, no gradient)."""
        self.head.add_data_parallel_bias(bias)

    def reset_parameters(self) -> None:
        self.encoder.reset_parameters()
        self.pooling.reset_parameters()
        self.strategy.reset_parameters()
        if self.devices is not None:
            self.devices.reset_parameters()
        self.head.reset_parameters()
        self.decoder.reset_parameters()

    # ---- inputs
    def check_inputs(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                     group_of: Tensor, group_mask: Tensor, dev_x: Tensor, dev_mask: Tensor | None = None) -> None:
        """Raise :class:`PolicyError` naming the first input that does not fit this policy."""
        n_ops = op_x.shape[0] if op_x.dim() == 2 else -1
        require(op_x.dim() == 2 and op_x.shape[1] == self.op_feature_dim,
                f"op_x must be (N, {self.op_feature_dim}), got {tuple(op_x.shape)}")
        require(dev_x.dim() == 2 and dev_x.shape[1] == self.device_feature_dim,
                f"dev_x must be (M, {self.device_feature_dim}), got {tuple(dev_x.shape)}")
        self.check_devices(dev_x, dev_mask)
        for name, tensor, shape, dtype in (("op_mask", op_mask, (n_ops,), torch.bool),
                                           ("group_of", group_of, (n_ops,), torch.long),
                                           ("edge_mask", edge_mask, (edge_index.shape[-1],), torch.bool),
                                           ("group_mask", group_mask, (group_mask.shape[0],), torch.bool)):
            require(tuple(tensor.shape) == shape and tensor.dtype == dtype,
                    f"{name} must be a {dtype} tensor of shape {shape}, "
                    f"got {tensor.dtype} {tuple(tensor.shape)}")
        require(edge_index.dim() == 2 and edge_index.shape[0] == 2 and edge_index.dtype == torch.long,
                f"edge_index must be an int64 tensor of shape (2, E), got {edge_index.dtype} "
                f"{tuple(edge_index.shape)}")
        real_edges = edge_index[:, edge_mask]
        outside = (real_edges < 0) | (real_edges >= n_ops)
        if bool(outside.any()):
            e = int(outside.any(0).nonzero()[0])
            raise PolicyError(f"real edge {real_edges[:, e].tolist()} points outside ops 0..{n_ops - 1}")
        to_padding = ~op_mask[real_edges]
        if bool(to_padding.any()):
            e = int(to_padding.any(0).nonzero()[0])
            raise PolicyError(f"real edge {real_edges[:, e].tolist()} touches a padding op (op_mask False)")
        groups = group_of[op_mask]
        n_groups = group_mask.shape[0]
        bad = (groups < 0) | (groups >= n_groups)
        bad[~bad] = ~group_mask[groups[~bad]]
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            op = int(op_mask.nonzero()[i])
            raise PolicyError(f"real op {op} is in group {int(groups[i])}, which is not a real group "
                              f"(0..{n_groups - 1} with group_mask True)")

    def check_devices(self, dev_x: Tensor, dev_mask: Tensor | None) -> None:
        """Raise :class:`PolicyError` when the device rows (and mask) do not fit this policy's head."""
        rows = dev_x.shape[0]
        if dev_mask is not None:
            require(dev_mask.dtype == torch.bool and tuple(dev_mask.shape) == (rows,),
                    f"dev_mask must be a torch.bool tensor of shape ({rows},), got {dev_mask.dtype} "
                    f"{tuple(dev_mask.shape)}")
        problem = self.head.device_problem(rows if dev_mask is None else int(dev_mask.sum()), rows)
        require(problem is None, str(problem))

    # ---- forward pieces
    def encode_ops(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                   dev_x: Tensor, dev_mask: Tensor | None = None) -> Tensor:
        """Op embeddings from the GAT encoder. Shapes: -> ``(N, hidden)``."""
        return self.encoder(op_x, op_mask, edge_index, edge_mask, dev_x, dev_mask)

    def embed_groups(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                     group_of: Tensor, group_mask: Tensor, dev_x: Tensor, dev_mask: Tensor | None = None) -> Tensor:
        """Group embeddings ``sigma(sum W e_o)`` (padding groups zero); inputs are checked.

        Shapes: -> ``(G, hidden)``.
        """
        self.check_inputs(op_x, op_mask, edge_index, edge_mask, group_of, group_mask, dev_x, dev_mask)
        op_emb = self.encode_ops(op_x, op_mask, edge_index, edge_mask, dev_x, dev_mask)
        return self.pooling(op_emb, op_mask, group_of, group_mask)

    def embed_devices(self, dev_x: Tensor, dev_mask: Tensor | None = None) -> DeviceTokens | None:
        """The device tokens the head points at (None for a head that reads none, as the fixed head).

        Shapes: dev_x ``(D, F_dev)``, dev_mask ``(D,)`` or None -> tokens ``(D, hidden)``.
        """
        if self.devices is None:
            return None
        self.check_devices(dev_x, dev_mask)
        return self.devices(dev_x, dev_mask)

    @property
    def split_actions(self) -> bool:
        """Whether the action space includes the splits beyond the batch (``PolicyConfig.split_actions``)."""
        return self._settings.split_actions

    @property
    def state_actions(self) -> bool:
        """Whether the action space ends with the state actions (``PolicyConfig.state_actions``)."""
        return self._settings.state_actions

    def n_actions_for(self, devices: DeviceTokens | None) -> int:
        """The logits per group for the cluster at hand, ``M + 4`` (``3 M + 6`` with split actions)
        (``devices``: :meth:`embed_devices`; None: the fixed head's cluster)."""
        return n_actions(self.n_devices if devices is None else devices.n_devices, self.split_actions,
                         self.state_actions)

    def encode_strategy(self, group_emb: Tensor, group_mask: Tensor) -> Tensor:
        """Transformer-XL states of the real groups in id order, scattered back (padding rows zero).

        A value head for PPO can pool these. Shapes: group_emb ``(G, hidden)`` -> ``(G, hidden)``.
        """
        return strategy_states(self.strategy, group_emb, group_mask)

    def logits_from_group_embeddings(self, group_emb: Tensor, group_mask: Tensor,
                                     devices: DeviceTokens | None = None) -> Tensor:
        """Strategy network and head; padding rows are zero. ``devices``: the tokens head's
        :meth:`embed_devices` (the fixed head takes None).

        Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)`` -> ``(G, M + 4)``.
        """
        return group_logits(self.strategy, self.head, group_emb, group_mask, devices)

    def forward(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                group_of: Tensor, group_mask: Tensor, dev_x: Tensor, dev_mask: Tensor | None = None) -> Tensor:
        self.decoder.check_independent("forward")
        group_emb = self.embed_groups(op_x, op_mask, edge_index, edge_mask, group_of, group_mask, dev_x, dev_mask)
        return self.logits_from_group_embeddings(group_emb, group_mask, self.embed_devices(dev_x, dev_mask))

    def distribution(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                     group_of: Tensor, group_mask: Tensor, dev_x: Tensor,
                     dev_mask: Tensor | None = None) -> MaskedCategorical:
        """The per-group action distribution with padding groups masked (see :class:`MaskedCategorical`)."""
        logits = self(op_x, op_mask, edge_index, edge_mask, group_of, group_mask, dev_x, dev_mask)
        return MaskedCategorical(logits, group_mask, self.split_actions, self.state_actions)

    # ---- strategies (both kinds of policy)
    def action_logits(self, group_emb: Tensor, group_mask: Tensor, actions: Tensor,
                      devices: DeviceTokens | None = None) -> Tensor:
        """The logits each group's choice was drawn from in the strategies ``actions`` (for an
        autoregressive policy, given the earlier groups' actions in that strategy; otherwise the same
        logits for every strategy). Padding rows are zero.

        ``devices``: the tokens head's :meth:`embed_devices` (None for the fixed head).

        Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)``, actions ``(K, G)`` -> ``(K, G, M + 4)``.
        """
        return self.decoder.action_logits(self.strategy, self.head, group_emb, group_mask, actions, devices)

    def sample_actions(self, group_emb: Tensor, group_mask: Tensor, n: int, *,
                       generator: torch.Generator | None = None, offsets: Tensor | None = None,
                       greedy: bool = False, devices: DeviceTokens | None = None) -> Tensor:
        """``n`` strategies: each group's action drawn (or, ``greedy``, its most likely decision:
        :func:`most_likely_actions`) from its logits plus the strategy's ``offsets`` (one offset per action
        shared by all groups of a strategy; None: none). An autoregressive policy decodes group by group;
        padding groups get action 0.

        ``devices``: the tokens head's :meth:`embed_devices` (None for the fixed head).

        Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)``, offsets ``(n, M + 4)`` -> ``(n, G)``.
        """
        return self.decoder.sample_actions(self.strategy, self.head, group_emb, group_mask, n, generator=generator,
                                           offsets=offsets, greedy=greedy, devices=devices)

    def draw(self, logits: Tensor | None, group_mask: Tensor, n: int, *, generator: torch.Generator | None = None,
             offsets: Tensor | None = None, greedy: bool = False) -> Tensor:
        """``n`` strategies from an independent policy's logits (:meth:`logits_from_group_embeddings`), drawn
        as :meth:`sample_actions` draws them, so that one pass of the strategy network can serve the draws
        and the update (``logits`` may be None when ``n`` is 0).

        Shapes: logits ``(G, M + 4)``, group_mask ``(G,)``, offsets ``(n, M + 4)`` -> ``(n, G)``.
        """
        self.decoder.check_independent("draw")
        return draw_strategies(logits, group_mask, n, generator=generator, offsets=offsets, greedy=greedy,
                               splits=self.split_actions, states=self.state_actions)

    # ---- plans: configs, recompute bits and the micro-batch choice
    def plan_logits_from_group_embeddings(self, group_emb: Tensor, group_mask: Tensor,
                                          devices: DeviceTokens | None = None) -> PlanLogits:
        """An independent policy's logits of every decision of a plan (one pass of the strategy network).

        Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)`` -> groups ``(G, M + 4)``, recompute
        ``(G, 2)``, micro ``(N_MICRO,)``.
        """
        self.decoder.check_independent("plan_logits_from_group_embeddings")
        return plan_logits(self.strategy, self.head, group_emb, group_mask, devices)

    def plan_logits(self, group_emb: Tensor, group_mask: Tensor, plans: Tensor,
                    devices: DeviceTokens | None = None) -> PlanLogits:
        """The logits each decision of the plans was drawn from (as :meth:`action_logits`, with the
        plan-level ones). Shapes: plans ``(K, 2 G + 1)`` -> ``(K, G, M + 4)``, ``(K, G, 2)``, ``(K, N_MICRO)``.
        """
        return self.decoder.plan_logits(self.strategy, self.head, group_emb, group_mask, plans, devices)

    def sample_plans(self, group_emb: Tensor, group_mask: Tensor, n: int, *,
                     generator: torch.Generator | None = None, offsets: Tensor | None = None,
                     greedy: bool = False, devices: DeviceTokens | None = None) -> Tensor:
        """``n`` plans: the configs as :meth:`sample_actions` draws them (``offsets`` apply to the config
        logits), then each group's recompute bit and the micro-batch choice (``greedy``: the more likely
        bit and the most likely choice). Padding groups get 0. Shapes: -> ``(n, 2 G + 1)``."""
        return self.decoder.sample_plans(self.strategy, self.head, group_emb, group_mask, n, generator=generator,
                                         offsets=offsets, greedy=greedy, devices=devices)

    def draw_plans(self, logits: PlanLogits | None, group_mask: Tensor, n: int, *,
                   generator: torch.Generator | None = None, offsets: Tensor | None = None,
                   greedy: bool = False) -> Tensor:
        """``n`` plans from an independent policy's plan logits (:meth:`plan_logits_from_group_embeddings`),
        drawn as :meth:`sample_plans` draws them. Shapes: -> ``(n, 2 G + 1)``."""
        self.decoder.check_independent("draw_plans")
        return draw_plans(logits, group_mask, n, generator=generator, offsets=offsets, greedy=greedy,
                          splits=self.split_actions, states=self.state_actions)

    def plan_distribution(self, op_x: Tensor, op_mask: Tensor, edge_index: Tensor, edge_mask: Tensor,
                          group_of: Tensor, group_mask: Tensor, dev_x: Tensor,
                          dev_mask: Tensor | None = None) -> PlanDistribution:
        """The distribution of whole plans (:class:`agents.networks.plan.PlanDistribution`): its
        ``log_prob`` and ``entropy`` include the recompute bits and the micro-batch choice."""
        group_emb = self.embed_groups(op_x, op_mask, edge_index, edge_mask, group_of, group_mask, dev_x, dev_mask)
        logits = self.plan_logits_from_group_embeddings(group_emb, group_mask, self.embed_devices(dev_x, dev_mask))
        return PlanDistribution(logits, group_mask, self.split_actions, self.state_actions)

    def __repr__(self) -> str:
        c = self._settings
        n_params = sum(p.numel() for p in self.parameters())
        return (f"{type(self).__name__}(ops={c.op_feature_dim}, devices={c.device_feature_dim}, "
                f"n_actions={c.n_actions}, hidden={c.hidden}, "
                f"gat={c.gat_layers}x{c.gat_heads} heads ({c.gat_conv}), "
                f"txl={c.txl_layers}x{c.txl_heads} heads (segment {c.segment_len}, "
                f"memory {c.mem_len}), group={c.group_activation}, dropout={c.dropout}, "
                f"autoregressive={c.autoregressive}, head={c.head}, split_actions={c.split_actions}, "
                f"state_actions={c.state_actions}, "
                f"params={n_params:,})")
