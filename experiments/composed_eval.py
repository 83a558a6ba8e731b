"""Composed replicas, measured (docs/results.md, "Composed replicas"): one data-parallel baseline's plan
evaluated from scratch composed from one slice of the cluster (``heterog.compose``) and simulated whole, in the
same process, alternating, and the two results compared field by field.

    python -m experiments.composed_eval --graph opt_350m:1024 --cluster gcp-a100-v100:a100=8,v100=24
        [--method ev-ar] [--micro K] [--whole-runs 3] [--json]

Each whole evaluation alternates with three composed ones (``Evaluator.iteration_time`` after
``Evaluator.clear_plans``, against an ``Evaluator(compose=False)`` on the same cost model); ``--whole-runs 0``
measures the composed evaluation alone (three runs). ``identical``: ``evaluate(compose=True)`` and ``evaluate()``
give the same iteration time, memory peaks and task count.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable

from experiments.args import argparse_type, model_batch_list, parser, print_rows
from heterog.errors import HeterogError
from heterog.reporting import Column, Table


def _ms(run: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure(graph_name: str, batch: int, cluster_name: str, method: str, micro: int, whole_runs: int) -> dict:
    """The row of one plan (module docstring)."""
    from heterog import baselines
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    graph, cluster = capture_model(graph_name, batch), load_cluster(cluster_name)
    ev = Evaluator(graph, cluster)
    whole_ev = Evaluator(graph, cluster, ev.cost, compose=False)
    strategy = baselines.run(method, graph, cluster, evaluator=ev)
    if micro > 1:
        strategy = strategy.with_micro_batches(micro)
    rep = ev.repetition(strategy)
    composed = ev.evaluate(strategy, compose=True)

    def one(e: Evaluator) -> Callable[[], object]:
        def run() -> object:
            e.clear_plans()
            return e.iteration_time(strategy)
        return run

    one(ev)()                                       # the slice's compile context, once
    tc: list[float] = []
    tw: list[float] = []
    for _ in range(max(whole_runs, 1)):
        tc += _ms(one(ev), 3)
        tw += _ms(one(whole_ev), 1) if whole_runs else []
    row = {"graph": f"{graph_name}:{batch}", "cluster": cluster_name, "method": method, "micro": micro,
           "slices": composed.composed, "slice_devices": rep[1].cluster.n_devices if rep else cluster.n_devices,
           "tasks": composed.n_tasks, "iteration_s": composed.iteration_time_s,
           "composed_ms": statistics.median(tc), "whole_ms": None, "ratio": None, "identical": None}
    if whole_runs:
        whole = whole_ev.evaluate(strategy)
        row.update(whole_ms=statistics.median(tw), ratio=statistics.median(tw) / statistics.median(tc),
                   identical=(whole.iteration_time_s == composed.iteration_time_s and whole.n_tasks == composed.n_tasks
                              and whole.peak_memory_bytes == composed.peak_memory_bytes))
    row["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return row


def _table(rows: list[dict]) -> Table:
    table = Table([Column("graph", align="left"), Column("cluster", align="left"), Column("plan", align="left"),
                   Column("slices x GPUs"), Column("tasks (whole)"), Column("composed ms"), Column("whole ms"),
                   Column("ratio"), Column("identical")])
    for r in rows:
        whole = "-" if r["whole_ms"] is None else f"{r['whole_ms']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        table.add(r["graph"], r["cluster"], f"{r['method']}, k = {r['micro']}", f"{r['slices']} x {r['slice_devices']}",
                  f"{r['tasks']:,}", f"{r['composed_ms']:.1f}", whole, ratio, same)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.composed_eval", __doc__)
    ap.add_argument("--graph", type=argparse_type(model_batch_list), required=True, help="MODEL:BATCH[,...]")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--method", default="ev-ar", help="a data-parallel baseline (ev-ar, cp-ar)")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches of the plan (even, 1F1B)")
    ap.add_argument("--whole-runs", type=int, default=3, help="whole evaluations (0: the composed one alone)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        rows = [measure(g, b, args.cluster, args.method, args.micro, args.whole_runs) for g, b in args.graph]
    except HeterogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return print_rows(rows, args.json, _table)


if __name__ == "__main__":
    raise SystemExit(main())
