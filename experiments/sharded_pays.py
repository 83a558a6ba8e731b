"""Where sharded state (ZeRO stages 1-3) pays (docs/results.md, "Sharded state in the planners"): each
planner with and without sharded state at the same search budget, and for the best plan without it, why
sharding does or does not pay.

    python -m experiments.sharded_pays --graphs bert_large:16,gpt2:8 --cluster paper-8gpu --cluster gen-3
        [--planners pipeline,mcmc] [--budget-s 30] [--max-evals 200] [--seed 0] [--optimizer adam] [--json]

``--cluster`` may be given several times. Per (graph, cluster, planner): the simulated iteration time of the
plan found with ``sharded=False`` and with ``sharded=True`` (OOM marked), their ratio, the groups that keep
sharded state and the way the plan was made to fit (``meta["fit"]``: fits, sharded, recompute, ...). MCMC
runs ``--max-evals`` proposals (deterministic for the seed); the pipeline planner ``--budget-s`` seconds.

The bound, on the best plan without sharded state: its headroom (the smallest of each device's capacity
less its peak; negative: out of memory) and the plan with every data-parallel AllReduce group keeping
each stage's sharded state, on the GPUs and with the optimizer state offloaded to the host where the
cluster's servers have hosts (shards even, by memory or by speed; the fastest of each). Where the
headroom is positive, state memory is not what binds, and the stage-k plans measure what sharding adds:
stage 1 an all-gather on top of the AllReduce, stage 2 a reduce-scatter and an all-gather in place of it
(each replica updating its shard), stage 3 two more all-gathers of every parameter.
"""
from __future__ import annotations

import sys

from experiments.args import argparse_type, model_batch_list, parser, print_rows
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

PLANNERS = ("pipeline", "mcmc")


def _graph(model: str, batch: int, optimizer: str):
    from heterog.cli.args import resolve_graph

    return resolve_graph(model, batch, optimizer=optimizer)


def _summary(ev, strategy) -> dict:
    r = ev.evaluate(strategy)
    headroom = min(r.memory_capacity_bytes[d] - r.peak_memory_bytes[d] for d in r.peak_memory_bytes)
    return {"iteration_time_s": r.iteration_time_s, "oom": bool(r.oom), "headroom_bytes": float(headroom),
            "sharded_groups": sum(c.sharded is not None for c in strategy.configs),
            "stages": sorted({int(c.sharded.stage) for c in strategy.configs if c.sharded is not None}),
            "offloaded_groups": sum(c.sharded is not None and c.sharded.offloads for c in strategy.configs),
            "recomputed_groups": len(strategy.recompute), "micro_batches": strategy.n_micro,
            "fit": strategy.meta.get("fit", "")}


def choice_label(choice: dict) -> str:
    """"2" for stage 2 on the GPUs, "2+offload" for stage 2 with the optimizer state on the host."""
    return str(int(choice["stage"])) + ("" if choice.get("offload", "none") == "none" else "+offload")


def stage_bound(ev, strategy) -> dict:
    """``strategy`` with every group that may keeping each choice of sharded state (``STATE_CHOICES``:
    stages 1-3, on the GPUs or offloaded; a group of one device only offloads), the fastest plan of each
    (over shard weights even, by memory, by speed): {``choice_label``: (time, OOM)}; a choice no group can
    take is left out."""
    from heterog.baselines.fit import STATE_CHOICES, sharded_variants, state_order, with_sharded
    from heterog.sharded import SHARD_BY

    groups = state_order(ev, strategy)
    out: dict[str, tuple[float, bool]] = {}
    for choice in STATE_CHOICES:
        for by in SHARD_BY:
            made = {g: sharded_variants(strategy.configs[g], ev.cluster, (choice,), (by,)) for g in groups}
            taking = [g for g in groups if made[g]]
            if not taking:
                continue
            s = with_sharded(strategy, taking,
                             lambda c, ch=choice, b=by: sharded_variants(c, ev.cluster, (ch,), (b,))[0])
            t, oom = ev.iteration_time(s)
            key = choice_label(choice)
            if key not in out or (oom, t) < (out[key][1], out[key][0]):
                out[key] = (float(t), bool(oom))
    return out


