"""What a training run shows: TensorBoard scalars, histograms and texts per round, the action breakdown of
the best plans (HeteroG Table 2), learning-curve PNGs and Gantt charts of the best plans."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agents.settings import TrainerView
from agents.tasks import GraphTask
from envs.actions import MICRO_CHOICES, full_plan, micro_choice, plan_length
from heterog.actions import extended_of, n_actions, state_action_name
from heterog.errors import HeterogError
from heterog.strategy import MAX_MICRO_BATCHES

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)



class TrainingLog:
    """TensorBoard records and the files of a run.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` or None (no TensorBoard records).
        run_dir: where the learning-curve PNG and Gantt charts go (None: nowhere).
        log_every: rounds between the heavier records (action histogram, breakdown text).
    """

    def __init__(self, writer: SummaryWriter | None = None, run_dir: str | Path | None = None,
                 log_every: int = 20) -> None:
        self.writer, self.log_every = writer, log_every
        self.run_dir = Path(run_dir) if run_dir is not None else None

    def log_round(self, trainer: TrainerView, stats: dict) -> None:
        """Scalars every round; action histogram and breakdown text every ``log_every`` rounds."""
        w, step = self.writer, trainer.rounds
        if w is None:
            return
        w.add_scalar("charts/reward_mean", stats["reward_mean"], step)
        w.add_scalar("charts/reward_max", stats["reward_max"], step)
        w.add_scalar("charts/episodes", trainer.episodes, step)
        for t in trainer.tasks:
            st = trainer.states[t.key]
            if st.best_actions is not None:
                w.add_scalar(f"charts/best_iteration_time_s/{t.name}", st.best_iteration_time_s, step)
            if st.baseline is not None:
                w.add_scalar(f"charts/baseline/{t.name}", st.baseline, step)
        w.add_scalar("losses/policy", stats["loss_policy"], step)
        w.add_scalar("losses/imitation", stats["loss_imitation"], step)
        w.add_scalar("losses/entropy", stats["entropy"], step)
        w.add_scalar("losses/grad_norm", stats["grad_norm"], step)
        if trainer.settings.algorithm == "ppo":
            w.add_scalar("losses/approx_kl", stats["approx_kl"], step)
        w.add_scalar("perf/sims_per_s", stats["sims"] / max(stats["round_s"], 1e-9), step)
        w.add_scalar("perf/round_s", stats["round_s"], step)
        if step % self.log_every == 0 or step == 1:
            w.add_histogram("actions/sampled", stats["actions"], step,
                            bins=np.arange(n_actions(trainer.policy.n_devices, trainer.policy.split_actions,
                                                      trainer.policy.state_actions) + 1) - 0.5)
            if "micro_choices" in stats:
                w.add_histogram("actions/micro_batch_choice", stats["micro_choices"], step,
                                bins=np.arange(len(MICRO_CHOICES) + 1) - 0.5)
        if "recompute_share" in stats:
            w.add_scalar("charts/recompute_share", stats["recompute_share"], step)
            w.add_text("actions/breakdown", breakdown_markdown(trainer), step)

    def log_distill(self, epoch: int, loss: float) -> None:
        """One distillation epoch's mean cross-entropy (:meth:`agents.trainer.Trainer.distill`)."""
        log.info("distill epoch %d: mean cross-entropy %.4f", epoch + 1, loss)
        if self.writer is not None:
            self.writer.add_scalar("losses/distill", loss, epoch + 1)

    def finish(self, trainer: TrainerView) -> None:
        """Learning curve PNG and the best plans' Gantt charts (files in run_dir, images in TensorBoard)."""
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_trainer_curves(trainer, self.run_dir / "learning_curve.png")
        for t in trainer.tasks:
            if trainer.states[t.key].best_actions is None:
                continue
            path = self.run_dir / f"gantt_{t.name}.png"
            gantt(trainer, t, path)
            if self.writer is not None:
                import matplotlib.image as mpimg

                self.writer.add_image(f"gantt/{t.name}", mpimg.imread(path)[..., :3], trainer.rounds,
                                      dataformats="HWC")
                self.writer.add_text("actions/breakdown", breakdown_markdown(trainer), trainer.rounds)
        if self.writer is not None:
            self.writer.flush()


def breakdown_markdown(trainer: TrainerView) -> str:
    """The best plans' action breakdown (HeteroG Table 2): per action, groups, share of ops and share of
    compute time (mean full-batch op time over devices)."""
    out = []
    for t in trainer.tasks:
        st = trainer.states[t.key]
        if st.best_actions is None:
            continue
        rows = action_breakdown(t, np.asarray(st.best_actions), trainer.policy.split_actions,
                                trainer.policy.state_actions)
        plan = plan_decisions(t, np.asarray(st.best_actions))
        out.append(f"**{t.name}** on {t.evaluator.cluster.name}: best {st.best_iteration_time_s * 1e3:.2f} ms"
                   f"{' (OOM)' if st.best_oom else ''}, {plan['micro_batches']} micro-batches, "
                   f"{plan['recomputed_groups']} of {t.n_groups} groups recomputed\n")
        out.append("| action | groups | ops % | compute % |\n|---|---|---|---|")
        out.extend(f"| {r['action']} | {r['groups']} | {100 * r['op_share']:.1f} | {100 * r['compute_share']:.1f} |"
                   for r in rows)
        out.append("")
    return "\n".join(out)


def plan_decisions(task: GraphTask, plan: np.ndarray) -> dict[str, int]:
    """The plan-level decisions of a plan (or configs alone) of ``task``: ``micro_batches`` (the number,
    after clipping to the batch) and ``recomputed_groups`` (how many)."""
    g = task.n_groups
    full = np.asarray(plan) if len(plan) > plan_length(g) else full_plan(plan, g)      # extended: with rows
    count, _ = micro_choice(int(full[2 * g]), extended=len(full) > plan_length(g))
    return {"micro_batches": min(count, task.evaluator.graph.batch_size, MAX_MICRO_BATCHES),
            "recomputed_groups": int(full[g:2 * g].sum())}


def action_breakdown(task: GraphTask, actions: np.ndarray, splits: bool = False,
                     states: bool = False) -> list[dict[str, Any]]:
    """Per config action used by ``actions`` (a plan, or one config per group): groups, share of ops, share
    of compute time (``splits``: the actions' space has the split actions, which the state actions follow,
    ``heterog.actions.state_action_name``; ``states``: it has the state actions, after which the extended
    ones follow, named ``<family>:<index>`` by ``heterog.actions.extended_of``)."""
    ev = task.evaluator
    m = ev.cluster.n_devices
    actions = np.asarray(actions)[:task.n_groups]
    op_action = np.asarray(actions)[ev.group_of]
    op_time = ev.cost.full_batch_times(ev.graph).mean(axis=1)
    total_time = max(float(op_time.sum()), 1e-30)
    rows = []
    for a in np.unique(actions).tolist():
        groups = int((np.asarray(actions) == a).sum())
        on = op_action == a
        family = extended_of(a, m, splits, states)
        name = state_action_name(a, m, splits) if family is None else f"{family[0]}:{family[1]}"
        rows.append({"action": name, "groups": groups, "op_share": float(on.mean()),
                     "compute_share": float(op_time[on].sum() / total_time)})
    return rows


def gantt(trainer: TrainerView, task: GraphTask, path: str | Path) -> Path:
    """Gantt chart PNG of ``task``'s best plan."""
    import simulator

    result = task.evaluator.evaluate(trainer.best_strategy(task))
    st = trainer.states[task.key]
    title = (f"{task.name} on {task.evaluator.cluster.name}: agent's best plan, "
             f"{st.best_iteration_time_s * 1e3:.2f} ms after {st.episodes} episodes")
    if result.plan is None or result.sim is None:
        raise HeterogError(f"the evaluation of {task.name}'s best plan kept no compiled plan or simulation")
    return simulator.plot_gantt(result.plan.tg, result.sim, path, title)


def save_trainer_curves(trainer: TrainerView, path: str | Path, references: dict[str, dict[str, float]] | None = None,
                        x: str = "wall_s") -> Path:
    """Best iteration time per graph of ``trainer`` against training time, as a PNG (see
    :func:`save_learning_curves`)."""
    return save_learning_curves({t.name: trainer.states[t.key].history for t in trainer.tasks}, path, references,
                                x, end=(trainer.wall_s, trainer.cpu_s))


def time_to_quality(history: list, target_s: float, clock: str = "wall_s") -> float | None:
    """Training time (``clock``: "wall_s" or "cpu_s") at which the best iteration time first reached
    ``target_s`` or better, from a TaskState history; None if it never did."""
    column = {"wall_s": 0, "cpu_s": 1}[clock]
    for entry in history:
        if entry[3] <= target_s:
            return float(entry[column])
    return None


def save_learning_curves(histories: dict[str, list], path: str | Path,
                         references: dict[str, dict[str, float]] | None = None, x: str = "wall_s",
                         end: tuple[float, float] | None = None) -> Path:
    """PNG of the best iteration time against training time (``x``: "wall_s" or "cpu_s"), one panel per
    graph; ``references`` (graph -> {label: seconds}) draws horizontal lines, e.g. baselines; ``end``
    (wall_s, cpu_s) extends each curve to the end of training."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from heterog.atomic import atomic_write

    names = list(histories)
    fig = Figure(figsize=(6.0 * max(1, min(len(names), 3)), 4.0 * math.ceil(max(len(names), 1) / 3)))
    FigureCanvasAgg(fig)
    column = 0 if x == "wall_s" else 1
    for i, name in enumerate(names):
        ax = fig.add_subplot(math.ceil(len(names) / 3), min(len(names), 3), i + 1)
        h = histories[name]
        if h:
            xs = [e[column] for e in h]
            ys = [e[3] * 1e3 for e in h]
            points = (xs, ys)
            if end is not None and end[column] > xs[-1]:
                xs, ys = [*xs, end[column]], [*ys, ys[-1]]
            line = ax.step(xs, ys, where="post", label="agent best (improvements marked)")[0]
            ax.plot(*points, "o", markersize=2.5, color=line.get_color())
        for label, seconds in (references or {}).get(name, {}).items():
            ax.axhline(seconds * 1e3, linestyle="--", linewidth=1, label=label, color=None)
        ax.set_title(name)
        ax.set_xlabel("training wall time (s)" if x == "wall_s" else "training CPU time (s)")
        ax.set_ylabel("best iteration time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100), mode="wb")
