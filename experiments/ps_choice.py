"""How good is the compiler's automatic parameter-server choice? (issue: load-aware PS)

For each model, the PS data-parallel baselines (EV-PS, CP-PS) are simulated with the compiler's own PS
choice and with PS devices assigned outside the compiler by a greedy bytes-balanced rule (groups in
decreasing gradient bytes, each onto its least-loaded replica device), both under the default order.

    python -m experiments.ps_choice [--cluster paper-8gpu] [--models bert_large:48,vgg19:192,transformer:720]
"""
from __future__ import annotations

import dataclasses

import numpy as np

from experiments.args import argparse_type, model_batch_list, parser
from heterog import baselines
from heterog.cluster import load_cluster
from heterog.compiler.index import graph_index
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.strategy import Strategy


def bytes_balanced(ev: Evaluator, strategy: Strategy) -> Strategy:
    """``strategy`` with every PS group's PS set by the greedy bytes-balanced rule."""
    gi = graph_index(ev.graph)
    agg = np.fromiter(ev.compile(strategy).aggregated, dtype=np.int64)
    group_bytes = np.bincount(strategy.group_of[gi.t_op[agg]], weights=gi.t_bytes[agg], minlength=strategy.n_groups)
    load = np.zeros(ev.cluster.n_devices)
    configs = list(strategy.configs)
    for g in np.lexsort((np.arange(len(group_bytes)), -group_bytes)).tolist():
        c = configs[g]
        if c.sync != "ps" or c.n_replicas < 2:
            continue
        d = min(c.devices, key=lambda x: (load[x], x))
        load[d] += group_bytes[g]
        configs[g] = dataclasses.replace(c, ps_device=d)
    return dataclasses.replace(strategy, configs=configs)


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.ps_choice", __doc__)
    ap.add_argument("--cluster", default="paper-8gpu")
    ap.add_argument("--models", type=argparse_type(model_batch_list), default="bert_large:48,vgg19:192,transformer:720",
                    help="MODEL:BATCH,...")
    args = ap.parse_args(argv)
    cluster = load_cluster(args.cluster)
    print(f"{'model':16s} {'method':6s} {'auto ms':>9s} {'balanced ms':>11s} {'auto/balanced':>13s}  PS devices used")
    for model, batch in args.models:
        ev = Evaluator(capture_model(model, batch), cluster)
        for method in ("ev-ps", "cp-ps"):
            s = baselines.run(method, ev.graph, cluster, evaluator=ev)
            auto = ev.evaluate(s)
            bal = ev.evaluate(bytes_balanced(ev, s))
            used = np.bincount(list(auto.plan.ps_device.values()), minlength=cluster.n_devices)
            print(f"{f'{model}-{batch}':16s} {method:6s} {auto.iteration_time_s * 1e3:9.1f} "
                  f"{bal.iteration_time_s * 1e3:11.1f} {auto.iteration_time_s / bal.iteration_time_s:13.3f}  "
                  f"{used.tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
