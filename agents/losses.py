"""The trainer's losses: per-group and per-plan log probabilities, the policy-gradient loss (REINFORCE,
PPO), the imitation term and its weights, and the columns of a plan that are decisions."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from agents.networks.plan import PlanLogits, plan_log_prob_parts


def per_group_log_prob(logits: Tensor, actions: Tensor) -> Tensor:
    """Log probability of each group's action, from one set of logits for all strategies or one per
    strategy (an autoregressive policy's, :meth:`StrategyPolicy.action_logits`).

    Shapes: logits ``(G, A)`` or ``(K, G, A)``, actions ``(K, G)`` -> ``(K, G)``.
    """
    log_p = logits.log_softmax(dim=-1).expand(actions.shape[0], -1, -1)
    return log_p.gather(-1, actions[..., None])[..., 0]


def plan_columns(groups: Tensor, n_groups: int) -> Tensor:
    """The entries of a plan ``(2 G + 1,)`` that belong to ``groups`` (their configs, then their recompute
    bits), then the micro-batch choice. Shapes: groups ``(D,)`` -> ``(2 D + 1,)``."""
    return torch.cat([groups, groups + n_groups, groups.new_full((1,), 2 * n_groups)])


def imitation_loss(logits: Tensor | PlanLogits, target: Tensor, weights: Tensor) -> Tensor:
    """Cross-entropy of the policy against one strategy, a weighted mean over groups: of the configs alone
    (``logits`` a tensor, ``target`` configs), or of whole plans (:class:`PlanLogits`, ``target`` a plan:
    each group's config and recompute bit weighted by the group, the micro-batch choice by 1).
    Shapes: logits ``(G, A)`` or ``(1, G, A)``, target ``(1, G)`` or ``(1, 2 G + 1)``, weights ``(G,)`` -> ``()``."""
    if isinstance(logits, PlanLogits):
        n = weights.shape[0]
        parts = plan_log_prob_parts(logits, target)[0]
        return -(((parts[:n] + parts[n:2 * n]) * weights).sum() + parts[-1]) / weights.sum()
    return -(per_group_log_prob(logits, target)[0] * weights).sum() / weights.sum()


def imitation_weights(flops: np.ndarray, sync_bytes: np.ndarray, by_load: float) -> Tensor:
    """Per-group weights of the imitation term: ``1 - by_load`` plus ``by_load`` times G times the mean
    of the group's shares of the FLOPs and of the aggregated gradient bytes (a share of a total of 0
    counts as even). They average 1. Shapes: ``(G,)`` -> ``(G,)``."""
    n = len(flops)
    shares = [x / x.sum() if x.sum() > 0 else np.full(n, 1.0 / n) for x in (flops, sync_bytes)]
    return torch.as_tensor((1.0 - by_load) + by_load * n * 0.5 * (shares[0] + shares[1]), dtype=torch.float32)


def mean_entropy(logits: Tensor) -> Tensor:
    """Mean entropy of the per-group distributions. Shapes: ``(..., G, A)`` -> ``()``."""
    return -(logits.softmax(dim=-1) * logits.log_softmax(dim=-1)).sum(-1).mean()


def policy_loss(log_p: Tensor, log_p_old: Tensor, advantages: Tensor, algorithm: str, clip: float,
                per: int | None = None) -> Tensor:
    """Policy-gradient loss: a sum over the decisions of a strategy (each decision is one factor of the
    strategy and shares its advantage) divided by ``per`` (None: the number of decisions, the mean), averaged
    over samples. For plans, ``per`` is the number of groups, so each config weighs as it does alone.

    REINFORCE: ``-A log pi``. PPO: ``-min(rho A, clip(rho, 1-eps, 1+eps) A)`` with the per-decision ratio
    ``rho = pi / pi_old`` (a ratio of whole-strategy probabilities over ~1000 groups would always clip).

    Shapes: log_p, log_p_old ``(K, D)``, advantages ``(K,)`` -> ``()``.
    """
    adv = advantages[:, None]
    n = log_p.shape[-1] if per is None else per
    if algorithm == "reinforce":
        return -(adv * log_p).sum(dim=-1).mean() / n
    ratio = (log_p - log_p_old).exp()
    return -torch.min(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv).sum(dim=-1).mean() / n
