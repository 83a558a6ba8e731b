"""``heterog run``: train a plan for real with torch.distributed (one worker process per device; under
torchrun, this process is one rank of an env:// job), writing checkpoints, resuming from one, and surviving
lost workers (``heterog.runtime.checkpoint``, ``heterog.runtime.elastic``)."""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from heterog.cli.args import add_model_args
from heterog.cli.output import add_json_flag, emit
from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.runtime.api import Model, PreparedRun, RunResult
    from heterog.runtime.checkpoint import CheckpointSettings, Resumed
    from heterog.runtime.elastic import ElasticSettings
    from heterog.runtime.executor import Job
    from heterog.strategy import Strategy

log = logging.getLogger(__name__)


def _settings(args: argparse.Namespace) -> tuple[CheckpointSettings | None, ElasticSettings]:
    """The checkpoint and elastic settings of the arguments (checked as a whole, before anything runs)."""
    from heterog.runtime.checkpoint import CheckpointSettings
    from heterog.runtime.elastic import ElasticSettings

    ck = None
    if args.checkpoint_dir is not None:
        ck = CheckpointSettings(Path(args.checkpoint_dir), args.checkpoint_every, args.checkpoint_every_s, args.keep,
                                os.environ.get("TORCHELASTIC_RUN_ID"))
    elif (args.checkpoint_every, args.checkpoint_every_s, args.keep) != (None, None, None):
        raise HeterogError("--checkpoint-every, --checkpoint-every-s and --keep need --checkpoint-dir")
    devices = Path(args.devices_file) if args.devices_file else None
    elastic = ElasticSettings(args.max_restarts, args.replan_method, args.replan_budget_s, devices, args.seed,
                              args.sync_batch_stats)
    return ck, elastic


def _model(args: argparse.Namespace) -> tuple[Model, Cluster]:
    from heterog.cluster import load_cluster
    from heterog.runtime.api import load_model

    cluster = load_cluster(args.cluster)
    return load_model(args.model, args.batch_size, optimizer=args.optimizer, lr=args.lr), cluster


def _strategy(args: argparse.Namespace, model: Model, cluster: Cluster) -> Strategy:
    """The plan the arguments name or search for, with synchronized batch statistics under --sync-batch-stats."""
    from heterog.runtime.api import resolve_strategy

    strategy = resolve_strategy(model, cluster, strategy=args.strategy, method=args.method, seed=args.seed,
                                budget_s=args.plan_budget_s)
    if args.sync_batch_stats:
        strategy = replace(strategy, sync_batch_stats=True, meta=dict(strategy.meta))
    return strategy


def _resumed(args: argparse.Namespace, model: Model) -> Resumed | None:
    from heterog.runtime.api import resume_state

    return resume_state(model, args.resume) if args.resume is not None else None


def cmd_run(args: argparse.Namespace) -> int:
    from heterog.runtime.api import prepare, run_prepared
    from heterog.runtime.checkpoint import remove_incomplete
    from heterog.runtime.elastic import SurvivingRun
    from heterog.runtime.launcher import env_rank

    if args.steps < 1:
        raise HeterogError(f"--steps must be at least 1, got {args.steps}")
    ck, elastic = _settings(args)
    if env_rank() is not None:                       # one rank of a torchrun / env:// job
        if elastic.max_restarts:
            raise HeterogError("under torchrun, restarts are torchrun's: give --max-restarts to torchrun")
        return _run_env(args, ck, elastic)
    if args.node_devices:
        raise HeterogError("--node-devices names the devices of a torchrun node; it has no use without torchrun")
    model, cluster = _model(args)
    resumed = _resumed(args, model)                  # a bad checkpoint is refused before planning
    strategy = _strategy(args, model, cluster)
    if ck is not None:
        remove_incomplete(ck.directory)
    batches = [model.example_inputs]
    if elastic.max_restarts:
        result = SurvivingRun(model, cluster, strategy, batches, args.steps, checkpoint=ck, resume=resumed,
                              elastic=elastic, backend=args.backend, warmup=args.warmup,
                              hang_timeout_s=args.hang_timeout_s).run()
    else:
        result = run_prepared(prepare(model, cluster, strategy, backend=args.backend), batches, args.steps,
                              warmup=args.warmup, hang_timeout_s=args.hang_timeout_s, resume=resumed, checkpoint=ck)
    return _report(args, model, strategy, result)


