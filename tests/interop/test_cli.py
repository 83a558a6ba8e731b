"""``heterog import-plan`` end to end: a Sailor plan file to a strategy file and its simulated time, and a bad
plan as exit status 2 with a one-line message."""
from __future__ import annotations

import json

from heterog.cli import main
from heterog.strategy import Strategy
from tests.interop.conftest import A100_YAML
from tests.interop.test_sailor import plan_pp2_dp2_tp2


def test_import_plan_command(tmp_path, capsys, opt_graph):
    graph = opt_graph.save(tmp_path / "opt.json.gz")
    cluster = tmp_path / "a100.yaml"
    cluster.write_text(A100_YAML)
    plan = tmp_path / "plan_config.json"
    plan.write_text(json.dumps(plan_pp2_dp2_tp2()))
    out = tmp_path / "s.json"
    argv = ["import-plan", str(plan), "--format", "sailor", "--graph", str(graph), "--cluster", str(cluster),
            "-o", str(out), "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["n_groups"] == 2 and doc["micro_batches"] == [4, 4] and doc["plan_real"] == 0.5
    assert doc["stages"][0] == {"devices": [0, 1, 2, 3], "shares": [4, 4, 4, 4], "grid": 2, "split": "tensor"}
    assert doc["iteration_time_s"] > 0 and doc["oom"] is False
    saved = Strategy.load(out)
    assert saved.method == "import-sailor" and saved.n_micro == 2 and [c.grid for c in saved.configs] == [2, 2]
    bad = plan_pp2_dp2_tp2()
    bad["gbs"] = 10
    plan.write_text(json.dumps(bad))
    assert main(argv[:-1]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gbs 10 is not divisible by mbs 2 x dp 2" in err
