"""`heterog run` and `heterog fidelity`: JSON fields, equivalence check, refusals, the scatter plot."""
from __future__ import annotations

import json
import math

from heterog import baselines
from heterog.cli import main
from heterog.cluster import load_cluster
from heterog.cost import ProfileTable
from tests.runtime.conftest import model


def test_run_json_reports_time_and_equivalence(capsys) -> None:
    rc = main(["run", "--model", "tiny_mlp", "--batch-size", "6", "--cluster", "local-cpu-2:slowdown=1,2",
               "--method", "cp-ps", "--steps", "3", "--warmup", "1", "--lr", "0.1", "--check-equivalence", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["equivalent"] is True and out["max_abs_param_diff"] < 1e-5
    assert out["iteration_time_s"] > 0 and len(out["iteration_times_s"]) == 3 and out["warmup_steps"] == 1
    assert out["method"] == "cp-ps" and out["n_ps_aggregations"] > 0
    assert math.isclose(out["losses"][0], out["reference_losses"][0], rel_tol=1e-5)


def test_run_refuses_a_strategy_for_another_cluster(tmp_path, capsys) -> None:
    m = model("tiny_mlp")
    s = baselines.run("ev-ar", m.graph, load_cluster("local-cpu-3:slowdown=1,2,3"))
    path = s.save(tmp_path / "s.json")
    rc = main(["run", "--model", "tiny_mlp", "--batch-size", "6", "--cluster", "local-cpu-2", "--strategy",
               str(path), "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and "strategy is for cluster 'local-cpu-3:slowdown=1,2,3'" in err


def test_fidelity_json_pairs_and_scatter_plot(pool2, tmp_path) -> None:
    from heterog.runtime.fidelity import run_fidelity

    rep = run_fidelity("tiny_mlp", "local-cpu-2", n_plans=3, batch_size=8, steps=3, warmup=1, repeats=1,
                       profile_file=tmp_path / "p.json", plot=tmp_path / "f.png", pool=pool2)
    rec = rep.record()
    assert len(rec["pairs"]) == 3 and len({p["plan"] for p in rec["pairs"]}) == 3
    assert rec["mape"] >= 0 and -1 <= rec["kendall_tau"] <= 1 and rec["mape_of_medians"] >= 0
    assert all(len(p["simulated_all_s"]) == len(p["measured_all_s"]) == 1 for p in rec["pairs"])
    assert all(p["measured_s"] > 0 and p["simulated_s"] > 0 for p in rec["pairs"])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "p.json").is_file()
    # the same runs simulated with the ops' lines instead of their measured points
    assert len(rec["op_lines"]["simulated_s"]) == 3 and rec["op_lines"]["mape"] >= 0
    assert ProfileTable.load(tmp_path / "p.json").op_points["cpu"]
