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

With extended actions (``extended``, the env's ``extended_actions``; ``heterog.extended_actions``) a plan
action has length ``(M + 2) G + 1``: each group's config may also be one of the extended actions (model
parallelism offloading the optimizer state, the two grids of the servers, the row actions), the plan entry
``2 G`` indexes :data:`EXTENDED_MICRO_CHOICES` (every number of micro-batches up to
``MAX_MICRO_BATCHES`` under each schedule of :data:`EXTENDED_SCHEDULES`, its first
``len(MICRO_CHOICES)`` entries those of :data:`MICRO_CHOICES` under 1F1B; clipped to what the batch and the
plan's grids allow, ``heterog.strategy.most_micro_batches``), and ``[2 G + 1, (M + 2) G + 1)`` are the groups'
rows, ``M`` entries each in ``0 .. row_levels(batch) - 1`` (clipped to that), read by the row actions (the PS
ones too) only.
``encode_plan`` turns a Strategy into a plan action of this layout; what it does not hold: the Strategy's
``priorities`` (an order of the ops for the scheduler, not a decision of the plan action), micro-batches of
uneven sizes, and the plan-wide ``sync_batch_stats`` (StrategyError for the last two).

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
from heterog.extended_actions import apply_extended, encode_configs, regroup, row_levels
from heterog.shares import even_shares
from heterog.strategy import MAX_MICRO_BATCHES, Strategy, most_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.evaluate import Evaluator

MICRO_CHOICES: tuple[int, ...] = (1, 2, 4, 8, 16)
"""The numbers of micro-batches a plan chooses from (by index, the last entry of a plan action)."""
KEEP, RECOMPUTE = 0, 1
SCHEDULE = "1f1b"
"""The micro-batch schedule of every plan the agent decodes without extended actions."""
EXTENDED_SCHEDULES = ("1f1b", "gpipe")
"""The schedules of the extended micro-batch choices, in their order (1F1B first: the first choices are
those of ``MICRO_CHOICES``)."""
MICRO_COUNTS: tuple[int, ...] = MICRO_CHOICES + tuple(k for k in range(1, MAX_MICRO_BATCHES + 1)
                                                      if k not in MICRO_CHOICES)
"""Every number of micro-batches, those of ``MICRO_CHOICES`` first."""
EXTENDED_MICRO_CHOICES: tuple[tuple[int, str], ...] = tuple((k, s) for s in EXTENDED_SCHEDULES for k in MICRO_COUNTS)
"""The (number of micro-batches, schedule) of the extended plan entry ``2 G``, by index."""


def plan_length(n_groups: int, row_width: int = 0) -> int:
    """``2 G + 1``: the length of a plan action over ``G`` group slots; ``(row_width + 2) G + 1`` with rows of
    ``row_width`` entries (extended actions: ``M``)."""
    return (2 + int(row_width)) * int(n_groups) + 1


def plan_nvec(n_devices: int, n_groups: int, splits: bool = False, states: bool = False, extended: bool = False,
              batch_size: int = 1) -> np.ndarray:
    """The choices of every entry of a plan action (a ``MultiDiscrete``'s ``nvec``):
    ``[A] * G + [2] * G + [len(MICRO_CHOICES)]``, ``A = n_actions(M, splits, states)``; with ``extended``
    ``A = n_actions(M, splits, states, extended=True)``, ``len(EXTENDED_MICRO_CHOICES)`` micro-batch choices and
    ``[row_levels(batch_size)] * (G M)`` rows."""
    g = int(n_groups)
    parts: list[np.ndarray] = [np.full(g, n_actions(n_devices, splits, states, extended)), np.full(g, 2),
                               np.full(1, len(EXTENDED_MICRO_CHOICES if extended else MICRO_CHOICES))]
    if extended:
        parts.append(np.full(g * int(n_devices), row_levels(batch_size)))
    return np.concatenate(parts).astype(np.int64)


def micro_batches(index: int, batch_size: int) -> int:
    """The number of micro-batches of choice ``index``, clipped to what a batch of ``batch_size`` allows."""
    if not 0 <= int(index) < len(MICRO_CHOICES):
        raise StrategyError(f"micro-batch choice {int(index)} is out of range 0..{len(MICRO_CHOICES) - 1} "
                            f"(choices {list(MICRO_CHOICES)})")
    return min(MICRO_CHOICES[int(index)], int(batch_size), MAX_MICRO_BATCHES)


def micro_choice(index: int, extended: bool = False) -> tuple[int, str]:
    """The (number of micro-batches, schedule) of choice ``index`` (``extended``: of
    ``EXTENDED_MICRO_CHOICES``), before clipping."""
    table = EXTENDED_MICRO_CHOICES if extended else tuple((k, SCHEDULE) for k in MICRO_CHOICES)
    if not 0 <= int(index) < len(table):
        raise StrategyError(f"micro-batch choice {int(index)} is out of range 0..{len(table) - 1}")
    return table[int(index)]


_EXTENDED_INDEX = {choice: i for i, choice in enumerate(EXTENDED_MICRO_CHOICES)}


def micro_neighbours(index: int, batch_size: int) -> list[int]:
    """The extended micro-batch choices next to choice ``index`` (of ``EXTENDED_MICRO_CHOICES``; a count beyond
    the batch stands for the batch): half and twice its number of micro-batches, one fewer and one more (within
    1 .. ``min(batch_size, MAX_MICRO_BATCHES)``), then its number under the other schedule (at more than one
    micro-batch); each once, none the same plan as ``index``, in that order. A search's step among the counts:
    any count is some steps away, where a uniform draw among all ``len(EXTENDED_MICRO_CHOICES)`` lands far from
    the plan, mostly beyond the batch (which clips it to the batch)."""
    count, schedule = micro_choice(index, extended=True)
    top = min(int(batch_size), MAX_MICRO_BATCHES)
    k = min(count, top)
    other = EXTENDED_SCHEDULES[1 - EXTENDED_SCHEDULES.index(schedule)]
    out: list[int] = []
    for near in ((max(1, k // 2), schedule), (min(2 * k, top), schedule), (k - 1, schedule), (k + 1, schedule),
                 (k, other)):
        same = near[0] == k and (near[1] == schedule or k == 1)
        if 1 <= near[0] <= top and not same and _EXTENDED_INDEX[near] not in out:
            out.append(_EXTENDED_INDEX[near])
    return out


@dataclass(frozen=True)
class PlanAction:
    """One plan action split into its parts, for the real groups only."""

    groups: np.ndarray
    """``(G,)`` int64: each real group's config action."""
    recompute: np.ndarray
    """``(G,)`` int64: each real group's recompute bit."""
    micro_index: int
    """Index into :data:`MICRO_CHOICES` (extended: :data:`EXTENDED_MICRO_CHOICES`)."""
    rows: np.ndarray | None = None
    """``(G, M)`` int64: each real group's row (extended actions only)."""

    @property
    def recomputed(self) -> list[int]:
        """The ids of the recomputed groups."""
        return np.flatnonzero(self.recompute).tolist()


def full_plan(action: npt.ArrayLike, n_groups: int, row_width: int = 0) -> np.ndarray:
    """``action`` as a plan action of length ``plan_length(G, row_width)``: a plan action as it is, a vector of
    ``G`` group configs extended with no recomputation, one micro-batch (and rows of zeros), and with rows a
    plan action without them gaining rows of zeros (the same plan: its micro-batch choice indexes the first
    entries of ``EXTENDED_MICRO_CHOICES``, which are those of ``MICRO_CHOICES``)."""
    a = np.asarray(action, dtype=np.int64)
    g = int(n_groups)
    n = plan_length(g, row_width)
    if a.shape[-1:] == (g,) or (row_width and a.shape[-1:] == (plan_length(g),)):
        out = np.zeros(a.shape[:-1] + (n,), dtype=np.int64)
        out[..., :a.shape[-1]] = a
        return out
    if a.shape[-1:] != (n,):
        raise StrategyError(f"a plan action over {g} groups has length {g} (configs) or {n} "
                            f"(configs, recompute bits, micro-batch choice{', rows' if row_width else ''}), "
                            f"got shape {a.shape}")
    return a


def split_plan(action: npt.ArrayLike, n_real: int, n_slots: int, n_devices: int,
               splits: bool = False, states: bool = False, extended: bool = False) -> PlanAction:
    """The parts of one plan action over ``n_slots`` group slots (length ``n_slots`` or
    ``plan_length(n_slots)``, with ``extended`` ``plan_length(n_slots, M)``) for its first ``n_real`` groups;
    StrategyError for a wrong shape or an entry out of range (``splits``: the split actions are in range;
    ``states``: the state actions too; ``extended``: the extended actions, choices and rows too)."""
    a = np.asarray(action)
    width = int(n_devices) if extended else 0
    if a.shape not in ((n_slots,), (plan_length(n_slots, width),)):
        raise StrategyError(f"action must have shape ({plan_length(n_slots, width)},) (configs, recompute bits, "
                            f"micro-batch choice{', rows' if extended else ''}) or ({n_slots},) (configs alone), "
                            f"got {a.shape}")
    a = full_plan(a.astype(np.int64), n_slots, width)
    groups, bits = a[:n_real], a[n_slots:n_slots + n_real]
    n = n_actions(n_devices, splits, states, extended)
    bad = np.flatnonzero((groups < 0) | (groups >= n))
    if len(bad):
        raise StrategyError(f"action {int(groups[bad[0]])} of group {int(bad[0])} is out of range "
                            f"0..{n - 1} for {n_devices} devices{' with splits' if splits else ''}"
                            f"{' with state actions' if states else ''}{' with extended actions' if extended else ''}")
    bad = np.flatnonzero((bits != KEEP) & (bits != RECOMPUTE))
    if len(bad):
        raise StrategyError(f"recompute bit {int(bits[bad[0]])} of group {int(bad[0])} is neither "
                            f"{KEEP} (keep) nor {RECOMPUTE} (recompute)")
    micro = int(a[2 * n_slots])
    micro_choice(micro, extended)                      # range check
    rows = None
    if extended:
        rows = a[2 * n_slots + 1:].reshape(n_slots, width)[:n_real]
        if (rows < 0).any():
            raise StrategyError(f"row entry {int(rows.min())} is negative (rows hold shares and weights, 0: none)")
    return PlanAction(groups, bits, micro, rows)


def plan_strategy(evaluator: Evaluator, action: npt.ArrayLike, method: str = "",
                  n_slots: int | None = None, states: bool = False, splits: bool = False,
                  extended: bool = False) -> Strategy:
    """Decode a plan action for ``evaluator``'s graph into a Strategy: its group configs
    (``Evaluator.strategy``; split actions where the graph has split options; with ``states``, the space
    with state actions after those of ``splits``: a state action is its AllReduce config keeping sharded
    state, ``heterog.actions.apply_states``), then its recomputed groups and micro-batches (1F1B).
    ``n_slots``: the group slots of the action (None: the graph's group count). ``meta["actions"]`` is
    the plan over the real groups (length ``2 G + 1``; extended: ``(M + 2) G + 1``), and ``meta`` gains
    ``micro_batches`` (the number) and ``recomputed_groups`` (how many), and ``sharded`` where a group keeps
    sharded state. ``extended``: the plan action of the extended actions (the module docstring)."""
    n_groups = evaluator.n_groups
    m = evaluator.cluster.n_devices
    plan = split_plan(action, n_groups, n_groups if n_slots is None else n_slots, m,
                      splits=splits or not (states or extended), states=states, extended=extended)
    groups = plan.groups
    if extended:
        groups = np.where(groups >= n_actions(m, splits, states), 0, groups)   # decoded by apply_extended
    if states:
        plain, choices = base_actions(groups, m, splits)
        strategy = apply_states(evaluator.strategy(plain, method), choices, evaluator.cluster)
    else:
        strategy = evaluator.strategy(groups, method)
    if extended:
        assert plan.rows is not None
        rows = np.minimum(plan.rows, row_levels(strategy.batch_size) - 1)
        strategy = apply_extended(strategy, plan.groups, rows, evaluator.cluster, splits, states)
        count, schedule = micro_choice(plan.micro_index, extended=True)
        k = min(count, most_micro_batches(strategy), MAX_MICRO_BATCHES)
    else:
        k, schedule = micro_batches(plan.micro_index, strategy.batch_size), SCHEDULE
    recomputed = [g for g in plan.recomputed if strategy.configs[g].split is None]
    if recomputed:
        strategy = strategy.with_recompute(recomputed)
    if k > 1:
        strategy = strategy.with_micro_batches(k, schedule)
    strategy.meta.update(plan_meta(strategy))
    strategy.meta["actions"] = [*plan.groups.tolist(), *plan.recompute.tolist(), plan.micro_index,
                                *([] if plan.rows is None else plan.rows.ravel().tolist())]
    return strategy


def encode_plan(strategy: Strategy, cluster: Cluster, splits: bool = False, states: bool = False,
                extended: bool = True, group_of: np.ndarray | None = None) -> np.ndarray:
    """The plan action over ``strategy``'s groups that ``plan_strategy`` decodes into its configs (with
    device peak FLOP/s shares for the proportional actions), recomputed groups, number of micro-batches and
    schedule (``heterog.extended_actions.encode_configs``); without ``extended`` the plan action of
    ``MICRO_CHOICES`` under 1F1B. Not kept: ``priorities``. StrategyError for what no plan action holds
    (uneven micro-batches, the plan-wide ``sync_batch_stats``, a config no action gives).
    ``group_of``: the grouping of the plan action (an Evaluator's, ``regroup``; None: the strategy's own).
    Shapes: -> ``(plan_length(G),)`` (extended: ``(plan_length(G, M),)``)."""
    if group_of is not None:
        strategy = regroup(strategy, group_of)
    if strategy.sync_batch_stats:
        raise StrategyError("a plan synchronizing its batch statistics (sync_batch_stats) is no plan action's decoding")
    k = strategy.n_micro
    if list(strategy.micro) != even_shares(strategy.batch_size, k):
        raise StrategyError(f"micro-batches of uneven sizes {list(strategy.micro)} are no plan action's decoding "
                            f"(a plan action gives even sizes)")
    schedule = SCHEDULE if k == 1 else strategy.schedule
    table = EXTENDED_MICRO_CHOICES if extended else tuple((c, SCHEDULE) for c in MICRO_CHOICES)
    if (k, schedule) not in table:
        raise StrategyError(f"{k} micro-batches under {schedule} are none of the plan action's choices "
                            f"{'(extended)' if extended else f'({list(MICRO_CHOICES)} under {SCHEDULE})'}")
    actions, rows = encode_configs(strategy, cluster, splits, states, extended)
    bits = np.zeros(strategy.n_groups, dtype=np.int64)
    bits[list(strategy.recompute)] = RECOMPUTE
    out: list[np.ndarray] = [actions, bits, np.full(1, table.index((k, schedule)))]
    if extended:
        out.append(rows.ravel())
    return np.concatenate(out).astype(np.int64)


def plan_meta(strategy: Strategy) -> dict[str, int]:
    """What a plan decided beyond its group configs: ``micro_batches`` and ``recomputed_groups``."""
    return {"micro_batches": strategy.n_micro, "recomputed_groups": len(strategy.recompute)}
