"""What every part of the policy network shares: its error type, the setting checks that list problems
instead of raising at the first, and the sizes of the data-parallel part of the action space and of the
plan-level choices."""

from __future__ import annotations

from heterog.errors import HeterogError
from heterog.strategy import N_CLUSTER_SPLIT_ACTIONS, n_actions

N_DP_SCHEMES = 4  # actions M..M+3: DP-even-PS, DP-even-AR, DP-proportional-PS, DP-proportional-AR
# with split actions (heterog.strategy's action table): M+4, M+5 divide a group's parameters over all devices
# (even, proportional), then one pointer per device for its server, even (M+6+d) and proportional (2M+6+d)
N_CLUSTER_SPLITS = N_CLUSTER_SPLIT_ACTIONS
# the plan-level choices: len(envs.actions.MICRO_CHOICES) numbers of micro-batches (stated here so that the
# network does not import the env package; tests/agents/test_plan_decisions.py checks they agree) and the
# recompute bit's "keep the activations" value (envs.actions.KEEP)
N_MICRO_CHOICES = 5
KEEP_ACTIVATIONS = 0


class PolicyError(HeterogError, ValueError):
    """A policy-network setting or input does not fit (sizes, heads, masks, action space)."""


def n_outputs(n_devices: int, splits: bool = False) -> int:
    """The logits per group for ``n_devices`` devices: ``M + 4``, or ``3 M + 6`` with split actions
    (``heterog.strategy.n_actions``)."""
    return n_actions(n_devices, splits)


def pointer_blocks(width: int, splits: bool = False) -> list[tuple[int, int]]:
    """The pointer blocks of a row of ``width`` logits: the ``[start, end)`` column ranges with one action
    per device, model parallelism and, with split actions, the even and the proportional split over each
    device's server."""
    if not splits:
        return [(0, width - N_DP_SCHEMES)]
    m = (width - N_DP_SCHEMES - N_CLUSTER_SPLITS) // 3
    first = m + N_DP_SCHEMES + N_CLUSTER_SPLITS
    return [(0, m), (first, first + m), (first + m, first + 2 * m)]


def require(condition: bool, message: str) -> None:
    """Raise :class:`PolicyError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise PolicyError(message)


def raise_problems(problems: list[str], what: str = "") -> None:
    """Raise one :class:`PolicyError` naming every problem (``what``: a prefix such as "bad policy
    settings"); nothing when the list is empty."""
    if problems:
        raise PolicyError((f"{what}: " if what else "") + "; ".join(problems))


def head_count_problems(what: str, hidden: int, heads: int) -> list[str]:
    """Whether ``hidden`` channels split evenly over ``heads`` attention heads of ``what`` (e.g. "GAT")."""
    if heads < 1:
        return [f"{what} heads must be at least 1, got {heads}"]
    if hidden % heads:
        return [f"hidden size {hidden} is not divisible by {heads} {what} heads"]
    return []
