"""Hydra app: compare every planner on graph x cluster (``python -m experiments.compare graph=vgg19
cluster=paper-8gpu``; ``-m graph=bert_large,vgg19 cluster=paper-8gpu,paper-12gpu`` for the grid)."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from heterog.errors import HeterogError


def run(cfg: DictConfig) -> dict:
    """Build graph, cluster and method list from ``cfg``, compare, write the report; returns its paths."""
    from heterog.cluster import load_cluster
    from heterog.compare import compare, write_report
    from heterog.graph.cache import capture_model
    from heterog.planners import parse_methods
    from heterog.reporting import comparison_text

    graph = capture_model(cfg.graph.model, cfg.graph.batch_size, cfg.graph.get("optimizer", "sgd"))
    cluster = load_cluster(cfg.cluster.name)
    methods = parse_methods(list(cfg.methods))
    comparison = compare(graph, cluster, methods, budget_s=float(cfg.budget_s), seed=int(cfg.seed),
                         agent_checkpoint=cfg.get("agent_checkpoint"), workers=int(cfg.get("workers", 1)),
                         ray_address=cfg.get("ray_address"))
    paths = write_report(comparison, Path(cfg.out_dir))
    print(comparison_text(comparison))
    print(f"wrote {paths['report']} and the best plan's Gantt chart {paths['gantt']}")
    return paths


@hydra.main(version_base="1.3", config_path="conf", config_name="compare")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except HeterogError as exc:
        print(f"experiments.compare: error: {exc} (config: {OmegaConf.to_container(cfg.graph)}, "
              f"cluster {cfg.cluster.name})", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
