"""The `make run` job: capture a zoo model, plan it on paper-8gpu with baselines, searches and the agent,
print the comparison table, and write the Chrome trace, Gantt chart and tables of the best plan.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

DEFAULT_MODEL, DEFAULT_BATCH, DEFAULT_CLUSTER = "bert_large", 48, "paper-8gpu"
DP_METHODS = ["single", "ev-ps", "ev-ar", "cp-ps", "cp-ar"]


def cost_table(graph, cluster, cost, n_ops: int = 3) -> Table:
    """Time of the costliest op of each kind (matmul-like, conv-like, elementwise) on each device type."""
    times = cost.full_batch_times(graph)
    types: dict[str, int] = {}
    for d in cluster.devices:
        types.setdefault(d.type.name, d.index)
    mean = times.mean(axis=1)
    picks: list[int] = []
    seen: set[str] = set()
    for i in np.argsort(-mean):
        t = graph.ops[i].target
        if graph.ops[i].kind == "compute" and t not in seen:
            seen.add(t)
            picks.append(int(i))
        if len(picks) >= n_ops:
            break
    # add a memory-bound op: the largest elementwise-ish op by bytes with few flops per byte
    ai = graph.flops / np.maximum(graph.bytes_total, 1)
    cand = [i for i in np.argsort(-graph.bytes_total) if graph.ops[i].kind == "compute" and ai[i] < 1.0]
    if cand and int(cand[0]) not in picks:
        picks.append(int(cand[0]))
    tab = Table(title=f"op time on {cluster.name} device types (ms, full batch {graph.batch_size})")
    tab.add_column("op")
    tab.add_column("GFLOP", justify="right")
    tab.add_column("MB moved", justify="right")
    for name in types:
        tab.add_column(name, justify="right")
    for i in picks:
        op = graph.ops[i]
        tab.add_row(f"{op.target} {op.output_shapes[0] if op.output_shapes else ''}", f"{op.flops / 1e9:.2f}",
                    f"{graph.bytes_total[i] / 1e6:.1f}", *[f"{times[i, d] * 1e3:.3f}" for d in types.values()])
    return tab


def comparison_table(records: list[dict], title: str) -> Table:
    best_dp = min((r["iteration_time_s"] for r in records if r["method"] in DP_METHODS[1:] and not r["oom"]),
                  default=None)
    tab = Table(title=title)
    for col in ("method", "order", "iter ms", "speed-up vs best DP", "compute ms", "comm ms", "overlap",
                "max peak GiB", "OOM", "search s"):
        tab.add_column(col, justify="left" if col in ("method", "order") else "right")
    for r in records:
        peak = max(r["peak_memory_bytes"].values()) / 2**30
        sp = f"{best_dp / r['iteration_time_s']:.2f}x" if best_dp else "-"
        tab.add_row(r["method"], r.get("order", "rank"), f"{r['iteration_time_s'] * 1e3:.1f}", sp,
                    f"{r['compute_time_s'] * 1e3:.1f}", f"{r['comm_time_s'] * 1e3:.1f}", f"{r['overlap_ratio']:.2f}",
                    f"{peak:.2f}", "OOM" if r["oom"] else "", f"{r.get('search_time_s', 0.0):.1f}")
    return tab


def main_job(out_dir: Path, quick: bool = False, model: str | None = None, batch_size: int | None = None,
             cluster_name: str = DEFAULT_CLUSTER, budget_s: float | None = None) -> int:
    import simulator
    from heterog import baselines
    from heterog.atomic import atomic_write_json
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    console = Console()
    model = model or ("tiny_transformer" if quick else DEFAULT_MODEL)
    batch_size = batch_size or (16 if quick else DEFAULT_BATCH)
    budget_s = budget_s if budget_s is not None else (3.0 if quick else 60.0)
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    with console.status(f"capturing {model} (batch {batch_size})..."):
        graph = capture_model(model, batch_size)
    s = graph.summary()
    console.print(f"[bold]{model}[/] batch {batch_size}: {s['ops']} ops ({s['compute_ops']} compute, "
                  f"{s['ops_by_phase']}), {s['edges']} edges, {s['params']:,} parameters, "
                  f"{sum(s['gflops_by_phase'].values()):.1f} GFLOP per iteration "
                  f"(captured or loaded in {time.perf_counter() - t0:.1f} s)")
    if s["estimated_flop_ops"]:
        console.print(f"ops without a FLOP formula (bytes-based estimate): {', '.join(s['estimated_flop_ops'])}")
    cluster = load_cluster(cluster_name)
    ev = Evaluator(graph, cluster)
    console.print(cost_table(graph, cluster, ev.cost))

    records: list[dict] = []
    best = None
    methods = [m for m in baselines.names() if m != "random"]
    for name in methods:
        opts = {"budget_s": budget_s} if name in ("mcmc", "pesto-ilp", "agent") else {}
        with console.status(f"planning with {name}..."):
            strategy = baselines.run(name, graph, cluster, evaluator=ev, **opts)
        for order in (("rank", "fifo") if name in DP_METHODS else ("rank",)):
            res = ev.evaluate(strategy, order=order, method=name)
            res.search_time_s = strategy.meta["search_time_s"]
            rec = {**res.record(), "order": order}
            records.append(rec)
            if order == "rank" and (best is None or (res.oom, res.iteration_time_s) < (best[0].oom, best[0].iteration_time_s)):
                best = (res, strategy)
    console.print(comparison_table(records, f"{model} (batch {batch_size}) on {cluster.name}"))
    res, strategy = best
    simulator.write_chrome_trace(res.plan.tg, res.sim, out_dir / "best_trace.json")
    simulator.plot_gantt(res.plan.tg, res.sim, out_dir / "best_gantt.png",
                         title=f"{model} on {cluster.name}: {res.method} {res.iteration_time_s * 1e3:.1f} ms")
    strategy.save(out_dir / "best_strategy.json")
    atomic_write_json(out_dir / "comparison.json", {"graph": graph.name, "cluster": cluster.name, "records": records})
    console.print(f"best plan: [bold]{res.method}[/] {res.iteration_time_s * 1e3:.1f} ms; wrote "
                  f"{out_dir / 'best_trace.json'}, {out_dir / 'best_gantt.png'}, {out_dir / 'comparison.json'}")
    return 0
