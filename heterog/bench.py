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
    out["eval_ms_rank"] = _median_ms(lambda: ev.priorities(plan, "rank-contention"), 3 if quick else 11)
    prio = ev.priorities(plan, "rank-contention")
    out["eval_ms_simulate"] = _median_ms(lambda: simulator.simulate(plan.tg, priority=prio), 3 if quick else 11)
    out["eval_ms_bert_large_paper8" if not quick else "eval_ms_quick"] = _median_ms(
        lambda: ev.iteration_time(strategy), 3 if quick else 11)
    if quick:
        out["eval_ms_bert_large_paper8"] = None
    else:
        out["order_comparison"] = order_comparison()
    return out


ORDER_MODELS = (("vgg19", 192), ("inception_v3", 192), ("transformer", 720))


def order_comparison(models=ORDER_MODELS, cluster_name: str = "paper-8gpu") -> dict:
    """Iteration time (s) of the four DP baselines under each task order, FIFO/order ratios (above 1: the
    order beats FIFO) averaged over the cases, and the worst case of each order against FIFO."""
    from heterog import baselines
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model
    from heterog.scheduler import ORDERS

    cluster = load_cluster(cluster_name)
    rows = []
    for model, batch in models:
        ev = Evaluator(capture_model(model, batch), cluster)
        for method in ("ev-ps", "ev-ar", "cp-ps", "cp-ar"):
            plan = ev.compile(baselines.run(method, ev.graph, cluster, evaluator=ev))
            times = {o: float(ev.simulate_plan(plan, o).makespan) for o in ORDERS}
            rows.append({"model": model, "method": method, **{f"{o}_s": t for o, t in times.items()}})
    mean_ratio = {o: float(np.mean([r["fifo_s"] / r[f"{o}_s"] for r in rows])) for o in ORDERS}
    worst = {o: float(np.min([r["fifo_s"] / r[f"{o}_s"] for r in rows])) for o in ORDERS}
    return {"rows": rows, "mean_fifo_over_order": mean_ratio, "min_fifo_over_order": worst}
