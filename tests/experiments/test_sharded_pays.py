"""experiments.sharded_pays: each planner with and without sharded state, and the bound on its plan."""
from __future__ import annotations

import json

import pytest

from experiments.sharded_pays import best_of_planners, main


def test_rows_compare_each_planner_with_and_without_sharded_state(capsys):
    assert main(["--graphs", "tiny_mlp:8", "--cluster", "local-cpu-3", "--planners", "mcmc,pipeline",
                 "--budget-s", "0.5", "--max-evals", "30", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["graph"], r["cluster"], r["planner"]) for r in rows] == [("tiny_mlp-b8", "local-cpu-3", "mcmc"),
                                                                      ("tiny_mlp-b8", "local-cpu-3", "pipeline")]
    for r in rows:
        assert r["without"]["sharded_groups"] == 0 and r["without"]["stages"] == []
        assert r["ratio"] == pytest.approx(r["without"]["iteration_time_s"] / r["with"]["iteration_time_s"])
        assert set(r["bound"]) <= {"1", "2", "3", "1+offload", "2+offload", "3+offload"}
    best = best_of_planners(rows)
    assert len(best) == 1
    fastest = {side: min((r[side]["iteration_time_s"], r["planner"]) for r in rows if not r[side]["oom"])
               for side in ("without", "with")}
    assert best[0]["without"] == (fastest["without"][1], fastest["without"][0])
    assert best[0]["ratio"] == pytest.approx(fastest["without"][0] / fastest["with"][0])
    assert main(["--graphs", "tiny_mlp:8", "--cluster", "local-cpu-3", "--planners", "mcmc", "--max-evals", "10"]) == 0
    out = capsys.readouterr().out
    assert "| tiny_mlp-b8 | local-cpu-3 | mcmc |" in out and "tiny_mlp-b8 on local-cpu-3: best without" in out
