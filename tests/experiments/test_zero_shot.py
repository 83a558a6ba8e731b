"""experiments.zero_shot: the shipped checkpoint's zero-shot plans against the DP baselines."""
from __future__ import annotations

import json

from experiments.zero_shot import main


def test_zero_shot_table_and_json(capsys):
    assert main(["--graphs", "tiny_mlp:16", "--clusters", "paper-8gpu,local-cpu-3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["graph"], r["cluster"], r["devices"]) for r in rows] == [("tiny_mlp-b16", "paper-8gpu", 8),
                                                                      ("tiny_mlp-b16", "local-cpu-3", 3)]
    for r in rows:            # never slower than the policy's own plan or the best DP plan, nothing OOM
        assert r["iteration_time_s"] <= min(r["policy_plan_s"], r["best_dp_s"]) + 1e-12 and not r["oom"]
        assert r["kept"] in ("policy", "ev-ps", "ev-ar", "cp-ps", "cp-ar")
    assert main(["--graphs", "tiny_mlp:16", "--clusters", "paper-8gpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| graph | cluster | devices | policy's plan | kept | best DP |"
    assert out[2].startswith("| tiny_mlp-b16 | paper-8gpu | 8 | ")
    assert main(["--graphs", "tiny_mlp:16", "--clusters", "no-such-cluster"]) == 2
    assert "no-such-cluster" in capsys.readouterr().err
