"""What the plan importers share: a foreign plan as pipelines of stages of replicas, GPU names resolved to
the cluster's device types, replicas placed on devices, and the Strategy built from it.

A plan (``ForeignPlan``) is one or more pipelines over the same layers (numbered as
``heterog.baselines.expert.block_layers`` numbers them: 0 the embeddings, 1..L the blocks, L+1 the head).
Each stage of a pipeline holds contiguous layers and data-parallel replicas; a replica is tp GPUs (named
by the plan's GPU type) that divide the stage's ops beyond the batch, Megatron style. The global batch is
divided evenly over the pipelines and, inside a pipeline, evenly over a stage's replicas; it is cut into
``micro_batches`` even micro-batches run under 1F1B.

Mapping onto a Strategy: a group per run of layers that every pipeline keeps in one stage; its config
lists every pipeline's replicas of that stage: one device alone (dp = tp = 1), data parallelism with
AllReduce (tp = 1), or a grid of the replicas by tp devices (``ParallelConfig.split_grid``, kind
"tensor": Megatron's column/row pattern). Replicas are placed stage by stage, replica by replica, on the
cluster's devices of their GPU type in cluster order: tp GPUs of one type inside one server where some
server has that many free, else over whole servers in order.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from heterog.cluster.catalog import SAILOR_NAMES, sailor_type
from heterog.errors import ClusterError, HeterogError
from heterog.shares import even_shares
from heterog.strategy import MAX_MICRO_BATCHES, ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.graph.opgraph import OpGraph

class PlanImportError(HeterogError):
    """A foreign plan file is malformed, inconsistent, or does not fit the graph or cluster."""


def plan_gpu_name(name: Any) -> str:
    """A GPU name as Sailor writes it: Metis' enum spellings (``A100_40``, ``DeviceType.A100_40``,
    ``a100-40``) normalised to ``A100-40``."""
    if not isinstance(name, str) or not name:
        raise PlanImportError(f"GPU type {name!r} is not a name")
    text = name.split(".")[-1].replace("_", "-")
    for known in SAILOR_NAMES:
        if known.lower() == text.lower():
            return known
    return text


@dataclass(frozen=True)
class Stage:
    """Contiguous layers and the replicas running them: per replica, the plan's GPU type of each of its
    tp GPUs."""

    layers: tuple[int, ...]
    replicas: tuple[tuple[str, ...], ...]

    @property
    def tp(self) -> int:
        return len(self.replicas[0])


@dataclass(frozen=True)
class ForeignPlan:
    """Another system's plan: ``pipelines[p][s]`` is stage s of pipeline p; the global batch and the number
    of even micro-batches it is cut into; ``meta`` what the source file says besides (measured time ...)."""

    source: str
    pipelines: tuple[tuple[Stage, ...], ...]
    global_batch: int
    micro_batches: int
    meta: dict[str, Any] = field(default_factory=dict)


def check_layers(pipeline: Sequence[Stage], n_layers: int, where: str) -> None:
    """Refuse a pipeline whose stages do not hold layers 0..n_layers-1 exactly once, in order."""
    flat = [int(x) for st in pipeline for x in st.layers]
    if flat == list(range(n_layers)):
        return
    counts = Counter(flat)
    missing = [x for x in range(n_layers) if x not in counts]
    dup = sorted(x for x, c in counts.items() if c > 1)
    extra = sorted(x for x in counts if not 0 <= x < n_layers)
    empty = [s for s, st in enumerate(pipeline) if not st.layers]
    what = [f"missing {missing}" if missing else "", f"duplicated {dup}" if dup else "",
            f"outside 0..{n_layers - 1} {extra}" if extra else "", f"empty stages {empty}" if empty else ""]
    detail = ", ".join(w for w in what if w) or "not in increasing order"
    raise PlanImportError(f"{where}: stages must hold layers 0..{n_layers - 1} exactly once, in order "
                          f"(the graph has {n_layers - 2} blocks): {detail}")


class Placer:
    """Hands out the cluster's devices by GPU type, in cluster order (see the module docstring)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.free: dict[str, list[list[int]]] = {}      # type name -> per server (cluster order), free devices
        for server in cluster.servers:
            by_type: dict[str, list[int]] = {}
            for d in server.devices:
                by_type.setdefault(cluster.devices[d].type.name, []).append(d)
            for name, devs in by_type.items():
                self.free.setdefault(name, []).append(devs)

    def type_of(self, plan_name: str) -> str:
        """The cluster's device type for a plan's GPU name (``heterog.cluster.catalog.sailor_type``)."""
        try:
            wanted = sailor_type(plan_name)
        except ClusterError:
            raise PlanImportError(f"unknown GPU type {plan_name!r} (known: {', '.join(SAILOR_NAMES)}, or a catalog "
                                  f"type; cluster {self.cluster.name!r} has {', '.join(self.free)})") from None
        if wanted not in self.free:
            raise PlanImportError(f"the plan needs GPUs of type {plan_name!r} ({wanted}); cluster "
                                  f"{self.cluster.name!r} has none (it has {', '.join(self.free)})")
        return wanted

    def check_counts(self, plan: ForeignPlan) -> None:
        """Refuse a plan that needs more GPUs of a type than the cluster has, naming both counts."""
        need = Counter(self.type_of(g) for pipe in plan.pipelines for st in pipe for r in st.replicas for g in r)
        for name, n in need.items():
            have = sum(len(devs) for devs in self.free[name])
            if n > have:
                raise PlanImportError(f"the plan needs {n} GPUs of type {name}, cluster {self.cluster.name!r} "
                                      f"has {have}")

    def take(self, replica: Sequence[str]) -> list[int]:
        """Devices for one replica (GPU types in order): each type's GPUs inside one server where one has
        enough free, else over servers in order."""
        out: list[int] = []
        for plan_name, n in Counter(replica).items():
            servers = self.free[self.type_of(plan_name)]
            inside = next((devs for devs in servers if len(devs) >= n), None)
            if inside is not None:
                out += inside[:n]
                del inside[:n]
                continue
            for devs in servers:
                k = min(n, len(devs))
                out += devs[:k]
                del devs[:k]
                n -= k
            if n:
                raise PlanImportError(f"no room for a replica of {len(replica)} GPUs ({plan_name}) on cluster "
                                      f"{self.cluster.name!r}")
        return out


