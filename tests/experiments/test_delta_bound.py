"""experiments.delta_bound: the premise of the bound (under FIFO, before a change's first touched event
the changed plan's schedule is the base's) and its arithmetic."""
from __future__ import annotations

import json

import numpy as np
import pytest

import simulator
from experiments.delta_bound import main, measure, summary, touched
from heterog.baselines.chains import ActionSearch
from heterog.cluster import load_cluster
from heterog.compiler.delta import dirty_units
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


@pytest.fixture(scope="module")
def ev():
    return Evaluator(capture_model("tiny_transformer", 8), load_cluster("paper-8gpu"))


def test_untouched_tasks_before_the_first_touched_event_keep_their_times(ev):
    rng = np.random.default_rng(3)
    m, c, search = ev.cluster.n_devices, ev.compiler, ActionSearch(ev)

    def run(plan):
        return simulator.simulate(plan.tg, priority=ev.priorities(plan, "fifo"), fifo=True)

    checked = 0
    for _ in range(12):
        actions = rng.integers(0, m + 4, size=ev.n_groups)
        changed = actions.copy()
        g = int(rng.integers(ev.n_groups))
        changed[g] = (changed[g] + 1 + rng.integers(m + 3)) % (m + 4)
        c.bases.clear()
        base = c.compile_state(search.strategy(actions))
        new = c.compile_state(search.strategy(changed))
        dirty = dirty_units(c, base.placement, new.placement)
        if dirty is None:
            continue
        rb, rn = run(base.plan), run(new.plan)
        hb, hn = touched(base, dirty), touched(new, dirty)
        first = min(rb.start[hb].min(initial=np.inf), rn.start[hn].min(initial=np.inf))
        at = {k: i for i, k in enumerate(new.tasks.order.tolist())}       # canonical keys: same task, same key
        early = np.nonzero(~hb & (rb.start < first))[0]
        for t in early.tolist():
            u = at[int(base.tasks.order[t])]
            assert not hn[u]
            assert (rn.start[u], rn.finish[u]) == (rb.start[t], rb.finish[t])
        checked += len(early)
    assert checked > 0


def test_bound_is_compile_plus_the_resimulated_share(ev):
    changes = measure(ev, n_changes=4)
    for ch in changes:
        assert 0.0 < ch.share_resimulated <= 1.0
        assert ch.bound_ms == pytest.approx(ch.compile_ms + ch.share_resimulated * ch.simulate_ms)
        assert ch.resimulated_ms == pytest.approx(ch.share_resimulated * ch.simulate_ms)
    s = summary(changes, target_ms=1e9)
    assert s["changes"] == 4 and s["bounds_at_most_1e+09_ms"] == 4 and s["resimulations_at_most_1e+09_ms"] == 4
    assert s["min_bound_ms"] <= s["median_bound_ms"]
    assert s["evals_per_s_at_most"] == pytest.approx(1e3 / np.mean([ch.bound_ms for ch in changes]))
    assert s["evals_per_s_at_most_free_compile"] > s["evals_per_s_at_most"]


def test_summary_by_hand():
    from experiments.delta_bound import Change

    changes = [Change(0, compile_ms=2.0, simulate_ms=4.0, share_resimulated=0.5, bound_ms=4.0),
               Change(1, compile_ms=1.0, simulate_ms=4.0, share_resimulated=1.0, bound_ms=5.0)]
    s = summary(changes, target_ms=3.0)
    assert s["median_resimulated_ms"] == 3.0 and s["resimulations_at_most_3_ms"] == 1
    assert s["bounds_at_most_3_ms"] == 0 and s["min_bound_ms"] == 4.0
    assert s["evals_per_s_at_most"] == pytest.approx(1e3 / 4.5)
    assert s["evals_per_s_at_most_free_compile"] == pytest.approx(1e3 / 3.0)


def test_cli_json(capsys):
    main(["--model", "tiny_mlp", "--batch-size", "8", "--changes", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["changes"] == 2 and len(out["per_change"]) == 2 and out["order"] == "fifo"
    assert all("resimulated_ms" in ch for ch in out["per_change"])
