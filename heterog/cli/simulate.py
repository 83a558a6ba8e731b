"""``heterog simulate``: simulate one training iteration of a plan (a strategy file or a method's plan)."""
from __future__ import annotations

import argparse

from heterog.cli.args import add_graph_args, resolve_graph
from heterog.cli.output import add_json_flag, emit


def cmd_simulate(args: argparse.Namespace) -> int:
    from heterog import planners
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.reporting import Column, Table, format_table
    from heterog.strategy import Strategy

    graph = resolve_graph(args.graph, args.batch_size, args.optimizer)
    cluster = load_cluster(args.cluster)
    layer_profile = None
    if args.layer_profiles:
        from heterog.cost import LayerProfile

        layer_profile = LayerProfile.load(args.layer_profiles, args.layer_profile_model)
    ev = Evaluator(graph, cluster, order=args.order, serialize_collectives=args.serialize_collectives,
                   layer_profile=layer_profile)
    if args.strategy:
        strategy = Strategy.load(args.strategy)
        strategy.check_fits(graph, cluster)
    else:
        strategy = planners.plan(args.method, evaluator=ev)
    res = ev.evaluate(strategy, method=strategy.method or args.method or "strategy")
    res.search_time_s = float(strategy.meta.get("search_time_s", 0.0))
    assert res.plan is not None and res.sim is not None          # Evaluator.evaluate keeps both
    if args.trace:
        import simulator

        simulator.write_chrome_trace(res.plan.tg, res.sim, args.trace)
    if args.gantt:
        import simulator

        title = f"{graph.name} on {cluster.name}: {res.method} ({res.iteration_time_s * 1e3:.1f} ms)"
        simulator.plot_gantt(res.plan.tg, res.sim, args.gantt, title=title)
    rec = {**res.record(), "graph": graph.name, "cluster": cluster.name}
    text = format_table([rec])
    if layer_profile is not None:
        rec["time_sources"] = sources = ev.time_sources(res.plan)
        tab = Table([Column("device type", 12, "left"), Column("source", 9, "left"), Column("ops", 6),
                     Column("tasks", 7), Column("compute ms", 11)])
        for t, by in sources.items():
            for src, v in by.items():
                tab.add(t, src, f"{v['ops']:.0f}", f"{v['tasks']:.0f}", f"{v['seconds'] * 1e3:.3f}")
        text += f"\ncompute time sources (layer profile {layer_profile.model!r}):\n" + tab.text(rule=True)
    emit(args, rec, text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from heterog.scheduler import DEFAULT_ORDER, ORDERS

    p = sub.add_parser("simulate", help="simulate one training iteration of a plan")
    add_graph_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--strategy", help="strategy JSON file")
    g.add_argument("--method", help="planner name (single, ev-ps, ev-ar, cp-ps, cp-ar, ...)")
    p.add_argument("--order", choices=list(ORDERS), default=DEFAULT_ORDER,
                   help="task order: best (default: the faster of rank-contention and FIFO, and the plan's own "
                        "op order if it has one), upward rank bounded by each resource's queue, FIFO ready queue, "
                        "the paper's upward rank, earliest start first, rank on links with earliest start on GPUs, "
                        "or the plan's own op order")
    p.add_argument("--serialize-collectives", action="store_true", help="NCCL-style: one collective at a time")
    p.add_argument("--layer-profiles", metavar="DIR",
                   help="per-layer profiles in Metis' layout (DIR/<GPU>/mbs<b>_tmp<t>.json, or DIR/<MODEL>/... "
                        "with --layer-profile-model): profiled layers take their measured times on those GPUs")
    p.add_argument("--layer-profile-model", metavar="MODEL", default=None,
                   help="the model's folder under --layer-profiles (e.g. OPT-350)")
    p.add_argument("--trace", help="write a Chrome trace JSON here")
    p.add_argument("--gantt", help="write a Gantt chart PNG here")
    add_json_flag(p)
    p.set_defaults(fn=cmd_simulate)