def stage_config(replicas: Sequence[Sequence[int]], share: Sequence[int]) -> ParallelConfig:
    """One stage's config: its replicas (devices each) with their batch shares (see the module docstring)."""
    tp = len(replicas[0])
    if tp == 1:
        if len(replicas) == 1:
            return ParallelConfig.single(replicas[0][0], share[0])
        return ParallelConfig(tuple(r[0] for r in replicas), tuple(share), sync="allreduce")
    return ParallelConfig.split_grid(replicas, [1] * tp, share, kind="tensor")


def to_strategy(plan: ForeignPlan, graph: OpGraph, cluster: Cluster) -> Strategy:
    """The Strategy running ``plan`` on ``graph`` and ``cluster`` (see the module docstring)."""
    from heterog.baselines.expert import block_layers

    layer_of, L = block_layers(graph)
    n_layers = L + 2
    B, P, k = int(plan.global_batch), len(plan.pipelines), int(plan.micro_batches)
    if k > MAX_MICRO_BATCHES:
        raise PlanImportError(f"the plan needs {k} micro-batches; at most {MAX_MICRO_BATCHES} are supported")
    if B != graph.batch_size:
        raise PlanImportError(f"the plan's global batch is {B}, graph {graph.name!r} has batch {graph.batch_size}: "
                              f"capture the graph at batch {B}")
    for p, pipe in enumerate(plan.pipelines):
        check_layers(pipe, n_layers, f"pipeline {p}")
    placer = Placer(cluster)
    placer.check_counts(plan)
    stage_of = np.zeros((P, n_layers), dtype=np.int64)              # (pipelines, layers) stage index
    placed: list[list[list[list[int]]]] = []                        # [p][s][replica] devices
    for p, pipe in enumerate(plan.pipelines):
        placed.append([[placer.take(r) for r in st.replicas] for st in pipe])
        for s, st in enumerate(pipe):
            stage_of[p, list(st.layers)] = s
    # a group per run of layers that every pipeline keeps in one stage
    change = np.any(stage_of[:, 1:] != stage_of[:, :-1], axis=0)
    segment = np.concatenate([[0], np.cumsum(change)]).astype(np.int64)  # (layers,) group of each layer
    configs = []
    for g in range(int(segment[-1]) + 1):
        layer = int(np.flatnonzero(segment == g)[0])
        reps: list[list[int]] = []
        shares: list[int] = []
        for p, pipe in enumerate(plan.pipelines):
            s = int(stage_of[p, layer])
            dp = len(pipe[s].replicas)
            if B % (P * dp):
                raise PlanImportError(f"global batch {B} does not divide over {P} pipeline(s) x {dp} replicas "
                                      f"(pipeline {p}, stage {s})")
            reps += placed[p][s]
            shares += [B // P // dp] * dp
        if len({len(r) for r in reps}) != 1:
            raise PlanImportError(f"layers {np.flatnonzero(segment == g).tolist()} run on replicas of tensor-"
                                  f"parallel degrees {sorted({len(r) for r in reps})}; one degree per stage is "
                                  f"supported")
        cfg = stage_config(reps, shares)
        if cfg.grid > 1 and B // k < cfg.grid:
            raise PlanImportError(f"micro-batches of {B // k} samples cannot feed {cfg.grid} replicas "
                                  f"(layers {np.flatnonzero(segment == g).tolist()})")
        configs.append(cfg)
    meta = {"source": plan.source, **plan.meta}
    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, B, segment[layer_of], configs,
                    method=f"import-{plan.source}", meta=meta,
                    micro_batches=None if k == 1 else tuple(even_shares(B, k)), schedule="1f1b")


def need(cond: object, message: str) -> None:
    """Raise a PlanImportError with ``message`` unless ``cond``."""
    if not cond:
        raise PlanImportError(message)


def positive_int(value: Any, what: str) -> int:
    """``value`` as a positive int, or a PlanImportError naming ``what``."""
    need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
         f"{what} must be a positive integer, got {value!r}")
    return int(value)
