"""The ``heterog compare`` and ``heterog plan`` subcommands: compare planners on a graph and cluster, or
write the strategy of one planner (a baseline, a search, or the learning agent) to a file."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _graph_and_cluster(args):
    from heterog.cli import resolve_graph
    from heterog.cluster import load_cluster

    return resolve_graph(args.graph, args.batch_size, args.optimizer), load_cluster(args.cluster)


def cmd_compare(args) -> int:
    from heterog.compare import compare, parse_methods, text_table, write_report

    methods = parse_methods(args.methods)
    graph, cluster = _graph_and_cluster(args)
    comp = compare(graph, cluster, methods, budget_s=args.budget_s, seed=args.seed,
                   agent_checkpoint=args.agent, agent_episodes=args.episodes, progress=not args.json,
                   workers=args.workers, ray_address=args.ray_address)
    doc = comp.document()
    text = text_table(comp)
    if args.out:
        paths = write_report(comp, args.out)
        doc["files"] = {k: str(p) for k, p in paths.items()}
        text += "\nwrote " + ", ".join(str(p) for p in paths.values())
    if args.json:
        print(json.dumps(doc, indent=1, default=float))
    else:
        print(text)
    return 0


def cmd_plan(args) -> int:
    from heterog.compare import AGENT, parse_methods, plan
    from heterog.evaluate import Evaluator

    method = AGENT if args.agent else (args.method or AGENT)
    parse_methods([method])
    graph, cluster = _graph_and_cluster(args)
    ev = Evaluator(graph, cluster)
    strategy = plan(method, graph, cluster, evaluator=ev, budget_s=args.budget_s, seed=args.seed,
                    checkpoint=args.agent, episodes=args.episodes, workers=args.workers, ray_address=args.ray_address)
    path = strategy.save(args.output)
    res = ev.evaluate(strategy, method=method)
    doc = {"method": method, "graph": graph.name, "cluster": cluster.name, "output": str(path),
           "n_groups": strategy.n_groups, "iteration_time_s": res.iteration_time_s, "oom": res.oom,
           "search_time_s": float(strategy.meta.get("search_time_s", 0.0))}
    if args.json:
        print(json.dumps(doc, indent=1, default=float))
    else:
        print(f"{method}: {strategy.n_groups} groups, simulated {res.iteration_time_s * 1e3:.2f} ms per iteration"
              f"{' (OOM)' if res.oom else ''}, searched {doc['search_time_s']:.1f} s -> {path}")
    return 0


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="processes for the searches that fan out (mcmc's chains, the agent's simulations): "
                        "1 runs them here; more start Ray workers (a local Ray unless --ray-address)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. HEAD:6379, after 'ray start --head' there) for the workers")


def add_commands(sub) -> None:
    """Add ``compare`` and ``plan`` to the ``heterog`` parser's subcommands."""
    from heterog.cli import _add_graph_args

    p = sub.add_parser("compare", help="plan with several methods, simulate and compare (HeteroG Tables 1-2)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_graph_args(p)
    p.add_argument("--methods", default=None,
                   help="comma-separated methods (default: every registered planner; add 'agent' to train one)")
    p.add_argument("--budget-s", type=float, default=60.0, help="time budget of each search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agent", default=None, metavar="CKPT", help="checkpoint for method 'agent'")
    p.add_argument("--episodes", type=int, default=None, help="episodes for method 'agent'")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for comparison.json/.csv, report.md (Tables 1-2), best plan's Gantt chart, "
                        "Chrome trace and strategy")
    _add_parallel_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON document (records) on stdout")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("plan", help="write the strategy of one method (default: the learning agent)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_graph_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--method", default=None, help="planner name (default: agent)")
    g.add_argument("--agent", default=None, metavar="CKPT", help="fine-tune the agent from this checkpoint")
    p.add_argument("--episodes", type=int, default=None, help="episodes for the agent")
    p.add_argument("--budget-s", type=float, default=60.0, help="time budget of a search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True, type=Path, help="strategy JSON to write")
    _add_parallel_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)
