"""``heterog run``: train a plan for real with torch.distributed (one worker process per device; under
torchrun, this process is one rank of an env:// job)."""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from heterog.cli.args import add_model_args
from heterog.cli.output import add_json_flag, emit
from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.runtime.api import Model, PreparedRun
    from heterog.runtime.executor import Job


def _prepare_from_args(args: argparse.Namespace) -> tuple[Model, Cluster, PreparedRun]:
    from heterog.cluster import load_cluster
    from heterog.runtime.api import load_model, prepare, resolve_strategy

    cluster = load_cluster(args.cluster)
    model = load_model(args.model, args.batch_size, optimizer=args.optimizer, lr=args.lr)
    strategy = resolve_strategy(model, cluster, strategy=args.strategy, method=args.method, seed=args.seed,
                                budget_s=args.plan_budget_s)
    if args.sync_batch_stats:
        strategy = replace(strategy, sync_batch_stats=True, meta=dict(strategy.meta))
    return model, cluster, prepare(model, cluster, strategy, backend=args.backend)


def cmd_run(args: argparse.Namespace) -> int:
    from heterog.runtime.api import collect, compare_values, run_prepared, train_single_process
    from heterog.runtime.launcher import env_rank, run_env_job

    if args.steps < 1:
        raise HeterogError(f"--steps must be at least 1, got {args.steps}")
    if env_rank() is not None:                       # one rank of a torchrun / env:// job
        box: dict[str, Any] = {}

        def make_jobs() -> list[Job]:
            box["model"], box["cluster"], box["prepared"] = _prepare_from_args(args)
            model = box["model"]
            return box["prepared"].jobs([model.example_inputs], args.steps)

        gathered = run_env_job(make_jobs, args.backend, timeout_s=args.hang_timeout_s)
        if gathered is None:
            return 0
        model, cluster, prepared = box["model"], box["cluster"], box["prepared"]
        result = collect(prepared, gathered, args.warmup)
    else:
        model, cluster, prepared = _prepare_from_args(args)
        result = run_prepared(prepared, [model.example_inputs], args.steps, warmup=args.warmup,
                              hang_timeout_s=args.hang_timeout_s)
    rec = {"model": args.model, "cluster": cluster.name, "batch_size": model.batch_size, "backend": args.backend,
           "optimizer": args.optimizer, "steps": args.steps, **result.record(),
           "equivalent": None, "max_abs_param_diff": None}
    if args.check_equivalence:
        ref_losses, ref_values = train_single_process(model, [model.example_inputs], args.steps)
        ok, diff, bad = compare_values(model, result.values, ref_values)
        rec.update({"equivalent": ok, "max_abs_param_diff": diff, "params_differing": bad,
                    "reference_losses": ref_losses, "inexact_causes": model.inexact_causes(prepared.strategy)})
    text = (f"{args.model} (batch {model.batch_size}) on {cluster.name} with {rec['method']} ({args.backend}): "
            f"{result.iteration_time_s * 1e3:.2f} ms/iteration measured (median of {args.steps - result.warmup_steps} "
            f"steps after {result.warmup_steps} warm-up), {result.simulated_iteration_time_s * 1e3:.2f} ms simulated; "
            f"final loss {result.losses[-1]:.4f}")
    if args.check_equivalence:
        text += (f"\nequivalent to single-process training: {'yes' if rec['equivalent'] else 'NO'} "
                 f"(max |param diff| {rec['max_abs_param_diff']:.3g})")
        if not rec["equivalent"] and rec["inexact_causes"]:
            text += "".join(f"\n  cause: {c}" for c in rec["inexact_causes"])
    emit(args, rec, text)
    return 0 if rec["equivalent"] in (None, True) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a plan for real with torch.distributed (one process per device)",
                       description="Train MODEL under a strategy on the devices of CLUSTER: one worker process "
                                   "per device (local-cpu-N: emulated on this machine; under torchrun: this "
                                   "process is one rank of an env:// job).")
    add_model_args(p, "global batch (default: the model's)", "cluster YAML, built-in name or local-cpu-N[:...]")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--strategy", help="strategy JSON file (refused if made for another graph or cluster)")
    g.add_argument("--method", help="planner: single, ev-ps, ev-ar, cp-ps, cp-ar, expert, dpos, mcmc, random, "
                                    "agent, best-dp")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median iteration time")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="seed of randomised planners")
    p.add_argument("--plan-budget-s", type=float, default=None, help="planning budget (agent, searches)")
    p.add_argument("--sync-batch-stats", action="store_true",
                   help="batch norms use the statistics of the whole batch (all-reduced over the replicas and "
                        "micro-batches of the step), whatever the strategy says")
    p.add_argument("--check-equivalence", action="store_true",
                   help="also train the same steps in one process and compare the parameters")
    p.add_argument("--hang-timeout-s", type=float, default=60.0, help="fail when no worker progresses this long")
    add_json_flag(p)
    p.set_defaults(fn=cmd_run)
