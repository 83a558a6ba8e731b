"""What stays fixed while strategies for one (graph, cluster, cost model) are compiled: the frozen
``CompileContext`` that every phase of the compiler reads, and the AllReduce costs per device set.

Of the package it imports only ``tasks`` and ``index``, the modules below it, so every phase can take a
context without an import cycle (``tests/compiler/test_context.py`` holds the package to its layers).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.index import GraphIndex, Paths, graph_index, path_table
from heterog.compiler.tasks import CATEGORIES, OrderKey
from heterog.strategy import MAX_MICRO_BATCHES

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.cost.model import CostModel
    from heterog.graph.opgraph import OpGraph
    from simulator.taskgraph import TaskGraph


@dataclass(frozen=True)
class AllReduceCosts:
    """AllReduce of every tensor over one device set: ``times_s`` (n_tensors,) and ``algo`` (n_tensors,),
    the algorithm as an index into ``names`` (sorted); ``links[i]`` the link resources algorithm
    ``names[i]`` holds; ``hosts`` the members that drive their own communication (held too)."""

    times_s: np.ndarray
    algo: np.ndarray
    names: tuple[str, ...]
    links: tuple[tuple[int, ...], ...]
    hosts: tuple[int, ...]


class AllReduceTable:
    """``AllReduceCosts`` of a graph's tensors per device set, priced as gradients
    (``CostModel.gradient_allreduce_times``), computed on first use (at most about 1024 sets are kept; then
    the table starts afresh)."""

    MAX_SETS = 1024

    def __init__(self, cost: CostModel, t_bytes: np.ndarray, n_devices: int, paths: Paths) -> None:
        self._cost, self._t_bytes, self._n_devices, self._host = cost, t_bytes, n_devices, paths.host
        self._costs: dict[tuple[int, ...], AllReduceCosts] = {}

    def __call__(self, devices: tuple[int, ...]) -> AllReduceCosts:
        """AllReduce of every tensor over ``devices``."""
        hit = self._costs.get(devices)
        if hit is None:
            if len(self._costs) > self.MAX_SETS:
                self._costs.clear()
            times, algos = self._cost.gradient_allreduce_times(devices, self._t_bytes)
            names, code = np.unique(np.asarray(algos), return_inverse=True)
            links = tuple(tuple(self._n_devices + x for x in self._cost.allreduce_links(devices, a))
                          for a in names.tolist())
            hit = self._costs[devices] = AllReduceCosts(
                np.asarray(times, dtype=np.float64), code.ravel().astype(np.int64), tuple(names.tolist()), links,
                tuple(int(d) for d in devices if self._host[d]))
        return hit


@dataclass(frozen=True)
class CompileContext:
    """Everything the compiler reads that no strategy changes. Build it with ``CompileContext.of``. What
    is derived from it on demand is kept while it lives: the AllReduce costs here (``allreduce``), each split
    config's options and the prices of collectives by the modules that derive them (``heterog.caches``).

    Shapes: ``bandwidth_Bps`` (M, M) bottleneck bandwidth and ``latency_s`` (M, M) summed latency of the
    path between two devices;
    ``category_codes`` (len(TaskCategory),); ``resident_ops`` (R,) ops whose memory is resident.
    """

    graph: OpGraph
    cluster: Cluster
    cost: CostModel
    index: GraphIndex               # the graph's tables (``heterog.compiler.index``)
    paths: Paths                    # the cluster's routes as TaskGraph resources
    n_devices: int
    n_links: int
    batch_size: int                 # global batch, in samples
    bandwidth_Bps: np.ndarray
    latency_s: np.ndarray
    nccl_resource: int              # the stream every AllReduce holds (serialised collectives), -1: none
    order_key: OrderKey             # packs a task's place in the canonical order (``heterog.compiler.tasks``)
    resources: TaskGraph            # no tasks: the devices, links and NCCL stream, and the categories
    category_codes: np.ndarray      # TaskCategory -> category code in ``resources``
    resident_ops: np.ndarray        # parameter, state and buffer placeholders
    allreduce: AllReduceTable       # AllReduce costs per device set, cached

    @classmethod
    def of(cls, graph: OpGraph, cluster: Cluster, cost: CostModel, *,
           serialize_collectives: bool = False) -> CompileContext:
        """The context of ``graph`` on ``cluster`` priced by ``cost`` (``serialize_collectives``: all
        AllReduces hold one more resource, an NCCL stream, and so run one at a time)."""
        import simulator  # here, not at the top: importing the compiler need not load the simulator

        index, paths = graph_index(graph), path_table(cluster)
        if cost.comm_blocks_compute:            # every device's communication holds it
            paths = replace(paths, host=np.ones(cluster.n_devices, dtype=bool))
        n_devices, n_links = cluster.n_devices, len(cluster.links)
        tg = simulator.TaskGraph()
        for d, device in enumerate(cluster.devices):
            tg.add_resource(device.name, memory_capacity_bytes=float(cluster.memory_bytes[d]))
        for link in cluster.links:
            tg.add_resource(link.name)
        if serialize_collectives:
            tg.add_resource("nccl-stream")
        return cls(graph=graph, cluster=cluster, cost=cost, index=index, paths=paths, n_devices=n_devices,
                   n_links=n_links, batch_size=graph.batch_size, bandwidth_Bps=cluster.bandwidth_Bps,
                   latency_s=cluster.latency_s, nccl_resource=n_devices + n_links if serialize_collectives else -1,
                   order_key=OrderKey(max(index.n_tensors, 1), 2 * n_devices * MAX_MICRO_BATCHES + 2), resources=tg,
                   category_codes=np.array([tg.category(x) for x in CATEGORIES], dtype=np.int64),
                   resident_ops=np.nonzero(index.placeholder_resident)[0],
                   allreduce=AllReduceTable(cost, index.t_bytes, n_devices, paths))
