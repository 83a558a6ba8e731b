"""The plan action: what the agent decides for one training graph, and its decoding into a Strategy.

For ``G`` group slots (the env's ``max_groups``; the trainer's real group count) a plan action is one
flat integer vector of length ``2 G + 1``:

- ``[0, G)``: each group's parallel config, one of ``M + 4`` (``heterog.actions.decode_action``), or
  with splits beyond the batch one of ``3 M + 6`` (``heterog.actions.n_actions(M, splits=True)``: then
  ``M + 4`` and ``M + 5`` divide the group's parameters over all devices, evenly or in proportion to
  device speed, ``M + 6 + d`` evenly over device d's server and ``2 M + 6 + d`` in proportion over it;
  ``heterog.actions.decode_split_action``);
- ``[G, 2 G)``: each group's recompute bit, ``0`` keep its forward activations, ``1`` free them after the
  forward and recompute them before its backward (``Strategy.recompute``); a group under a split action
  keeps its activations (the bit is ignored: split groups are not recomputed);
- ``2 G``: the index of the number of micro-batches in :data:`MICRO_CHOICES`, the same for the whole
  plan (even micro-batches, 1F1B schedule; ``Strategy.with_micro_batches``). A choice above the batch
  size is clipped to the largest number the batch allows (``min(batch, MAX_MICRO_BATCHES)``), so every
  index is valid on every graph.

With state actions (``states``, the env's ``state_actions``) each group's config may also be one of the
``2 N_STATE_CHOICES`` actions after those: DP-even-AR or DP-proportional-AR keeping sharded state (ZeRO
stage 1, 2 or 3, shards even, by memory or by speed, the optimizer state on the GPU or offloaded to the
host; ``heterog.actions.STATE_CHOICES``, ``heterog.actions.decode_state_action``).

A vector of length ``G`` (the group configs alone) is the same plan with one micro-batch and no
recomputation. Entries of padding groups (beyond the graph's real groups) are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from heterog.actions import apply_states, base_actions, n_actions
from heterog.errors import StrategyError
from heterog.strategy import MAX_MICRO_BATCHES, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluate import Evaluator

MICRO_CHOICES: tuple[int, ...] = (1, 2, 4, 8, 16)
"""The numbers of micro-batches a plan chooses from (by index, the last entry of a plan action)."""
KEEP, RECOMPUTE = 0, 1
SCHEDULE = "1f1b"
"""The micro-batch schedule of every plan the agent decodes."""


def plan_length(n_groups: int) -> int:
    """``2 G + 1``: the length of a plan action over ``G`` group slots."""
    return 2 * int(n_groups) + 1


def plan_nvec(n_devices: int, n_groups: int, splits: bool = False, states: bool = False) -> np.ndarray:
    """The choices of every entry of a plan action (a ``MultiDiscrete``'s ``nvec``):
    ``[A] * G + [2] * G + [len(MICRO_CHOICES)]``, ``A = n_actions(M, splits, states)``."""
    g = int(n_groups)
    return np.concatenate([np.full(g, n_actions(n_devices, splits, states)), np.full(g, 2),
                           [len(MICRO_CHOICES)]]).astype(np.int64)


def micro_batches(index: int, batch_size: int) -> int:
    """The number of micro-batches of choice ``index``, clipped to what a batch of ``batch_size`` allows."""
    if not 0 <= int(index) < len(MICRO_CHOICES):
        raise StrategyError(f"micro-batch choice {int(index)} is out of range 0..{len(MICRO_CHOICES) - 1} "
                            f"(choices {list(MICRO_CHOICES)})")
    return min(MICRO_CHOICES[int(index)], int(batch_size), MAX_MICRO_BATCHES)


@dataclass(frozen=True)
class PlanAction:
    """One plan action split into its parts, for the real groups only."""

    groups: np.ndarray
    """``(G,)`` int64: each real group's config action."""
    recompute: np.ndarray
    """``(G,)`` int64: each real group's recompute bit."""
    micro_index: int
    """Index into :data:`MICRO_CHOICES`."""

    @property
    def recomputed(self) -> list[int]:
        """The ids of the recomputed groups."""
        return np.flatnonzero(self.recompute).tolist()


def full_plan(action: npt.ArrayLike, n_groups: int) -> np.ndarray:
    """``action`` as a plan action of length ``2 G + 1``: a plan action as it is, a vector of ``G``
    group configs extended with no recomputation and one micro-batch."""
    a = np.asarray(action, dtype=np.int64)
    g = int(n_groups)
    if a.shape[-1:] == (g,):
        out = np.zeros(a.shape[:-1] + (plan_length(g),), dtype=np.int64)
        out[..., :g] = a
        return out
    if a.shape[-1:] != (plan_length(g),):
        raise StrategyError(f"a plan action over {g} groups has length {g} (configs) or {plan_length(g)} "
                            f"(configs, recompute bits, micro-batch choice), got shape {a.shape}")
    return a


def split_plan(action: npt.ArrayLike, n_real: int, n_slots: int, n_devices: int,
               splits: bool = False, states: bool = False) -> PlanAction:
    """The parts of one plan action over ``n_slots`` group slots (length ``n_slots`` or
    ``2 n_slots + 1``) for its first ``n_real`` groups; StrategyError for a wrong shape or an entry out of
    range (``splits``: the split actions are in range; ``states``: the state actions too)."""
    a = np.asarray(action)
    if a.shape not in ((n_slots,), (plan_length(n_slots),)):
        raise StrategyError(f"action must have shape ({plan_length(n_slots)},) (configs, recompute bits, "
                            f"micro-batch choice) or ({n_slots},) (configs alone), got {a.shape}")
    a = full_plan(a.astype(np.int64), n_slots)
    groups, bits = a[:n_real], a[n_slots:n_slots + n_real]
    n = n_actions(n_devices, splits, states)
    bad = np.flatnonzero((groups < 0) | (groups >= n))
    if len(bad):
        raise StrategyError(f"action {int(groups[bad[0]])} of group {int(bad[0])} is out of range "
                            f"0..{n - 1} for {n_devices} devices{' with splits' if splits else ''}"
                            f"{' with state actions' if states else ''}")
    bad = np.flatnonzero((bits != KEEP) & (bits != RECOMPUTE))
    if len(bad):
        raise StrategyError(f"recompute bit {int(bits[bad[0]])} of group {int(bad[0])} is neither "
                            f"{KEEP} (keep) nor {RECOMPUTE} (recompute)")
    micro_batches(int(a[-1]), MAX_MICRO_BATCHES)            # range check
    return PlanAction(groups, bits, int(a[-1]))


def plan_strategy(evaluator: Evaluator, action: npt.ArrayLike, method: str = "",
                  n_slots: int | None = None, states: bool = False, splits: bool = False) -> Strategy:
    """Decode a plan action for ``evaluator``'s graph into a Strategy: its group configs
    (``Evaluator.strategy``; split actions where the graph has split options; with ``states``, the space
    with state actions after those of ``splits``: a state action is its AllReduce config keeping sharded
    state, ``heterog.actions.apply_states``), then its recomputed groups and micro-batches (1F1B).
    ``n_slots``: the group slots of the action (None: the graph's group count). ``meta["actions"]`` is
    the plan over the real groups (length ``2 G + 1``), and ``meta`` gains ``micro_batches`` (the number)
    and ``recomputed_groups`` (how many), and ``sharded`` where a group keeps sharded state."""
    n_groups = evaluator.n_groups
    m = evaluator.cluster.n_devices
    plan = split_plan(action, n_groups, n_groups if n_slots is None else n_slots, m, splits=splits or not states,
                      states=states)
    if states:
        plain, choices = base_actions(plan.groups, m, splits)
        strategy = apply_states(evaluator.strategy(plain, method), choices, evaluator.cluster)
    else:
        strategy = evaluator.strategy(plan.groups, method)
    k = micro_batches(plan.micro_index, strategy.batch_size)
    recomputed = [g for g in plan.recomputed if strategy.configs[g].split is None]
    if recomputed:
        strategy = strategy.with_recompute(recomputed)
    if k > 1:
        strategy = strategy.with_micro_batches(k, SCHEDULE)
    strategy.meta.update(plan_meta(strategy))
    strategy.meta["actions"] = [*plan.groups.tolist(), *plan.recompute.tolist(), plan.micro_index]
    return strategy


def plan_meta(strategy: Strategy) -> dict[str, int]:
    """What a plan decided beyond its group configs: ``micro_batches`` and ``recomputed_groups``."""
    return {"micro_batches": strategy.n_micro, "recomputed_groups": len(strategy.recompute)}
