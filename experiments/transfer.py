"""Time to quality of fine-tuning against training from scratch (the HeteroG paper's Table 6).

For each pair of runs on one graph (from scratch, fine-tuned from a pretrained checkpoint) the quality
is the scratch run's best iteration time at its end; the ratio is the training time the fine-tuned run
needed to reach that quality over the time the scratch run needed (both CPU seconds by default, so that
runs sharing a machine are compared fairly). Reads each run's ``agent.pt`` and ``config.yaml``::

    python -m experiments.transfer --pair runs/scratch__vgg19-b192__... runs/finetune__vgg19-b192__... \\
        [--pair ...] [--plot curves.png] [--json]

Prints a Markdown table (or JSON) and, with ``--plot``, writes the learning curves of every pair.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from agents.checkpoint import load_checkpoint
from agents.reporting import time_to_quality
from experiments.args import parser
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

CLOCKS = ("cpu_s", "wall_s")


@dataclass
class Run:
    """One graph's training history from a run folder."""

    path: str
    graph: str
    history: list[tuple[float, float, int, float]]    # (wall_s, cpu_s, episodes, best_s) at each improvement
    end: tuple[float, float]                          # (wall_s, cpu_s) at the end of training
    init_from: str | None

    @property
    def best_s(self) -> float:
        return self.history[-1][3]


def load_run(run_dir: str | Path) -> Run:
    """The history of the single graph trained in ``run_dir`` (HeterogError naming what is missing)."""
    d = Path(run_dir)
    ckpt = d / "agent.pt"
    if not ckpt.is_file():
        raise HeterogError(f"run folder {str(d)!r} has no agent.pt (not a finished training run?)")
    state = load_checkpoint(ckpt)
    tasks = list(state["tasks"].values())
    if len(tasks) != 1:
        raise HeterogError(f"run {str(d)!r} trained {len(tasks)} graphs; a transfer pair needs one graph per run")
    task = tasks[0]
    if not task["history"]:
        raise HeterogError(f"run {str(d)!r} recorded no strategy for {task['name']}")
    init_from = None
    if (d / "config.yaml").is_file():
        from omegaconf import OmegaConf

        init_from = OmegaConf.load(d / "config.yaml").get("run", {}).get("init_from")
    c = state["counters"]
    return Run(str(d), task["name"], [tuple(h) for h in task["history"]], (float(c["wall_s"]), float(c["cpu_s"])),
               init_from)


@dataclass
class TransferRow:
    graph: str
    scratch_best_s: float
    scratch_reached_s: float          # training time at which scratch first reached its best
    finetune_best_s: float
    finetune_reached_s: float | None  # training time at which fine-tuning reached the scratch best; None: never
    finetune_first_s: float           # best of the fine-tuned run's first round
    ratio: float | None               # finetune_reached_s / scratch_reached_s
    clock: str
    scratch: str
    finetune: str
    pretrained: str | None
    tolerance: float = 0.0            # the quality target: the scratch best times (1 + tolerance)


def compare(scratch: Run, finetune: Run, clock: str = "cpu_s", tolerance: float = 0.0) -> TransferRow:
    """The time-to-quality row of one pair (same graph, else HeterogError): when each run first reached
    the scratch run's best iteration time times ``1 + tolerance`` (0: the best itself)."""
    if clock not in CLOCKS:
        raise HeterogError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if not 0.0 <= tolerance < 1.0:
        raise HeterogError(f"tolerance must be in [0, 1), got {tolerance}")
    if scratch.graph != finetune.graph:
        raise HeterogError(f"pair of different graphs: {scratch.graph} ({scratch.path}) and "
                           f"{finetune.graph} ({finetune.path})")
    target = scratch.best_s * (1.0 + tolerance)
    reached = time_to_quality(scratch.history, target, clock)
    ft = time_to_quality(finetune.history, target, clock)
    ratio = None if ft is None else ft / max(reached, 1e-9)
    return TransferRow(scratch.graph, scratch.best_s, reached, finetune.best_s, ft, finetune.history[0][3],
                       ratio, clock, scratch.path, finetune.path, finetune.init_from, tolerance)


def met(row: TransferRow, limit: float = 0.3) -> bool:
    """Whether the fine-tuned run reached the quality target within ``limit`` of the scratch time."""
    return row.ratio is not None and row.ratio <= limit


