"""The plan-level decisions of the policy, beside each group's config: per group whether to recompute its
forward activations (2-way), and for the whole plan the number of micro-batches (one of
``envs.actions.MICRO_CHOICES``).

A *plan* is a flat action of length ``2 G + 1`` (``envs.actions``): ``G`` group configs, ``G`` recompute
bits, one micro-batch choice. :class:`PlanLogits` holds the logits of all three parts;
:func:`plan_log_prob_parts` gives the log probability of each part of given plans (summed, the log
probability of a plan), :func:`plan_entropy` the entropy bonus and :func:`draw_plan_decisions` draws the
recompute bits and the micro-batch choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agents.networks.common import KEEP_ACTIVATIONS, N_MICRO_CHOICES, PolicyError, require
from agents.networks.distributions import draw_strategies
from heterog.actions import N_STATE_CHOICES, STATE_BASES

N_MICRO = N_MICRO_CHOICES
PLAN_PRIOR = 1.0
"""Initial logit bias of "keep the activations" and of one micro-batch (the first choice): a fresh
policy recomputes a group with probability 1 / (1 + e) (0.27) and picks one micro-batch with
probability e / (e + 4) (0.40), and its greedy plan is one micro-batch without recomputation."""
STATE_PRIOR = -3.0
"""Initial offset of every state action's logit from its AllReduce action's (``PlanHead.state``): a policy
that has not learnt them never picks one greedily (each is e^-3 times as likely as the plain AllReduce
action), and samples one of the 18 of an AllReduce action about half as often as the plain action."""
N_STATE_LOGITS = len(STATE_BASES) * N_STATE_CHOICES


class _ZeroLinear(nn.Module):
    """A linear layer created without drawing from the random generator (zeros; :meth:`PlanHead.reset_parameters`
    sets the values), so that adding it leaves every other initial weight of a seeded policy as it was."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class PlanHead(nn.Module):
    """Logits of the plan-level decisions from the group states: a 2-way recompute logit per group (a
    linear layer of the group's state: ``[keep, recompute]``) and one logit per micro-batch choice (a
    linear layer of the masked mean of the real groups' states).

    Both layers start with zero weights and the bias :data:`PLAN_PRIOR` on keeping the activations and on
    one micro-batch, so a fresh policy mildly prefers the plain plan. With ``states`` a third layer
    (``state``) gives each state action's offset from its AllReduce action's logit
    (:meth:`with_state_logits`), zero weights and bias :data:`STATE_PRIOR`.

    Shapes: states ``(..., G, hidden)``, group_mask ``(G,)`` -> recompute ``(..., G, 2)``, micro
    ``(..., N_MICRO)``.
    """

    def __init__(self, hidden: int, states: bool = False) -> None:
        super().__init__()
        self.hidden = hidden
        self.recompute = _ZeroLinear(hidden, 2)
        self.micro = _ZeroLinear(hidden, N_MICRO)
        self.state = _ZeroLinear(hidden, N_STATE_LOGITS) if states else None
        self.reset_parameters()

    def with_state_logits(self, logits: Tensor, states: Tensor, n_devices: int) -> Tensor:
        """``logits`` followed by the state actions' (``heterog.actions.state_action``): each its AllReduce
        action's logit plus its offset from the group's state; ``logits`` as they are without ``states``.

        Shapes: logits ``(..., G, A)``, states ``(..., G, hidden)`` -> ``(..., G, A + 2 N_STATE_CHOICES)``."""
        if self.state is None:
            return logits
        base = logits[..., [n_devices + b for b in STATE_BASES]]
        offsets = self.state(states).unflatten(-1, (len(STATE_BASES), N_STATE_CHOICES))
        return torch.cat([logits, (base[..., None] + offsets).flatten(-2)], dim=-1)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for layer in (self.recompute, self.micro):
                layer.weight.zero_()
                layer.bias.zero_()
            self.recompute.bias[KEEP_ACTIVATIONS] = PLAN_PRIOR
            self.micro.bias[0] = PLAN_PRIOR
            if self.state is not None:
                self.state.weight.zero_()
                self.state.bias.fill_(STATE_PRIOR)

    def forward(self, states: Tensor, group_mask: Tensor) -> tuple[Tensor, Tensor]:
        weights = group_mask.to(states.dtype)[:, None]
        pooled = (states * weights).sum(dim=-2) / weights.sum().clamp(min=1.0)
        recompute = self.recompute(states).masked_fill(~group_mask.unsqueeze(-1), 0.0)
        return recompute, self.micro(pooled)

    def __repr__(self) -> str:
        states = "" if self.state is None else f", {self.hidden}->{N_STATE_LOGITS} state offsets per group"
        return (f"{type(self).__name__}({self.hidden}->2 recompute per group, {self.hidden}->{N_MICRO} "
                f"micro-batches{states})")


