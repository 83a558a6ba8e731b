"""How far a plan lies from the uniform plans that the searches start from, counted in local-search moves:
a lower bound on the rounds of local search that reach the plan.

A move of the agent's local search (``agents.candidates.CandidateSearch.mutate``) and of MCMC
(``heterog.baselines.mcmc``) sets one group, or one coupled block of groups
(``heterog.baselines.chains.coupled_blocks``), to one action. The agent advances its best plan by at
most one move per round, so a plan ``n`` moves from every start needs at least ``n`` rounds of local
search.

The count is a lower bound: coupled blocks are connected components of the group graph at rising byte
thresholds, so two blocks are nested or disjoint. A move changes the groups of at most one maximal
block (or one group outside every block) and gives them one action. So reaching a plan takes at least
as many moves as there are distinct (maximal block or lone group, action) pairs among the groups that
differ from the start.

    from heterog.moves import moves_from_uniform
    moves_from_uniform(evaluator, strategy)   # NearestUniform(action=11, name='dp-prop-ar', moves=1, ...)
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from heterog.actions import n_actions, split_action_name
from heterog.errors import HeterogError
from heterog.strategy import Strategy

if TYPE_CHECKING:
    from heterog.evaluate import Evaluator


class GroupBlock(Protocol):
    """Groups that local search moves together (``heterog.baselines.chains.Block``)."""

    @property
    def groups(self) -> Sequence[int] | np.ndarray: ...


@dataclass(frozen=True)
class NearestUniform:
    """The uniform plan (every group with one action) nearest to a plan in local-search moves."""

    action: int            # the action every group of the uniform plan takes
    name: str              # its name: ``mp:<device>`` or a DP action such as ``dp-prop-ar``
    moves: int             # fewest moves from the uniform plan to the plan (a lower bound on search rounds)
    groups_differ: int     # groups whose action differs between the two


def block_units(blocks: Iterable[GroupBlock], n_groups: int) -> np.ndarray:
    """Per group, an id of the largest block that holds it (``-1 - first group`` of that block), or the
    group's own index when no block does. ``blocks``: ``Block``s (or anything with ``.groups``) that are
    nested or disjoint.

    Shapes: -> ``(G,)``."""
    unit = np.arange(n_groups, dtype=np.int64)
    size = np.ones(n_groups, dtype=np.int64)
    for block in blocks:
        members = np.asarray(block.groups, dtype=np.int64)
        grow = members[len(members) > size[members]]
        unit[grow] = -1 - int(members.min())
        size[grow] = len(members)
    return unit


def min_moves(actions: np.ndarray, start: np.ndarray, unit: np.ndarray) -> int:
    """Fewest moves (one group or one block set to one action) from the plan ``start`` to ``actions``:
    the distinct (unit, action) pairs among the groups where they differ.

    Shapes: ``actions``, ``start``, ``unit`` ``(G,)``."""
    actions, start = np.asarray(actions), np.asarray(start)
    differ = np.nonzero(actions != start)[0]
    return len({(int(unit[g]), int(actions[g])) for g in differ})


def nearest_starts(actions: np.ndarray, n_choices: int, unit: np.ndarray,
                   sharded: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """Every uniform plan (every group with action ``a``, for ``a`` < ``n_choices``), nearest first, as
    (moves, groups that differ, a). ``sharded``: the groups that keep sharded state (MCMC's shard moves,
    ``heterog.baselines.chains``): each took a move of its own (a shard move sets one group), and they
    differ from every uniform plan (which keeps none).

    Shapes: ``actions``, ``unit``, ``sharded`` ``(G,)``."""
    actions = np.asarray(actions)
    own = np.zeros(len(actions), dtype=bool) if sharded is None else np.asarray(sharded, dtype=bool)
    rest = ~own
    out = [(min_moves(actions[rest], np.full(int(rest.sum()), a), unit[rest]) + int(own.sum()),
            int(((actions != a) | own).sum()), a) for a in range(n_choices)]
    return sorted(out)


def moves_from_uniform(evaluator: Evaluator, plan: Strategy | Sequence[int] | np.ndarray) -> NearestUniform:
    """The uniform plan nearest to ``plan`` in local-search moves, on ``evaluator``'s graph, grouping and
    cluster. ``plan``: one action per group, or a Strategy that carries them in ``meta["actions"]`` (the
    plans of the agent and of MCMC do; MCMC's also the groups' sharded state in ``meta["sharded"]``, a
    move each); a HeterogError otherwise.

    Shapes: ``plan`` as actions ``(G,)``."""
    from heterog.baselines.chains import coupled_blocks

    group_of = np.asarray(evaluator.group_of)
    n_groups = int(group_of.max()) + 1
    actions = plan.meta.get("actions") if isinstance(plan, Strategy) else plan
    if actions is None or len(actions) != n_groups:
        raise HeterogError(f"the plan carries no actions for the {n_groups} groups of {evaluator.graph.name} "
                           f"(plans of the agent and MCMC carry them in their meta)")
    m = evaluator.cluster.n_devices
    actions = np.asarray(actions, dtype=np.int64)
    n = n_actions(m, splits=bool(actions.max() >= n_actions(m)))      # the agent's split actions, if any
    if actions.min() < 0 or actions.max() >= n:
        raise HeterogError(f"the plan's actions span {actions.min()}..{actions.max()}; "
                           f"{evaluator.cluster.name} has {n} (0..{n - 1})")
    unit = block_units(coupled_blocks(evaluator.graph, group_of), n_groups)
    sharded = plan.meta.get("sharded") if isinstance(plan, Strategy) else None
    own = None if sharded is None else np.array([s is not None for s in sharded], dtype=bool)
    moves, groups, a = nearest_starts(actions, n, unit, own)[0]
    return NearestUniform(a, split_action_name(a, m), moves, groups)
