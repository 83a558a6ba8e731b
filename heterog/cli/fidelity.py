"""``heterog fidelity``: measured vs simulated iteration time over several plans (MAPE, Kendall tau)."""
from __future__ import annotations

import argparse

from heterog.cli.args import add_model_args
from heterog.cli.output import add_json_flag, emit


def cmd_fidelity(args: argparse.Namespace) -> int:
    from heterog.reporting import fidelity_text
    from heterog.runtime.fidelity import run_fidelity

    rep = run_fidelity(args.model, args.cluster, n_plans=args.plans, batch_size=args.batch_size, steps=args.steps,
                       warmup=args.warmup, repeats=args.repeats, profile_file=args.profile,
                       reprofile=args.reprofile, plot=args.plot, hang_timeout_s=args.hang_timeout_s,
                       breakdown=args.breakdown)
    rec = rep.record()
    emit(args, rec, fidelity_text(rep, rec))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from heterog.runtime import fidelity

    p = sub.add_parser("fidelity", help="measured vs simulated iteration time over several plans",
                       description="Profile op and link costs (or load the cached profile), run N different plans "
                                   "for real and in the simulator with the profiled costs, report MAPE, Kendall "
                                   "tau and the per-plan pairs, and write a scatter plot (PNG).")
    add_model_args(p, None, "a local-cpu-N[:...] cluster (or one whose devices this machine has)")
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
    add_json_flag(p)
    p.set_defaults(fn=cmd_fidelity)