def _run_env(args: argparse.Namespace, ck: CheckpointSettings | None, elastic: ElasticSettings) -> int:
    """One rank of an env:// job: rank 0 gathers the devices the ranks name, plans for them (the given plan
    on the cluster's own devices, a re-plan on any other set), resumes from this job's newest checkpoint
    when torchrun restarted it or its rendezvous changed the nodes, and hands each rank its program. Rank 0
    warns when torchrun's agents would stall on a node that joins (``heterog.runtime.launcher.joins_stall``)."""
    from heterog.runtime.api import collect
    from heterog.runtime.launcher import agent_argv, env_rank, joins_stall, run_env_job

    rank, _, local = env_rank() or (0, 1, 0)
    stall = joins_stall(agent_argv(), os.environ) if rank == 0 else None
    if stall:
        log.warning("%s", stall)
    mine = None
    if args.node_devices:
        names = [n.strip() for n in args.node_devices.split(",") if n.strip()]
        if local >= len(names):
            raise HeterogError(f"--node-devices names {len(names)} devices; local rank {local} has none")
        mine = names[local]
    box: dict[str, Any] = {}

    def make_jobs(names: list[str | None]) -> list[Job]:
        box["model"], box["prepared"], box["resumed"], box["replan"] = _env_plan(args, ck, elastic, names)
        return box["prepared"].jobs([box["model"].example_inputs], args.steps, resumed=box["resumed"],
                                    checkpoint=ck)

    gathered = run_env_job(make_jobs, args.backend, timeout_s=args.hang_timeout_s, device=mine)
    if gathered is None:
        return 0
    result = collect(box["prepared"], gathered, args.warmup, box["resumed"])
    return _report(args, box["model"], box["prepared"].strategy, result, replan=box["replan"])


def _env_plan(args: argparse.Namespace, ck: CheckpointSettings | None, elastic: ElasticSettings,
              names: list[str | None]) -> tuple[Model, PreparedRun, Resumed | None, dict[str, Any] | None]:
    """Rank 0's part of ``_run_env``: the model, the plan prepared for the ranks' devices (device i is rank
    i's), where training starts, and the re-plan's record (None: the given plan, on the cluster's own
    devices)."""
    from heterog.cluster.topology import subset
    from heterog.runtime.api import prepare, resume_state
    from heterog.runtime.checkpoint import newest_of_job, remove_incomplete
    from heterog.runtime.elastic import replan_prepared

    model, full = _model(args)
    if any(n is None for n in names):
        if any(n is not None for n in names):
            raise HeterogError("some ranks name their device (--node-devices) and some do not")
        if len(names) != full.n_devices:
            raise HeterogError(f"the job has {len(names)} processes for the {full.n_devices} devices of "
                               f"{full.name!r}; name each node's devices with --node-devices")
        names = list(full.device_names)
    cluster = subset(full, [str(n) for n in names], ordered=True)
    resumed = _resumed(args, model)
    if ck is not None:
        newest = newest_of_job(ck.directory, ck.job) if ck.job else None
        resumed = resume_state(model, newest) if newest is not None else resumed
        remove_incomplete(ck.directory)
    if cluster.name != full.name:
        prepared, record = replan_prepared(model, cluster, elastic, backend=args.backend)
        return model, prepared, resumed, {**record, "devices": cluster.device_names}
    return model, prepare(model, cluster, _strategy(args, model, cluster), backend=args.backend), resumed, None


