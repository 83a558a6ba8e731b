"""experiments.planner_table: the options each column plans with, one tiny case end to end, and the verdicts
and counts of hand-made cases."""
from __future__ import annotations

import json

import pytest

from experiments.planner_table import (
    AGENT,
    PLANNERS,
    ZERO_SHOT,
    action_round_trip,
    main,
    planner_options,
    run_case,
    tables,
    verdict,
)
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.planners import plan
from heterog.strategy import ParallelConfig, Strategy


def test_each_planner_gets_the_whole_plan_space_it_takes():
    assert planner_options("mcmc", 60, 3) == ("mcmc", {"splits": True, "sharded": True, "budget_s": 60.0, "seed": 3})
    assert planner_options("pipeline", 60, 3) == ("pipeline", {"splits": True, "sharded": True, "budget_s": 60.0})
    assert planner_options("os-dpos", 9, 0) == ("os-dpos", {"splits": True, "budget_s": 9.0})
    assert planner_options("cp-ar", 60, 0) == ("cp-ar", {})
    assert planner_options("agent-0s", 60, 1) == ("agent", {"splits": True, "sharded": True, "budget_s": 0.0,
                                                           "seed": 1, "progress": False})
    # a checkpoint to compare goes to the agent's two columns only
    assert planner_options("agent-0s", 60, 1, "c.pt")[1]["checkpoint"] == "c.pt"
    assert planner_options("agent", 60, 1, "c.pt")[1]["checkpoint"] == "c.pt"
    assert planner_options("mcmc", 60, 3, "c.pt") == planner_options("mcmc", 60, 3)


def _case(times: dict[str, float | None], cluster: str = "paper-8gpu") -> dict:
    records = [{"planner": p, "error": "HeterogError: no plan"} if t is None else
               {"planner": p, "iteration_time_s": abs(t), "oom": t < 0} for p, t in times.items()]
    return {"graph": "m", "batch_size": 8, "cluster": cluster, "records": records}


def test_the_verdicts_of_hand_made_cases():
    # the agent ahead of every other planner by 2.5%; zero-shot 5% behind the fastest, ahead of the best DP
    # that fits (ev-ps runs out of memory: negative time)
    v = verdict(_case({"ev-ps": -0.5, "cp-ar": 1.2, "mcmc": 1.025, "agent": 1.0, "agent-0s": 1.05}))
    assert (v["fastest"], v["agent_fastest"], v["agent_ahead"]) == ("agent", True, True)
    assert v["zero_over_fastest"] == pytest.approx(1.05) and v["zero_within"]
    assert v["zero_over_best_dp"] == pytest.approx(1.05 / 1.2) and v["zero_not_slower_than_dp"]
    assert v["agent_over_others"] == pytest.approx(1 / 1.025)
    # within 0.5% of the fastest counts as fastest, not as ahead; zero-shot behind the best DP and 20% behind
    v = verdict(_case({"cp-ar": 1.1, "pipeline": 1.0, "agent": 1.004, "agent-0s": 1.2}))
    assert (v["fastest"], v["agent_fastest"], v["agent_ahead"]) == ("pipeline", True, False)
    assert not v["zero_within"] and not v["zero_not_slower_than_dp"]
    v = verdict(_case({"cp-ar": 1.1, "pipeline": 1.0, "agent": 1.006, "agent-0s": None}))
    assert not v["agent_fastest"] and "zero_within" not in v
    text = tables([_case({"cp-ar": 1.1, "agent": 1.0}), _case({"cp-ar": 1.0, "agent": None}, "mixed")],
                  ["cp-ar", "agent"])
    assert "| m:8 | 1100.0 | 1000.0 | agent | 0.909 | - | - | - |" in text
    assert "| m:8 | 1000.0 | error | cp-ar | - | - | - | - |" in text
    assert "the agent fastest (within 0.5%) in 1 of 1 (1 without the plan)" in text


def test_a_tiny_case_is_planned_saved_and_rendered(tmp_path, capsys):
    path = tmp_path / "tiny_mlp-b16-paper-8gpu.json"
    run_case("tiny_mlp", 16, "paper-8gpu", ["cp-ar", "mcmc", "agent-0s"], 0.5, 0, str(path))
    doc = json.loads(path.read_text())
    assert [r["planner"] for r in doc["records"]] == ["cp-ar", "mcmc", "agent-0s"]
    mcmc = doc["records"][1]
    assert mcmc["method"] == "mcmc" and mcmc["iteration_time_s"] <= doc["records"][0]["iteration_time_s"]
    assert [r["actions"] for r in doc["records"]] == ["ok"] * 3
    plan = Strategy.from_dict(mcmc["strategy"])
    assert Evaluator(capture_model("tiny_mlp", 16), load_cluster("paper-8gpu")).evaluate(plan).iteration_time_s == \
        pytest.approx(mcmc["iteration_time_s"], rel=1e-9)
    assert main(["--out", str(tmp_path), "--render", "--planners", "cp-ar,mcmc,agent-0s"]) == 0
    text = capsys.readouterr().out
    assert "| tiny_mlp:16 |" in text and "The agent's plan actions hold 3 of the 3 plans." in text
    assert main(["--out", str(tmp_path), "--planners", "nope"]) == 2
    # planned again: the named planner only, the document saved with it in place of the old record
    before = path.stat().st_mtime_ns
    run_case("tiny_mlp", 16, "paper-8gpu", ["cp-ar", "mcmc", "agent-0s"], 0.5, 0, str(path))
    assert path.stat().st_mtime_ns == before                                 # nothing missing: not rewritten
    run_case("tiny_mlp", 16, "paper-8gpu", ["cp-ar", "mcmc", "agent-0s"], 0.5, 0, str(path), rerun=("cp-ar",))
    again = json.loads(path.read_text())
    assert sorted(r["planner"] for r in again["records"]) == ["agent-0s", "cp-ar", "mcmc"]
    assert again["records"][:2] == doc["records"][1:]


def test_the_agents_seed_cells():
    from experiments.planner_table import _seed_cells

    assert _seed_cells(None) == ("-", "-")
    rec = {"stats": {"best_seed": "pipeline", "best_seed_s": 0.4567, "agent_added": 0.0213}}
    assert _seed_cells(rec) == ("pipeline 456.7", "+2.1%")


def test_a_plan_no_action_holds_says_why():
    ev = Evaluator(capture_model("tiny_mlp", 16), load_cluster("paper-8gpu"))
    base = ev.strategy([ev.cluster.n_devices + 3] * ev.n_groups)
    assert action_round_trip(ev, base) == "ok"
    ring = ParallelConfig.of([(0, 8), (1, 8)], allreduce="ring")            # no planner picks the algorithm
    odd = Strategy(base.graph_fingerprint, base.cluster_name, base.n_devices, base.batch_size, base.group_of,
                   [ring] * base.n_groups)
    assert "is no action's decoding" in action_round_trip(ev, odd)


@pytest.mark.parametrize("name", [p for p in PLANNERS if p not in (AGENT, ZERO_SHOT)])
def test_every_planners_plan_is_held_by_the_agents_actions_on_coarse_groups(name):
    # 12 groups for the transformer's ops: each group spans several of the layers, coarse nodes and
    # placement units the planners cut at, which must not split it
    ev = Evaluator(capture_model("tiny_transformer", 8), load_cluster("paper-8gpu"), max_groups=12)
    method, opts = planner_options(name, 1.0, 0)
    strategy = plan(method, evaluator=ev, **opts)
    assert action_round_trip(ev, strategy) == "ok"
