"""The ``heterog`` command line (also ``python -m heterog``): capture, simulate, compare, plan, run, fidelity, bench.

Every subcommand has ``--help``; ``--json`` prints one JSON document on stdout. Bad input exits non-zero with
a one-line message naming what is wrong.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from heterog.errors import HeterogError


# ----------------------------------------------------------------------------- shared argument handling
def resolve_graph(ref: str, batch_size: int | None = None, optimizer: str = "sgd"):
    """A graph file, or a MODEL (zoo name or file.py:build) captured (and cached) at ``batch_size``."""
    from heterog.graph import load_graph

    p = Path(ref)
    if p.suffix in (".json", ".gz") or (p.exists() and p.is_file() and not ref.endswith(".py")):
        return load_graph(p)
    from heterog.graph.cache import capture_model

    return capture_model(ref, batch_size, optimizer)


def _emit(args, payload: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=1, default=float))
    else:
        print(text)


def _add_graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", required=True, help="graph file (.json/.json.gz) or MODEL (zoo name or file.py:build)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size when --graph is a MODEL")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="optimizer when --graph is a MODEL")
    p.add_argument("--cluster", required=True, help="cluster YAML or built-in name (e.g. paper-8gpu, local-cpu-2)")


# ----------------------------------------------------------------------------- subcommands
def cmd_capture(args) -> int:
    from heterog.graph.cache import capture_model

    g = capture_model(args.model, args.batch_size, args.optimizer, fuse=not args.no_fuse, use_cache=not args.no_cache)
    g.save(args.output)
    s = g.summary()
    _emit(args, {**s, "output": str(args.output), "meta": g.meta},
          f"captured {args.model} (batch {g.batch_size}, {g.optimizer}): {s['ops']} ops "
          f"({s['compute_ops']} compute), {s['edges']} edges, {s['params']:,} params -> {args.output}")
    return 0


def cmd_simulate(args) -> int:
    from heterog import baselines
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.strategy import Strategy

    graph = resolve_graph(args.graph, args.batch_size, args.optimizer)
    cluster = load_cluster(args.cluster)
    ev = Evaluator(graph, cluster, order=args.order, serialize_collectives=args.serialize_collectives)
    if args.strategy:
        strategy = Strategy.load(args.strategy)
        strategy.check_fits(graph, cluster)
    else:
        strategy = baselines.run(args.method, graph, cluster, evaluator=ev)
    res = ev.evaluate(strategy, method=strategy.method or args.method or "strategy")
    res.search_time_s = float(strategy.meta.get("search_time_s", 0.0))
    if args.trace:
        import simulator

        simulator.write_chrome_trace(res.plan.tg, res.sim, args.trace)
    if args.gantt:
        import simulator

        title = f"{graph.name} on {cluster.name}: {res.method} ({res.iteration_time_s * 1e3:.1f} ms)"
        simulator.plot_gantt(res.plan.tg, res.sim, args.gantt, title=title)
    rec = {**res.record(), "graph": graph.name, "cluster": cluster.name}
    _emit(args, rec, format_table([rec]))
    return 0


def cmd_bench(args) -> int:
    from heterog.bench import run_bench

    out = run_bench(quick=args.quick)
    _emit(args, out, "\n".join(f"{k:36s} {v}" for k, v in out.items()))
    return 0


def cmd_main(args) -> int:
    from heterog.main_job import main_job

    return main_job(out_dir=Path(args.out), quick=args.quick)


def format_table(records: list[dict]) -> str:
    """A plain-text table of simulate/compare records."""
    head = (f"{'method':12s} {'iter ms':>9s} {'order':>15s} {'compute ms':>10s} {'comm ms':>9s} {'overlap':>7s} "
            f"{'peak GiB (max)':>14s} {'OOM':>4s} {'search s':>8s}")
    lines = [head, "-" * len(head)]
    for r in records:
        peak = max(r["peak_memory_bytes"].values()) / 2**30 if r["peak_memory_bytes"] else 0.0
        lines.append(f"{r['method']:12s} {r['iteration_time_s'] * 1e3:9.2f} {r.get('order', ''):>15s} "
                     f"{r['compute_time_s'] * 1e3:10.2f} "
                     f"{r['comm_time_s'] * 1e3:9.2f} {r['overlap_ratio']:7.2f} {peak:14.2f} "
                     f"{'yes' if r['oom'] else 'no':>4s} {r.get('search_time_s', 0.0):8.2f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from heterog.scheduler import DEFAULT_ORDER, ORDERS

    ap = argparse.ArgumentParser(prog="heterog", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("capture", help="capture a model's training step into a graph file")
    p.add_argument("model", help="zoo name or path/to/file.py:build")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--no-fuse", action="store_true", help="keep zero-cost view ops as separate ops")
    p.add_argument("--no-cache", action="store_true", help="capture again even if a cached graph exists")
    p.add_argument("-o", "--output", required=True, help="graph file to write (.json or .json.gz)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_capture)

    p = sub.add_parser("simulate", help="simulate one training iteration of a plan")
    _add_graph_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--strategy", help="strategy JSON file")
    g.add_argument("--method", help="planner name (single, ev-ps, ev-ar, cp-ps, cp-ar, ...)")
    p.add_argument("--order", choices=list(ORDERS), default=DEFAULT_ORDER,
                   help="task order: best (default: the faster of rank-contention and FIFO, and the plan's own "
                        "op order if it has one), upward rank bounded by each resource's queue, FIFO ready queue, "
                        "the paper's upward rank, earliest start first, rank on links with earliest start on GPUs, "
                        "or the plan's own op order")
    p.add_argument("--serialize-collectives", action="store_true", help="NCCL-style: one collective at a time")
    p.add_argument("--trace", help="write a Chrome trace JSON here")
    p.add_argument("--gantt", help="write a Gantt chart PNG here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_simulate)

    p = sub.add_parser("bench", help="simulator and evaluation benchmarks")
    p.add_argument("--quick", action="store_true", help="smaller sizes (for tests)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("main", help="the `make run` job: capture, plan, compare, write trace and plots")
    p.add_argument("--out", default="results/main", help="output folder")
    p.add_argument("--quick", action="store_true", help="small model and budgets (for tests)")
    p.set_defaults(fn=cmd_main)

    for extra in _extra_commands():
        extra(sub)
    return ap


def _extra_commands():
    """Subcommands contributed by other modules (planning, runtime)."""
    import importlib

    out = []
    for mod in ("heterog.cli_plan", "heterog.cli_run"):
        try:
            out.append(importlib.import_module(mod).add_commands)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except HeterogError as exc:
        print(f"heterog {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"heterog {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
