"""Hydra application of the agent: train (from scratch or from a checkpoint), pretrain on several
graphs, fine-tune, or evaluate a checkpoint. ``python -m experiments.train experiment=pretrain``;
conf/config.yaml lists the groups. This entry point builds every object from the config and passes
them down; nothing deeper reads the config."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from agents.checkpoint import check_fits, checkpoint_head, load_checkpoint, policy_from_checkpoint
from agents.reporting import save_trainer_curves
from agents.tasks import make_task
from agents.trainer import Trainer, TrainerSettings
from envs.actions import full_plan
from envs.features import DEVICE_FEATURE_DIM, op_feature_dim
from heterog.atomic import atomic_write_json
from heterog.errors import HeterogError


def graph_specs(cfg: DictConfig) -> list[dict[str, Any]]:
    """The graphs of the run: ``run.graphs`` without the ``run.holdout`` model(s), or the graph group's
    graph."""
    specs = [dict(s) for s in cfg.run.graphs] if cfg.run.graphs else [dict(cfg.graph)]
    if cfg.run.holdout is not None and cfg.run.graphs:
        held = _holdouts(cfg.run.holdout)
        specs = [s for s in specs if s["model"] not in held]
    if not specs:
        raise HeterogError(f"no graphs left to train on (holdout {cfg.run.holdout!r})")
    return specs


def _holdouts(holdout) -> list[str]:
    """``run.holdout`` as a list: one model name or a list of them."""
    return [holdout] if isinstance(holdout, str) else [str(h) for h in holdout]


def cluster_names(cfg: DictConfig) -> list[str]:
    """The clusters of the run: ``run.clusters`` (names or paths) or the cluster group's cluster, then
    ``run.generated_clusters`` generated ones (``gen-0``, ``gen-1``, ...)."""
    names = [str(c) for c in cfg.run.clusters] if cfg.run.clusters else [str(cfg.cluster.name)]
    names += [f"gen-{i}" for i in range(int(cfg.run.generated_clusters))]
    if len(set(names)) != len(names):
        raise HeterogError(f"a cluster is given twice: {names}")
    return names


def run_name(experiment: str, graph_names: list[str], cluster: str, seed: int, holdout: str | None) -> str:
    """``<experiment>__<graphs>__<cluster>__seed<seed>__<YYYYmmdd-HHMMSS>``."""
    graphs = "+".join(graph_names) if len(graph_names) <= 3 else f"{len(graph_names)}graphs"
    if holdout:
        graphs += f"-minus-{holdout}"
    return f"{experiment}__{graphs}__{cluster}__seed{seed}__{time.strftime('%Y%m%d-%H%M%S')}"


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured experiment; returns (and writes to <run>/report.json) its report."""
    from heterog import baselines
    from heterog.cluster import load_cluster
    from heterog.graph.cache import capture_model

    if cfg.run.mode not in ("train", "evaluate"):
        raise HeterogError(f"run.mode must be train or evaluate, got {cfg.run.mode!r}")
    if cfg.run.needs_checkpoint and cfg.run.init_from is None and cfg.run.resume is None:
        raise HeterogError(f"experiment {cfg.run.name} needs run.init_from=<checkpoint>")
    torch.set_num_threads(int(cfg.threads))
    # ---- instantiate everything from the config
    clusters = [load_cluster(n) for n in cluster_names(cfg)]
    specs = graph_specs(cfg)
    graphs = [capture_model(s["model"], s.get("batch_size"), s.get("optimizer", "sgd")) for s in specs]
    # the checkpoint to resume or start from (its head, else agent.head, sets the op feature layout)
    source = cfg.run.resume or cfg.run.init_from
    state = load_checkpoint(source) if source is not None else None
    head = checkpoint_head(state) if state is not None else cfg.agent.get("head", "fixed")
    layout = "device-free" if head == "tokens" else "per-device"
    sizes = sorted({c.n_devices for c in clusters})
    if head != "tokens" and len(sizes) > 1:
        raise HeterogError(f"clusters of {sizes} devices need one policy for any size: agent.head=tokens")
    # one task per (graph, cluster); with several clusters the task name carries the cluster
    tasks = [make_task(g, c, max_groups=int(cfg.run.max_groups), layout=layout,
                       name=f"{g.name}-b{g.batch_size}@{c.name}" if len(clusters) > 1 else None)
             for c in clusters for g in graphs]
    settings: TrainerSettings = instantiate(cfg.trainer)
    make_policy = instantiate(cfg.agent)
    holdout = "+".join(_holdouts(cfg.run.holdout)) if cfg.run.graphs and cfg.run.holdout is not None else None
    cluster_label = "+".join(c.name for c in clusters) if len(clusters) <= 3 else f"{len(clusters)}clusters"
    name = run_name(cfg.run.name, [g.name + f"-b{g.batch_size}" for g in graphs], cluster_label, int(cfg.seed),
                    holdout)
    run_dir = Path(cfg.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    writer = None
    if cfg.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir))
        writer.add_text("config", "```\n" + OmegaConf.to_yaml(cfg, resolve=True) + "\n```", 0)

    # ---- the policy: from the checkpoint to resume or start from, or fresh
    m = sizes[-1]
    if state is not None:
        for size in sizes:
            check_fits(state, size, op_feature_dim(size, layout), DEVICE_FEATURE_DIM,
                       source=f"checkpoint {str(source)!r}")
        policy = policy_from_checkpoint(state)
    else:
        policy = make_policy(n_devices=m, seed=int(cfg.seed), dp_bias=settings.initial_dp_bias)
    trainer = Trainer(policy, tasks, settings, writer=writer, run_dir=run_dir, ray_address=cfg.run.ray_address)
    demonstrations = {}
    if cfg.run.resume is not None:
        trainer.load_state_dict(state)
    elif cfg.run.demonstrations:
        demonstrations = demonstrate(trainer, list(cfg.run.demonstrations), float(cfg.run.demonstration_budget_s))

    # ---- train or evaluate
    report: dict[str, Any] = {"run": name, "run_dir": str(run_dir), "experiment": cfg.run.name,
                              "cluster": cluster_label, "clusters": [c.name for c in clusters],
                              "seed": int(cfg.seed), "init_from": source, "demonstrations": demonstrations}
    try:
        if cfg.run.mode == "evaluate":
            report["evaluation"] = trainer.evaluate_policy(int(cfg.run.eval_samples))
            trainer.report.finish(trainer)
        else:
            trainer.train(rounds=cfg.run.rounds, episodes=cfg.run.episodes, budget_s=cfg.run.budget_s,
                          checkpoint_path=run_dir / "agent.pt", checkpoint_every=int(cfg.run.checkpoint_every))
            if int(cfg.run.distill_epochs) > 0:
                report["distill_losses"] = trainer.distill(int(cfg.run.distill_epochs))
                trainer.save(run_dir / "agent.pt")
            report["checkpoint"] = str(run_dir / "agent.pt")
    finally:
        trainer.close()
    report.update(trainer.summary())

    # ---- compare with the baselines, save the best strategies and the learning curves
    references: dict[str, dict[str, float]] = {}
    for task in tasks:
        entry = report["graphs"][task.name]
        entry["baselines"] = {}
        for method in cfg.run.compare:
            t_s, oom = task.evaluator.iteration_time(baselines.run(method, task.evaluator.graph,
                                                                   task.evaluator.cluster, evaluator=task.evaluator))
            entry["baselines"][method] = {"iteration_time_s": t_s, "oom": oom}
        ok = {k: v["iteration_time_s"] for k, v in entry["baselines"].items() if not v["oom"]}
        if ok:
            best_method = min(ok, key=ok.get)
            entry["best_baseline"] = best_method
            entry["speedup_vs_best_baseline"] = ok[best_method] / entry["best_iteration_time_s"]
            references[task.name] = {f"{best_method} (best baseline)": ok[best_method]}
        if trainer.states[task.key].best_actions is None:    # never drawn (graphs_per_round, short run)
            entry["strategy"] = None
            continue
        strategy_path = run_dir / f"strategy_{task.name}.json"
        trainer.best_strategy(task).save(strategy_path)
        entry["strategy"] = str(strategy_path)
    save_trainer_curves(trainer, run_dir / "learning_curve.png", references)
    save_trainer_curves(trainer, run_dir / "learning_curve_cpu.png", references, x="cpu_s")
    report["learning_curve"] = str(run_dir / "learning_curve.png")
    report["learning_curve_cpu"] = str(run_dir / "learning_curve_cpu.png")
    atomic_write_json(run_dir / "report.json", report)
    if writer is not None:
        writer.close()
    return report


