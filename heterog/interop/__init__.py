"""Plans of other systems (Sailor, Metis) turned into heterog Strategies, and Strategies written back in
Sailor's format; ``heterog import-plan`` on the command line. No torch.

    read_plan(fmt, path) -> ForeignPlan          to_strategy(plan, graph, cluster) -> Strategy
    import_plan(fmt, path, graph, cluster) -> Strategy
    write_sailor(strategy, graph, cluster) -> dict   (a Sailor plan of one pipeline)
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from heterog.interop.common import ForeignPlan, PlanImportError, Stage, to_strategy
from heterog.interop.metis import read_metis
from heterog.interop.sailor import read_sailor, write_sailor

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import Strategy

READERS: dict[str, Callable[..., ForeignPlan]] = {"sailor": read_sailor, "metis": read_metis}
FORMATS = tuple(READERS)


def read_plan(fmt: str, path: str | Path) -> ForeignPlan:
    """The plan in file ``path`` written in format ``fmt`` (``FORMATS``)."""
    from heterog.atomic import read_json_file

    if fmt not in READERS:
        raise PlanImportError(f"unknown plan format {fmt!r} (choose from {', '.join(FORMATS)})")
    return READERS[fmt](read_json_file(path, "plan file", PlanImportError), source=str(path))


def import_plan(fmt: str, path: str | Path, graph: OpGraph, cluster: Cluster) -> Strategy:
    """The Strategy of the ``fmt`` plan in ``path`` on ``graph`` and ``cluster``."""
    strategy = to_strategy(read_plan(fmt, path), graph, cluster)
    strategy.meta["plan_file"] = str(path)
    return strategy


__all__ = ["FORMATS", "ForeignPlan", "PlanImportError", "Stage", "import_plan", "read_metis",
           "read_plan", "read_sailor", "to_strategy", "write_sailor"]
