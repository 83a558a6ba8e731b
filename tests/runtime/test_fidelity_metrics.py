"""Fidelity metrics and plan choice (no processes)."""
from __future__ import annotations

import pytest

from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.runtime.fidelity import PlanPair, candidate_plans, kendall_tau, mape, memory_mape
from tests.runtime.conftest import model


def test_mape_and_kendall_tau_on_hand_computed_pairs() -> None:
    pairs = [PlanPair("a", 1.0, 1.1), PlanPair("b", 2.0, 1.8), PlanPair("c", 4.0, 4.0)]
    assert mape(pairs) == pytest.approx(100 * (0.1 + 0.1 + 0.0) / 3)
    assert kendall_tau(pairs) == pytest.approx(1.0)
    swapped = [PlanPair("a", 1.0, 2.0), PlanPair("b", 2.0, 1.0), PlanPair("c", 4.0, 4.0)]
    assert kendall_tau(swapped) == pytest.approx(1 / 3)


def test_per_round_pairs_take_the_median_of_paired_errors() -> None:
    # the machine got twice as slow in round 1: plan and profile both moved, the paired errors did not
    p = PlanPair("a", 2.0, 2.2, measured_all_s=[1.0, 2.0, 1.0], simulated_all_s=[1.1, 4.4, 0.9])
    assert p.error == pytest.approx(0.1)                 # median of +10%, +120%, -10%
    assert p.record()["simulated_all_s"] == [1.1, 4.4, 0.9]
    assert PlanPair("b", 2.0, 2.5, measured_all_s=[2.0, 2.0]).error == pytest.approx(0.25)   # unpaired
    assert mape([p, PlanPair("c", 1.0, 0.8)]) == pytest.approx(100 * (0.1 + 0.2) / 2)


def test_peak_memory_errors_per_device_and_their_mape() -> None:
    a = PlanPair("a", 1.0, 1.0, measured_peak_memory_bytes={"cpu0": 1000, "cpu1": 0},
                 simulated_peak_memory_bytes={"cpu0": 1100, "cpu1": 0})
    b = PlanPair("b", 1.0, 1.0, measured_peak_memory_bytes={"cpu0": 400, "cpu1": 500},
                 simulated_peak_memory_bytes={"cpu0": 300, "cpu1": 500})
    assert a.memory_errors() == pytest.approx({"cpu0": 0.1})          # an empty device has no error
    rec = b.record()
    assert rec["peak_memory_error"] == pytest.approx({"cpu0": -0.25, "cpu1": 0.0})
    assert rec["measured_peak_memory_bytes"] == {"cpu0": 400, "cpu1": 500}
    assert rec["simulated_peak_memory_bytes"] == {"cpu0": 300, "cpu1": 500}
    assert memory_mape([a, b]) == pytest.approx(100 * (0.1 + 0.25 + 0.0) / 3)
    assert memory_mape([PlanPair("c", 1.0, 1.0)]) != memory_mape([PlanPair("c", 1.0, 1.0)])   # NaN: no numbers


def test_candidate_plans_are_distinct_and_include_the_baselines() -> None:
    m = model("tiny_mlp")
    ev = Evaluator(m.graph, load_cluster("local-cpu-2"))
    plans = candidate_plans(ev, 8)
    names = [s.method for s in plans]
    assert len(plans) == 8 and names[:4] == ["single", "ev-ps", "ev-ar", "mp-split"]
    assert "cp-ps" not in names           # equal devices: the same plan as ev-ps, left out
    layouts = {tuple((c.devices, c.shares, c.sync) for c in (s.configs[g] for g in s.group_of)) for s in plans}
    assert len(layouts) == 8
