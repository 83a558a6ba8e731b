"""How the policy's groups choose their actions: independently, each from logits that one pass of the
strategy network gives every group, or autoregressively, each group conditioned on the earlier groups'
actions (decoded group by group). :class:`GroupDecoder` is the interface the policy calls."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from agents.networks.common import PolicyError
from agents.networks.distributions import draw_actions, draw_strategies
from agents.networks.encoders import DeviceTokens
from agents.networks.heads import PolicyHead
from agents.networks.plan import PlanLogits, draw_plan_decisions, draw_plans
from agents.networks.transformer_xl import TransformerXL
from heterog.actions import n_actions

if TYPE_CHECKING:
    from agents.networks.config import PolicyConfig


def strategy_states(strategy: TransformerXL, group_emb: Tensor, group_mask: Tensor) -> Tensor:
    """Transformer-XL states of the real groups in id order, scattered back (padding rows zero).

    Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)`` -> ``(G, hidden)``.
    """
    real = group_mask.nonzero().squeeze(1)
    states = strategy(group_emb[real])
    return group_emb.new_zeros(group_emb.shape).index_copy(0, real, states)


def group_logits(strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                 devices: DeviceTokens | None) -> Tensor:
    """The strategy network, then the head; padding rows are zero.

    Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)`` -> ``(G, M + 4)``.
    """
    logits = head(strategy_states(strategy, group_emb, group_mask), devices)
    return logits.masked_fill(~group_mask.unsqueeze(1), 0.0)


def plan_logits(strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                devices: DeviceTokens | None) -> PlanLogits:
    """The strategy network, then the head's config and plan-level logits (one pass); padding rows zero.

    Shapes: group_emb ``(G, hidden)``, group_mask ``(G,)`` -> groups ``(G, M + 4)``, recompute ``(G, 2)``,
    micro ``(N_MICRO,)``.
    """
    states = strategy_states(strategy, group_emb, group_mask)
    logits = head(states, devices).masked_fill(~group_mask.unsqueeze(1), 0.0)
    return PlanLogits(logits, *head.plan_logits(states, group_mask))


class GroupDecoder(nn.Module, metaclass=ABCMeta):
    """How strategies (one action per group) come out of the group embeddings: the interface the policy
    calls. Each method takes the policy's strategy network and head; ``devices`` are the head's device
    tokens (None for a head without them). ``autoregressive`` (a class attribute) says whether a group's
    logits depend on the earlier groups' actions, in which case the policy has no action-independent
    logits (:meth:`check_independent` refuses them).

    Shapes:
        group_emb ``(G, hidden)``, group_mask ``(G,)``; :meth:`action_logits` of actions ``(K, G)``
        -> ``(K, G, M + 4)``; :meth:`sample_actions` -> ``(n, G)``, offsets ``(n, M + 4)``.
    """

    autoregressive: ClassVar[bool]

    def check_independent(self, what: str) -> None:
        """Raise :class:`PolicyError` when ``what`` (a method giving action-independent logits) does not
        fit this decoder."""

    @abstractmethod
    def action_logits(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                      actions: Tensor, devices: DeviceTokens | None) -> Tensor:
        """The logits each group's choice was drawn from in the strategies ``actions``; padding rows zero."""

    @abstractmethod
    def sample_actions(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                       n: int, *, generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                       devices: DeviceTokens | None) -> Tensor:
        """``n`` strategies drawn (or, ``greedy``, each group's most likely decision) from the logits plus
        the strategy's ``offsets`` (None: none); padding groups get action 0."""

    @abstractmethod
    def plan_logits(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                    plans: Tensor, devices: DeviceTokens | None) -> PlanLogits:
        """The logits each decision of the plans ``(K, 2 G + 1)`` was drawn from: ``(K, G, M + 4)``,
        ``(K, G, 2)`` and ``(K, N_MICRO)``; padding rows zero."""

    @abstractmethod
    def sample_plans(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                     n: int, *, generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                     devices: DeviceTokens | None) -> Tensor:
        """``n`` plans ``(n, 2 G + 1)``: configs as :meth:`sample_actions` draws them, then each group's
        recompute bit and the micro-batch choice from the plan-level logits."""

    def reset_parameters(self) -> None:
        """The initial weights (none by default)."""


