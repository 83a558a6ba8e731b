"""``heterog compare``: plan a graph on a cluster with several methods, simulate and compare them
(HeteroG Tables 1-2), optionally writing the report files."""
from __future__ import annotations

import argparse
from pathlib import Path

from heterog.cli.args import add_graph_args, add_parallel_args, graph_and_cluster
from heterog.cli.output import add_json_flag, emit


def cmd_compare(args: argparse.Namespace) -> int:
    from heterog.compare import compare, write_report
    from heterog.planners import parse_methods
    from heterog.reporting import comparison_text

    methods = parse_methods(args.methods)
    graph, cluster = graph_and_cluster(args)
    comp = compare(graph, cluster, methods, budget_s=args.budget_s, seed=args.seed,
                   agent_checkpoint=args.agent, agent_episodes=args.episodes, progress=not args.json,
                   workers=args.workers, ray_address=args.ray_address)
    doc = comp.document()
    text = comparison_text(comp)
    if args.out:
        paths = write_report(comp, args.out)
        doc["files"] = {k: str(p) for k, p in paths.items()}
        text += "\nwrote " + ", ".join(str(p) for p in paths.values())
    emit(args, doc, text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="plan with several methods, simulate and compare (HeteroG Tables 1-2)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_graph_args(p)
    p.add_argument("--methods", default=None,
                   help="comma-separated methods (default: every registered planner; add 'agent' to train one)")
    p.add_argument("--budget-s", type=float, default=60.0, help="time budget of each search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agent", default=None, metavar="CKPT",
                   help="checkpoint for method 'agent' (default: the shipped pretrained one; 'scratch': from scratch)")
    p.add_argument("--episodes", type=int, default=None, help="episodes for method 'agent'")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for comparison.json/.csv, report.md (Tables 1-2), best plan's Gantt chart, "
                        "Chrome trace and strategy")
    add_parallel_args(p)
    add_json_flag(p, "print one JSON document (records) on stdout")
    p.set_defaults(fn=cmd_compare)