@dataclass(frozen=True)
class PlanLogits:
    """The logits of a plan's three parts, for one set of strategies (leading ``K``) or for all (none).

    Shapes: groups ``(..., G, A)``, recompute ``(..., G, 2)``, micro ``(..., N_MICRO)``.
    """

    groups: Tensor
    recompute: Tensor
    micro: Tensor

    def expand(self, n: int) -> PlanLogits:
        """The same logits for ``n`` strategies (from unbatched logits)."""
        return PlanLogits(self.groups.expand(n, -1, -1), self.recompute.expand(n, -1, -1),
                          self.micro.expand(n, -1))

    def detach(self) -> PlanLogits:
        return PlanLogits(self.groups.detach(), self.recompute.detach(), self.micro.detach())

    def select(self, index: int | slice | Tensor) -> PlanLogits:
        """The logits of some strategies of batched logits (``index`` over the leading dimension)."""
        return PlanLogits(self.groups[index], self.recompute[index], self.micro[index])


def split_plans(plans: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """The parts of plans ``(..., 2 G + 1)``: configs ``(..., G)``, recompute bits ``(..., G)`` and the
    micro-batch choice ``(...)``."""
    require(plans.shape[-1] == 2 * n_groups + 1,
            f"plans over {n_groups} groups have length {2 * n_groups + 1}, got shape {tuple(plans.shape)}")
    return plans[..., :n_groups], plans[..., n_groups:2 * n_groups], plans[..., -1]


def _log_prob(logits: Tensor, actions: Tensor) -> Tensor:
    """Log probability of each action. Shapes: logits ``(..., C)`` broadcastable to actions ``(...)``."""
    log_p = logits.log_softmax(dim=-1).expand(*actions.shape, -1)
    return log_p.gather(-1, actions[..., None])[..., 0]


def plan_log_prob_parts(logits: PlanLogits, plans: Tensor) -> Tensor:
    """Log probability of each decision of the plans: each group's config, each group's recompute bit and
    the micro-batch choice, in plan order (their sum is the log probability of a plan). ``logits``: one set
    for all plans (unbatched) or one per plan.

    Shapes: plans ``(K, 2 G + 1)`` -> ``(K, 2 G + 1)``.
    """
    n_groups = logits.groups.shape[-2]
    groups, bits, micro = split_plans(plans, n_groups)
    n_choices = (logits.groups.shape[-1], 2, N_MICRO)
    for name, part, n in (("config", groups, n_choices[0]), ("recompute bit", bits, 2), ("micro-batch choice", micro,
                                                                                          N_MICRO)):
        if bool(((part < 0) | (part >= n)).any()):
            raise PolicyError(f"a {name} of the plans is out of range 0..{n - 1}")
    return torch.cat([_log_prob(logits.groups, groups), _log_prob(logits.recompute, bits),
                      _log_prob(logits.micro, micro)[..., None]], dim=-1)


def plan_log_prob(logits: PlanLogits, plans: Tensor, group_mask: Tensor | None = None) -> Tensor:
    """Log probability of whole plans: the sum over the real groups' configs and recompute bits and the
    micro-batch choice. Shapes: plans ``(K, 2 G + 1)``, group_mask ``(G,)`` or None (all real) -> ``(K,)``."""
    parts = plan_log_prob_parts(logits, plans)
    if group_mask is None:
        return parts.sum(dim=-1)
    real = torch.cat([group_mask, group_mask, group_mask.new_ones(1)]).to(parts.dtype)
    return (parts * real).sum(dim=-1)


def categorical_entropy(logits: Tensor) -> Tensor:
    """The entropy of each categorical of ``logits`` ``(..., C)`` -> ``(...)``."""
    return -(logits.softmax(dim=-1) * logits.log_softmax(dim=-1)).sum(-1)


def plan_entropy(logits: PlanLogits, groups: Tensor | None = None) -> Tensor:
    """The entropy bonus of a plan distribution: the mean entropy of the groups' configs, plus that of their
    recompute bits, plus the entropy of the micro-batch choice (``groups``: the groups counted; None:
    all). Shapes: -> ``()``."""
    configs, bits = logits.groups, logits.recompute
    if groups is not None:
        configs, bits = configs[..., groups, :], bits[..., groups, :]
    return (categorical_entropy(configs).mean() + categorical_entropy(bits).mean()
            + categorical_entropy(logits.micro).mean())


def draw_plan_decisions(recompute: Tensor, micro: Tensor, group_mask: Tensor, n: int,
                        generator: torch.Generator | None, greedy: bool) -> Tensor:
    """The recompute bits and the micro-batch choice of ``n`` plans, drawn from their logits (or, ``greedy``,
    the most likely ones: keep and the first choice on a tie); padding groups get 0.

    Shapes: recompute ``(G, 2)`` or ``(n, G, 2)``, micro ``(N_MICRO,)`` or ``(n, N_MICRO)`` -> ``(n, G + 1)``.
    """
    n_groups = group_mask.shape[0]
    recompute = recompute.expand(n, n_groups, 2)
    micro = micro.expand(n, micro.shape[-1])
    if greedy:
        bits, choice = recompute.argmax(dim=-1), micro.argmax(dim=-1)
    elif n == 0:
        bits, choice = recompute.new_zeros(0, n_groups, dtype=torch.long), micro.new_zeros(0, dtype=torch.long)
    else:
        probs = recompute.softmax(dim=-1).reshape(n * n_groups, 2)
        bits = torch.multinomial(probs, 1, generator=generator).reshape(n, n_groups)
        choice = torch.multinomial(micro.softmax(dim=-1), 1, generator=generator)[:, 0]
    return torch.cat([bits * group_mask, choice[:, None]], dim=1)


def draw_plans(logits: PlanLogits | None, group_mask: Tensor, n: int, *, generator: torch.Generator | None = None,
               offsets: Tensor | None = None, greedy: bool = False, splits: bool = False,
               states: bool = False) -> Tensor:
    """``n`` plans from one set of plan logits (an independent policy's): the configs as
    :func:`draw_strategies` draws them (``offsets`` apply to the config logits), then the recompute bits and
    the micro-batch choice (:func:`draw_plan_decisions`). ``logits`` may be None when ``n`` is 0;
    ``splits``: the config logits include the split actions, ``states`` the state actions.

    Shapes: group_mask ``(G,)``, offsets ``(n, A)`` -> ``(n, 2 G + 1)``.
    """
    if n == 0:
        return torch.zeros(0, 2 * group_mask.shape[0] + 1, dtype=torch.long, device=group_mask.device)
    if logits is None:
        raise PolicyError(f"drawing {n} plans needs their logits")
    configs = draw_strategies(logits.groups, group_mask, n, generator=generator, offsets=offsets, greedy=greedy,
                              splits=splits, states=states)
    return torch.cat([configs, draw_plan_decisions(logits.recompute, logits.micro, group_mask, n, generator,
                                                   greedy)], dim=1)


class PlanDistribution:
    """The distribution of whole plans of an independent policy: each real group's config and recompute bit
    and the micro-batch choice, all independent. ``log_prob`` sums them (padding groups do not count),
    ``entropy`` is :func:`plan_entropy` over the real groups, ``sample``/``mode`` give plans (padding
    groups 0).

    Shapes: logits unbatched (groups ``(G, A)``), mask ``(G,)``; ``sample(n)`` and ``log_prob`` of
    ``(K, 2 G + 1)`` -> ``(n, 2 G + 1)`` and ``(K,)``; ``mode`` -> ``(2 G + 1,)``.
    """

    def __init__(self, logits: PlanLogits, mask: Tensor, splits: bool = False, states: bool = False) -> None:
        require(logits.groups.dim() == 2, f"plan logits must be unbatched, got configs {tuple(logits.groups.shape)}")
        self.logits, self.mask, self.splits, self.states = logits, mask, splits, states

    def log_prob(self, plans: Tensor) -> Tensor:
        return plan_log_prob(self.logits, plans, self.mask)

    def entropy(self) -> Tensor:
        return plan_entropy(self.logits, self.mask.nonzero().squeeze(1))

    def sample(self, n: int = 1, generator: torch.Generator | None = None) -> Tensor:
        return draw_plans(self.logits, self.mask, n, generator=generator, splits=self.splits, states=self.states)

    @property
    def mode(self) -> Tensor:
        """The greedy plan: each group's most likely decision, its more likely recompute bit, the most likely
        micro-batch choice."""
        return draw_plans(self.logits, self.mask, 1, greedy=True, splits=self.splits, states=self.states)[0]
