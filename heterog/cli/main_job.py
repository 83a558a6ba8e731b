"""``heterog main``, the `make run` job: capture a zoo model, plan it on paper-8gpu with the baselines, the
searches and the agent, print the comparison table, and write the Chrome trace, Gantt chart and report of
the best plan."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_MODEL, DEFAULT_BATCH, DEFAULT_CLUSTER = "bert_large", 48, "paper-8gpu"


def main_job(out_dir: Path, quick: bool = False, model: str | None = None, batch_size: int | None = None,
             cluster_name: str = DEFAULT_CLUSTER, budget_s: float | None = None, with_agent: bool = True) -> int:
    from rich.console import Console

    from heterog.atomic import atomic_write_json
    from heterog.cluster import load_cluster
    from heterog.compare import AGENT, compare, write_report
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model
    from heterog.planners import default_methods
    from heterog.reporting import DP_BASELINES, comparison_table, cost_table

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
    console.print(cost_table(graph, cluster, ev.cost).rich())

    methods = [m for m in default_methods() if m != "random"] + ([AGENT] if with_agent else [])
    comp = compare(graph, cluster, methods, budget_s=budget_s, evaluator=ev)
    records = []
    for r in comp.results:
        records.append(r.record)
        if r.method in DP_BASELINES or r.method == "single":   # the paper's order, for comparison
            paper = ev.evaluate(r.strategy, order="rank", method=r.method)
            records.append({**paper.record(), "search_time_s": r.record["search_time_s"]})
    console.print(comparison_table(records, f"{model} (batch {batch_size}) on {cluster.name}, "
                                            f"{budget_s:g} s per search").rich())
    paths = write_report(comp, out_dir)
    atomic_write_json(Path(out_dir) / "comparison_with_rank.json",
                      {"graph": graph.name, "cluster": cluster.name, "records": records})
    best = comp.best()
    console.print(f"best plan: [bold]{best.method}[/] {best.result.iteration_time_s * 1e3:.1f} ms; wrote "
                  + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_main(args: argparse.Namespace) -> int:
    return main_job(out_dir=Path(args.out), quick=args.quick)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("main", help="the `make run` job: capture, plan, compare, write trace and plots")
    p.add_argument("--out", default="results/main", help="output folder")
    p.add_argument("--quick", action="store_true", help="small model and budgets (for tests)")
    p.set_defaults(fn=cmd_main)
