"""Splits beyond the batch, measured (docs/results.md, "Splits beyond the batch"): each planner with and
without splits at the same budget, proportional against even shards of the same split, and split plans
run for real against data parallelism.

    python -m experiments.splits planners --graphs big_embedding:16 --cluster mixed-h100-a100-l4
        [--planners mcmc,pipeline,os-dpos,agent] [--budget-s 60] [--optimizer adam] [--json]
    python -m experiments.splits uneven --graphs bert_large:48,gpt2:8 --cluster CLUSTER.yaml
        [--devices 0,1] [--json]
    python -m experiments.splits runtime --graphs tiny_transformer:8 --cluster local-cpu-2:slowdown=1,3
        [--steps 8] [--warmup 3] [--json]
    python -m experiments.splits grids --graphs gpt2_xl:8 --optimizer adam --cluster mixed-h100-a100-l4 [--json]
    python -m experiments.splits bounds --graphs gpt2_xl:8 --optimizer adam --cluster paper-8gpu [--json]

``--cluster`` may be given several times.

``planners``: the plan of each planner with ``splits=False`` and ``splits=True`` (ms per iteration, OOM
marked) and the share of the plan's groups that are split. ``uneven``: every group divided over
``--devices`` (default: all) with even weights and with weights in proportion to peak FLOP/s
(``split_weights(cluster.power)``), along parameters and along attributes, simulated. ``runtime``: the
two even-shares data-parallel plans and those four split plans on the runtime: simulated and measured
iteration time (median after the warm-up steps), messages per step, and equivalence with single-process
training. ``grids``: every group on one grid (``ParallelConfig.split_grid``: one group per server, even
weights, batch shares in proportion to the servers' peak FLOP/s) over every set of two or more servers of
the same size, and every group divided over each server alone, each at its best micro-batches
(``pipeline.with_best_micro_batches``). ``bounds``: each server's compute time for the whole step divided
over its own devices (a one-server split, its busiest device), and from these rates two lower bounds
without any communication: every server working on every layer at once (rates added), and pipelines
whose stages are servers (balanced stages, at most one micro-batch per sample: ``(k + S - 1) / k`` times
the stage).
"""
from __future__ import annotations

import itertools
import sys

import numpy as np

from experiments.args import argparse_type, model_batch_list, parser, print_rows
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

PLANNERS = ("mcmc", "pipeline", "os-dpos")


def _graph(model: str, batch: int, optimizer: str):
    from heterog.cli.args import resolve_graph

    return resolve_graph(model, batch, optimizer=optimizer)


def split_strategies(graph, cluster, devices: tuple[int, ...]) -> dict:
    """Every group divided over ``devices``: ``{(weights label, kind): Strategy}``, even and proportional
    to peak FLOP/s, along parameters and along attributes."""
    from heterog.shares import split_weights
    from heterog.strategy import ParallelConfig, Strategy

    out = {}
    for label, weights in (("even", [1] * len(devices)),
                           ("proportional", split_weights(np.asarray(cluster.power)[list(devices)]))):
        for kind in ("parameter", "attribute"):
            cfg = ParallelConfig.split_over(devices, weights, graph.batch_size, kind=kind)
            out[(label, kind)] = Strategy(graph.fingerprint, cluster.name, cluster.n_devices, graph.batch_size,
                                          np.zeros(graph.n_ops, dtype=np.int64), [cfg])
    return out


def planner_case(graph, cluster, planner: str, budget_s: float) -> dict:
    """One planner's plan with and without splits at ``budget_s`` seconds each."""
    from heterog.evaluate import Evaluator
    from heterog.planners import get, plan

    row: dict = {"graph": f"{graph.name}-b{graph.batch_size}", "cluster": cluster.name, "planner": planner}
    quiet = {"progress": False} if "progress" in get(planner).options else {}
    for splits in (False, True):
        ev = Evaluator(graph, cluster)
        s = plan(planner, evaluator=ev, budget_s=budget_s, splits=splits, **quiet)
        r = ev.evaluate(s)
        key = "with" if splits else "without"
        row[key] = {"iteration_time_s": r.iteration_time_s, "oom": bool(r.oom),
                    "split_share": sum(c.split is not None for c in s.configs) / max(1, len(s.configs))}
    row["speedup"] = row["without"]["iteration_time_s"] / row["with"]["iteration_time_s"]
    return row


def uneven_case(graph, cluster, devices: tuple[int, ...]) -> dict:
    """Even against proportional shares of the same split, simulated."""
    from heterog.evaluate import Evaluator

    ev = Evaluator(graph, cluster)
    times = {f"{label}/{kind}": ev.evaluate(s).iteration_time_s
             for (label, kind), s in split_strategies(graph, cluster, devices).items()}
    return {"graph": f"{graph.name}-b{graph.batch_size}", "cluster": cluster.name, "devices": list(devices),
            "iteration_time_s": times,
            "speedup": {kind: times[f"even/{kind}"] / times[f"proportional/{kind}"]
                        for kind in ("parameter", "attribute")}}


