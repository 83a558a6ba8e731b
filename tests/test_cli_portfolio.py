"""``heterog plan`` without ``--method``: the portfolio of planners within the budget, the fastest plan that fits
returned, the planner it came from named, every candidate's time listed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from heterog.cli import main
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph import load_graph
from heterog.strategy import Strategy
from tests.baselines.helpers import layered_graph


@pytest.fixture(autouse=True)
def no_measured_zero_shot(monkeypatch):
    """Each test starts with no zero-shot time measured (``heterog.replan`` keeps them per process)."""
    import heterog.replan as rp

    monkeypatch.setattr(rp, "ZERO_SHOT_SECONDS", {})


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def fitting(tried: list[dict]) -> list[dict]:
    return [e for e in tried if "oom" in e and not e["oom"] and "refused" not in e]


def test_plan_without_a_method_returns_the_fastest_candidate_that_fits(capsys, tmp_path):
    out = tmp_path / "s.json"
    doc = plan_json(capsys, "--graph", "tiny_mlp", "--batch-size", "16", "--cluster", "local-cpu-2",
                    "--budget-s", "3", "-o", str(out))
    tried = doc["tried"]
    assert doc["method"] == "auto" and doc["budget_s"] == 3.0 and [e["method"] for e in tried][:6] == \
        ["ev-ar", "cp-ar", "ev-ps", "cp-ps", "single", "expert"]
    best = min(fitting(tried), key=lambda e: e["iteration_time_s"])
    assert doc["iteration_time_s"] == pytest.approx(best["iteration_time_s"], rel=1e-12) and not doc["oom"]
    chosen = [e for e in fitting(tried) if e["method"] == doc["chosen"]]
    assert chosen and chosen[0]["iteration_time_s"] == best["iteration_time_s"]
    # the file holds the chosen planner's plan, and it simulates to the time reported
    strategy = Strategy.load(out)
    assert strategy.method == doc["chosen"] and set(strategy.meta["chosen_from"]) == {e["method"] for e in tried
                                                                                       if "oom" in e}
    from heterog.graph.cache import capture_model

    ev = Evaluator(capture_model("tiny_mlp", 16), load_cluster("local-cpu-2"))
    assert ev.iteration_time(strategy)[0] == pytest.approx(doc["iteration_time_s"], rel=1e-12)


def test_plan_text_names_the_chosen_planner_under_the_candidates_table(capsys, tmp_path):
    assert main(["plan", "--graph", "tiny_mlp", "--batch-size", "16", "--cluster", "local-cpu-2",
                 "--budget-s", "0.5", "-o", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split() == ["planner", "iter", "ms", "OOM", "seconds"]
    chosen = [line for line in text if line.startswith("chosen: ")]
    assert len(chosen) == 1
    name = chosen[0].split()[1]
    rows = {line.split()[0]: line.split() for line in text[2:] if line and line.split()[0] in
            ("ev-ar", "cp-ar", "ev-ps", "cp-ps", "single", "expert", "agent", "pipeline", "mcmc")}
    assert rows[name][-1] == "chosen" and {"ev-ar", "cp-ar", "ev-ps", "cp-ps", "single", "expert"} <= set(rows)
    assert min(float(r[1]) for r in rows.values() if r[2] == "no") == float(rows[name][1])


def write_small_memory_case(tmp_path: Path) -> tuple[Path, Path]:
    """Four layers of 64 MiB parameters on one fast GPU of 300 MiB and two slow ones of 16 GiB: everything on
    the fast GPU is the fastest plan and runs out of memory; every data-parallel plan does too."""
    graph = layered_graph(4, 64 << 20, batch=8, width=256).save(tmp_path / "g.json")
    fast = {"name": "F", "peak_tflops": 100, "memory_bandwidth": "2000 GB/s", "memory": "300 MiB"}
    slow = {"name": "S", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": "16 GiB"}
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump({"name": "fast-small", "servers": [{
        "name": "s0", "gpus": [fast, slow, slow], "intra": {"kind": "pcie", "bandwidth": "10 GB/s",
                                                            "latency_us": 5}}]}))
    return graph, cluster


def test_an_out_of_memory_candidate_is_not_returned_when_one_fits(capsys, tmp_path, monkeypatch):
    import heterog.replan as rp

    monkeypatch.setattr(rp, "ZERO_SHOT_SHARE", 2.0)     # no policy plan here: the choice among plans is tested
    graph, cluster = write_small_memory_case(tmp_path)
    doc = plan_json(capsys, "--graph", str(graph), "--cluster", str(cluster), "--budget-s", "3",
                    "-o", str(tmp_path / "s.json"))
    tried = doc["tried"]
    single = next(e for e in tried if e["method"] == "single")
    assert single["oom"] and single["iteration_time_s"] < doc["iteration_time_s"]     # faster, but does not fit
    assert not doc["oom"] and doc["chosen"] in {e["method"] for e in fitting(tried)}
    assert doc["iteration_time_s"] == pytest.approx(min(e["iteration_time_s"] for e in fitting(tried)), rel=1e-12)
    ev = Evaluator(load_graph(graph), load_cluster(str(cluster)))
    t, oom = ev.iteration_time(Strategy.load(tmp_path / "s.json"))
    assert not oom and t == pytest.approx(doc["iteration_time_s"], rel=1e-12)


def test_planner_options_need_a_method_and_the_agent_flags_keep_the_agent(capsys, tmp_path):
    from heterog.cli.plan import plan_method

    code = main(["plan", "--graph", "tiny_mlp", "--cluster", "local-cpu-2", "--option", "max_evals=5",
                 "-o", str(tmp_path / "s.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "name the planner with --method" in err[0]
    from heterog.cli import build_parser

    def method(*flags: str) -> str:
        return plan_method(build_parser().parse_args(["plan", "--graph", "g", "--cluster", "c", "-o", "s", *flags]))

    assert method() == "auto" and method("--method", "mcmc") == "mcmc"
    assert method("--agent", "scratch") == method("--episodes", "3") == "agent"
    assert method("--budget-s", "0") == "agent"                # the shipped policy's zero-shot plan, as before
