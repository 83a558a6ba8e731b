"""The placement environment: one episode = one parallelisation plan for a training graph on a cluster,
scored by the simulator (reward -sqrt(iteration time), x oom_factor on OOM)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
import numpy.typing as npt
from gymnasium import spaces

from envs.actions import PlanAction, plan_length, plan_nvec, plan_strategy, split_plan
from envs.features import GraphFeatures, graph_features, observation_space, pad_observation
from heterog.actions import n_actions, state_action_name
from heterog.cluster.topology import Cluster
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator, reward
from heterog.extended_actions import extended_action_name
from heterog.graph.opgraph import OpGraph
from heterog.scheduler import DEFAULT_ORDER

DEFAULT_GRAPH = "tiny_transformer"
DEFAULT_CLUSTER = "paper-8gpu"


def resolve_graph(graph: OpGraph | str, batch_size: int | None = None, optimizer: str = "sgd") -> OpGraph:
    """An OpGraph as is, or a MODEL reference (zoo name or file.py:build) captured (and cached)."""
    if isinstance(graph, OpGraph):
        return graph
    if isinstance(graph, str):
        from heterog.graph.cache import capture_model

        return capture_model(graph, batch_size, optimizer)
    raise HeterogError(f"graph must be an OpGraph or a model reference, got {type(graph).__name__}")


def resolve_cluster(cluster: Cluster | str) -> Cluster:
    """A Cluster as is, or a built-in cluster name / YAML path loaded."""
    if isinstance(cluster, str):
        from heterog.cluster import load_cluster

        return load_cluster(cluster)
    return cluster


class PlacementEnv(gym.Env[dict[str, Any], np.ndarray]):
    """Choose, for every op group of a training graph, model parallelism on one device, one of four
    data-parallel schemes or (with ``splits``) a split of its parameters over devices, and whether to
    recompute its activations, and for the whole plan the number of micro-batches; the simulator scores
    the plan.

    ## Action Space
    ``MultiDiscrete([A] * max_groups + [2] * max_groups + [len(MICRO_CHOICES)])``, a flat vector of
    length ``2 * max_groups + 1`` (``envs.actions``), ``A = M + 4``, or ``3 M + 6`` with ``splits``:

    - ``[0, max_groups)``: one config per group. ``0..M-1`` model parallelism on that device, ``M``
      DP-even-PS, ``M+1`` DP-even-AR, ``M+2`` DP-proportional-PS, ``M+3`` DP-proportional-AR. With
      ``splits`` (splits beyond the batch, ``heterog.actions.decode_split_action``): ``M+4`` the group's
      parameters divided evenly over all devices (every device runs the whole batch on its part),
      ``M+5`` in proportion to device speed, ``M+6+d`` evenly over the devices of device d's server,
      ``2M+6+d`` in proportion over them (a server of one device: model parallelism on it). With
      ``state_actions``, ``2 * 18`` more after those: DP-even-AR (the first 18) and DP-proportional-AR
      keeping sharded state, choice ``s = 9 o + 3 (stage - 1) + b`` (offload ``o``: 0 none, 1 the optimizer
      state on the host; ZeRO stage 1-3; shards ``b``: 0 even, 1 by memory, 2 by speed;
      ``heterog.actions.STATE_CHOICES``); where the config has one replica the state is dropped.
    - ``[max_groups, 2 * max_groups)``: one recompute bit per group, ``0`` keep its forward activations,
      ``1`` free them after the forward and recompute them before the group's backward.
    - ``2 * max_groups``: the number of micro-batches, an index into ``MICRO_CHOICES = (1, 2, 4, 8, 16)``
      (even micro-batches, 1F1B schedule). A choice above the graph's batch size is clipped to the batch
      size (every index stays valid on every graph).

    Entries of padding groups (``group_mask == 0``) are ignored. An action of the earlier length
    ``max_groups`` (the configs alone) is accepted as one micro-batch and no recomputation.

    ## Observation Space
    ``Dict`` padded to ``max_ops``, ``max_edges`` and ``max_groups`` (fixed at construction, so graphs
    of different sizes share one space; real entries come first and masks mark them):

    - ``op_x (max_ops, F_op)`` float32: per-op features, log-scaled (``envs.features``): compute time
      on each device at the full batch, at the even and at the proportional DP share; mean time over
      devices and share of the graph's compute; input and output bytes; mean transfer time of the
      output across device pairs; FLOPs; resident parameter bytes; AllReduce time of its gradient;
      topological position; batch and gradient flags; one-hots of phase, kind and op type.
    - ``op_mask (max_ops,)``, ``edge_mask (max_edges,)``, ``group_mask (max_groups,)``: 1 = real.
    - ``edge_index (2, max_edges)`` int64: source and destination op of each tensor.
    - ``group_of (max_ops,)`` int64: the group of each op (-1 on padding ops).
    - ``dev_x (M, F_dev)`` float32: per-device power, memory, memory pressure, link bandwidth and
      latency (``envs.features.DEVICE_FEATURES``).

    With ``max_devices`` set (for the device-token policy, ``agent.head=tokens``) the space no longer
    depends on the cluster: ``op_x`` summarises its per-device columns by their mean, min and max over
    devices, ``dev_x`` has ``max_devices`` rows (the device tokens, real devices first) and
    ``dev_mask (max_devices,)`` marks the real ones. The action space stays ``A`` per group for the
    cluster at hand.

    ## Rewards
    ``-sqrt(iteration_time_s)`` of the simulated training iteration, multiplied by ``oom_factor``
    when any device runs out of memory. ``info`` carries ``iteration_time_s``, ``oom``,
    ``peak_memory_bytes`` (device -> bytes), ``compute_time_s``, ``comm_time_s``, ``overlap_ratio``,
    ``graph``, ``n_groups``, ``micro_batches`` (the number chosen, after clipping),
    ``recomputed_groups`` (how many real groups recompute) and ``sharded_groups`` (how many keep sharded
    state). The Evaluator prices sharded state and offloading (memory, communication, the host step).

    ## Starting State
    The observation of one graph: with several graphs, ``reset`` draws one uniformly from
    ``self.np_random`` (or takes ``options={"graph": index or name}``); with one graph the start is
    always that graph.

    ## Episode End
    An episode is one plan: the single ``step`` completes it and returns ``terminated=True``.
    ``truncated`` is always False (there is no time limit to cut an episode short). Stepping again
    needs a ``reset``.

    ## Arguments
    - ``graph``: an ``OpGraph``, a MODEL reference (zoo name or ``file.py:build``), or a sequence of
      them (default ``"tiny_transformer"``).
    - ``cluster``: a ``Cluster``, a built-in cluster name or a YAML path (default ``"paper-8gpu"``).
    - ``batch_size``, ``optimizer``: used to capture MODEL references (None: the zoo default).
    - ``max_groups``: at most this many op groups per graph (HeteroG's N) and the padded group count
      (None: 2000 for grouping, padded to the largest graph's group count).
    - ``max_ops``, ``max_edges``: padded sizes (None: the largest graph's).
    - ``max_devices``: pad the device tokens to this many devices (None: the cluster's own ``M``, and
      the per-device op feature layout).
    - ``oom_factor``: reward multiplier on OOM (default 10).
    - ``order``: task order of the scheduler (``heterog.scheduler.ORDERS``); ``"best"`` (default) keeps,
      per plan, the faster of rank-contention and FIFO.
    - ``splits``: offer the split actions (default False); every graph needs its per-op split options.
    - ``state_actions``: offer the state actions (default False: the shipped policies were trained
      without them).
    - ``extended_actions``: offer the extended actions (default False): after the others, model parallelism
      offloading the optimizer state, the grids of the servers and the row actions, each group's row of
      ``M`` shares after the plan entry ``2 * max_groups``, and every number of micro-batches under 1F1B or
      GPipe (``envs.actions``, ``heterog.extended_actions``); the action has length
      ``(M + 2) * max_groups + 1``.
    - ``render_mode``: None or ``"ansi"`` (a text summary of the last plan).
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, graph: OpGraph | str | Sequence[OpGraph | str] = DEFAULT_GRAPH,
                 cluster: Cluster | str = DEFAULT_CLUSTER, *, batch_size: int | None = None, optimizer: str = "sgd",
                 max_groups: int | None = None, max_ops: int | None = None, max_edges: int | None = None,
                 max_devices: int | None = None, oom_factor: float = 10.0, order: str = DEFAULT_ORDER,
                 splits: bool = False, state_actions: bool = False, extended_actions: bool = False,
                 render_mode: str | None = None) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise HeterogError(f"render_mode {render_mode!r} is not supported (use None or 'ansi')")
        if max_groups is not None and max_groups < 1:
            raise HeterogError(f"max_groups must be at least 1, got {max_groups}")
        graphs = [graph] if isinstance(graph, (OpGraph, str)) else list(graph)
        if not graphs:
            raise HeterogError("PlacementEnv needs at least one graph")
        self.cluster = resolve_cluster(cluster)
        self.graphs = [resolve_graph(g, batch_size, optimizer) for g in graphs]
        unsplittable = [g.name for g in self.graphs if g.splits is None] if splits else []
        if unsplittable:
            raise HeterogError(f"splits=True needs the per-op split options, which these graphs lack: {unsplittable}")
        self.splits = bool(splits)
        self.state_actions = bool(state_actions)
        self.extended_actions = bool(extended_actions)
        self.evaluators = [Evaluator(g, self.cluster, order=order, max_groups=max_groups or 2000)
                           for g in self.graphs]
        if max_devices is not None and not 1 <= self.cluster.n_devices <= max_devices:
            raise HeterogError(f"cluster {self.cluster.name!r} has {self.cluster.n_devices} devices, more than "
                               f"max_devices={max_devices}")
        self.max_devices = max_devices
        layout = "per-device" if max_devices is None else "device-free"
        self.features: list[GraphFeatures] = [graph_features(ev.graph, self.cluster, ev.cost, ev.group_of, layout)
                                              for ev in self.evaluators]
        self.max_ops = max_ops or max(f.n_ops for f in self.features)
        self.max_edges = max_edges or max(max(f.n_edges for f in self.features), 1)
        self.max_groups = max_groups or max(f.n_groups for f in self.features)
        self.observations = [pad_observation(f, self.max_ops, self.max_edges, self.max_groups, max_devices)
                             for f in self.features]
        self.oom_factor = float(oom_factor)
        self.render_mode = render_mode
        self.n_devices = self.cluster.n_devices
        self.observation_space = observation_space(self.n_devices, self.max_ops, self.max_edges, self.max_groups,
                                                   max_devices)
        self.action_space = spaces.MultiDiscrete(plan_nvec(self.n_devices, self.max_groups, self.splits,
                                                           self.state_actions, self.extended_actions,
                                                           max(g.batch_size for g in self.graphs)))
        self.graph_index = 0
        self._needs_reset = True
        self._last: dict[str, Any] | None = None

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        choice = (options or {}).get("graph")
        if choice is None:
            self.graph_index = int(self.np_random.integers(len(self.graphs))) if len(self.graphs) > 1 else 0
        else:
            self.graph_index = self._graph_index(choice)
        self._needs_reset = False
        self._last = None
        return self._observation(), {"graph": self.graphs[self.graph_index].name,
                                     "n_groups": self.features[self.graph_index].n_groups}

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], SupportsFloat, bool, bool, dict[str, Any]]:
        if self._needs_reset:
            raise gym.error.ResetNeeded("the plan is complete (terminated); call reset() before step()")
        plan = self.plan_action(action)
        ev = self.evaluators[self.graph_index]
        strategy = plan_strategy(ev, action, "env", n_slots=self.max_groups, states=self.state_actions,
                                 splits=self.splits, extended=self.extended_actions)
        result = ev.evaluate(strategy, detail=True)
        r = reward(result.iteration_time_s, result.oom, self.oom_factor)
        info = {"graph": self.graphs[self.graph_index].name, "n_groups": len(plan.groups),
                "micro_batches": strategy.n_micro, "recomputed_groups": len(strategy.recompute),
                "sharded_groups": sum(c.sharded is not None for c in strategy.configs),
                "iteration_time_s": result.iteration_time_s, "oom": result.oom,
                "peak_memory_bytes": dict(result.peak_memory_bytes), "compute_time_s": result.compute_time_s,
                "comm_time_s": result.comm_time_s, "overlap_ratio": result.overlap_ratio}
        self._needs_reset = True
        self._last = {"actions": plan.groups, **info}
        return self._observation(), r, True, False, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        name = self.graphs[self.graph_index].name
        if self._last is None:
            return f"{name} on {self.cluster.name}: {self.features[self.graph_index].n_groups} groups, no plan yet\n"
        first = n_actions(self.n_devices, self.splits, self.state_actions)
        counts = np.bincount(self._last["actions"], minlength=n_actions(self.n_devices, self.splits, self.state_actions,
                                                                        self.extended_actions))
        parts = ", ".join(f"{self._action_name(a, first)}={c}" for a, c in enumerate(counts) if c)
        return (f"{name} on {self.cluster.name}: iteration {self._last['iteration_time_s'] * 1e3:.2f} ms"
                f"{' (OOM)' if self._last['oom'] else ''}; groups: {parts}; "
                f"{self._last['micro_batches']} micro-batches, {self._last['recomputed_groups']} of "
                f"{self._last['n_groups']} groups recomputed\n")

    # ------------------------------------------------------------------ helpers
    def _action_name(self, action: int, first: int) -> str:
        if action >= first:
            return extended_action_name(action, self.n_devices, self.splits, self.state_actions)
        return state_action_name(action, self.n_devices, self.splits)

    @property
    def action_length(self) -> int:
        """``2 * max_groups + 1`` (extended actions: ``(M + 2) * max_groups + 1``): the length of a full action."""
        return plan_length(self.max_groups, self.n_devices if self.extended_actions else 0)

    def plan_action(self, action: npt.ArrayLike) -> PlanAction:
        """The real groups' configs and recompute bits and the micro-batch choice of an action of shape
        ``(2 * max_groups + 1,)`` or ``(max_groups,)`` (configs alone: one micro-batch, no recomputation);
        padding entries are dropped.

        Raises StrategyError for a wrong shape or an entry out of range.
        """
        return split_plan(action, self.features[self.graph_index].n_groups, self.max_groups, self.n_devices,
                          self.splits, self.state_actions, self.extended_actions)

    def group_actions(self, action: npt.ArrayLike) -> np.ndarray:
        """The real groups' config actions of an action (either length, see :meth:`plan_action`)."""
        return self.plan_action(action).groups

    def _graph_index(self, choice: object) -> int:
        if isinstance(choice, (int, np.integer)) and 0 <= int(choice) < len(self.graphs):
            return int(choice)
        names = [g.name for g in self.graphs]
        if isinstance(choice, str) and choice in names:
            return names.index(choice)
        raise HeterogError(f"reset option graph={choice!r} is neither an index 0..{len(self.graphs) - 1} "
                           f"nor one of {names}")

    def _observation(self) -> dict[str, np.ndarray]:
        """A fresh copy (callers may modify what they get)."""
        return {k: v.copy() for k, v in self.observations[self.graph_index].items()}