def planner_case(graph, cluster, planner: str, budget_s: float, max_evals: int, seed: int) -> dict:
    """One planner's plan with and without sharded state at the same budget, and the bound."""
    from heterog.evaluate import Evaluator
    from heterog.planners import plan

    row: dict = {"graph": f"{graph.name}-b{graph.batch_size}", "cluster": cluster.name, "planner": planner}
    opts: dict = {"max_evals": max_evals, "seed": seed} if planner == "mcmc" else {"budget_s": budget_s}
    plans = {}
    for sharded in (False, True):
        ev = Evaluator(graph, cluster)
        plans[sharded] = plan(planner, evaluator=ev, sharded=sharded, **opts)
        row["with" if sharded else "without"] = _summary(ev, plans[sharded])
    w, s = row["without"], row["with"]
    row["ratio"] = w["iteration_time_s"] / s["iteration_time_s"]
    row["bound"] = {str(k): v for k, v in stage_bound(Evaluator(graph, cluster), plans[False]).items()}
    return row


def main(argv: list[str] | None = None) -> int:
    p = parser("experiments.sharded_pays", __doc__)
    p.add_argument("--graphs", type=argparse_type(model_batch_list), required=True, help="MODEL:BATCH,...")
    p.add_argument("--cluster", action="append", required=True, help="a cluster name or YAML path (repeatable)")
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--budget-s", type=float, default=30.0, help="the pipeline planner's search time")
    p.add_argument("--max-evals", type=int, default=200, help="MCMC's proposals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from heterog.cluster import load_cluster

    rows: list[dict] = []
    try:
        clusters = [load_cluster(c) for c in args.cluster]
        for model, batch in args.graphs:
            graph = _graph(model, batch, args.optimizer)
            for cluster in clusters:
                rows += [planner_case(graph, cluster, pl.strip(), args.budget_s, args.max_evals, args.seed)
                         for pl in args.planners.split(",") if pl.strip()]
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    code = print_rows(rows, args.json, _table)
    if not args.json:
        print("\n" + "\n".join(best_lines(rows)))
    return code


def best_of_planners(rows: list[dict]) -> list[dict]:
    """Per (graph, cluster): the fastest plan that fits among the planners' plans without sharded state and
    among those with it (None where none fits), and their ratio (without / with)."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        case = out.setdefault((r["graph"], r["cluster"]), {"graph": r["graph"], "cluster": r["cluster"],
                                                            "without": None, "with": None})
        for side in ("without", "with"):
            if not r[side]["oom"] and (case[side] is None or r[side]["iteration_time_s"] < case[side][1]):
                case[side] = (r["planner"], r[side]["iteration_time_s"])
    for case in out.values():
        w, s = case["without"], case["with"]
        case["ratio"] = w[1] / s[1] if w and s else None
    return list(out.values())


def best_lines(rows: list[dict]) -> list[str]:
    """One line per (graph, cluster): the best plan without and with sharded state, and the ratio."""
    lines = []
    for c in best_of_planners(rows):
        w, s = c["without"], c["with"]
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        lines.append(f"{c['graph']} on {c['cluster']}: best without "
                     f"{'none fits' if w is None else f'{w[0]} {w[1] * 1e3:.1f} ms'}, best with "
                     f"{'none fits' if s is None else f'{s[0]} {s[1] * 1e3:.1f} ms'}: {ratio}")
    return lines


def _ms(t: float, oom: bool = False) -> str:
    return f"{t * 1e3:.1f}{' OOM' if oom else ''}"


def _table(rows: list[dict]) -> Table:
    table = Table([Column("graph", align="left"), Column("cluster", align="left"), Column("planner", align="left"),
                   Column("without (ms)"), Column("with (ms)"), Column("ratio"), Column("with: stages / groups / fit"),
                   Column("headroom without (GiB)"), Column("all DP groups at stage 1 / 2 / 3 (ms)"),
                   Column("offloaded: stage 1 / 2 / 3 (ms)")])
    for r in rows:
        w, s, b = r["without"], r["with"], r["bound"]
        stages = " / ".join(_ms(*b[k]) if k in b else "-" for k in ("1", "2", "3"))
        offloaded = " / ".join(_ms(*b[k]) if k in b else "-" for k in ("1+offload", "2+offload", "3+offload"))
        table.add(r["graph"], r["cluster"], r["planner"], _ms(w["iteration_time_s"], w["oom"]),
                  _ms(s["iteration_time_s"], s["oom"]), f"{r['ratio']:.2f}",
                  f"{','.join(map(str, s['stages'])) or '-'} / {s['sharded_groups']} / {s['fit'] or '-'}",
                  f"{w['headroom_bytes'] / 2 ** 30:.2f}", stages, offloaded)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
