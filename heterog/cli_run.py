"""``heterog run`` (train a plan for real with torch.distributed) and ``heterog fidelity`` (measured vs
simulated iteration times over several plans); added to the ``heterog`` CLI by ``add_commands``."""
from __future__ import annotations

import json
import math
from typing import Any


def _emit(args, payload: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=1, default=_plain))
    else:
        print(text)


def _plain(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


# ----------------------------------------------------------------------------- run
def _prepare_from_args(args):
    from heterog.cluster import load_cluster
    from heterog.runtime.api import load_model, prepare, resolve_strategy

    cluster = load_cluster(args.cluster)
    model = load_model(args.model, args.batch_size, optimizer=args.optimizer, lr=args.lr)
    strategy = resolve_strategy(model, cluster, strategy=args.strategy, method=args.method, seed=args.seed,
                                budget_s=args.plan_budget_s)
    return model, cluster, prepare(model, cluster, strategy, backend=args.backend)


def cmd_run(args) -> int:
    from heterog.runtime.api import collect, compare_values, run_prepared, train_single_process
    from heterog.runtime.launcher import env_rank, run_env_job

    if args.steps < 1:
        from heterog.errors import HeterogError

        raise HeterogError(f"--steps must be at least 1, got {args.steps}")
    if env_rank() is not None:                       # one rank of a torchrun / env:// job
        box: dict = {}

        def make_jobs():
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
                    "reference_losses": ref_losses})
    text = (f"{args.model} (batch {model.batch_size}) on {cluster.name} with {rec['method']} ({args.backend}): "
            f"{result.iteration_time_s * 1e3:.2f} ms/iteration measured (median of {args.steps - result.warmup_steps} "
            f"steps after {result.warmup_steps} warm-up), {result.simulated_iteration_time_s * 1e3:.2f} ms simulated; "
            f"final loss {result.losses[-1]:.4f}")
    if args.check_equivalence:
        text += (f"\nequivalent to single-process training: {'yes' if rec['equivalent'] else 'NO'} "
                 f"(max |param diff| {rec['max_abs_param_diff']:.3g})")
    _emit(args, rec, text)
    return 0 if rec["equivalent"] in (None, True) else 1


# ----------------------------------------------------------------------------- fidelity
def cmd_fidelity(args) -> int:
    from heterog.runtime.fidelity import run_fidelity

    rep = run_fidelity(args.model, args.cluster, n_plans=args.plans, batch_size=args.batch_size, steps=args.steps,
                       warmup=args.warmup, repeats=args.repeats, profile_file=args.profile,
                       reprofile=args.reprofile, plot=args.plot, hang_timeout_s=args.hang_timeout_s,
                       breakdown=args.breakdown)
    rec = rep.record()
    head = (f"{rep.model} (batch {rep.batch_size}) on {rep.cluster}: MAPE {rep.mape:.1f}%, Kendall tau "
            f"{rep.kendall_tau:.2f} over {len(rep.pairs)} plans (profile {rep.profile}, plot {rep.plot}); "
            f"with op lines instead of points: MAPE {rec['op_lines']['mape']:.1f}%, "
            f"tau {rec['op_lines']['kendall_tau']:.2f}")
    lines = [head, f"{'plan':14s} {'measured ms':>12s} {'simulated ms':>13s} {'error':>8s}"]
    for p in rep.pairs:
        lines.append(f"{p.plan:14s} {p.measured_s * 1e3:12.3f} {p.simulated_s * 1e3:13.3f} {p.error * 100:7.1f}%")
    if rep.breakdown:
        lines += ["", "where the time goes, measured / simulated ms per step (fed: compute ops that read a message; "
                      "wait / idle: the rank waiting, the device idle in the simulation)",
                  f"{'plan':14s} {'device':24s} {'compute':>15s} {'fed compute':>15s} {'other compute':>15s} "
                  f"{'communication':>15s} {'wait / idle':>15s}"]
        for part in rep.breakdown:
            for d in part["devices"]:
                m, s = d["measured"], d["simulated"]
                cells = [(m["compute_s"], s["compute_s"]), (m["fed_compute_s"], s["fed_compute_s"]),
                         (m["compute_s"] - m["fed_compute_s"], s["compute_s"] - s["fed_compute_s"]),
                         (m["comm_s"], s["comm_s"]), (m["wait_s"], s["idle_s"])]
                lines.append(f"{part['plan']:14s} {d['device']:24s} " + " ".join(
                    f"{a * 1e3:7.2f}/{b * 1e3:<7.2f}" for a, b in cells))
    _emit(args, rec, "\n".join(lines))
    return 0


# ----------------------------------------------------------------------------- parser
def add_commands(sub) -> None:
    """Register ``run`` and ``fidelity`` on the ``heterog`` subparsers."""
    from heterog.runtime import fidelity
    p = sub.add_parser("run", help="train a plan for real with torch.distributed (one process per device)",
                       description="Train MODEL under a strategy on the devices of CLUSTER: one worker process "
                                   "per device (local-cpu-N: emulated on this machine; under torchrun: this "
                                   "process is one rank of an env:// job).")
    p.add_argument("--model", required=True, help="zoo name or path/to/file.py:build")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the model's)")
    p.add_argument("--cluster", required=True, help="cluster YAML, built-in name or local-cpu-N[:...]")
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
    p.add_argument("--check-equivalence", action="store_true",
                   help="also train the same steps in one process and compare the parameters")
    p.add_argument("--hang-timeout-s", type=float, default=60.0, help="fail when no worker progresses this long")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("fidelity", help="measured vs simulated iteration time over several plans",
                       description="Profile op and link costs (or load the cached profile), run N different plans "
                                   "for real and in the simulator with the profiled costs, report MAPE, Kendall "
                                   "tau and the per-plan pairs, and write a scatter plot (PNG).")
    p.add_argument("--model", required=True, help="zoo name or path/to/file.py:build")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--cluster", required=True, help="a local-cpu-N[:...] cluster (or one whose devices this "
                                                    "machine has)")
    p.add_argument("--plans", type=int, default=8, help="number of different plans")
    p.add_argument("--steps", type=int, default=30, help="steps per plan")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each median")
    p.add_argument("--repeats", type=int, default=fidelity.ROUNDS,
                   help="rounds over all plans (a plan's error is the median over rounds)")
    p.add_argument("--profile", default=None, help="profile table file (default: cached per model and cluster)")
    p.add_argument("--reprofile", action="store_true", help="measure again even if the profile file exists")
    p.add_argument("--plot", default=None, help="scatter plot PNG (default: next to the profile)")
    p.add_argument("--hang-timeout-s", type=float, default=120.0)
    p.add_argument("--breakdown", action="store_true",
                   help="also trace every plan once and show, per device, measured vs simulated compute (and "
                        "compute of the ops that read a message), communication and waiting")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_fidelity)


__all__ = ["add_commands", "cmd_fidelity", "cmd_run"]
