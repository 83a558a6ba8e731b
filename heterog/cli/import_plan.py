"""``heterog import-plan``: turn another system's plan (Sailor's plan_config JSON, a Metis plan) into a
strategy file, and simulate it."""
from __future__ import annotations

import argparse
from pathlib import Path

from heterog.cli.args import add_graph_args, graph_and_cluster
from heterog.cli.output import add_json_flag, emit


def cmd_import_plan(args: argparse.Namespace) -> int:
    from heterog.evaluate import Evaluator
    from heterog.interop import import_plan

    graph, cluster = graph_and_cluster(args)
    strategy = import_plan(args.format, args.file, graph, cluster)
    path = strategy.save(args.output)
    doc = {"format": args.format, "plan": str(args.file), "graph": graph.name, "cluster": cluster.name,
           "output": str(path), "n_groups": strategy.n_groups, "micro_batches": list(strategy.micro),
           "schedule": strategy.schedule,
           "stages": [{"devices": list(c.devices), "shares": list(c.shares), "grid": c.grid, "split": c.split}
                      for c in strategy.configs]}
    for key in ("real", "max_mem", "cost"):
        if key in strategy.meta:
            doc[f"plan_{key}"] = strategy.meta[key]
    text = (f"{args.format} plan {args.file}: {strategy.n_groups} stages, {strategy.n_micro} micro-batches "
            f"({strategy.schedule}) -> {path}")
    if not args.no_simulate:
        res = Evaluator(graph, cluster).evaluate(strategy, method=strategy.method)
        doc.update({"iteration_time_s": res.iteration_time_s, "oom": res.oom})
        text += f", simulated {res.iteration_time_s * 1e3:.2f} ms per iteration{' (OOM)' if res.oom else ''}"
    emit(args, doc, text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from heterog.interop import FORMATS

    p = sub.add_parser("import-plan", help="turn a Sailor or Metis plan into a strategy file",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("file", type=Path,
                   help="the plan file (Sailor: plan_config_*.json; Metis: see heterog.interop.metis)")
    p.add_argument("--format", required=True, choices=list(FORMATS), help="the plan's format")
    add_graph_args(p)
    p.add_argument("-o", "--output", required=True, type=Path, help="strategy JSON to write")
    p.add_argument("--no-simulate", action="store_true", help="write the strategy without simulating it")
    add_json_flag(p)
    p.set_defaults(fn=cmd_import_plan)
