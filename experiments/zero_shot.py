"""Zero-shot plans of a pretrained checkpoint (by default the shipped one) on several graphs and clusters:
the policy's own greedy plan, the plan kept (the faster of it and the four DP plans) and the best DP
baseline, each in ms per iteration under the default order (docs/results.md, "One policy for any
cluster").

    python -m experiments.zero_shot [--checkpoint CKPT] [--graphs bert_large:48,vgg19:192,gpt2:8]
        [--clusters paper-8gpu,paper-12gpu,gen-8,gen-9,gen-65,mixed-a100-v100-t4] [--optimizer sgd] [--json]
"""
from __future__ import annotations

import sys

from experiments.args import argparse_type, model_batch_list, parser, print_rows
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

DP = ("ev-ps", "ev-ar", "cp-ps", "cp-ar")
GRAPHS = "bert_large:48,vgg19:192,gpt2:8"
CLUSTERS = "paper-8gpu,paper-12gpu,gen-8,gen-9,gen-65,mixed-a100-v100-t4"


def zero_shot_case(graph, cluster, checkpoint=None) -> dict:
    """One (graph, cluster): the zero-shot plan's meta against every DP baseline."""
    import time

    from agents.planner import plan
    from heterog import baselines
    from heterog.evaluate import Evaluator

    ev = Evaluator(graph, cluster)
    dps = {dp: ev.iteration_time(baselines.run(dp, graph, cluster, evaluator=ev)) for dp in DP}
    fit = {k: t for k, (t, oom) in dps.items() if not oom}
    best_dp = min(fit, key=fit.get) if fit else None
    t0 = time.perf_counter()
    meta = plan(ev, checkpoint, budget_s=0, progress=False).meta
    return {"graph": f"{graph.name}-b{graph.batch_size}", "cluster": cluster.name, "devices": cluster.n_devices,
            "policy_plan_s": meta["policy_plan_s"], "policy_plan_oom": bool(meta["policy_plan_oom"]),
            "kept": meta["kept"], "iteration_time_s": meta["best_iteration_time_s"], "oom": bool(meta["oom"]),
            "best_dp": best_dp, "best_dp_s": fit.get(best_dp), "plan_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.zero_shot", __doc__)
    ap.add_argument("--checkpoint", default=None, help="a tokens-head checkpoint (default: the shipped one)")
    ap.add_argument("--graphs", type=argparse_type(model_batch_list), default=GRAPHS, help="MODEL:BATCH,...")
    ap.add_argument("--clusters", default=CLUSTERS, help="cluster names or paths, comma-separated")
    ap.add_argument("--optimizer", default="sgd", help="the optimizer the graphs are captured with")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the Markdown table")
    args = ap.parse_args(argv)
    import torch

    from heterog.cluster import load_cluster
    from heterog.graph.cache import capture_model

    torch.set_num_threads(1)
    try:
        rows = []
        for model, batch in args.graphs:
            graph = capture_model(model, batch, args.optimizer)
            rows += [zero_shot_case(graph, load_cluster(c.strip()), args.checkpoint)
                     for c in args.clusters.split(",") if c.strip()]
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_rows(rows, args.json, _table)


def _table(rows: list[dict]) -> Table:
    def ms(t, oom=False):
        return "-" if t is None else f"{t * 1e3:.1f}{' OOM' if oom else ''}"
    table = Table([Column("graph", align="left"), Column("cluster", align="left"), Column("devices"),
                   Column("policy's plan"), Column("kept", align="left"), Column("best DP")])
    for r in rows:
        table.add(r["graph"], r["cluster"], str(r["devices"]), ms(r["policy_plan_s"], r["policy_plan_oom"]),
                  r["kept"], f"{r['best_dp']} {ms(r['best_dp_s'])}")
    return table


if __name__ == "__main__":
    sys.exit(main())
