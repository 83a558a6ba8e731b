"""How the policy's logits become actions: each group's most likely decision, the masked per-group
categorical distribution, and drawing whole strategies (one action per group) from logits."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Categorical

from agents.networks.common import PolicyError, pointer_blocks, require


def most_likely_actions(logits: Tensor, splits: bool = False, states: bool = False) -> Tensor:
    """Each group's most likely decision: model parallelism (the probabilities of its ``M`` device
    actions summed), one of the four DP schemes, or with ``splits`` (split actions) one of the two
    cluster-wide splits or a split over some server (the even or the proportional pointers summed),
    whichever is most likely (a single action on a tie); for a pointer decision, its most likely device.

    Why not the argmax over the actions: a policy that is sure a group belongs on one device but cannot
    tell equivalent devices apart (eight identical GPUs) gives each an eighth of that mass, and the
    argmax never places it there. Drawing the decision, then the device, is the same distribution as
    drawing an action, so only the greedy plan changes.

    ``states``: the logits end with the state actions (``heterog.actions.state_action``), single actions.

    Shapes: ``(..., A)`` -> ``(...)``, ``A = M + 4`` (or ``3 M + 6`` with ``splits``).
    """
    blocks = pointer_blocks(logits.shape[-1], splits, states)
    in_block = torch.zeros(logits.shape[-1], dtype=torch.bool)
    for start, end in blocks:
        in_block[start:end] = True
    singles = (~in_block).nonzero().squeeze(1).to(logits.device)
    scores = torch.cat([logits[..., singles]] + [torch.logsumexp(logits[..., a:b], dim=-1, keepdim=True)
                                                 for a, b in blocks], dim=-1)
    decision = scores.argmax(dim=-1)                                  # the first maximum: a single on a tie
    out = singles[decision.clamp(max=len(singles) - 1)]
    for k, (start, end) in enumerate(blocks):
        out = torch.where(decision == len(singles) + k, start + logits[..., start:end].argmax(dim=-1), out)
    return out


class MaskedCategorical(Categorical):
    """Independent categorical actions, one per group, where padding groups do not count.

    Padding rows are replaced by uniform logits, ``log_prob`` sums over real groups only (the log
    probability of a whole strategy), ``entropy`` is the mean over real groups, and sampled or
    modal actions of padding groups are 0.

    Args:
        logits: unnormalised log probabilities.
        mask: True for real groups.
        splits: the logits include the split actions (for :attr:`mode`, :func:`most_likely_actions`).
        states: the logits end with the state actions (the same).

    Shapes:
        logits ``(G, A)``, mask ``(G,)``; ``sample(k)`` -> ``(k, G)``; ``log_prob`` of ``(..., G)``
        -> ``(...)``; ``entropy()`` -> ``()``; ``mode`` -> ``(G,)``.
    """

    def __init__(self, logits: Tensor, mask: Tensor, splits: bool = False, states: bool = False) -> None:
        require(logits.dim() == 2, f"logits must be (groups, actions), got shape {tuple(logits.shape)}")
        require(mask.shape == logits.shape[:1] and mask.dtype == torch.bool,
                 f"mask must be a bool tensor of shape ({logits.shape[0]},), "
                 f"got {mask.dtype} {tuple(mask.shape)}")
        self.mask, self.splits, self.states = mask, splits, states
        super().__init__(logits=logits.masked_fill(~mask.unsqueeze(1), 0.0), validate_args=False)

    @property
    def n_real(self) -> int:
        """Number of real (non-padding) groups."""
        return int(self.mask.sum())

    def sample(self, sample_shape: int | torch.Size | list[int] | tuple[int, ...] = (),
               generator: torch.Generator | None = None) -> Tensor:
        """Draw actions for every group; padding groups get action 0.

        Args:
            sample_shape: ``k`` (an int) or a shape of independent draws.
            generator: optional ``torch.Generator`` for reproducible draws.
        """
        shape = torch.Size([sample_shape]) if isinstance(sample_shape, int) else torch.Size(sample_shape)
        n_draws, n_groups = shape.numel(), self.mask.shape[0]
        real = self.mask.nonzero().squeeze(1)
        actions = torch.zeros(n_draws, n_groups, dtype=torch.long, device=self.logits.device)
        if n_draws > 0 and real.numel() > 0:
            with torch.no_grad():
                draws = torch.multinomial(self.probs[real], n_draws, replacement=True, generator=generator)
            actions[:, real] = draws.T
        return actions.reshape(shape + (n_groups,))

    def log_prob(self, value: Tensor) -> Tensor:
        n_actions = self.logits.shape[-1]
        require(value.shape[-1:] == self.mask.shape,
                 f"actions must end with the group dimension {self.mask.shape[0]}, got {tuple(value.shape)}")
        out_of_range = ((value < 0) | (value >= n_actions)) & self.mask
        if bool(out_of_range.any()):
            bad = out_of_range.nonzero()[0].tolist()
            raise PolicyError(f"action {int(value[tuple(bad)])} of group {bad[-1]} is out of range "
                              f"0..{n_actions - 1}")
        safe = torch.where(self.mask, value, torch.zeros_like(value)).long()
        per_group = super().log_prob(safe)
        return (per_group * self.mask).sum(dim=-1)

    def entropy(self) -> Tensor:
        return (super().entropy() * self.mask).sum() / self.mask.sum().clamp(min=1)

    @property
    def mode(self) -> Tensor:
        """Each real group's most likely decision (:func:`most_likely_actions`); padding groups 0."""
        return torch.where(self.mask, most_likely_actions(self.logits, self.splits, self.states),
                           torch.zeros_like(self.mask, dtype=torch.long))




