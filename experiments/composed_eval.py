"""Composed replicas, measured (docs/results.md, "Composed replicas"): a plan evaluated from scratch composed
from one slice of the cluster (``heterog.compose``) and simulated whole, in the same process, alternating, and
the two results compared field by field. The plan: one data-parallel baseline's, or the peers' plans of one
of Sailor's scenarios (Metis' and Sailor's, ``experiments.peer_plans``, on its graph).

    python -m experiments.composed_eval --graph opt_350m:1024 --cluster gcp-a100-v100:a100=8,v100=24
        [--method ev-ar] [--micro K] [--whole-runs 3] [--json]
    python -m experiments.composed_eval --peers 32+96 [--whole-runs 1] [--json]
    python -m experiments.composed_eval --graph opt_350m_megatron:1024 --optimizer adam --cluster CLUSTER \
        --plan STRATEGY.json [--whole-runs 1]

A plan that does not compose is measured whole only (``--whole-runs 0``: not at all).

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
from typing import TYPE_CHECKING

from experiments.args import argparse_type, model_batch_list, parser, print_rows
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import Strategy


def _ms(run: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure(graph: OpGraph, cluster: Cluster, strategy: Strategy, label: str, whole_runs: int) -> dict:
    """The row of one plan (module docstring)."""
    from heterog.evaluate import Evaluator

    ev = Evaluator(graph, cluster)
    whole_ev = Evaluator(graph, cluster, ev.cost, compose=False)
    rep = ev.repetition(strategy)
    if rep is None and not whole_runs:
        return {"graph": f"{graph.name}:{graph.batch_size}", "cluster": cluster.name, "plan": label,
                "micro": strategy.n_micro, "slices": 1, "slice_devices": cluster.n_devices, "tasks": None,
                "iteration_s": None, "composed_ms": None, "whole_ms": None, "ratio": None, "identical": None,
                "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
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
    row = {"graph": f"{graph.name}:{graph.batch_size}", "cluster": cluster.name, "plan": label,
           "micro": strategy.n_micro, "slices": composed.composed,
           "slice_devices": rep[1].cluster.n_devices if rep else cluster.n_devices,
           "tasks": composed.n_tasks, "iteration_s": composed.iteration_time_s,
           "composed_ms": statistics.median(tc), "whole_ms": None, "ratio": None, "identical": None}
    if whole_runs:
        whole = whole_ev.evaluate(strategy)
        row.update(whole_ms=statistics.median(tw), ratio=statistics.median(tw) / statistics.median(tc),
                   identical=(whole.iteration_time_s == composed.iteration_time_s and whole.n_tasks == composed.n_tasks
                              and whole.peak_memory_bytes == composed.peak_memory_bytes))
    row["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return row


def baseline_rows(graph_name: str, batch: int, optimizer: str, cluster_name: str, method: str, micro: int,
                  whole_runs: int, plan: str | None = None) -> dict:
    """The row of ``method``'s plan (or of the strategy file ``plan``) of ``graph_name`` at ``batch`` on
    ``cluster_name`` over ``micro`` micro-batches."""
    from heterog import baselines
    from heterog.atomic import read_json
    from heterog.cluster import load_cluster
    from heterog.graph.cache import capture_model
    from heterog.strategy import Strategy

    graph, cluster = capture_model(graph_name, batch, optimizer), load_cluster(cluster_name)
    if plan is not None:
        strategy = Strategy.from_dict(read_json(plan), plan)
        strategy.check_fits(graph, cluster)
        method = plan
    else:
        strategy = baselines.run(method, graph, cluster)
    if micro > 1:
        strategy = strategy.with_micro_batches(micro)
    return measure(graph, cluster, strategy, method, whole_runs)


def peer_rows(scenario: str, whole_runs: int) -> list[dict]:
    """A row per peer plan of Sailor's ``scenario`` that imports (``experiments.peer_plans.peer_plans``)."""
    from experiments.peer_plans import BATCH, MODEL, OPTIMIZER, parse_scenarios, peer_plans, scenario_cluster
    from heterog.cli.args import resolve_graph
    from heterog.cluster import load_cluster

    (scenario,) = parse_scenarios(scenario)
    graph, cluster = resolve_graph(MODEL, BATCH, optimizer=OPTIMIZER), load_cluster(scenario_cluster(scenario))
    return [measure(graph, cluster, s, label, whole_runs) for label, s, _ in peer_plans(scenario, graph, cluster)
            if s is not None]


def _table(rows: list[dict]) -> Table:
    table = Table([Column("graph", align="left"), Column("cluster", align="left"), Column("plan", align="left"),
                   Column("slices x GPUs"), Column("tasks (whole)"), Column("composed ms"), Column("whole ms"),
                   Column("ratio"), Column("identical")])
    for r in rows:
        whole = "-" if r["whole_ms"] is None else f"{r['whole_ms']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        tasks = "-" if r["tasks"] is None else f"{r['tasks']:,}"
        composed = "-" if r["composed_ms"] is None else f"{r['composed_ms']:.1f}"
        table.add(r["graph"], r["cluster"], f"{r['plan']}, k = {r['micro']}", f"{r['slices']} x {r['slice_devices']}",
                  tasks, composed, whole, ratio, same)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.composed_eval", __doc__)
    ap.add_argument("--graph", type=argparse_type(model_batch_list), help="MODEL:BATCH[,...]")
    ap.add_argument("--cluster")
    ap.add_argument("--method", default="ev-ar", help="a data-parallel baseline (ev-ar, cp-ar)")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches of the plan (even, 1F1B)")
    ap.add_argument("--optimizer", default="sgd", help="the graph's optimizer (sgd, adam)")
    ap.add_argument("--plan", help="a strategy file of the graph and cluster, instead of --method")
    ap.add_argument("--peers", help="the peers' plans of one of Sailor's scenarios (experiments.peer_plans)")
    ap.add_argument("--whole-runs", type=int, default=3, help="whole evaluations (0: the composed one alone)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.peers is None and (args.graph is None or args.cluster is None):
        ap.error("give --graph and --cluster, or --peers")
    try:
        if args.peers is not None:
            rows = peer_rows(args.peers, args.whole_runs)
        else:
            rows = [baseline_rows(g, b, args.optimizer, args.cluster, args.method, args.micro, args.whole_runs,
                                  args.plan) for g, b in args.graph]
    except HeterogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return print_rows(rows, args.json, _table)


if __name__ == "__main__":
    raise SystemExit(main())