def by_graph(rows: list[TransferRow], limit: float = 0.3) -> dict[str, dict[str, int]]:
    """Per graph (in first-seen order), how many of its pairs there are and how many met ``limit``: a
    graph transfers when every one of its pairs (seeds) did."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        g = out.setdefault(r.graph, {"pairs": 0, "met": 0})
        g["pairs"] += 1
        g["met"] += met(r, limit)
    return out


def markdown(rows: list[TransferRow]) -> str:
    clock = rows[0].clock.removesuffix("_s") if rows else "cpu"
    tab = Table([Column("graph", align="left")] + [Column(h) for h in (
        "scratch best (ms)", f"reached at ({clock} s)", "fine-tuned best (ms)", f"fine-tuned reaches it at ({clock} s)",
        "ratio", "first fine-tune round best (ms)")])
    for r in rows:
        tab.add(r.graph, f"{r.scratch_best_s * 1e3:.2f}", f"{r.scratch_reached_s:.1f}",
                f"{r.finetune_best_s * 1e3:.2f}",
                "-" if r.finetune_reached_s is None else f"{r.finetune_reached_s:.1f}",
                "never" if r.ratio is None else f"{100 * r.ratio:.1f}%", f"{r.finetune_first_s * 1e3:.2f}")
    return tab.markdown()


def plot(pairs: list[tuple[Run, Run]], path: str | Path, clock: str = "cpu_s") -> Path:
    """Learning curves, one panel per pair: scratch and fine-tuned best iteration time over training time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from heterog.atomic import atomic_write

    column = {"wall_s": 0, "cpu_s": 1}[clock]      # of history entries and of ``end``
    n = len(pairs)
    fig = Figure(figsize=(5.5 * min(n, 3), 4.0 * ((n + 2) // 3)))
    FigureCanvasAgg(fig)
    for i, (scratch, finetune) in enumerate(pairs):
        ax = fig.add_subplot((n + 2) // 3, min(n, 3), i + 1)
        for run, label in ((scratch, "from scratch"), (finetune, "fine-tuned")):
            xs = [h[column] for h in run.history] + [run.end[column]]
            ys = [h[3] * 1e3 for h in run.history] + [run.best_s * 1e3]
            ax.step(xs, ys, where="post", label=label)
        ax.axhline(scratch.best_s * 1e3, color="0.5", lw=0.8, ls="--", label="scratch best")
        ax.set_title(scratch.graph)
        ax.set_xlabel(f"training {'CPU' if clock == 'cpu_s' else 'wall'} time (s)")
        ax.set_ylabel("best iteration time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100), mode="wb")


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.transfer", __doc__)
    ap.add_argument("--pair", nargs=2, action="append", required=True, metavar=("SCRATCH_RUN", "FINETUNE_RUN"),
                    help="a from-scratch run folder and a fine-tuned run folder on the same graph (repeatable)")
    ap.add_argument("--clock", choices=CLOCKS, default="cpu_s", help="training time to compare (default cpu_s)")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="quality target: the scratch best times (1 + T), for both runs (default 0: the best itself)")
    ap.add_argument("--plot", help="write the learning curves of every pair to this PNG")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the Markdown table")
    args = ap.parse_args(argv)
    try:
        pairs = [(load_run(s), load_run(f)) for s, f in args.pair]
        rows = [compare(s, f, args.clock, args.tolerance) for s, f in pairs]
        if args.plot:
            plot(pairs, args.plot, args.clock)
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_met = sum(met(r) for r in rows)
    graphs = by_graph(rows)
    n_graphs = sum(g["met"] == g["pairs"] for g in graphs.values())
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "met_30_percent": n_met, "graphs": graphs,
                          "graphs_met_30_percent": n_graphs}, indent=2))
    else:
        print(markdown(rows))
        target = "the scratch best" + (f" + {100 * args.tolerance:g}%" if args.tolerance else "")
        print(f"\nquality target: {target}; ratio at most 30%: {n_met} of {len(rows)} pairs")
        print("per graph (pairs at most 30% / pairs): "
              + ", ".join(f"{name} {g['met']}/{g['pairs']}" for name, g in graphs.items())
              + f"; graphs with every pair at most 30%: {n_graphs} of {len(graphs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
