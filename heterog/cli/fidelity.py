"""``heterog fidelity``: measured vs simulated iteration time over several plans (MAPE, Kendall tau): plans run
here for real, or the published runs of another system (``--published``)."""
from __future__ import annotations

import argparse
from pathlib import Path

from heterog.cli.output import add_json_flag, emit
from heterog.errors import HeterogError

# Sailor's simulator's predictions of its validation plans (experiments/peers.py simulate), where the
# repository's data folder is at hand
SAILOR_PREDICTIONS = Path(__file__).resolve().parents[2] / "experiments/data/sailor/simulator_predictions.json"


def cmd_fidelity(args: argparse.Namespace) -> int:
    if args.published:
        return _published(args)
    if not args.model or not args.cluster:
        raise HeterogError("heterog fidelity needs --model and --cluster (or --published DIR)")
    for flag, value, least in (("--plans", args.plans, 1), ("--steps", args.steps, 1), ("--repeats", args.repeats, 1)):
        if value < least:
            raise HeterogError(f"{flag} must be at least {least}, got {value}")
    from heterog.reporting import fidelity_text
    from heterog.runtime.fidelity import run_fidelity

    rep = run_fidelity(args.model, args.cluster, n_plans=args.plans, batch_size=args.batch_size, steps=args.steps,
                       warmup=args.warmup, repeats=args.repeats, profile_file=args.profile,
                       reprofile=args.reprofile, plot=args.plot, hang_timeout_s=args.hang_timeout_s,
                       breakdown=args.breakdown)
    rec = rep.record()
    emit(args, rec, fidelity_text(rep, rec))
    return 0


def _published(args: argparse.Namespace) -> int:
    from rich.progress import Progress, TaskID

    from heterog.interop.published import RunRecord, published_report, scatter_plot
    from heterog.reporting import published_text

    predictions = args.sailor_predictions or (SAILOR_PREDICTIONS if SAILOR_PREDICTIONS.is_file() else None)
    sources: list[str | None] = [None] if not args.layer_profiles else (
        [None, args.layer_profiles] if args.both else [args.layer_profiles])
    reports = []
    with Progress(transient=True, disable=args.json) as bar:
        for src in sources:
            task = bar.add_task(f"simulating ({src or 'roofline'})", total=None)

            def step(rec: RunRecord, task: TaskID = task) -> None:
                bar.update(task, advance=1, description=f"{rec.name}: {rec.simulated_s:.3g} s")

            reports.append(published_report(args.published, layer_profiles=src, sailor_predictions=predictions,
                                            only=args.only or (), progress=step))
    plot = scatter_plot(reports, args.plot) if args.plot else None
    rec = {"reports": [r.record() for r in reports], "plot": None if plot is None else str(plot)}
    emit(args, rec, "\n\n".join(published_text(r) for r in reports) + (f"\nplot: {plot}" if plot else ""))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from heterog.runtime import fidelity

    p = sub.add_parser("fidelity", help="measured vs simulated iteration time over several plans",
                       description="Profile op and link costs (or load the cached profile), run N different plans "
                                   "for real and in the simulator with the profiled costs, report MAPE, Kendall "
                                   "tau and the per-plan pairs, and write a scatter plot (PNG). With --published, "
                                   "simulate another system's measured runs (Sailor's validation plans) instead.")
    p.add_argument("--model", default=None, help="zoo name or path/to/file.py:build")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the model's)")
    p.add_argument("--cluster", default=None,
                   help="a local-cpu-N[:...] cluster (or one whose devices this machine has)")
    p.add_argument("--plans", type=int, default=8, help="number of different plans")
    p.add_argument("--steps", type=int, default=30, help="steps per plan")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each median")
    p.add_argument("--repeats", type=int, default=fidelity.ROUNDS,
                   help="rounds over all plans (a plan's error is the median over rounds)")
    p.add_argument("--profile", default=None, help="profile table file (default: cached per model and cluster)")
    p.add_argument("--reprofile", action="store_true", help="measure again even if the profile file exists")
    p.add_argument("--plot", default=None, help="scatter plot PNG (default: next to the profile; with "
                                                "--published: none unless given)")
    p.add_argument("--hang-timeout-s", type=float, default=120.0)
    p.add_argument("--breakdown", action="store_true",
                   help="also trace every plan once and show, per device, measured vs simulated compute (and "
                        "compute of the ops that read a message), communication and waiting")
    p.add_argument("--published", default=None, metavar="DIR",
                   help="Sailor's validation folder (sailor/Planner/simulations/validation, or its clariden/ or "
                        "mit/): simulate every plan_config_*.json and compare with its measured time and memory")
    p.add_argument("--layer-profiles", default=None, metavar="DIR",
                   help="with --published: Metis' profiles folder (sailor/Planner/baselines/Metis/profiles) as "
                        "the cost source where it has entries")
    p.add_argument("--both", action="store_true", help="with --layer-profiles: also report the roofline alone")
    p.add_argument("--sailor-predictions", default=None, metavar="FILE",
                   help="Sailor's simulator's predictions (experiments/peers.py simulate; default: the "
                        "repository's experiments/data/sailor/simulator_predictions.json)")
    p.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="with --published: only runs whose path contains TEXT (repeatable)")
    add_json_flag(p)
    p.set_defaults(fn=cmd_fidelity)
