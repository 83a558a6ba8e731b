"""Task order on real graphs: the four DP baselines of vgg19, inception_v3 and transformer on paper-8gpu.

Measured (docs/results.md): HeteroG's upward rank on every resource loses to FIFO by ~2% on average
(it starves weight gradients that feed the shared links), wins by 11% on inception under PS;
upward rank bounded by the work queued on each resource (``rank-contention``) and rank on links with
readiness on GPUs (``rank-links``) beat FIFO on average.
"""
from __future__ import annotations

import numpy as np
import pytest

from heterog import baselines
from heterog.bench import ORDER_MODELS
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


@pytest.fixture(scope="module")
def order_times() -> dict:
    cluster = load_cluster("paper-8gpu")
    out = {}
    for model, batch in ORDER_MODELS:
        ev = Evaluator(capture_model(model, batch), cluster)
        for method in ("ev-ps", "ev-ar", "cp-ps", "cp-ar"):
            plan = ev.compile(baselines.run(method, ev.graph, cluster, evaluator=ev))
            out[model, method] = {o: ev.simulate_plan(plan, o).makespan
                                  for o in ("rank", "fifo", "rank-links", "rank-contention")}
    return out


@pytest.mark.parametrize("order", ["rank-contention", "rank-links"])
def test_resource_aware_rank_beats_fifo_on_average(order_times, order):
    ratios = [t["fifo"] / t[order] for t in order_times.values()]
    assert np.mean(ratios) > 1.01
    assert min(ratios) > 0.99                      # never materially worse than FIFO


def test_contention_bound_repairs_what_plain_rank_loses(order_times):
    plain = [t["fifo"] / t["rank"] for t in order_times.values()]
    lifted = [t["fifo"] / t["rank-contention"] for t in order_times.values()]
    assert np.mean(plain) < 1.0 < np.mean(lifted)
    assert all(b >= a - 1e-3 for a, b in zip(plain, lifted))     # the bound never costs more than 0.1%


def test_rank_orders_parameter_server_traffic_better_than_fifo(order_times):
    for method in ("ev-ps", "cp-ps"):
        t = order_times["inception_v3", method]
        assert t["fifo"] / t["rank"] > 1.05
