"""Can the strategy policy represent a set of plans, and does what it learns carry to an unseen graph?

Transfer needs plans that the policy can express as a function of what it sees. This probe trains a
fresh policy by supervised imitation (cross-entropy on every group's action, Adam, gradient clipping)
on target plans of some graphs and reports, per graph, how often its greedy plan (every group's most
likely action) matches the target and what the greedy plan's simulated iteration time is, next to the
target's and the best uniform plan's (the DP baselines). One graph can be held out: it is only scored.
It also reports what the policy's probabilities say about the target beyond the greedy plan: the mean
model-parallel probability of the groups the target puts on one device and of the others, and how well
that probability ranks the two (AUC). ``--policy CKPT`` scores a trained checkpoint's policy (e.g. a
pretrained one on graphs it never saw) instead of training one.

Targets:
  - ``--runs DIR ...``: the best plans found by training runs (each run folder's ``agent.pt`` and
    ``config.yaml``; every graph of each run);
  - ``--rule-bytes B --graphs MODEL:BATCH ...``: a rule of the features, model parallel on device 0 for
    groups holding at least ``B`` bytes of parameters and optimizer state, DP-proportional-AllReduce
    for the rest (a control: a rule the policy sees should be learned and carried over).

    python -m experiments.policy_probe --runs runs/pretrain__... runs/finetune__gpt2-b8__... --holdout gpt2-b8
    python -m experiments.policy_probe --rule-bytes 4e6 --graphs resnet50:128 transformer:64 vgg19:192 \\
        --holdout vgg19-b192
    python -m experiments.policy_probe --runs runs/scratch__gpt2-b8__... --policy runs/pretrain__.../agent.pt
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from agents.checkpoint import load_checkpoint
from agents.planner import build_policy
from agents.tasks import GraphTask, make_task
from agents.trainer import per_group_log_prob
from experiments.args import model_batch, parser
from heterog.errors import HeterogError
from heterog.reporting import Column, Table
from heterog.strategy import DP_ACTION_NAMES, N_DP_ACTIONS

DP_PROP_AR = DP_ACTION_NAMES.index("dp-prop-ar")     # offset after the M model-parallel actions


@dataclass
class ProbeRow:
    graph: str
    held_out: bool
    groups: int
    match: float                   # share of groups whose greedy action is the target's
    uniform_share: float           # share of the target's groups that take its most common action
    greedy_s: float
    greedy_oom: bool
    target_s: float
    best_uniform_s: float          # best plan giving every group one action (the DP baselines among them)
    target_mp_groups: int = 0      # groups the target puts on one device (model parallel)
    p_mp_target: float = float("nan")   # the policy's mean P(model parallel) over those groups ...
    p_mp_other: float = float("nan")    # ... and over the other groups
    mp_auc: float = float("nan")        # P(a target MP group's P(MP) > another group's), ties count half


def targets_from_runs(run_dirs: list[str], cluster) -> list[tuple[GraphTask, np.ndarray]]:
    """(task, best actions) for every graph of every run (the run's config names the graphs)."""
    from omegaconf import OmegaConf

    from experiments.train import graph_specs
    from heterog.graph.cache import capture_model

    out: dict[str, tuple[GraphTask, np.ndarray]] = {}
    for d in map(Path, run_dirs):
        if not (d / "agent.pt").is_file() or not (d / "config.yaml").is_file():
            raise HeterogError(f"run folder {str(d)!r} needs agent.pt and config.yaml")
        cfg = OmegaConf.load(d / "config.yaml")
        if cfg.cluster.name != cluster.name:
            raise HeterogError(f"run {str(d)!r} planned for {cfg.cluster.name!r}, not {cluster.name!r}")
        tasks = {}
        for spec in graph_specs(cfg):
            task = make_task(capture_model(spec["model"], spec.get("batch_size"), spec.get("optimizer", "sgd")),
                             cluster, max_groups=int(cfg.run.max_groups))
            tasks[task.key] = task
        for key, state in load_checkpoint(d / "agent.pt")["tasks"].items():
            if key in tasks and state["best_actions"] is not None:
                out[tasks[key].name] = (tasks[key], np.asarray(state["best_actions"], dtype=np.int64))
    if not out:
        raise HeterogError("the runs hold no best plan")
    return list(out.values())


def targets_from_rule(graphs: list[str], min_bytes: float, cluster) -> list[tuple[GraphTask, np.ndarray]]:
    """(task, rule actions): model parallel on device 0 where a group holds >= min_bytes, else DP-prop-AR."""
    from heterog.graph.cache import capture_model

    out = []
    for name in graphs:
        model, batch = model_batch(name)
        task = make_task(capture_model(model, batch, "sgd"), cluster)
        ev = task.evaluator
        held = np.zeros(task.n_groups)
        np.add.at(held, ev.group_of, ev.graph.resident_bytes)
        out.append((task, np.where(held >= min_bytes, 0, cluster.n_devices + DP_PROP_AR)))
    return out


def probe(targets: list[tuple[GraphTask, np.ndarray]], holdout: str | None, steps: int, lr: float,
          seed: int = 0, size: str = "small", autoregressive: bool = False) -> list[ProbeRow]:
    """Imitate the targets of every graph but ``holdout`` for ``steps`` steps (one graph per step, in
    turn), then score every graph's greedy plan (``autoregressive``: of a policy that conditions each
    group on the earlier groups' actions, trained on the target's own earlier actions)."""
    names = [t.name for t, _ in targets]
    if holdout is not None and holdout not in names:
        raise HeterogError(f"held-out graph {holdout!r} is not among the targets {names}")
    train = [(t, a) for t, a in targets if t.name != holdout]
    if not train:
        raise HeterogError("nothing to train on: every graph is held out")
    m = targets[0][0].inputs.n_devices
    policy = build_policy(m, size, seed, dp_bias=0.0, autoregressive=autoregressive)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    for step in range(steps):
        task, actions = train[step % len(train)]
        target = torch.as_tensor(actions)[None]
        logits = policy.action_logits(policy.embed_groups(*task.inputs.args()), task.inputs.group_mask, target)
        loss = -per_group_log_prob(logits, target).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
    return score(policy, targets, holdout)


def auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    if len(positive) == 0 or len(negative) == 0:
        return float("nan")
    diff = positive[:, None] - negative[None, :]
    return float((diff > 0).mean() + 0.5 * (diff == 0).mean())


def score(policy, targets: list[tuple[GraphTask, np.ndarray]], holdout: str | None = None) -> list[ProbeRow]:
    """Every graph's row for ``policy``: its greedy plan against the target, and its model-parallel
    probabilities (along the target, for an autoregressive policy) at the target's MP groups and elsewhere."""
    rows = []
    policy.eval()
    m = policy.n_devices
    with torch.no_grad():
        for task, actions in targets:
            ev = task.evaluator
            group_emb = policy.embed_groups(*task.inputs.args())
            greedy = policy.sample_actions(group_emb, task.inputs.group_mask, 1, greedy=True)[0].numpy()
            logits = policy.action_logits(group_emb, task.inputs.group_mask, torch.as_tensor(actions)[None])[0]
            p_mp = logits.softmax(-1)[:, :m].sum(-1).numpy()
            on_one = actions < m
            greedy_s, greedy_oom = ev.iteration_time(ev.strategy(greedy, "greedy"))
            uniform = [ev.iteration_time(ev.strategy(np.full(task.n_groups, a), "uniform"))
                       for a in range(m + N_DP_ACTIONS)]
            rows.append(ProbeRow(task.name, task.name == holdout, task.n_groups, float((greedy == actions).mean()),
                                 float(np.bincount(actions).max() / len(actions)), greedy_s, greedy_oom,
                                 ev.iteration_time(ev.strategy(actions, "target"))[0],
                                 min((t for t, oom in uniform if not oom), default=float("inf")),
                                 int(on_one.sum()),
                                 float(p_mp[on_one].mean()) if on_one.any() else float("nan"),
                                 float(p_mp[~on_one].mean()) if (~on_one).any() else float("nan"),
                                 auc(p_mp[on_one], p_mp[~on_one])))
    return rows


def markdown(rows: list[ProbeRow]) -> str:
    tab = Table([Column("graph", align="left"), Column("held out", align="left")] + [Column(h) for h in (
        "groups", "greedy = target", "target's commonest action", "greedy (ms)", "target (ms)",
        "best uniform plan (ms)", "target's MP groups", "P(MP) there / elsewhere", "AUC")])
    for r in rows:
        tab.add(r.graph, "yes" if r.held_out else "", str(r.groups), f"{100 * r.match:.1f}%",
                f"{100 * r.uniform_share:.1f}%", f"{r.greedy_s * 1e3:.2f}{' OOM' if r.greedy_oom else ''}",
                f"{r.target_s * 1e3:.2f}", f"{r.best_uniform_s * 1e3:.2f}", str(r.target_mp_groups),
                f"{r.p_mp_target:.4f} / {r.p_mp_other:.4f}", f"{r.mp_auc:.2f}")
    return tab.markdown()


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.policy_probe", __doc__)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--runs", nargs="+", metavar="RUN_DIR", help="imitate the best plans of these runs")
    source.add_argument("--rule-bytes", type=float, metavar="B",
                        help="imitate the rule: groups holding >= B bytes on device 0, the rest DP-prop-AR")
    ap.add_argument("--graphs", nargs="+", metavar="MODEL:BATCH", help="graphs of the rule (with --rule-bytes)")
    ap.add_argument("--holdout", help="graph name (e.g. vgg19-b192) scored but not trained on")
    ap.add_argument("--cluster", default="paper-8gpu")
    ap.add_argument("--steps", type=int, default=1500, help="imitation steps, one graph each (default 1500)")
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="Adam step size (default 1e-3, the trainer's learning_rate; at 1e-2 even a rule is not "
                         "learned)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", metavar="CKPT",
                    help="score this checkpoint's policy on the targets instead of training one")
    ap.add_argument("--autoregressive", action="store_true",
                    help="probe a policy that conditions each group on the earlier groups' actions")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the Markdown table")
    args = ap.parse_args(argv)
    from heterog.cluster import load_cluster

    torch.set_num_threads(1)
    try:
        if args.steps < 0 or args.lr <= 0:
            raise HeterogError(f"--steps must be >= 0 and --lr > 0, got {args.steps} and {args.lr}")
        cluster = load_cluster(args.cluster)
        if args.runs:
            targets = targets_from_runs(args.runs, cluster)
        else:
            if not args.graphs:
                raise HeterogError("--rule-bytes needs --graphs MODEL:BATCH ...")
            targets = targets_from_rule(args.graphs, args.rule_bytes, cluster)
        if args.policy:
            from agents.checkpoint import check_fits, policy_from_checkpoint

            state = load_checkpoint(args.policy)
            inputs = targets[0][0].inputs
            check_fits(state, inputs.n_devices, inputs.op_x.shape[1], inputs.dev_x.shape[1], args.policy)
            rows = score(policy_from_checkpoint(state), targets, args.holdout)
        else:
            rows = probe(targets, args.holdout, args.steps, args.lr, args.seed, autoregressive=args.autoregressive)
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