def runtime_case(model: str, batch: int, cluster, steps: int, warmup: int) -> list[dict]:
    """Data-parallel and split plans run for real on ``cluster`` (one worker per device)."""
    from heterog import baselines
    from heterog.runtime import WorkerPool, compare_values, load_model, prepare, run_prepared, train_single_process

    m = load_model(model, batch, lr=0.01)
    plans = {dp: baselines.run(dp, m.graph, cluster) for dp in ("ev-ar", "cp-ar")}
    plans.update({f"{label}/{kind}": s for (label, kind), s in
                  split_strategies(m.graph, cluster, tuple(range(cluster.n_devices))).items()})
    _, ref = train_single_process(m, [m.example_inputs], steps)
    rows = []
    with WorkerPool(cluster.n_devices, "gloo", device_names=cluster.device_names) as pool:
        for name, s in plans.items():
            prepared = prepare(m, cluster, s)
            res = run_prepared(prepared, [m.example_inputs], steps, warmup=warmup, pool=pool)
            ok, diff, _ = compare_values(m, res.values, ref, rtol=1e-3, atol=1e-4)
            rows.append({"graph": f"{model}-b{batch}", "cluster": cluster.name, "plan": name,
                         "simulated_s": prepared.simulated_iteration_time_s, "measured_s": res.iteration_time_s,
                         "messages": res.n_messages, "equivalent": bool(ok), "max_abs_diff": diff})
    return rows


def _whole_graph(graph, cluster, cfg):
    from heterog.strategy import Strategy

    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, graph.batch_size,
                    np.zeros(graph.n_ops, dtype=np.int64), [cfg])


def grid_cases(graph, cluster) -> list[dict]:
    """Every group on a grid of any two or more servers of equal size, or divided over one server, each at its
    best micro-batches."""
    from heterog.baselines.pipeline import with_best_micro_batches
    from heterog.evaluate import Evaluator
    from heterog.shares import proportional_shares
    from heterog.strategy import ParallelConfig

    ev = Evaluator(graph, cluster)
    power = np.asarray(cluster.power, dtype=np.float64)
    servers = [tuple(int(d) for d in s.devices) for s in cluster.servers]
    cands = [(cluster.servers[i].name, ParallelConfig.split_over(servers[i], [1] * len(servers[i]),
                                                                  graph.batch_size))
             for i in range(len(servers)) if len(servers[i]) > 1]
    for pick in (sub for k in range(2, len(servers) + 1) for sub in itertools.combinations(range(len(servers)), k)):
        groups = [servers[i] for i in pick]
        shares = proportional_shares(graph.batch_size, [power[list(g)].sum() for g in groups])
        if len({len(g) for g in groups}) == 1 and min(shares) > 0:
            cands.append(("grid " + "+".join(cluster.servers[i].name for i in pick),
                          ParallelConfig.split_grid(groups, [1] * len(groups[0]), shares)))
    rows = []
    for name, cfg in cands:
        best = with_best_micro_batches(ev, _whole_graph(graph, cluster, cfg), graph.batch_size)
        t, oom = ev.iteration_time(best)
        rows.append({"graph": graph.name, "cluster": cluster.name, "plan": name,
                     "batch_shares": list(cfg.shares[::cfg.group_size]), "micro_batches": best.micro_batches,
                     "iteration_time_s": float(t), "oom": bool(oom)})
    return rows


def bound_case(graph, cluster) -> dict:
    """Each server's compute time for the whole step divided over its devices, and the two bounds of the
    module docstring."""
    from heterog.compiler import TaskKind
    from heterog.evaluate import Evaluator
    from heterog.strategy import ParallelConfig

    ev = Evaluator(graph, cluster)
    t_server = []
    for s in cluster.servers:
        devs = tuple(int(d) for d in s.devices)
        cfg = ParallelConfig.split_over(devs, [1] * len(devs), graph.batch_size) if len(devs) > 1 else \
            ParallelConfig.single(devs[0], graph.batch_size)
        plan = ev.evaluate(_whole_graph(graph, cluster, cfg)).plan
        comp = plan.task_kind == TaskKind.COMPUTE
        busy = np.bincount(plan.task_device[comp], weights=plan.tg.duration[comp], minlength=cluster.n_devices)
        t_server.append(float(busy[list(devs)].max()))
    rate = 1.0 / np.array(t_server)
    k = graph.batch_size
    pipes = [((k + n - 1) / k / rate[list(sub)].sum(), sub) for n in range(2, len(t_server) + 1)
             for sub in itertools.combinations(range(len(t_server)), n)]
    pipe, sub = min(pipes) if pipes else (float("inf"), ())
    return {"graph": graph.name, "cluster": cluster.name,
            "server_compute_s": dict(zip((s.name for s in cluster.servers), t_server)),
            "all_servers_s": float(1.0 / rate.sum()), "pipeline_s": float(pipe),
            "pipeline_stages": [cluster.servers[i].name for i in sub]}


