"""Ship a pretraining run's policy as the package's pretrained checkpoint (``agents.planner.PRETRAINED``,
which ``heterog plan --method agent`` starts from when no ``--agent`` is given):

    python -m experiments.ship runs/<pretrain run> [--out agents/pretrained/tokens-small.pt]

Only the policy (config and weights) is kept, with its provenance: the run's name and hydra config
(graphs, clusters, budget, agent, trainer), its (graph, cluster) tasks and counters (rounds, episodes,
simulations, wall and CPU seconds). Retraining: docs/design.md, "The shipped checkpoint"."""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from agents.checkpoint import export_policy, load_checkpoint
from agents.planner import PRETRAINED
from experiments.args import parser
from heterog.errors import HeterogError


def ship(run_dir: str | Path, out: str | Path = PRETRAINED) -> Path:
    run = Path(run_dir)
    state = load_checkpoint(run / "agent.pt")
    if state["policy_config"].get("head") != "tokens":
        raise HeterogError(f"{run} trained a fixed-head policy; the shipped one must plan for any cluster "
                           f"(agent.head=tokens)")
    config = OmegaConf.to_container(OmegaConf.load(run / "config.yaml")) if (run / "config.yaml").is_file() else {}
    provenance = {
        "run": run.name,
        "config": config,
        "tasks": sorted(t["name"] for t in state.get("tasks", {}).values()),
        "counters": dict(state.get("counters", {})),
        "settings": dict(state.get("settings", {})),
    }
    return export_policy(state, out, provenance)


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.ship", __doc__)
    ap.add_argument("run_dir", type=Path, help="the pretraining run's folder (holds agent.pt and config.yaml)")
    ap.add_argument("--out", type=Path, default=PRETRAINED)
    args = ap.parse_args(argv)
    try:
        path = ship(args.run_dir, args.out)
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"shipped {args.run_dir}/agent.pt -> {path} ({path.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
