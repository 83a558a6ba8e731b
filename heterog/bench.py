"""`heterog bench`: the performance targets of DESIGN.md section 6, measured side by side.

Speeds are reported with the reference measured in the same run, so a noisy machine shifts both.
"""
from __future__ import annotations

import time

import numpy as np


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def run_bench(quick: bool = False) -> dict:
    """Simulator kernel throughput vs the reference, and one full evaluation of bert_large on paper-8gpu."""
    import simulator
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    out: dict = {}
    sim = simulator.bench(n_tasks=5000 if quick else 50000)
    out.update({k: sim[k] for k in ("sim_tasks_per_s", "ref_tasks_per_s", "sim_speedup_vs_reference")})

    model, batch = ("tiny_transformer", 16) if quick else ("bert_large", 48)
    t0 = time.perf_counter()
    graph = capture_model(model, batch)
    out["graph_load_or_capture_s"] = time.perf_counter() - t0
    out["graph"] = f"{model} (batch {batch}): {graph.n_ops} ops"
    ev = Evaluator(graph, load_cluster("paper-8gpu"))
    rng = np.random.default_rng(0)
    actions = rng.integers(0, ev.cluster.n_devices + 4, size=ev.n_groups)   # a mixed MP/DP strategy
    strategy = ev.strategy(actions, "mixed")
    res = ev.evaluate(strategy)
    out["eval_tasks"] = res.n_tasks
    out["eval_ms_compile"] = _median_ms(lambda: ev.compile(strategy), 3 if quick else 11)
    plan = ev.compile(strategy)
    out["eval_ms_rank"] = _median_ms(lambda: ev.priorities(plan), 3 if quick else 11)
    prio = ev.priorities(plan)
    out["eval_ms_simulate"] = _median_ms(lambda: simulator.simulate(plan.tg, priority=prio), 3 if quick else 11)
    out["eval_ms_bert_large_paper8" if not quick else "eval_ms_quick"] = _median_ms(
        lambda: ev.iteration_time(strategy), 3 if quick else 11)
    if quick:
        out["eval_ms_bert_large_paper8"] = None
    return out
