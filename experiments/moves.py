"""How far a plan lies from the uniform plans that the searches start from, in local-search moves.

    python -m experiments.moves --graph bert_large --batch-size 48 --cluster gen-65 plan.json ...

A move of the agent's local search (``agents.candidates.CandidateSearch.mutate``) and of MCMC
(``heterog.baselines.mcmc``) sets one group, or one coupled block of groups
(``heterog.baselines.chains.coupled_blocks``), to one action. The agent advances its best plan by at
most one move per round, so a plan ``n`` moves from every start needs at least ``n`` rounds of local
search (docs/results.md, "The search mix (stop 32)").

The count is a lower bound: coupled blocks are connected components of the group graph at rising byte
thresholds, so two blocks are nested or disjoint. A move changes the groups of at most one maximal
block (or one group outside every block) and gives them one action. So reaching a plan takes at least
as many moves as there are distinct (maximal block or lone group, action) pairs among the groups that
differ from the start.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from heterog.errors import HeterogError


def block_units(blocks, n_groups: int) -> np.ndarray:
    """Per group, an id of the largest block that holds it (``-1 - first group`` of that block), or the
    group's own index when no block does. ``blocks``: ``Block``s (or anything with ``.groups``) that are
    nested or disjoint. Shapes: -> ``(G,)``."""
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
    the distinct (unit, action) pairs among the groups where they differ. Shapes: ``(G,)`` each."""
    actions, start = np.asarray(actions), np.asarray(start)
    differ = np.nonzero(actions != start)[0]
    return len({(int(unit[g]), int(actions[g])) for g in differ})


def nearest_starts(actions: np.ndarray, n_actions: int, unit: np.ndarray) -> list[tuple[int, int, int]]:
    """The uniform plans (every group with action ``a``), nearest first, as (moves, groups that differ,
    a)."""
    actions = np.asarray(actions)
    out = [(min_moves(actions, np.full_like(actions, a), unit), int((actions != a).sum()), a)
           for a in range(n_actions)]
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    from heterog.baselines.chains import coupled_blocks
    from heterog.cli.args import graph_and_cluster
    from heterog.evaluate import Evaluator
    from heterog.strategy import N_DP_ACTIONS, Strategy, action_name

    p = argparse.ArgumentParser(prog="python -m experiments.moves", description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", required=True, help="zoo model name or graph file")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--cluster", required=True)
    p.add_argument("plans", nargs="+", type=Path, help="strategy JSON files with their actions in meta")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        graph, cluster = graph_and_cluster(args)
        ev = Evaluator(graph, cluster)
        group_of = np.asarray(ev.group_of)
        unit = block_units(coupled_blocks(graph, group_of), int(group_of.max()) + 1)
        rows = []
        for path in args.plans:
            strategy = Strategy.load(path)
            actions = strategy.meta.get("actions")
            if actions is None or len(actions) != len(unit):
                raise HeterogError(f"{path}: no actions for the {len(unit)} groups of {graph.name} in its meta "
                                   f"(plans of the agent and MCMC carry them)")
            moves, groups, a = nearest_starts(np.asarray(actions), cluster.n_devices + N_DP_ACTIONS, unit)[0]
            rows.append({"plan": str(path), "nearest_start": action_name(a, cluster.n_devices), "moves": moves,
                         "groups_differ": groups})
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['plan']}: {r['moves']} moves ({r['groups_differ']} groups) from the uniform plan "
                  f"{r['nearest_start']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
