"""``PlanEvaluator``: the Evaluator has every member of the protocol, its methods with the same parameters, and the
classic planners read nothing of an evaluator beyond it (each plans the same through an object that has
the protocol's members alone)."""
from __future__ import annotations

import inspect

import pytest

from heterog import baselines, planners
from heterog.evaluate import Evaluator
from heterog.evaluator_protocol import PlanEvaluator
from heterog.parallel import EvaluatorSpec
from tests.baselines.helpers import gpu_cluster, layered_graph

MEMBERS = {"graph", "cluster", "cost", "order", "shares", "serialize_collectives", "sync_batch_stats", "max_groups",
           "checkpoint_every_steps", "group_of", "n_groups", "strategy", "iteration_time", "ps_devices"}
OPTIONS = {"os-dpos": {"budget_s": 30.0}, "mcmc": {"max_evals": 40, "seed": 0},
           "pesto-ilp": {"budget_s": 30.0, "solver_workers": 1}, "random": {"seed": 3}}


class ProtocolOnly:
    """An evaluator with the members of ``PlanEvaluator`` alone (read from ``ev``); reading any other
    attribute is an AttributeError naming it."""

    def __init__(self, ev: Evaluator) -> None:
        self._ev = ev

    def __getattr__(self, name: str) -> object:
        if name not in MEMBERS:
            raise AttributeError(f"{name!r} is not a member of PlanEvaluator")
        return getattr(self._ev, name)


@pytest.fixture(scope="module")
def ev() -> Evaluator:
    return Evaluator(layered_graph(3, 4096), gpu_cluster(3))


def test_members_are_the_listed_ones():
    assert {name for name in vars(PlanEvaluator) if not name.startswith("_")} == MEMBERS


def test_evaluator_is_a_plan_evaluator(ev):
    assert isinstance(ev, PlanEvaluator)
    assert isinstance(ProtocolOnly(ev), PlanEvaluator)
    assert not isinstance(object(), PlanEvaluator)


@pytest.mark.parametrize("name", ["iteration_time", "strategy"])
def test_evaluator_method_takes_the_protocol_parameters(name):
    def parameters(fn: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(getattr(Evaluator, name)) == parameters(getattr(PlanEvaluator, name))


@pytest.mark.parametrize("method", sorted(set(baselines.names()) | {"best-dp"}))
def test_planner_reads_only_the_protocol(ev, method):
    """The same plan through the protocol's members alone as through the whole Evaluator."""
    options = OPTIONS.get(method, {})
    full = planners.plan(method, evaluator=ev, **options).to_dict()
    narrow = planners.plan(method, evaluator=ProtocolOnly(ev), **options).to_dict()
    for strategy in (full, narrow):
        strategy.pop("meta")                # search times differ
    assert narrow == full


def test_evaluator_spec_rebuilds_from_the_protocol(ev):
    rebuilt = EvaluatorSpec.of(ProtocolOnly(ev)).build()
    assert (rebuilt.graph, rebuilt.cluster, rebuilt.cost, rebuilt.order, rebuilt.shares, rebuilt.max_groups,
            rebuilt.serialize_collectives, rebuilt.sync_batch_stats) == (
        ev.graph, ev.cluster, ev.cost, ev.order, ev.shares, ev.max_groups, ev.serialize_collectives,
        ev.sync_batch_stats)
    actions = [0] * ev.n_groups
    assert rebuilt.iteration_time(rebuilt.strategy(actions)) == ev.iteration_time(ev.strategy(actions))
