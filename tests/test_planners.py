"""The planner registry: names, option routing and refusals (a planner's own options, the shared ones it
takes, every other option an error), best-dp, and planners of other packages through the
``heterog.planners`` entry point (the agent's, and a fake one)."""
from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from heterog import baselines, planners
from heterog.baselines import basic
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from tests.baselines.helpers import gpu_cluster, layered_graph


@pytest.fixture(scope="module")
def ev() -> Evaluator:
    return Evaluator(layered_graph(3, 4096), gpu_cluster(3))


def test_names_list_the_baselines_then_best_dp_then_plugins():
    names = planners.names()
    assert names[:len(baselines.names())] == baselines.names()
    assert names[len(baselines.names())] == "best-dp"
    assert "agent" in names, "the agent's entry point is missing: reinstall the project (pip install -e .)"
    # neither best-dp, nor the agent, nor lp-round (a 30 s MILP, a check on the bound) by default
    assert planners.default_methods() == [n for n in baselines.names() if n != "lp-round"]
    assert "lp-round" in planners.names() and not planners.get("lp-round").default


def test_agent_comes_from_the_entry_point():
    agent = planners.get("agent")
    assert agent.name == "agent" and not agent.default
    assert {"checkpoint", "episodes", "budget_s", "workers"} <= agent.options
    assert agent.plan.__module__ == "agents.planner"


def test_plan_passes_a_planner_only_its_options(ev, monkeypatch):
    seen = {}

    def fake(evaluator, **options):
        seen.update(options)
        return basic.single(evaluator)

    monkeypatch.setattr(planners, "_builtin", lambda: {"fake": planners.Planner("fake", fake, frozenset({"seed"}))})
    monkeypatch.setattr(planners, "_plugins", dict)
    s = planners.plan("fake", evaluator=ev, seed=3, budget_s=5.0, workers=2, progress=None)
    assert seen == {"seed": 3}
    assert s.method == "fake" and s.meta["search_time_s"] >= 0


def test_refusals_are_one_line_errors(ev):
    with pytest.raises(HeterogError, match="--agent applies to the agent only, not to method 'cp-ar'"):
        planners.plan("cp-ar", evaluator=ev, checkpoint="x.pt")
    with pytest.raises(HeterogError, match="--agent and --episodes apply to the agent only"):
        planners.plan("mcmc", evaluator=ev, checkpoint="x.pt", episodes=3)
    with pytest.raises(HeterogError, match="budget must be positive, got 0"):
        planners.plan("mcmc", evaluator=ev, budget_s=0)
    with pytest.raises(HeterogError, match=r"unknown method 'nope'; known: single, .*best-dp"):
        planners.plan("nope", evaluator=ev)
    with pytest.raises(HeterogError, match=r"^planner 'single' takes no option 'temperature' \(its options: device\)$"):
        planners.plan("single", evaluator=ev, temperature=1.0)
    with pytest.raises(HeterogError, match="unknown methods 'a', 'b'"):
        planners.parse_methods("single,a,b")
    assert planners.parse_methods(" cp-ar, dpos,cp-ar ") == ["cp-ar", "dpos"]


def test_built_in_planners_take_the_shared_options_among_their_parameters():
    taken = {name: planners.get(name).options for name in baselines.names()}
    assert taken == {"single": set(), "ev-ps": set(), "ev-ar": set(), "cp-ps": set(), "cp-ar": set(),
                     "expert": set(), "dpos": set(), "os-dpos": {"budget_s"}, "pesto-ilp": {"budget_s", "seed"},
                     "pipeline": {"budget_s"}, "mcmc": {"budget_s", "seed", "workers", "ray_address"},
                     "random": {"seed"}, "lp-round": set()}
    assert planners.get("mcmc").own_options == {"starts", "temperature", "oom_factor", "max_evals", "order", "keep",
                                                "block_moves", "max_micro_batches", "splits", "sharded",
                                                "shard_moves"}
    assert {"sharded", "splits"} <= planners.get("pipeline").own_options
    assert planners.get("best-dp").own_options == frozenset()