class IndependentDecoder(GroupDecoder):
    """Every group draws its action from its own logits, independent of the others' actions: one pass of
    the strategy network gives the logits of every strategy."""

    autoregressive = False

    def action_logits(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                      actions: Tensor, devices: DeviceTokens | None) -> Tensor:
        logits = group_logits(strategy, head, group_emb, group_mask, devices)
        return logits.expand(actions.shape[0], -1, -1)

    def sample_actions(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                       n: int, *, generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                       devices: DeviceTokens | None) -> Tensor:
        logits = group_logits(strategy, head, group_emb, group_mask, devices) if n else None
        return draw_strategies(logits, group_mask, n, generator=generator, offsets=offsets, greedy=greedy,
                               splits=head.splits, states=head.states)

    def plan_logits(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                    plans: Tensor, devices: DeviceTokens | None) -> PlanLogits:
        return plan_logits(strategy, head, group_emb, group_mask, devices).expand(plans.shape[0])

    def sample_plans(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                     n: int, *, generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                     devices: DeviceTokens | None) -> Tensor:
        logits = plan_logits(strategy, head, group_emb, group_mask, devices) if n else None
        return draw_plans(logits, group_mask, n, generator=generator, offsets=offsets, greedy=greedy,
                          splits=head.splits, states=head.states)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AutoregressiveDecoder(GroupDecoder):
    """The groups choose one after another: the Transformer-XL input of group ``n`` is ``g_n + E[a_{n-1}]``
    (``E`` an action embedding, row ``n_actions`` a start token for the first group), so each group's
    logits depend on the actions of all earlier groups. Sampling decodes group by group (with the
    Transformer-XL's cached keys and values); :meth:`action_logits` reads given strategies at all
    positions at once (teacher forcing).

    Args:
        n_actions: the head's output size (``M + 4``, or ``3 M + 6`` with split actions).
        hidden: group embedding size.
    """

    autoregressive = True

    def __init__(self, n_actions: int, hidden: int) -> None:
        super().__init__()
        self.n_actions, self.hidden = n_actions, hidden
        self.action_emb = nn.Embedding(n_actions + 1, hidden)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.action_emb.weight, std=0.1)

    def check_independent(self, what: str) -> None:
        raise PolicyError(f"{what} gives action-independent logits, which an autoregressive policy does not have; "
                          "use sample_actions and action_logits")

    def _teacher_forced(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                        actions: Tensor, devices: DeviceTokens | None) -> tuple[Tensor, Tensor]:
        """The config logits ``(K, G, A)`` along the strategies and the group states ``(K, G, hidden)``
        (padding rows zero)."""
        n_seq = actions.shape[0]
        real = group_mask.nonzero().squeeze(1)
        earlier = torch.cat([actions.new_full((n_seq, 1), self.n_actions), actions[:, real[:-1]]], dim=1)
        states = strategy(group_emb[real][None] + self.action_emb(earlier))             # (K, S, hidden)
        logits = group_emb.new_zeros(n_seq, group_emb.shape[0], self.n_actions)
        scattered = group_emb.new_zeros(n_seq, *group_emb.shape).index_copy(1, real, states)
        return logits.index_copy(1, real, head(states, devices)), scattered

    def action_logits(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                      actions: Tensor, devices: DeviceTokens | None) -> Tensor:
        return self._teacher_forced(strategy, head, group_emb, group_mask, actions, devices)[0]

    def plan_logits(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                    plans: Tensor, devices: DeviceTokens | None) -> PlanLogits:
        logits, states = self._teacher_forced(strategy, head, group_emb, group_mask, plans, devices)
        return PlanLogits(logits, *head.plan_logits(states, group_mask))

    def _decode(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor, n: int,
                generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                devices: DeviceTokens | None) -> tuple[Tensor, Tensor]:
        """Decode ``n`` strategies group by group: their configs ``(n, G)`` and group states
        ``(n, G, hidden)`` (padding rows zero)."""
        actions = torch.zeros(n, group_mask.shape[0], dtype=torch.long, device=group_emb.device)
        states = group_emb.new_zeros(n, *group_emb.shape)
        if n == 0:
            return actions, states
        real = group_mask.nonzero().squeeze(1)
        state = strategy.start_decoding(n, group_emb)
        earlier = actions.new_full((n,), self.n_actions)
        for g in real.tolist():
            states[:, g] = strategy.decode_step(state, group_emb[g][None] + self.action_emb(earlier))
            step_logits = head(states[:, g], devices)
            if offsets is not None:
                step_logits = step_logits + offsets
            earlier = draw_actions(step_logits[:, None], None, generator, greedy, head.splits, head.states)[:, 0]
            actions[:, g] = earlier
        return actions, states

    def sample_actions(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                       n: int, *, generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                       devices: DeviceTokens | None) -> Tensor:
        return self._decode(strategy, head, group_emb, group_mask, n, generator, offsets, greedy, devices)[0]

    def sample_plans(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                     n: int, *, generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                     devices: DeviceTokens | None) -> Tensor:
        actions, states = self._decode(strategy, head, group_emb, group_mask, n, generator, offsets, greedy, devices)
        recompute, micro = head.plan_logits(states, group_mask)
        return torch.cat([actions, draw_plan_decisions(recompute, micro, group_mask, n, generator, greedy)], dim=1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(actions={self.n_actions}, hidden={self.hidden})"


def decoder_for(config: PolicyConfig) -> GroupDecoder:
    """The decoder of a policy with these settings (``config.autoregressive``)."""
    if not config.autoregressive:
        return IndependentDecoder()
    return AutoregressiveDecoder(n_actions(config.n_devices, config.split_actions, config.state_actions), config.hidden)
