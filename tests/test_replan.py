"""Re-planning within a budget (``heterog.replan``): ``auto`` runs the planners in order while budget is left
and keeps the plans best first; one planner, or the agent's zero-shot plan, on request; plans that cannot
run are left out; an unknown method or a budget of nothing is refused."""
from __future__ import annotations

import pytest

from heterog.cluster import load_cluster
from heterog.cluster.topology import subset
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.replan import AUTO_PLANNERS, FAST_PLANNERS, replan


@pytest.fixture(scope="module")
def graph():
    return capture_model("tiny_mlp", 8, "sgd")


@pytest.fixture(scope="module")
def left():
    """paper-8gpu less its two V100s: one server removed."""
    c = load_cluster("paper-8gpu")
    return subset(c, [d.name for d in c.devices if not d.type.name.startswith("V100")])


def test_auto_keeps_the_best_plan_of_the_planners_in_the_budget(graph, left) -> None:
    r = replan(graph, left, "auto", 3.0)
    tried = [e["method"] for e in r.tried]
    assert tried == [m for m in AUTO_PLANNERS if m in tried] and tried[:len(FAST_PLANNERS)] == list(FAST_PLANNERS)
    ev = Evaluator(graph, left)
    times = [ev.iteration_time(s) for s in r.candidates]
    assert times == sorted(times, key=lambda t: (t[1], t[0]))               # (OOM, time): best first
    assert r.best.method == r.record()["chosen"] and len(r.candidates) == len([e for e in r.tried if "oom" in e])
    best = min((e for e in r.tried if "oom" in e), key=lambda e: (e["oom"], e["iteration_time_s"]))
    assert times[0][0] == pytest.approx(best["iteration_time_s"])


def test_with_almost_no_budget_auto_stops_after_the_first_planner(graph, left) -> None:
    r = replan(graph, left, "auto", 1e-9)
    assert [e["method"] for e in r.tried] == [FAST_PLANNERS[0]] and r.best.method == FAST_PLANNERS[0]


def test_one_planner_or_the_policys_zero_shot_plan(graph, left) -> None:
    assert replan(graph, left, "cp-ar", 5.0).best.method == "cp-ar"
    r = replan(graph, left, "agent", 5.0)
    assert r.best.method == "agent" and r.tried[0]["method"] == "agent"


def test_plans_that_cannot_run_are_left_out(graph, left) -> None:
    # the first fast planner always runs (the others start while the budget lasts: on a loaded machine the
    # later ones may not)
    first = FAST_PLANNERS[0]
    r = replan(graph, left, "auto", 1.0, runs=lambda s: None if s.method == first else "not here")
    assert [s.method for s in r.candidates] == [first]
    assert all(e.get("refused") == "not here" for e in r.tried if e["method"] != first)
    with pytest.raises(HeterogError, match=r"found no plan that runs within 1 s \(cp-ar: no\)"):
        replan(graph, left, "cp-ar", 1.0, runs=lambda s: "no")


def test_an_unknown_method_or_no_budget_is_refused(graph, left) -> None:
    with pytest.raises(HeterogError, match="unknown method 'fastest'"):
        replan(graph, left, "fastest", 1.0)
    with pytest.raises(HeterogError, match="budget must be positive"):
        replan(graph, left, "auto", 0.0)


def test_auto_runs_the_policy_when_its_measured_time_fits(graph, left, monkeypatch) -> None:
    import heterog.replan as rp

    monkeypatch.setattr(rp, "ZERO_SHOT_SECONDS", {})
    assert rp.warm_up("cp-ar", graph, left) is None and not rp.ZERO_SHOT_SECONDS     # no agent needed
    assert rp.warm_up("auto", graph, left) == rp.ZERO_SHOT_SECONDS[graph.fingerprint] > 0
    rp.ZERO_SHOT_SECONDS[graph.fingerprint] = 0.0                  # as if it took no time: it fits any budget
    assert "agent" in [e["method"] for e in replan(graph, left, "auto", 0.5).tried]
    rp.ZERO_SHOT_SECONDS[graph.fingerprint] = 1e9                  # a zero-shot plan slower than the budget
    assert "agent" not in [e["method"] for e in replan(graph, left, "auto", 1.0).tried]


def test_the_fast_planners_after_the_first_stop_at_their_share_of_the_budget(graph, left, monkeypatch) -> None:
    import time

    import heterog.planners as planners
    import heterog.replan as rp

    monkeypatch.setattr(rp, "ZERO_SHOT_SECONDS", {})
    plan = planners.plan

    def slow_cp_ar(name, *args, **kwargs):
        if name == "cp-ar":                     # as an evaluation of hundreds of GPUs: longer than the share
            time.sleep(rp.FAST_SHARE * 1.0 + 0.05)
        return plan(name, *args, **kwargs)

    monkeypatch.setattr(planners, "plan", slow_cp_ar)
    tried = [e["method"] for e in replan(graph, left, "auto", 1.0).tried]
    assert tried[:2] == ["ev-ar", "cp-ar"] and not set(tried) & set(FAST_PLANNERS[2:])


def test_pipeline_takes_what_is_left_where_mcmc_could_not_start_after_it(graph, left, monkeypatch) -> None:
    import heterog.planners as planners
    import heterog.replan as rp

    monkeypatch.setattr(rp, "ZERO_SHOT_SECONDS", {})
    plan, budgets = planners.plan, {}

    def recording(name, *args, **kwargs):
        budgets[name] = kwargs.get("budget_s")
        return plan(name, *args, **kwargs)

    monkeypatch.setattr(planners, "plan", recording)
    monkeypatch.setattr(rp, "MCMC_TAIL_EVALS", 10**9)          # as if one evaluation took seconds
    replan(graph, left, "auto", 10.0)
    assert "mcmc" not in budgets and budgets["pipeline"] > rp.PIPELINE_SHARE * 10.0   # its share would be less
