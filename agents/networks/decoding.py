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
from agents.networks.transformer_xl import TransformerXL

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
        return draw_strategies(logits, group_mask, n, generator=generator, offsets=offsets, greedy=greedy)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AutoregressiveDecoder(GroupDecoder):
    """The groups choose one after another: the Transformer-XL input of group ``n`` is ``g_n + E[a_{n-1}]``
    (``E`` an action embedding, row ``n_actions`` a start token for the first group), so each group's
    logits depend on the actions of all earlier groups. Sampling decodes group by group (with the
    Transformer-XL's cached keys and values); :meth:`action_logits` reads given strategies at all
    positions at once (teacher forcing).

    Args:
        n_actions: ``M + 4`` (the head's output size).
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

    def action_logits(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                      actions: Tensor, devices: DeviceTokens | None) -> Tensor:
        n_seq = actions.shape[0]
        real = group_mask.nonzero().squeeze(1)
        earlier = torch.cat([actions.new_full((n_seq, 1), self.n_actions), actions[:, real[:-1]]], dim=1)
        states = strategy(group_emb[real][None] + self.action_emb(earlier))             # (K, S, hidden)
        logits = group_emb.new_zeros(n_seq, group_emb.shape[0], self.n_actions)
        return logits.index_copy(1, real, head(states, devices))

    def sample_actions(self, strategy: TransformerXL, head: PolicyHead, group_emb: Tensor, group_mask: Tensor,
                       n: int, *, generator: torch.Generator | None, offsets: Tensor | None, greedy: bool,
                       devices: DeviceTokens | None) -> Tensor:
        actions = torch.zeros(n, group_mask.shape[0], dtype=torch.long, device=group_emb.device)
        if n == 0:
            return actions
        real = group_mask.nonzero().squeeze(1)
        state = strategy.start_decoding(n, group_emb)
        earlier = actions.new_full((n,), self.n_actions)
        for g in real.tolist():
            step_logits = head(strategy.decode_step(state, group_emb[g][None] + self.action_emb(earlier)), devices)
            if offsets is not None:
                step_logits = step_logits + offsets
            earlier = draw_actions(step_logits[:, None], None, generator, greedy)[:, 0]
            actions[:, g] = earlier
        return actions

    def __repr__(self) -> str:
        return f"{type(self).__name__}(actions={self.n_actions}, hidden={self.hidden})"


def decoder_for(config: PolicyConfig) -> GroupDecoder:
    """The decoder of a policy with these settings (``config.autoregressive``)."""
    return AutoregressiveDecoder(config.n_actions, config.hidden) if config.autoregressive else IndependentDecoder()
