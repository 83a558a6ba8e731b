"""experiments.splits: planners with and without splits, proportional against even shares, split plans run
for real."""
from __future__ import annotations

import json

import pytest

from experiments.splits import main


def test_planner_rows_compare_the_same_planner_with_and_without_splits(capsys):
    assert main(["planners", "--graphs", "tiny_mlp:8", "--cluster", "local-cpu-3", "--planners", "mcmc,pipeline",
                 "--budget-s", "0.5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["graph"], r["cluster"], r["planner"]) for r in rows] == [("tiny_mlp-b8", "local-cpu-3", "mcmc"),
                                                                      ("tiny_mlp-b8", "local-cpu-3", "pipeline")]
    for r in rows:
        assert r["without"]["split_share"] == 0.0 and 0.0 <= r["with"]["split_share"] <= 1.0
        assert r["speedup"] == pytest.approx(r["without"]["iteration_time_s"] / r["with"]["iteration_time_s"])


def test_uneven_rows_divide_every_group_both_ways(capsys):
    assert main(["uneven", "--graphs", "tiny_mlp:8", "--cluster", "local-cpu-3:slowdown=1,2,4", "--devices", "0,2",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["devices"] == [0, 2] and set(row["iteration_time_s"]) == {
        "even/parameter", "even/attribute", "proportional/parameter", "proportional/attribute"}
    t = row["iteration_time_s"]
    assert row["speedup"]["parameter"] == pytest.approx(t["even/parameter"] / t["proportional/parameter"])
    assert main(["uneven", "--graphs", "tiny_mlp:8", "--cluster", "no-such-cluster"]) == 2
    assert "no-such-cluster" in capsys.readouterr().err


def test_runtime_rows_run_split_plans_exactly(capsys):
    assert main(["runtime", "--graphs", "tiny_mlp:6", "--cluster", "local-cpu-2:slowdown=1,3", "--steps", "2",
                 "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| graph | cluster | plan | simulated | measured | messages | equivalent |"
    plans = [line.split(" | ")[2] for line in lines[2:]]
    assert plans == ["ev-ar", "cp-ar", "even/parameter", "even/attribute", "proportional/parameter",
                     "proportional/attribute"]
    assert all(line.endswith("| True |") for line in lines[2:])
