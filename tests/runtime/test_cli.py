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
                       profile_file=tmp_path / "p.json", plot=tmp_path / "f.png", pool=pool2, breakdown=True)
    rec = rep.record()
    assert len(rec["pairs"]) == 3 and len({p["plan"] for p in rec["pairs"]}) == 3
    assert rec["mape"] >= 0 and -1 <= rec["kendall_tau"] <= 1 and rec["mape_of_medians"] >= 0
    assert all(len(p["simulated_all_s"]) == len(p["measured_all_s"]) == 1 for p in rec["pairs"])
    assert all(p["measured_s"] > 0 and p["simulated_s"] > 0 for p in rec["pairs"])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "p.json").is_file()
    # the same runs simulated with the ops' lines instead of their measured points
    assert len(rec["op_lines"]["simulated_s"]) == 3 and rec["op_lines"]["mape"] >= 0
    assert ProfileTable.load(tmp_path / "p.json").op_points["cpu"]
    # where the time goes: per plan and device, measured beside simulated
    assert [b["plan"] for b in rec["breakdown"]] == [p["plan"] for p in rec["pairs"]]
    for part in rec["breakdown"]:
        assert [d["device"] for d in part["devices"]] == load_cluster("local-cpu-2").device_names
        for d in part["devices"]:
            for side in ("measured", "simulated"):
                assert 0 <= d[side]["fed_compute_s"] <= d[side]["compute_s"] + 1e-12
    single = rec["breakdown"][0]
    assert single["plan"] == "single" and single["devices"][1]["measured"]["compute_s"] == 0.0
    assert single["devices"][0]["measured"]["compute_s"] > 0 and single["devices"][0]["measured"]["wait_s"] == 0.0


def test_simulated_breakdown_of_single_device_and_split_plans() -> None:
    from heterog.evaluate import Evaluator
    from heterog.runtime.fidelity import _split_strategy, simulated_breakdown

    m = model("tiny_mlp")
    cluster = load_cluster("local-cpu-2")
    ev = Evaluator(m.graph, cluster)
    single = baselines.run("single", m.graph, cluster, device=0)
    makespan = ev.evaluate(single).iteration_time_s
    (d0, d1), fed = simulated_breakdown(ev, single)
    # one device does everything back to back; nothing is received
    assert math.isclose(d0["compute_s"], makespan, rel_tol=1e-9) and d0["idle_s"] < 1e-12
    assert d1["compute_s"] == d1["comm_s"] == 0.0 and math.isclose(d1["idle_s"], makespan, rel_tol=1e-9)
    assert not fed and d0["fed_compute_s"] == 0.0
    # split in two: the second device's first ops read the first one's activations, and the first device's
    # backward reads the gradients coming back; both devices hold the (host-driven) transfers
    (d0, d1), fed = simulated_breakdown(ev, _split_strategy(ev, "mp-split"))
    assert {d for d, _ in fed} == {0, 1}
    assert 0 < d0["fed_compute_s"] < d0["compute_s"] and 0 < d1["fed_compute_s"] <= d1["compute_s"]
    assert d0["comm_s"] == d1["comm_s"] > 0
