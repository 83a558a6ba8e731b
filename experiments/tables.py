"""The planner tables of docs/results.md: every planner and the agent, at one search budget, on the paper's
eight models and its two clusters, under the default task order.

    python -m experiments.tables --budget-s 30 --jobs 2 --out results/tables      # run (resumes)
    python -m experiments.tables --out results/tables --render                    # tables only

Each (model, cluster) case runs ``heterog.compare.compare`` in its own process and is saved as
``<model>-b<batch>-<cluster>.json`` (written, then renamed; finished cases are not run again). Besides
the comparison records, a case stores the DP baselines under FIFO and under the paper's upward rank, and
for every plan the share of compute ops under PS data parallelism, AllReduce data parallelism and model
parallelism (the paper's Table 2, by synchronisation).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys
from pathlib import Path

from experiments.args import argparse_type, model_batch_list, parser

PAPER_MODELS = ("vgg19:192", "resnet200:192", "inception_v3:192", "mobilenet_v2:192", "nasnet:192",
                "transformer:720", "bert_large:48", "xlnet_large:48")
CLUSTERS = ("paper-8gpu", "paper-12gpu")
DP = ("ev-ps", "ev-ar", "cp-ps", "cp-ar")
SEARCHES = ("dpos", "os-dpos", "pesto-ilp", "mcmc", "agent")


def sync_shares(strategy, graph) -> dict[str, float]:
    """Share of compute ops whose group runs PS data parallelism, AllReduce data parallelism, or one device."""
    import numpy as np

    kind = np.array([("mp" if c.n_replicas == 1 else "ps" if c.sync == "ps" else "ar") for c in strategy.configs])
    ops = kind[strategy.group_of[np.nonzero(graph.is_compute)[0]]]
    return {k: float(np.mean(ops == k)) if len(ops) else 0.0 for k in ("ps", "ar", "mp")}


def run_case(model: str, batch: int, cluster_name: str, budget_s: float, seed: int, path: str) -> str:
    """Compare every planner and the agent on one case and save the case document."""
    from heterog.atomic import atomic_write_json
    from heterog.cluster import load_cluster
    from heterog.compare import compare
    from heterog.graph.cache import capture_model
    from heterog.planners import default_methods

    graph = capture_model(model, batch)
    cluster = load_cluster(cluster_name)
    methods = [m for m in default_methods() if m != "random"] + ["agent"]
    # the agent trains from scratch here (its column is the from-scratch agent), not from the shipped checkpoint
    comp = compare(graph, cluster, methods, budget_s=budget_s, seed=seed, progress=False,
                   agent_checkpoint="scratch")
    doc = comp.document()
    ev_orders = {}
    for r in comp.results:
        r.record["sync_shares"] = sync_shares(r.strategy, graph)
    from heterog.evaluate import Evaluator

    ev = Evaluator(graph, cluster)
    for r in comp.results:
        if r.method in DP:
            ev_orders[r.method] = {o: ev.evaluate(r.strategy, order=o).iteration_time_s for o in ("fifo", "rank")}
    doc["records"] = comp.records()
    doc["dp_other_orders_s"] = ev_orders
    atomic_write_json(Path(path), doc)
    return path


def _case_path(out: Path, model: str, batch: int, cluster: str) -> Path:
    return out / f"{model}-b{batch}-{cluster}.json"


def render(out: Path) -> str:
    """Markdown tables of every saved case, one block per cluster."""
    cases = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    lines = []
    for cluster in CLUSTERS:
        rows = [c for c in cases if c["cluster"] == cluster]
        if not rows:
            continue
        budget = rows[0]["budget_s"]
        lines += [f"### {cluster}: ms per iteration (default order `best`; OOM marked; search budget {budget:g} s)",
                  "", "| model | single | " + " | ".join(DP) + " | expert | " + " | ".join(SEARCHES) + " |",
                  "|---|" + "---:|" * (2 + len(DP) + len(SEARCHES))]
        for c in rows:
            rec = {r["method"]: r for r in c["records"]}
            cells = [f"{rec[m]['iteration_time_s'] * 1e3:.0f}{' OOM' if rec[m]['oom'] else ''}" if m in rec else "-"
                     for m in ("single", *DP, "expert", *SEARCHES)]
            lines.append(f"| {c['graph']}-b{c['batch_size']} | " + " | ".join(cells) + " |")
        lines += ["", f"### {cluster}: best plan against the best DP baseline", "",
                  "| model | best DP (order kept) | best plan (order kept) | speed-up, default order | "
                  "vs DP under its best order (default or FIFO) | vs DP under paper's rank | lower bound | "
                  "best plan / bound | best plan PS / AR / MP ops |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for c in rows:
            fit = [r for r in c["records"] if not r["oom"]]
            dps = [r for r in fit if r["method"] in DP]
            if not fit or not dps:
                lines.append(f"| {c['graph']}-b{c['batch_size']} | all DP OOM | | | | | | | |")
                continue
            dp = min(dps, key=lambda r: r["iteration_time_s"])
            best = min(fit, key=lambda r: r["iteration_time_s"])
            other = c["dp_other_orders_s"]
            dp_best_order = min(min(r["iteration_time_s"], other[r["method"]]["fifo"]) for r in dps)
            dp_rank = min(other[r["method"]]["rank"] for r in dps)
            t, lb = best["iteration_time_s"], c["lower_bound_s"]
            mix = best["sync_shares"]
            lines.append(
                f"| {c['graph']}-b{c['batch_size']} | {dp['method']} {dp['iteration_time_s'] * 1e3:.1f} "
                f"({dp['order']}) | {best['method']} {t * 1e3:.1f} ({best['order']}) | "
                f"{dp['iteration_time_s'] / t:.3f}x | {dp_best_order / t:.3f}x | {dp_rank / t:.3f}x | "
                f"{lb * 1e3:.1f} | {t / lb:.2f} | {mix['ps'] * 100:.0f}% / {mix['ar'] * 100:.0f}% / "
                f"{mix['mp'] * 100:.0f}% |")
        lines += ["", f"### {cluster}: share of compute ops under PS / AllReduce / one device, per searched plan", "",
                  "| model | " + " | ".join(SEARCHES) + " |", "|---|" + "---|" * len(SEARCHES)]
        for c in rows:
            rec = {r["method"]: r for r in c["records"]}
            cells = [(lambda s: f"{s['ps'] * 100:.0f} / {s['ar'] * 100:.0f} / {s['mp'] * 100:.0f}")(
                rec[m]["sync_shares"]) if m in rec else "-" for m in SEARCHES]
            lines.append(f"| {c['graph']}-b{c['batch_size']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.tables", __doc__)
    ap.add_argument("--models", type=argparse_type(model_batch_list), default=",".join(PAPER_MODELS),
                    help="MODEL:BATCH,...")
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--budget-s", type=float, default=30.0, help="search budget of every budgeted planner")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (one process each)")
    ap.add_argument("--out", default="results/tables")
    ap.add_argument("--render", action="store_true", help="only print the tables of the saved cases")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.render:
        todo = []
        for model, batch in args.models:
            for cluster in args.clusters.split(","):
                p = _case_path(out, model, batch, cluster)
                if not p.exists():
                    todo.append((model, batch, cluster, args.budget_s, args.seed, str(p)))
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            for done in pool.starmap(run_case, todo, chunksize=1):
                print(f"wrote {done}", file=sys.stderr)
    print(render(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
