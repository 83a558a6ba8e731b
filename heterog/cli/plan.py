"""``heterog plan``: write the strategy of one method (a baseline, a search or the learning agent) to a file."""
from __future__ import annotations

import argparse
import ast
from dataclasses import replace
from pathlib import Path
from typing import Any

from heterog.cli.args import add_graph_args, add_parallel_args, graph_and_cluster
from heterog.cli.output import add_json_flag, emit

DEFAULT_METHOD = "agent"


def planner_options(pairs: list[str]) -> dict:
    """``--option NAME=VALUE`` pairs -> the planner's own options; a VALUE that is a Python literal (number,
    None, list, ...) is read as one, true and false (any case) as booleans, anything else is a string."""
    from heterog.errors import HeterogError
    from heterog.planners import OPTIONS

    out: dict[str, Any] = {}
    for pair in pairs:
        name, eq, text = pair.partition("=")
        if not eq or not name.strip():
            raise HeterogError(f"--option takes NAME=VALUE, got {pair!r}")
        name = name.strip()
        if name in OPTIONS:
            raise HeterogError(f"--option {name}: a shared planning option, set by its own flag")
        if text.strip().lower() in ("true", "false"):        # splits=true, as in YAML
            out[name] = text.strip().lower() == "true"
            continue
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from heterog import planners
    from heterog.evaluate import Evaluator

    method = DEFAULT_METHOD if args.agent else (args.method or DEFAULT_METHOD)
    planners.parse_methods([method])
    own = planner_options(args.option)
    planners.get(method).check_options(own)          # before the graph is captured
    graph, cluster = graph_and_cluster(args)
    ev = Evaluator(graph, cluster, sync_batch_stats=args.sync_batch_stats)
    strategy = planners.plan(method, evaluator=ev, budget_s=args.budget_s, seed=args.seed, checkpoint=args.agent,
                             episodes=args.episodes, workers=args.workers, ray_address=args.ray_address, **own)
    if args.sync_batch_stats:                    # planned with them: the plan says so
        strategy = replace(strategy, sync_batch_stats=True, meta=dict(strategy.meta))
    path = strategy.save(args.output)
    res = ev.evaluate(strategy, method=method)
    doc = {"method": method, "graph": graph.name, "cluster": cluster.name, "output": str(path),
           "n_groups": strategy.n_groups, "iteration_time_s": res.iteration_time_s, "oom": res.oom,
           "search_time_s": float(strategy.meta.get("search_time_s", 0.0)), "micro_batches": list(strategy.micro),
           "schedule": res.plan.schedule if strategy.n_micro > 1 and res.plan is not None else None,
           "recomputed_groups": list(strategy.recompute),
           "split_groups": [g for g, cfg in enumerate(strategy.configs) if cfg.split is not None],
           "sync_batch_stats": strategy.sync_batch_stats}
    if "policy_plan_s" in strategy.meta:        # zero-shot: the policy's own plan, before the DP comparison
        doc.update({k: strategy.meta[k] for k in ("policy_plan_s", "policy_plan_oom", "kept")})
    micro = f", {strategy.n_micro} micro-batches ({doc['schedule']})" if strategy.n_micro > 1 else ""
    if strategy.recompute:
        micro += f", {len(strategy.recompute)} groups recomputed"
    split_groups = [g for g, cfg in enumerate(strategy.configs) if cfg.split is not None]
    if split_groups:
        micro += f", {len(split_groups)} groups split beyond the batch"
    if strategy.sync_batch_stats:
        micro += ", batch statistics synchronized"
    emit(args, doc, f"{method}: {strategy.n_groups} groups{micro}, simulated {res.iteration_time_s * 1e3:.2f} ms "
                    f"per iteration{' (OOM)' if res.oom else ''}, searched {doc['search_time_s']:.1f} s -> {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="write the strategy of one method (default: the learning agent)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_graph_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--method", default=None, help="planner name (default: agent)")
    g.add_argument("--agent", default=None, metavar="CKPT",
                   help="fine-tune the agent from this checkpoint (default: the pretrained one shipped with the "
                        "package; 'scratch': a fresh policy)")
    p.add_argument("--episodes", type=int, default=None, help="episodes for the agent")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="time budget of a search; 0 for the agent: the pretrained checkpoint's plan, zero-shot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an option of the method's own (repeatable), e.g. --option max_evals=2000 for mcmc")
    p.add_argument("--sync-batch-stats", action="store_true",
                   help="batch norms use the statistics of the whole batch (all-reduced over replicas and "
                        "micro-batches, as torch.nn.SyncBatchNorm), planned and written so")
    p.add_argument("-o", "--output", required=True, type=Path, help="strategy JSON to write")
    add_parallel_args(p)
    add_json_flag(p)
    p.set_defaults(fn=cmd_plan)
