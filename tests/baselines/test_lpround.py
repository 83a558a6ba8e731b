"""lp-round: a data-parallel plan read off the action-space LP."""
from __future__ import annotations

import numpy as np
import pytest

import heterog.baselines as bl
from heterog.cluster import load_cluster
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


@pytest.fixture(scope="module")
def tiny():
    g, c = capture_model("tiny_transformer", 16), load_cluster("paper-8gpu")
    return g, c, Evaluator(g, c)


def test_lp_round_is_a_data_parallel_plan_no_faster_than_its_bound(tiny):
    g, c, ev = tiny
    s = bl.run("lp-round", g, c, evaluator=ev, integral_groups=10, time_limit_s=20)
    assert s.method == "lp-round" and "lp-round" in bl.names()
    m = c.n_devices
    for cfg in s.configs:
        assert cfg.devices == tuple(range(m)) and cfg.batch_size == g.batch_size
        assert (cfg.sync == "ps") == (cfg.ps_device is not None)
    prop = [cfg.shares for cfg in s.configs]
    assert all(p == prop[0] for p in prop)                      # layout="prop": one layout, no re-layouts
    assert s.priorities is not None and np.all(np.diff(s.priorities) < 0)
    r = ev.evaluate(s)
    assert "plan" in ev.candidate_orders(r.plan) and r.order in ev.candidate_orders(r.plan)
    assert r.iteration_time_s >= s.meta["lp_bound_s"] * (1 - 1e-9)
    assert len(s.meta["lp_actions"]) == ev.n_groups


def test_lp_round_options(tiny):
    g, c, ev = tiny
    s = bl.run("lp-round", g, c, evaluator=ev, integral_groups=0, layout="lp", order="none")
    assert s.priorities is None
    with pytest.raises(HeterogError, match="layout"):
        bl.run("lp-round", g, c, evaluator=ev, layout="bogus")
