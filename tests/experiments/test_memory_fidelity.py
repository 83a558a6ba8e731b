"""The memory-fidelity sweep: plans without a parameter server metered in one process, a bad model refused."""
from __future__ import annotations

import json

import pytest

from experiments import memory_fidelity


def test_metered_rows_are_each_ranks_metered_peak_beside_the_simulated_one(capsys) -> None:
    from heterog.cluster import load_cluster
    from heterog.runtime import load_model, prepare
    from heterog.runtime.check import metered_dry_run

    rc = memory_fidelity.main(["--models", "tiny_mlp:6", "--plans", "single,ev-ar", "--clusters", "local-cpu-2",
                               "--metered", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["plan"], r["measured_by"]) for r in rows] == [("single", "metered"), ("ev-ar", "metered"),
                                                             ("ev-ar", "metered")]
    m = load_model("tiny_mlp", 6, optimizer="adam")
    cluster = load_cluster(f"local-cpu-2:host={memory_fidelity.HOST}")
    prepared = prepare(m, cluster, memory_fidelity.strategy_of("ev-ar", m, cluster))
    want = [peak for peak, _ in metered_dry_run(prepared)]
    assert [r["measured_bytes"] for r in rows[1:]] == want
    for r in rows:
        assert r["error"] == pytest.approx((r["simulated_bytes"] - r["measured_bytes"]) / r["measured_bytes"])
        assert abs(r["error"]) < 0.01          # one device and data parallel: the same values for the same spans


def test_a_bad_model_spec_is_one_line_and_exit_2(capsys) -> None:
    assert memory_fidelity.main(["--models", "tiny_mlp", "--metered"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be MODEL:BATCH" in err[0]