def draw_actions(logits: Tensor, group_mask: Tensor | None, generator: torch.Generator | None,
                 greedy: bool, splits: bool = False, states: bool = False) -> Tensor:
    """One action per (strategy, group): drawn from the softmax of ``logits``, or (``greedy``) each group's
    most likely decision (:func:`most_likely_actions`; ``splits``: the logits include the split actions);
    padding groups (``group_mask`` False) get 0.

    Shapes: logits ``(n, G, A)``, group_mask ``(G,)`` or None (all real) -> ``(n, G)``.
    """
    n, n_groups, n_actions = logits.shape
    if greedy:
        out = most_likely_actions(logits, splits, states)
    else:
        probs = logits.softmax(dim=-1).reshape(n * n_groups, n_actions)
        out = torch.multinomial(probs, 1, generator=generator).reshape(n, n_groups)
    return out if group_mask is None else out * group_mask


def draw_strategies(logits: Tensor | None, group_mask: Tensor, n: int, *, generator: torch.Generator | None = None,
                    offsets: Tensor | None = None, greedy: bool = False, splits: bool = False,
                    states: bool = False) -> Tensor:
    """``n`` strategies from one set of per-group logits (an independent policy's): each group's action
    drawn (or, ``greedy``, its most likely decision) from its logits plus the strategy's ``offsets`` (one
    offset per action shared by all groups of a strategy; None: none). Padding groups get action 0;
    ``logits`` may be None when ``n`` is 0; ``splits``: the logits include the split actions, ``states``
    the state actions.

    Shapes: logits ``(G, A)``, group_mask ``(G,)``, offsets ``(n, A)`` -> ``(n, G)``.
    """
    if n == 0:
        return torch.zeros(0, group_mask.shape[0], dtype=torch.long, device=group_mask.device)
    if logits is None:
        raise PolicyError(f"{n} strategies need logits; got None")
    if offsets is None:
        dist = MaskedCategorical(logits, group_mask, splits, states)
        return dist.mode[None].expand(n, -1).clone() if greedy else dist.sample(n, generator=generator)
    return draw_actions(logits[None] + offsets[:, None], group_mask, generator, greedy, splits, states)