def test_a_planner_gets_its_own_options_as_given_and_the_shared_ones_it_takes(ev, monkeypatch):
    seen = {}

    def fake(evaluator, seed: int = 0, depth: int | None = 3, *, width: str = "w"):
        seen.update(seed=seed, depth=depth, width=width)
        return basic.single(evaluator)

    planner = planners.Planner.of("fake", fake)
    assert planner.options == {"seed"} and planner.own_options == {"depth", "width"}
    monkeypatch.setattr(planners, "_builtin", lambda: {"fake": planner})
    monkeypatch.setattr(planners, "_plugins", dict)
    planners.plan("fake", evaluator=ev, seed=None, depth=None, width="x", budget_s=2.0, progress=False)
    assert seen == {"seed": 0, "depth": None, "width": "x"}     # a shared None: the default; an own None: None
    with pytest.raises(HeterogError, match=r"^planner 'fake' takes no options 'deep', 'wide' \(its options: depth, "
                                           r"seed, width\)$"):
        planners.plan("fake", evaluator=ev, deep=1, wide=2)


@pytest.mark.parametrize("method", planners.names())
def test_every_registered_planner_rejects_an_unknown_option(ev, method):
    planner = planners.get(method)
    takes = sorted(planner.options | planner.own_options)
    listing = f"its options: {', '.join(takes)}" if takes else "it takes no options"
    with pytest.raises(HeterogError) as info:
        planners.plan(method, evaluator=ev, budget_s=1.0, no_such_option=1)
    assert str(info.value) == f"planner {method!r} takes no option 'no_such_option' ({listing})"


def test_a_parameter_named_after_an_undeclared_shared_option_is_refused():
    def plan(evaluator, workers: int = 1):
        return None

    with pytest.raises(ValueError, match=r"parameters \['workers'\] are shared options"):
        planners.Planner("threads", plan)
    assert planners.Planner.of("threads", plan).options == {"workers"}


def test_best_dp_is_the_fastest_dp_baseline(ev):
    s = planners.plan("best-dp", evaluator=ev)
    times = {n: ev.iteration_time(baselines.run(n, ev.graph, ev.cluster, evaluator=ev))[0]
             for n in planners.BEST_DP_CANDIDATES}
    assert s.method == min(times, key=times.get) and s.meta["chosen_from"] == list(planners.BEST_DP_CANDIDATES)


def test_plugin_entry_points_load_on_first_use(ev, monkeypatch):
    good = EntryPoint("cp-again", "tests.test_planners:CP_AGAIN", planners.ENTRY_POINT_GROUP)
    missing = EntryPoint("ghost", "no_such_package.planner:PLANNER", planners.ENTRY_POINT_GROUP)
    wrong = EntryPoint("wrong", "tests.test_planners:CP_AGAIN", planners.ENTRY_POINT_GROUP)
    monkeypatch.setattr(planners, "_plugins", lambda: {ep.name: ep for ep in (good, missing, wrong)})
    assert planners.names()[-3:] == ["cp-again", "ghost", "wrong"]
    s = planners.plan("cp-again", evaluator=ev, seed=1)
    assert s.method == "cp-ar" and s.configs == baselines.run("cp-ar", ev.graph, ev.cluster, evaluator=ev).configs
    with pytest.raises(HeterogError, match=r"ghost planner not available \(no_such_package.planner:PLANNER"):
        planners.get("ghost")
    with pytest.raises(HeterogError, match="is not a Planner named 'wrong'"):
        planners.get("wrong")


def test_a_planner_declares_known_options_only():
    with pytest.raises(ValueError, match="unknown options \\['temperature'\\]"):
        planners.Planner("x", lambda ev: None, frozenset({"temperature"}))


CP_AGAIN = planners.Planner(
    "cp-again", lambda ev, **_: baselines.run("cp-ar", ev.graph, ev.cluster, evaluator=ev), frozenset({"seed"}))
