"""experiments.tables: one tiny case end to end, and the rendered rows."""
from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.tables import DP, render, run_case, sync_shares
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


def test_sync_shares_count_compute_ops_by_synchronisation():
    graph = capture_model("tiny_mlp", 16)
    ev = Evaluator(graph, load_cluster("paper-8gpu"))
    actions = np.zeros(ev.n_groups, dtype=np.int64)
    actions[: ev.n_groups // 2] = ev.cluster.n_devices       # action M: DP-even-PS, on the first half of the groups
    s = ev.strategy(actions)
    shares = sync_shares(s, graph)
    assert sum(shares.values()) == pytest.approx(1.0)
    compute = np.nonzero(graph.is_compute)[0]
    on_ps = np.isin(s.group_of[compute], np.arange(ev.n_groups // 2))
    assert shares["ps"] == pytest.approx(on_ps.mean())
    assert shares["ar"] == 0.0


def test_a_case_is_saved_and_rendered(tmp_path):
    path = tmp_path / "tiny_mlp-b16-paper-8gpu.json"
    run_case("tiny_mlp", 16, "paper-8gpu", 0.5, 0, str(path))
    doc = json.loads(path.read_text())
    methods = [r["method"] for r in doc["records"]]
    assert set(DP) <= set(methods) and "agent" in methods and "mcmc" in methods
    assert set(doc["dp_other_orders_s"]) == set(DP)
    assert all(r["order_requested"] == "best" for r in doc["records"])
    text = render(tmp_path)
    assert text.count("| tiny_mlp-b16 |") == 3                # times, best vs DP, shares
