"""The `make run` job: capture a zoo model, plan it on paper-8gpu with the baselines, the searches and the
agent, print the comparison table, and write the Chrome trace, Gantt chart and report of the best plan.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

DEFAULT_MODEL, DEFAULT_BATCH, DEFAULT_CLUSTER = "bert_large", 48, "paper-8gpu"
DP_METHODS = ("ev-ps", "ev-ar", "cp-ps", "cp-ar")
DEFAULT_ORDER = "best"          # heterog.scheduler.DEFAULT_ORDER (not imported: numba loads lazily)


def cost_table(graph, cluster, cost, n_ops: int = 3) -> Table:
    """Time of the costliest ops of distinct kinds, plus one memory-bound op, on each device type."""
    times = cost.full_batch_times(graph)
    types: dict[str, int] = {}
    for d in cluster.devices:
        types.setdefault(d.type.name, d.index)
    picks: list[int] = []
    seen: set[str] = set()
    for i in np.argsort(-times.mean(axis=1), kind="stable"):
        op = graph.ops[int(i)]
        if op.kind == "compute" and op.target not in seen:
            seen.add(op.target)
            picks.append(int(i))
        if len(picks) >= n_ops:
            break
    intensity = graph.flops / np.maximum(graph.bytes_total, 1.0)
    memory_bound = [int(i) for i in np.argsort(-graph.bytes_total, kind="stable")
                    if graph.ops[int(i)].kind == "compute" and intensity[i] < 1.0]
    if memory_bound and memory_bound[0] not in picks:
        picks.append(memory_bound[0])
    tab = Table(title=f"op time on the {cluster.name} device types (ms, batch {graph.batch_size})")
    for col in ("op", "output", "GFLOP", "MB moved", *types):
        tab.add_column(col, justify="left" if col in ("op", "output") else "right")
    for i in picks:
        op = graph.ops[i]
        tab.add_row(op.target, str(op.output_shapes[0] if op.output_shapes else ""), f"{op.flops / 1e9:.2f}",
                    f"{graph.bytes_total[i] / 1e6:.1f}", *[f"{times[i, d] * 1e3:.3f}" for d in types.values()])
    return tab


def comparison_table(records: list[dict], title: str) -> Table:
    """Iteration time, speed-up over the best DP baseline, breakdown, memory and search time per method."""
    best_dp = min((r["iteration_time_s"] for r in records
                   if r["method"] in DP_METHODS and r["order_requested"] == DEFAULT_ORDER and not r["oom"]),
                  default=None)
    tab = Table(title=title)
    for col in ("method", "order", "iter ms", "vs best DP", "compute ms", "comm ms", "overlap", "max peak GiB",
                "OOM", "search s"):
        tab.add_column(col, justify="left" if col in ("method", "order") else "right")
    for r in records:
        peak = max(r["peak_memory_bytes"].values()) / 2**30
        speedup = f"{best_dp / r['iteration_time_s']:.2f}x" if best_dp else "-"
        order = f"best: {r['order']}" if r["order_requested"] == DEFAULT_ORDER else f"{r['order']} (paper)"
        tab.add_row(r["method"], order, f"{r['iteration_time_s'] * 1e3:.1f}", speedup,
                    f"{r['compute_time_s'] * 1e3:.1f}", f"{r['comm_time_s'] * 1e3:.1f}", f"{r['overlap_ratio']:.2f}",
                    f"{peak:.2f}", "OOM" if r["oom"] else "", f"{r.get('search_time_s', 0.0):.1f}")
    return tab


def main_job(out_dir: Path, quick: bool = False, model: str | None = None, batch_size: int | None = None,
             cluster_name: str = DEFAULT_CLUSTER, budget_s: float | None = None, with_agent: bool = True) -> int:
    from heterog.atomic import atomic_write_json
    from heterog.cluster import load_cluster
    from heterog.compare import AGENT, compare, default_methods, write_report
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    console = Console() if sys.stdout.isatty() else Console(width=150)
    model = model or ("tiny_transformer" if quick else DEFAULT_MODEL)
    batch_size = batch_size or (16 if quick else DEFAULT_BATCH)
    budget_s = budget_s if budget_s is not None else (2.0 if quick else 60.0)

    t0 = time.perf_counter()
    with console.status(f"capturing {model} (batch {batch_size})..."):
        graph = capture_model(model, batch_size)
    s = graph.summary()
    console.print(f"[bold]{model}[/] batch {batch_size}: {s['ops']} ops ({s['compute_ops']} compute; "
                  f"{s['ops_by_phase']}), {s['edges']} edges, {s['params']:,} parameters, "
                  f"{sum(s['gflops_by_phase'].values()):.1f} GFLOP per iteration "
                  f"(captured or loaded from cache in {time.perf_counter() - t0:.1f} s)")
    if s["estimated_flop_ops"]:
        console.print(f"ops without a FLOP formula (bytes-based estimate): {', '.join(s['estimated_flop_ops'])}")
    cluster = load_cluster(cluster_name)
    ev = Evaluator(graph, cluster)
    console.print(cost_table(graph, cluster, ev.cost))

    methods = [m for m in default_methods() if m != "random"] + ([AGENT] if with_agent else [])
    comp = compare(graph, cluster, methods, budget_s=budget_s, evaluator=ev)
    records = []
    for r in comp.results:
        records.append(r.record)
        if r.method in DP_METHODS or r.method == "single":   # the paper's order, for comparison
            paper = ev.evaluate(r.strategy, order="rank", method=r.method)
            records.append({**paper.record(), "search_time_s": r.record["search_time_s"]})
    console.print(comparison_table(records, f"{model} (batch {batch_size}) on {cluster.name}, "
                                            f"{budget_s:g} s per search"))
    paths = write_report(comp, out_dir)
    atomic_write_json(Path(out_dir) / "comparison_with_rank.json",
                      {"graph": graph.name, "cluster": cluster.name, "records": records})
    best = comp.best()
    console.print(f"best plan: [bold]{best.method}[/] {best.result.iteration_time_s * 1e3:.1f} ms; wrote "
                  + ", ".join(str(p) for p in paths.values()))
    return 0