def demonstrate(trainer: Trainer, names: list[str], budget_s: float) -> dict[str, dict[str, float]]:
    """Record the plans of planners ``names`` for every task of ``trainer`` as demonstrations, before its first
    round (``Trainer.seed_plans``: the best becomes the task's best plan, the imitation term's target, and all
    join the replay pool), each planner with the options of the policy's plan space it takes and the budgeted
    ones sharing ``budget_s`` per task, and MCMC's split starts among ``names`` (``agents.planner.SEED_STARTS``)
    where the policy has split actions; plans the policy's actions do not hold are left out (with
    ``trainer.extended_plans``, those the extended actions do not hold). Returns task ->
    planner -> simulated seconds of the plans recorded (shown with progress)."""
    from rich.progress import track

    from agents.planner import SEED_STARTS, seed_actions, seed_plans, seed_starts

    policy, out = trainer.policy, {}
    starts = [n for n in names if n in SEED_STARTS]
    for task in track(trainer.tasks, description="demonstrations", transient=True):
        ev = task.evaluator
        plans = {name: plan for name, (plan, _) in seed_starts(ev, starts, policy.split_actions).items()}
        plans.update(seed_plans(ev, [n for n in names if n not in SEED_STARTS], budget_s, time.perf_counter(),
                                policy.split_actions, policy.state_actions, share=1.0))
        held = seed_actions(ev, plans, policy, extended=trainer.settings.extended_plans)
        out[task.name] = {}
        if held:
            actions = np.stack([full_plan(a, task.n_groups, trainer.scorer.width(task)) for a in held.values()])
            trainer.seed_plans(task, actions)
            times = trainer.scorer.score(task, actions)[1]          # as recorded: cached, not simulated again
            out[task.name] = dict(zip(held, times.tolist()))
    return out


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    report = run(cfg)
    lines = [(f"run {report['run']} ({report['rounds']} rounds, {report['episodes']} episodes, "
              f"{report['wall_s']:.1f} s wall, {report['cpu_s']:.1f} s CPU)")]
    for graph, entry in report["graphs"].items():
        base = entry.get("best_baseline")
        extra = (f"; best baseline {base} {entry['baselines'][base]['iteration_time_s'] * 1e3:.2f} ms "
                 f"(speed-up {entry['speedup_vs_best_baseline']:.3f}x)") if base else ""
        lines.append(f"  {graph}: agent {entry['best_iteration_time_s'] * 1e3:.2f} ms"
                     f"{' (OOM)' if entry['oom'] else ''}{extra}")
    lines.append(f"  report: {report['run_dir']}/report.json")
    print("\n".join(lines))
    print(json.dumps({"report": report["run_dir"] + "/report.json"}))


if __name__ == "__main__":
    main()
