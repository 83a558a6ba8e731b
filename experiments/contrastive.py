"""A contrastive model at realistic size on the paper's cluster (docs/results.md, "A contrastive loss at
ViT-B/16 size"): CLIP ViT-B/16 (``experiments/models/clip_vit_b16.py``) trained on its own loss, which compares
every image with every text of the batch, planned by the best data-parallel baseline and by searches; per
plan, the iteration time and what gathering the embeddings costs in it.

    python -m experiments.contrastive [--graph clip_vit_b16:256] [--cluster paper-8gpu]
        [--planners best-dp,pipeline,mcmc] [--budget-s 120] [--seed 0] [--out DIR] [--json]

The loss's ops couple samples (``heterog.graph.coupling``): they run once over the whole batch on one device
(``heterog.compiler.coupled``), so a plan gathers the embeddings of every replica there (*gather*: the
transfers, splits and concatenations that move values into a coupled op's device) and cuts their gradients
back to the replicas (*scatter*: those that move values a coupled op made). Per plan: its simulated
iteration time, the busy seconds of its gather and scatter tasks, the part of them on the critical path
(the gather and scatter tasks that end where a task of the critical path waits for them, by the simulated
schedule), the device that runs the coupled ops and its time in them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from experiments.args import argparse_type, model_batch, parser
from heterog.reporting import Column, Table

MODEL = "experiments/models/clip_vit_b16.py:build"
GRAPH = "clip_vit_b16:256"
PLANNERS = ("best-dp", "pipeline", "mcmc")
MOVES = ("TRANSFER", "RELAYOUT", "CONCAT")


def coupling_costs(graph: Any, plan: Any, start: np.ndarray, finish: np.ndarray) -> dict[str, float]:
    """What a compiled plan spends around its coupled ops (module docstring), seconds."""
    from heterog.compiler import TaskKind

    coupled = graph.coupled
    kinds = plan.task_kind
    dur = finish - start
    moves = np.isin(kinds, [int(TaskKind[k]) for k in MOVES])
    ptr, idx = plan.dep_ptr, plan.dep_idx
    compute = (kinds == TaskKind.COMPUTE)
    into = np.zeros(plan.n_tasks, dtype=bool)             # moves a coupled instance waits for (transitively)
    todo = [t for t in np.nonzero(compute & coupled[plan.task_op])[0].tolist()]
    seen = set(todo)
    while todo:
        t = todo.pop()
        for d in idx[ptr[t]:ptr[t + 1]].tolist():
            if moves[d] and d not in seen and not coupled[plan.task_op[d]]:
                seen.add(d)
                into[d] = True
                todo.append(d)
    out = moves & coupled[plan.task_op]                    # values a coupled op made, moved to the replicas
    critical = _critical(plan, start, finish)
    device = sorted({int(plan.task_device[t]) for t in np.nonzero(compute & coupled[plan.task_op])[0].tolist()})
    return {"gather_s": float(dur[into].sum()), "scatter_s": float(dur[out].sum()),
            "gather_critical_s": float(dur[into & critical].sum()),
            "scatter_critical_s": float(dur[out & critical].sum()),
            "coupled_compute_s": float(dur[compute & coupled[plan.task_op]].sum()),
            "coupled_devices": device}


def _critical(plan: Any, start: np.ndarray, finish: np.ndarray) -> np.ndarray:
    """(n_tasks,) the tasks of a critical path of the simulated schedule: from the last task to end, back
    through the dependency that ended last before each task started."""
    ptr, idx = plan.dep_ptr, plan.dep_idx
    out = np.zeros(plan.n_tasks, dtype=bool)
    t = int(np.argmax(finish))
    while t >= 0:
        out[t] = True
        deps = idx[ptr[t]:ptr[t + 1]]
        t = int(deps[np.argmax(finish[deps])]) if len(deps) else -1
    return out


def run_graph(model: str, batch: int, cluster_name: str, planners: list[str], budget_s: float,
              seed: int) -> list[dict[str, Any]]:
    from heterog import planners as registry
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    graph = capture_model(MODEL if model == "clip_vit_b16" else model, batch, "sgd")
    cluster = load_cluster(cluster_name)
    records = []
    for name in planners:
        ev = Evaluator(graph, cluster)
        strategy = registry.plan(name, evaluator=ev, budget_s=budget_s, seed=seed, progress=False)
        res = ev.evaluate(strategy, method=name)
        sim = res.sim
        rec = {"graph": f"{model}:{batch}", "cluster": cluster.name, "method": name,
               "iteration_time_s": float(res.iteration_time_s), "oom": bool(res.oom),
               "n_groups": strategy.n_groups, "micro_batches": list(strategy.micro),
               "coupled_ops": int(graph.coupled.sum()), "ops": graph.n_ops,
               **coupling_costs(graph, res.plan, np.asarray(sim.start), np.asarray(sim.finish))}
        records.append(rec)
        print(f"  {name}: {rec['iteration_time_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    best_dp = next((r["iteration_time_s"] for r in records if r["method"] == "best-dp"), None)
    for r in records:
        r["speedup_vs_best_dp"] = best_dp / r["iteration_time_s"] if best_dp else None
    return records


def table(records: list[dict[str, Any]]) -> Table:
    """One row per plan: time, against best-dp, gather and scatter busy and critical seconds, coupled ops."""
    def ms(x: float) -> str:
        return f"{x * 1e3:.2f}"

    out = Table([Column(h, align="left" if h == "method" else "right") for h in (
        "method", "iteration (ms)", "x best-dp", "gather (ms)", "gather on path (ms)", "scatter (ms)",
        "scatter on path (ms)", "coupled ops (ms)", "coupled on", "oom")],
        title="CLIP ViT-B/16: the contrastive loss in each plan")
    for r in records:
        out.add(r["method"], ms(r["iteration_time_s"]),
                f"{r['speedup_vs_best_dp']:.3f}" if r["speedup_vs_best_dp"] else "-", ms(r["gather_s"]),
                ms(r["gather_critical_s"]), ms(r["scatter_s"]), ms(r["scatter_critical_s"]),
                ms(r["coupled_compute_s"]), ",".join(map(str, r["coupled_devices"])), "yes" if r["oom"] else "")
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser("experiments.contrastive", __doc__)
    p.add_argument("--graph", type=argparse_type(model_batch), default=model_batch(GRAPH),
                   help=f"MODEL:BATCH (default {GRAPH}; clip_vit_b16 is {MODEL})")
    p.add_argument("--cluster", default="paper-8gpu")
    p.add_argument("--planners", default=",".join(PLANNERS), help="comma-separated planners")
    p.add_argument("--budget-s", type=float, default=120.0, help="search budget per planner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="folder for contrastive.json and contrastive.md")
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    args = p.parse_args(argv)
    model, batch = args.graph
    planners = [s.strip() for s in args.planners.split(",") if s.strip()]
    records = run_graph(model, batch, args.cluster, planners, args.budget_s, args.seed)
    markdown = table(records).markdown()
    if args.out is not None:
        from heterog.atomic import atomic_write, atomic_write_json

        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out / "contrastive.json", records)
        atomic_write(args.out / "contrastive.md", lambda f: f.write(markdown + "\n"))
    print(json.dumps(records, indent=1) if args.json else markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
