"""The compare/plan commands and the hydra app: files, JSON fields, tables, one-line errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from heterog.cli import main
from heterog.compare import action_breakdown, compare, config_action, table1_markdown
from heterog.strategy import ParallelConfig
from tests.baselines.helpers import gpu_cluster, layered_graph

RECORD_FIELDS = {"method", "iteration_time_s", "oom", "peak_memory_bytes", "compute_time_s", "comm_time_s",
                 "search_time_s"}


@pytest.fixture()
def graph_file(tmp_path) -> Path:
    return layered_graph(3, 4096).save(tmp_path / "g.json")


def test_compare_cli_smoke(graph_file, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["compare", "--graph", str(graph_file), "--cluster", "paper-8gpu", "--methods",
               "single,ev-ar,cp-ar,dpos,mcmc", "--budget-s", "1", "--json", "--out", str(out)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in doc["records"]] == ["single", "ev-ar", "cp-ar", "dpos", "mcmc"]
    for rec in doc["records"]:
        assert RECORD_FIELDS <= set(rec)
        assert len(rec["peak_memory_bytes"]) == 8 and rec["iteration_time_s"] > 0
    assert doc["records"][-1]["stats"]["evals_per_s"] > 0
    for name in ("comparison.json", "comparison.csv", "report.md", "best_gantt.png", "best_trace.json",
                 "best_strategy.json"):
        assert (out / name).stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "Table 1" in report and "speed-up vs CP-AR" in report and "Table 2" in report
    assert (out / "comparison.csv").read_text().count("\n") == 6


def test_compare_errors_are_one_line(graph_file, capsys):
    assert main(["compare", "--graph", str(graph_file), "--cluster", "paper-8gpu", "--methods", "dpos,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown method 'nope'" in err
    assert main(["compare", "--graph", str(graph_file), "--cluster", "no-such-cluster", "--methods", "single"]) == 2
    assert "no-such-cluster" in capsys.readouterr().err


def test_agent_method_without_the_agents_package(graph_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "agents.planner", None)     # import fails with ModuleNotFoundError
    assert main(["compare", "--graph", str(graph_file), "--cluster", "paper-8gpu", "--methods", "single,agent"]) == 2
    assert "agent planner not available" in capsys.readouterr().err


def test_plan_writes_the_strategy_of_a_method(graph_file, tmp_path, capsys):
    from heterog.strategy import Strategy

    out = tmp_path / "s.json"
    assert main(["plan", "--graph", str(graph_file), "--cluster", "paper-8gpu", "--method", "dpos", "-o", str(out),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    st = Strategy.load(out)
    assert st.method == "dpos" and doc["n_groups"] == st.n_groups and st.priorities is not None
    assert main(["plan", "--graph", str(graph_file), "--cluster", "paper-8gpu", "--method", "cp-ar",
                 "--episodes", "3", "-o", str(out)]) == 2


def test_tables_and_action_breakdown():
    graph = layered_graph(3, 4096, batch=16)
    cluster = gpu_cluster(4)
    comp = compare(graph, cluster, ["ev-ps", "cp-ar", "single"], budget_s=1, progress=False)
    single = comp.results[2]
    assert action_breakdown(single.strategy, graph, cluster)["mp:0"] == 1.0
    assert comp.results[1].record["action_breakdown"]["dp-prop-ar"] == 1.0
    t_ps, t_single = comp.results[0].result.iteration_time_s, single.result.iteration_time_s
    assert f"{(t_ps / t_single - 1) * 100:+.1f}%" in table1_markdown(comp).splitlines()[-1]
    assert config_action(ParallelConfig.of([(0, 8), (2, 8)]), cluster, 16) == "dp-other"
    assert config_action(ParallelConfig.of([(d, 4) for d in range(4)], sync="ps"), cluster, 16) == "dp-even-ps"


def test_hydra_app_composes_and_runs(tmp_path):
    from hydra import compose, initialize_config_dir

    from experiments.compare import run

    conf = Path(__file__).resolve().parents[2] / "experiments" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("compare", overrides=["graph=tiny_mlp", "cluster=local-cpu-2", "methods=[single,cp-ar,dpos]",
                                            "budget_s=1", f"out_dir={tmp_path}"])
    assert cfg.graph.model == "tiny_mlp" and cfg.cluster.name == "local-cpu-2"
    paths = run(cfg)
    doc = json.loads(Path(paths["json"]).read_text())
    assert [r["method"] for r in doc["records"]] == ["single", "cp-ar", "dpos"]
    assert np.isfinite([r["iteration_time_s"] for r in doc["records"]]).all()
