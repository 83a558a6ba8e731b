"""What planners and bounds read of an evaluator: ``PlanEvaluator``, the part of ``heterog.evaluate.Evaluator``
that a planner (``heterog.planners``, ``heterog.baselines``) or a bound (``heterog.bounds``) may use.

A planner receives one and may rely on these members alone; ``Evaluator`` has them all (mypy checks it
wherever an Evaluator is passed to a planner, and ``isinstance(ev, PlanEvaluator)`` holds at run time).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.cost.model import CostModel
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import Strategy


@runtime_checkable
class PlanEvaluator(Protocol):
    """Scores strategies of one graph on one cluster.

    The graph, cluster and cost model plan and bound with; the op grouping actions are given over; the
    settings that rebuild the evaluator in another process (``heterog.parallel.EvaluatorSpec``); decoding
    one action per group into a Strategy, the simulated iteration time of a Strategy and the PS devices
    the compiler gives it.
    """

    @property
    def graph(self) -> OpGraph:
        """The graph being planned."""

    @property
    def cluster(self) -> Cluster:
        """The cluster it is planned on."""

    @property
    def cost(self) -> CostModel:
        """The cost model every time is read from."""

    @property
    def order(self) -> str:
        """The task order plans are simulated under (``heterog.scheduler.ORDERS``)."""

    @property
    def shares(self) -> str:
        """How proportional actions split the batch (``heterog.evaluate.SHARE_MODES``)."""

    @property
    def serialize_collectives(self) -> bool:
        """Whether collectives run one at a time."""

    @property
    def sync_batch_stats(self) -> bool:
        """Whether every plan's batch norms use the whole batch's statistics (``heterog.compiler.sync_stats``)."""

    @property
    def max_groups(self) -> int:
        """The most op groups the grouping makes."""

    @property
    def checkpoint_every_steps(self) -> int | None:
        """The checkpoint interval whose share of a checkpoint's time iteration times include (None: none)."""

    @property
    def group_of(self) -> np.ndarray:
        """(n_ops,) the group of each op; actions are given one per group."""

    @property
    def n_groups(self) -> int:
        """The number of groups (G)."""

    def strategy(self, actions: Sequence[int] | np.ndarray, method: str = "") -> Strategy:
        """The Strategy of one (M + 4)-way action per group. Shapes: ``actions`` (G,)."""

    def iteration_time(self, strategy: Strategy, order: str | None = None) -> tuple[float, bool]:
        """(simulated iteration time in seconds, whether a device runs out of memory) of ``strategy``
        under ``order`` (None: ``self.order``)."""

    def ps_devices(self, strategy: Strategy) -> dict[int, int]:
        """The parameter-server device of each PS group of ``strategy`` as compiled (group -> device): the
        one its config names, or the compiler's load-aware choice (``heterog.compiler.ps``)."""


__all__ = ["PlanEvaluator"]
