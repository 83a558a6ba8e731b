"""Classic planners that return a Strategy: data-parallel baselines, expert, DPOS, Pesto ILP, MCMC, random.

They are planners of the one registry, ``heterog.planners`` (``baseline_planners``); ``run(name, graph,
cluster, **opts)`` and ``names()`` are that registry seen from here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import Strategy


def names() -> list[str]:
    """The classic planners' methods, in the registry's order."""
    from heterog import planners

    return list(planners.baseline_planners())


def run(name: str, graph: OpGraph | None, cluster: Cluster | None, *, evaluator: PlanEvaluator | None = None,
        **opts: Any) -> Strategy:
    """Plan ``graph`` on ``cluster`` with classic planner ``name`` through the registry
    (``heterog.planners.plan``); the strategy's meta records search_time_s.

    ``opts``: the shared planning options (``heterog.planners.OPTIONS``: ``seed``, ``budget_s``, ...; a
    planner that does not take one is not given it) and the planner's own (its keyword parameters, e.g.
    mcmc's ``max_evals``). Any other option is a HeterogError naming the planner and its options.
    """
    from heterog import planners

    known = names()
    if name not in known:
        raise HeterogError(f"unknown method {name!r}; known: {', '.join(known)}")
    return planners.plan(name, graph, cluster, evaluator=evaluator, **opts)
