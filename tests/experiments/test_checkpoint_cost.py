"""experiments.checkpoint_cost: checkpoint writes by local workers, their share of a step, re-planning times."""
from __future__ import annotations

import json
import math

import pytest

from experiments.checkpoint_cost import main, state_shapes
from heterog.graph.cache import capture_model
from heterog.replan import FAST_PLANNERS


def test_the_report_of_writes_shares_and_re_plans(capsys, tmp_path):
    assert main(["--model", "tiny_mlp", "--batch-size", "8", "--workers", "2", "--repeats", "2", "--lose", "s3",
                 "--budget-s", "0.5", "--every", "10,100", "--out", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    shapes = state_shapes(capture_model("tiny_mlp", 8, "momentum"), "momentum")
    assert len(shapes) == 2 * 6 and shapes["model.fc1.weight"] == shapes["optimizer.state.fc1.weight.momentum_buffer"]
    nbytes = 4 * sum(math.prod(s) for s in shapes.values())
    assert [w["layout"] for w in r["writes"]] == ["whole on rank 0", "divided by rows"]
    assert all(w["bytes"] == nbytes and len(w["seconds"]) == 2 for w in r["writes"])
    assert list(tmp_path.iterdir()) == []                          # the measurement's checkpoints are removed
    s = r["shares"]
    assert s["checkpoint_bytes"] == nbytes and s["every_10"]["simulated_share"] == pytest.approx(
        10 * s["every_100"]["simulated_share"])
    assert s["every_10"]["simulated_share"] == pytest.approx(s["checkpoint_s"] / 10 / s["step_s"])
    rp = r["replan"]
    assert rp["devices"] == 6 and "s3/gpu0" not in rp["cluster"]
    assert [row["method"] for row in rp["planners"]][:len(FAST_PLANNERS)] == list(FAST_PLANNERS)
    assert rp["auto"]["budget_s"] == 0.5 and rp["auto"]["chosen"] in [row["method"] for row in rp["planners"]]
    assert main(["--model", "tiny_mlp", "--lose", "nowhere"]) == 2
    assert "has no server 'nowhere' (its servers: s0, s1, s2, s3)" in capsys.readouterr().err
