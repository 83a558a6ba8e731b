"""What every part of the policy network shares: its error type, the setting checks that list problems
instead of raising at the first, the pointer blocks of a row of logits and the sizes of the plan-level
choices (the per-group action's offsets live in ``heterog.actions``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar, cast

from torch import nn

from heterog.actions import device_action_blocks, devices_of
from heterog.errors import HeterogError

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# the plan-level choices: len(envs.actions.MICRO_CHOICES) numbers of micro-batches (stated here so that the
# network does not import the env package; tests/agents/test_plan_decisions.py checks they agree) and the
# recompute bit's "keep the activations" value (envs.actions.KEEP)
N_MICRO_CHOICES = 5
KEEP_ACTIVATIONS = 0


class PolicyError(HeterogError, ValueError):
    """A policy-network setting or input does not fit (sizes, heads, masks, action space)."""


class Modules(nn.ModuleList, Generic[ModuleT]):
    """An ``nn.ModuleList`` of one kind of module whose iteration is typed as that kind (its state-dict keys
    are a ModuleList's)."""

    def __iter__(self) -> Iterator[ModuleT]:
        return cast(Iterator[ModuleT], super().__iter__())


def layer(sequence: nn.Sequential, index: int, kind: type[ModuleT]) -> ModuleT:
    """Layer ``index`` of ``sequence``, checked to be a ``kind`` (the type the caller relies on)."""
    module = sequence[index]
    if not isinstance(module, kind):
        raise PolicyError(f"layer {index} of {type(sequence).__name__} is a {type(module).__name__}, "
                          f"not a {kind.__name__}")
    return module


def pointer_blocks(width: int, splits: bool = False, states: bool = False) -> list[tuple[int, int]]:
    """The pointer blocks of a row of ``width`` logits: the ``[start, end)`` column ranges with one action
    per device, model parallelism and, with split actions, the even and the proportional split over each
    device's server (``heterog.actions.device_action_blocks``); ``states``: the row ends with the state
    actions (single actions)."""
    return device_action_blocks(devices_of(width, splits, states), splits)


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
