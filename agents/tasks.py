"""The graphs the agent plans for and what training learns about each: a :class:`GraphTask` (a graph's
evaluator and the policy's inputs) and its :class:`TaskState` (baseline, best plan, replay pool, history)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from agents.features import PolicyInputs
from envs.features import graph_features
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph


@dataclass
class GraphTask:
    """One (graph, cluster) the agent plans for: its evaluator and the policy's inputs."""

    name: str
    evaluator: Evaluator
    inputs: PolicyInputs

    @classmethod
    def from_evaluator(cls, evaluator: Evaluator, name: str | None = None, layout: str = "per-device") -> GraphTask:
        """The task of ``evaluator``'s graph and cluster, with op features in ``layout`` (the policy's
        ``feature_layout``: ``"per-device"`` for the fixed head, ``"device-free"`` for the tokens head)."""
        g = evaluator.graph
        features = graph_features(g, evaluator.cluster, evaluator.cost, evaluator.group_of, layout)
        return cls(name or f"{g.name}-b{g.batch_size}", evaluator, PolicyInputs.from_features(features))

    @property
    def key(self) -> str:
        """Identifies the task in checkpoints: name, cluster and the graph's fingerprint."""
        g = self.evaluator.graph
        return f"{self.name}@{self.evaluator.cluster.name}:{g.fingerprint[:16]}"

    @property
    def n_groups(self) -> int:
        return self.inputs.n_groups


def make_task(graph: OpGraph, cluster: Cluster, *, max_groups: int = 2000, name: str | None = None,
              layout: str = "per-device") -> GraphTask:
    """A GraphTask for ``graph`` on ``cluster`` (HeteroG grouping into at most ``max_groups`` groups; op
    features in ``layout``, see :meth:`GraphTask.from_evaluator`)."""
    return GraphTask.from_evaluator(Evaluator(graph, cluster, max_groups=max_groups), name, layout)


@dataclass
class TaskState:
    """What the trainer learns about one graph: its baseline, its best plans and its history."""

    baseline: float | None = None
    """Moving average of sampled rewards (None before the first round)."""
    reward_var: float = 0.0
    """Moving average of squared deviations from the baseline (advantage scale)."""
    best_reward: float = -math.inf
    """Highest reward seen (OOM plans count with the oom_factor penalty)."""
    best_iteration_time_s: float = math.inf
    """Iteration time of that best plan."""
    best_oom: bool = True
    """Whether that best plan runs out of memory."""
    best_actions: list[int] | None = None
    """Its plan (None before the first sample): each group's config, each group's recompute bit and the
    micro-batch choice (``envs.actions``; checkpoints from before plans hold the configs alone)."""
    held_reward: float = -math.inf
    """Highest reward of a plan the policy's actions hold."""
    held_actions: list[int] | None = None
    """That plan (None before one was recorded): the imitation target where the best plan lies beyond the
    policy's actions (an extended plan: a pipeline's stages on device subsets, a parameter server's rows)."""
    pool: list[tuple[float, list[int]]] = field(default_factory=list)
    """Best distinct strategies seen (reward, plan), best first."""
    episodes: int = 0
    """Strategies sampled for this graph (replays not counted)."""
    history: list[tuple[float, float, int, float]] = field(default_factory=list)
    """(wall_s, cpu_s, episodes, best_iteration_time_s) whenever the best improved."""

    def keep_best(self, actions: np.ndarray, rewards: np.ndarray, times: np.ndarray, ooms: np.ndarray,
                  wall_s: float, cpu_s: float) -> None:
        """Make the highest-reward strategy of ``actions`` ``(k, G)`` the best if it beats the best so far,
        and note the improvement in the history at training time (``wall_s``, ``cpu_s``)."""
        i = int(np.argmax(rewards))
        if rewards[i] > self.best_reward:
            self.best_reward = float(rewards[i])
            self.best_iteration_time_s = float(times[i])
            self.best_oom = bool(ooms[i])
            self.best_actions = actions[i].tolist()
            self.history.append((wall_s, cpu_s, self.episodes, self.best_iteration_time_s))

    def keep_held(self, actions: np.ndarray, rewards: np.ndarray, held: np.ndarray) -> None:
        """Make the highest-reward strategy of ``actions`` ``(k, L)`` among those the policy's actions hold
        (``held``, ``(k,)`` bool) the best held plan if it beats the one so far."""
        if not held.any():
            return
        i = int(np.flatnonzero(held)[np.argmax(rewards[held])])
        if rewards[i] > self.held_reward:
            self.held_reward = float(rewards[i])
            self.held_actions = actions[i].tolist()

    def best_plan(self) -> list[int]:
        """The best plan found so far; an error before any plan was recorded."""
        if self.best_actions is None:
            raise HeterogError("no plan of this graph has been recorded yet")
        return self.best_actions

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TaskState:
        state = cls(**d)
        state.pool = [(float(r), list(a)) for r, a in state.pool]
        state.history = [(float(w), float(c), int(e), float(t)) for w, c, e, t in state.history]
        return state