def main(argv: list[str] | None = None) -> int:
    p = parser("experiments.splits", __doc__)
    p.add_argument("what", choices=("planners", "uneven", "runtime", "grids", "bounds"))
    p.add_argument("--graphs", type=argparse_type(model_batch_list), required=True, help="MODEL:BATCH,...")
    p.add_argument("--cluster", action="append", required=True, help="a cluster name or YAML path (repeatable)")
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--devices", default=None, help="uneven: the split's devices, e.g. 0,1 (default: all)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from heterog.cluster import load_cluster

    rows: list[dict] = []
    try:
        clusters = [load_cluster(c) for c in args.cluster]
        for model, batch in args.graphs:
            for cluster in clusters:
                if args.what == "runtime":
                    rows += runtime_case(model, batch, cluster, args.steps, args.warmup)
                    continue
                graph = _graph(model, batch, args.optimizer)
                if args.what == "planners":
                    rows += [planner_case(graph, cluster, pl.strip(), args.budget_s)
                             for pl in args.planners.split(",") if pl.strip()]
                elif args.what == "grids":
                    rows += grid_cases(graph, cluster)
                elif args.what == "bounds":
                    rows.append(bound_case(graph, cluster))
                else:
                    devs = tuple(int(d) for d in args.devices.split(",")) if args.devices else \
                        tuple(range(cluster.n_devices))
                    rows.append(uneven_case(graph, cluster, devs))
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_rows(rows, args.json, lambda r: _table(args.what, r))


def _table(what: str, rows: list[dict]) -> Table:
    def ms(t: float, oom: bool = False) -> str:
        return f"{t * 1e3:.1f}{' OOM' if oom else ''}"
    if what == "planners":
        table = Table([Column("graph", align="left"), Column("cluster", align="left"),
                       Column("planner", align="left"), Column("without"), Column("with"), Column("share"),
                       Column("speed-up")])
        for r in rows:
            w, s = r["without"], r["with"]
            table.add(r["graph"], r["cluster"], r["planner"], ms(w["iteration_time_s"], w["oom"]),
                      ms(s["iteration_time_s"], s["oom"]), f"{s['split_share']:.3f}", f"{r['speedup']:.2f}")
    elif what == "uneven":
        table = Table([Column("graph", align="left"), Column("cluster", align="left"),
                       Column("even (parameter / attribute)"), Column("proportional"), Column("speed-up")])
        for r in rows:
            t, sp = r["iteration_time_s"], r["speedup"]
            table.add(r["graph"], r["cluster"], f"{ms(t['even/parameter'])} / {ms(t['even/attribute'])}",
                      f"{ms(t['proportional/parameter'])} / {ms(t['proportional/attribute'])}",
                      f"{sp['parameter']:.2f}x / {sp['attribute']:.2f}x")
    elif what == "grids":
        table = Table([Column("graph", align="left"), Column("cluster", align="left"), Column("plan", align="left"),
                       Column("batch shares", align="left"), Column("micro-batches", align="left"), Column("step")])
        for r in rows:
            table.add(r["graph"], r["cluster"], r["plan"], str(r["batch_shares"]), str(r["micro_batches"]),
                      ms(r["iteration_time_s"], r["oom"]))
    elif what == "bounds":
        table = Table([Column("graph", align="left"), Column("cluster", align="left"),
                       Column("server compute", align="left"), Column("all servers"), Column("pipeline"),
                       Column("its stages", align="left")])
        for r in rows:
            table.add(r["graph"], r["cluster"], ", ".join(f"{n} {ms(t)}" for n, t in r["server_compute_s"].items()),
                      ms(r["all_servers_s"]), ms(r["pipeline_s"]), "+".join(r["pipeline_stages"]))
    else:
        table = Table([Column("graph", align="left"), Column("cluster", align="left"), Column("plan", align="left"),
                       Column("simulated"), Column("measured"), Column("messages"),
                       Column("equivalent", align="left")])
        for r in rows:
            table.add(r["graph"], r["cluster"], r["plan"], ms(r["simulated_s"]), ms(r["measured_s"]),
                      str(r["messages"]), str(r["equivalent"]))
    return table


if __name__ == "__main__":
    sys.exit(main())
