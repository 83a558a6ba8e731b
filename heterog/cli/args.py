"""Arguments several subcommands share: the graph (a file or a MODEL captured on the fly) and cluster,
and the Ray fan-out of the searches."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.graph.opgraph import OpGraph


def resolve_graph(ref: str, batch_size: int | None = None, optimizer: str = "sgd") -> OpGraph:
    """A graph file, or a MODEL (zoo name or file.py:build) captured (and cached) at ``batch_size``."""
    from heterog.graph import load_graph

    p = Path(ref)
    if p.suffix in (".json", ".gz") or (p.exists() and p.is_file() and not ref.endswith(".py")):
        return load_graph(p)
    from heterog.graph.cache import capture_model

    return capture_model(ref, batch_size, optimizer)


def add_graph_args(p: argparse.ArgumentParser) -> None:
    """``--graph``, ``--batch-size``, ``--optimizer`` (when the graph is a MODEL) and ``--cluster``."""
    p.add_argument("--graph", required=True, help="graph file (.json/.json.gz) or MODEL (zoo name or file.py:build)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size when --graph is a MODEL")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="optimizer when --graph is a MODEL")
    p.add_argument("--cluster", required=True, help="cluster YAML or built-in name (e.g. paper-8gpu, local-cpu-2)")


def graph_and_cluster(args: argparse.Namespace) -> tuple[OpGraph, Cluster]:
    """The graph and cluster named by ``add_graph_args``' arguments."""
    from heterog.cluster import load_cluster

    return resolve_graph(args.graph, args.batch_size, args.optimizer), load_cluster(args.cluster)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--workers`` and ``--ray-address`` of the searches that fan out (``heterog.parallel``)."""
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="processes for the searches that fan out (mcmc's chains, the agent's simulations): "
                        "1 runs them here; more start Ray workers (a local Ray unless --ray-address)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. HEAD:6379, after 'ray start --head' there) for the workers")


def add_model_args(p: argparse.ArgumentParser, batch_help: str | None, cluster_help: str) -> None:
    """``--model`` (zoo name or file.py:build), ``--batch-size`` and ``--cluster`` of the commands that run
    a model for real (``run``, ``fidelity``)."""
    p.add_argument("--model", required=True, help="zoo name or path/to/file.py:build")
    p.add_argument("--batch-size", type=int, default=None, help=batch_help)
    p.add_argument("--cluster", required=True, help=cluster_help)