def _report(args: argparse.Namespace, model: Model, strategy: Strategy, result: RunResult,
            replan: dict[str, Any] | None = None) -> int:
    """Print the run's record of ``model`` trained under ``strategy`` (``replan``: under torchrun, the re-plan
    this start made)."""
    from heterog.runtime.api import compare_values, train_single_process

    rec = {"model": args.model, "cluster": result.cluster, "batch_size": model.batch_size, "backend": args.backend,
           "optimizer": args.optimizer, "steps": args.steps, **result.record(), "replan": replan,
           "equivalent": None, "max_abs_param_diff": None}
    if args.check_equivalence:
        ref_losses, ref_values = train_single_process(model, [model.example_inputs], args.steps)
        ok, diff, bad = compare_values(model, result.values, ref_values)
        rec.update({"equivalent": ok, "max_abs_param_diff": diff, "params_differing": bad,
                    "reference_losses": ref_losses, "inexact_causes": model.inexact_causes(strategy)})
    ran = args.steps - result.first_step
    text = (f"{args.model} (batch {model.batch_size}) on {result.cluster} with {rec['method']} ({args.backend}): "
            f"{result.iteration_time_s * 1e3:.2f} ms/iteration measured (median of {ran - result.warmup_steps} "
            f"steps after {result.warmup_steps} warm-up), {result.simulated_iteration_time_s * 1e3:.2f} ms "
            f"simulated; final loss {result.losses[-1]:.4f}")
    if replan is not None:
        text += (f"\nre-planned for {', '.join(replan['devices'])} in {replan['seconds']:.2f} s (budget "
                 f"{replan['budget_s']:g} s): {replan['chosen']}")
    if result.first_step:
        text += f"\nresumed at step {result.first_step}"
    for r in result.restarts:
        text += (f"\nlost {', '.join(r['lost'])} at step {r['reached_step']}: resumed from step {r['resumed_from']} "
                 f"on {', '.join(r['devices'])} under {r['method']} (re-planned in {r['replan']['seconds']:.2f} s)")
    if result.checkpoints:
        text += (f"\ncheckpoints: {len(result.checkpoints)} written (steps "
                 f"{', '.join(str(s) for s, _ in result.checkpoints)}), "
                 f"{max(t for _, t in result.checkpoints):.2f} s the longest")
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
                                   "process is one rank of an env:// job). With --checkpoint-dir the ranks write "
                                   "checkpoints in torch.distributed.checkpoint's format; --resume continues "
                                   "from one under any plan; --max-restarts re-plans for the devices left when "
                                   "a worker is lost and resumes from the newest checkpoint.")
    add_model_args(p, "global batch (default: the model's)", "cluster YAML, built-in name or local-cpu-N[:...]")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--strategy", help="strategy JSON file (refused if made for another graph or cluster)")
    g.add_argument("--method", help="planner: single, ev-ps, ev-ar, cp-ps, cp-ar, expert, dpos, mcmc, random, "
                                    "agent, best-dp")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--steps", type=int, default=10, help="training steps (a resumed run: up to this step)")
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
    c = p.add_argument_group("checkpoints and restarts")
    c.add_argument("--checkpoint-dir", metavar="D", help="write checkpoints to D/step-N")
    c.add_argument("--checkpoint-every", type=int, metavar="N", help="a checkpoint every N steps (and the last)")
    c.add_argument("--checkpoint-every-s", type=float, metavar="T", help="a checkpoint when T seconds have passed")
    c.add_argument("--keep", type=int, metavar="K", help="keep the K newest checkpoints (default: all)")
    c.add_argument("--resume", metavar="D", help="start from checkpoint D (a step-N directory, or the newest "
                                                 "complete one in D), under this run's plan and cluster")
    c.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="when a worker is lost, re-plan for the devices left and resume, up to K times")
    c.add_argument("--replan-method", default="auto", metavar="NAME",
                   help="planner of a re-plan: auto (the best of the planners that fit the budget) or a method "
                        "(agent: the shipped policy's zero-shot plan)")
    c.add_argument("--replan-budget-s", type=float, default=5.0, metavar="S", help="seconds a re-plan may take")
    c.add_argument("--devices-file", metavar="F", help="the devices available, one a line, read at each re-plan: "
                                                       "a lost device listed again after its loss is used again")
    c.add_argument("--node-devices", metavar="NAMES", help="under torchrun: this node's devices of the cluster, "
                                                           "by local rank (comma-separated)")
    add_json_flag(p)
    p.set_defaults(fn=cmd_run)
