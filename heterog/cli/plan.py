"""``heterog plan``: write a strategy to a file: by default the fastest plan that fits of the project's portfolio
of planners within the budget (``heterog.replan``'s ``auto``), or that of one method (a baseline, a search or
the learning agent)."""
from __future__ import annotations

import argparse
import ast
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from heterog.cli.args import add_graph_args, add_parallel_args, graph_and_cluster
from heterog.cli.output import add_json_flag, emit

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import Strategy

DEFAULT_METHOD = "agent"        # what --agent, --episodes or --budget-s 0 without --method plan with
PORTFOLIO = "auto"              # what plan runs with none of them (``heterog.replan``)


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


def plan_method(args: argparse.Namespace) -> str:
    """The method ``plan`` runs: ``--method``'s; the agent with ``--agent``, ``--episodes`` or ``--budget-s 0``
    (its zero-shot plan), as before the portfolio was the default; else ``PORTFOLIO``."""
    if args.method:
        return str(args.method)
    if args.agent is not None or args.episodes is not None or args.budget_s == 0:
        return DEFAULT_METHOD
    return PORTFOLIO


def run_portfolio(args: argparse.Namespace, graph: OpGraph, cluster: Cluster) -> tuple[Strategy, dict[str, Any], str]:
    """The portfolio's plan (``heterog.replan``'s ``auto`` within ``--budget-s``), with the record of what each
    planner found (``method, budget_s, seconds, chosen, tried``) and the table of it for the terminal."""
    from heterog.replan import replan
    from heterog.reporting import portfolio_table

    found = replan(graph, cluster, PORTFOLIO, args.budget_s, seed=args.seed, sync_batch_stats=args.sync_batch_stats,
                   zero_shot=True, progress=not args.json, workers=args.workers, ray_address=args.ray_address)
    strategy = found.best
    record = found.record()
    strategy.meta["chosen_from"] = [e["method"] for e in found.tried if "oom" in e]
    return strategy, record, portfolio_table(found.tried, record["chosen"]).text(rule=True)


def cmd_plan(args: argparse.Namespace) -> int:
    from heterog import planners
    from heterog.errors import HeterogError
    from heterog.evaluate import Evaluator

    method = plan_method(args)
    own = planner_options(args.option)
    if method == PORTFOLIO:
        if own:
            raise HeterogError("--option sets one planner's own options: name the planner with --method")
        if not args.budget_s > 0:
            raise HeterogError(f"budget must be positive, got {args.budget_s} s")
    else:
        planners.parse_methods([method])
        planners.get(method).check_options(own)          # before the graph is captured
    graph, cluster = graph_and_cluster(args)
    ev = Evaluator(graph, cluster, sync_batch_stats=args.sync_batch_stats)
    portfolio: dict[str, Any] = {}
    table = ""
    if method == PORTFOLIO:
        strategy, portfolio, table = run_portfolio(args, graph, cluster)
    else:
        strategy = planners.plan(method, evaluator=ev, budget_s=args.budget_s, seed=args.seed,
                                 checkpoint=args.agent, episodes=args.episodes, workers=args.workers,
                                 ray_address=args.ray_address, **own)
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
        doc.update({k: strategy.meta[k] for k in ("policy_plan_s", "policy_plan_oom", "kept", "compared")})
    if portfolio:                               # which planner's plan won, and what every planner found
        doc.update({k: portfolio[k] for k in ("chosen", "budget_s", "seconds", "tried")})
        doc["search_time_s"] = portfolio["seconds"]                  # the whole portfolio's
    micro = f", {strategy.n_micro} micro-batches ({doc['schedule']})" if strategy.n_micro > 1 else ""
    if strategy.recompute:
        micro += f", {len(strategy.recompute)} groups recomputed"
    split_groups = [g for g, cfg in enumerate(strategy.configs) if cfg.split is not None]
    if split_groups:
        micro += f", {len(split_groups)} groups split beyond the batch"
    if strategy.sync_batch_stats:
        micro += ", batch statistics synchronized"
    line = (f"{method}: {strategy.n_groups} groups{micro}, simulated {res.iteration_time_s * 1e3:.2f} ms "
            f"per iteration{' (OOM)' if res.oom else ''}, searched {doc['search_time_s']:.1f} s -> {path}")
    if portfolio:
        line = (f"{table}\nchosen: {portfolio['chosen']} (the fastest plan that fits of {len(portfolio['tried'])} "
                f"planners, {portfolio['seconds']:.1f} s of a {args.budget_s:g} s budget)\n{line}")
    emit(args, doc, line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="write the fastest plan that fits of the planners' portfolio within the budget, "
                                    "or the strategy of one method",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_graph_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--method", default=None,
                   help="planner name (default: the portfolio: the DP baselines, single and expert, the shipped "
                        "policy's zero-shot plan, pipeline and mcmc sharing --budget-s, the fastest plan that fits "
                        "kept; the agent with --agent, --episodes or --budget-s 0)")
    g.add_argument("--agent", default=None, metavar="CKPT",
                   help="fine-tune the agent from this checkpoint (default: the pretrained one shipped with the "
                        "package; 'scratch': a fresh policy)")
    p.add_argument("--episodes", type=int, default=None, help="episodes for the agent")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="time budget of a search (of the whole portfolio without --method); 0 for the agent: the "
                        "pretrained checkpoint's plan, zero-shot")
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
