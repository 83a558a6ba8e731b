"""What the compiler reads from a graph and a cluster whatever the strategy: the graph's tensors and
their aggregation needs (``GraphIndex``) and the cluster's routes as resources (``Paths``); both cached.

Each is derived once per graph (cluster) object and kept while it lives (``heterog.caches``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterog.caches import DerivedCache
from heterog.compiler.tasks import TaskCategory
from heterog.errors import StrategyError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.graph.opgraph import Op, OpGraph

# ops whose partial results are batch statistics (mean and inverse std of a batch norm over its samples)
STATISTICS_TARGETS = frozenset({
    "aten._native_batch_norm_legit.default", "aten._native_batch_norm_legit_functional.default",
    "aten.native_batch_norm.default",
})
VALUE_FREE_TARGETS = frozenset({
    "aten.ones_like.default", "aten.zeros_like.default", "aten.empty_like.default", "aten.full_like.default",
    "aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default",
})
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "double": 8,
                "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
                "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or its name); a StrategyError for an unknown one."""
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise StrategyError(f"unknown dtype {dtype!r} in graph")
    return _DTYPE_BYTES[name]


def output_bytes(op: Op) -> list[float]:
    """Bytes of each output of ``op`` at the graph's batch (a scalar output: one element)."""
    return [float(math.prod(shape)) * dtype_bytes(dt) if len(shape) else float(dtype_bytes(dt))
            for shape, dt in zip(op.output_shapes, op.output_dtypes)]


@dataclass
class GraphIndex:
    """Everything about a graph the compiler needs that does not depend on the strategy (cached).

    Aggregation is decided per *tensor* (an op output that some edge carries): a multi-output op such
    as ``convolution_backward`` yields a batch-carrying input gradient and partial weight gradients.

    Shapes: op arrays (n_ops,), edge arrays ``e_*`` (E,), tensor arrays ``t_*`` (n_tensors,).
    """

    n_ops: int
    has_batch: np.ndarray          # op touches a batch tensor -> split along the batch
    post_agg: np.ndarray           # non-batch compute op that reads aggregated values, or update phase
    placeholder_resident: np.ndarray  # param / state / buffer placeholders (resident memory)
    is_compute: np.ndarray
    out_fixed_bytes: np.ndarray    # allocation of the op's outputs that does not scale with batch
    out_batch_bytes: np.ndarray    # allocation that scales with the batch share
    resident_bytes: np.ndarray     # parameters, buffers and optimizer state (gradients are allocated)
    category: np.ndarray           # TaskCategory of the op's instances
    is_grad: np.ndarray
    e_src: np.ndarray
    e_dst: np.ndarray
    e_bytes: np.ndarray            # what the consumer reads of the tensor (a view of it: its bytes)
    e_batch: np.ndarray            # edge tensor carries a batch
    e_value_free: np.ndarray       # consumer only needs the shape (ones_like, ...)
    e_tensor: np.ndarray           # tensor id of the edge
    t_op: np.ndarray               # producer op of each tensor
    t_bytes: np.ndarray            # the producer's whole output, what moves between devices (the runtime
                                   # moves it and runs each reader's views where it is read)
    t_needs_agg: np.ndarray        # partial result (batch inputs, no batch dim) whose value someone reads
    t_pulled: np.ndarray           # value of a PS-resident op (parameter, state, update) read by a batch op
    partial_bytes: np.ndarray      # (n_ops,) bytes of the op's partial results that are read (t_needs_agg)
    has_partial: np.ndarray        # (n_ops,) the op has a partial result that is read (of any size)
    t_statistic: np.ndarray        # partial result of a batch norm (``STATISTICS_TARGETS``): its readers of the
                                   # same layout read their own instance's (per replica, per micro-batch)

    @property
    def n_tensors(self) -> int:
        return len(self.t_op)


_INDEXES: DerivedCache[OpGraph, GraphIndex] = DerivedCache("GraphIndex of each graph")
_PATHS: DerivedCache[Cluster, Paths] = DerivedCache("Paths of each cluster")


def graph_index(graph: OpGraph) -> GraphIndex:
    """The graph's ``GraphIndex`` (built once per graph object)."""
    return _INDEXES.get(graph, lambda: _build_index(graph))


def _build_index(graph: OpGraph) -> GraphIndex:
    """``graph_index`` computed."""
    n = graph.n_ops
    ops = graph.ops
    out_fixed = np.zeros(n)
    out_batch = np.zeros(n)
    for i, op in enumerate(ops):
        for b, bd in zip(output_bytes(op), op.batch_dims):
            if bd is None:
                out_fixed[i] += b
            else:
                out_batch[i] += b
    is_compute = graph.is_compute.copy()
    has_batch = graph.has_batch.copy()
    is_grad = np.array([op.is_grad for op in ops], dtype=bool)
    placeholder_resident = np.array([op.kind in ("param", "state", "buffer") for op in ops], dtype=bool)
    src, dst = graph.edge_src, graph.edge_dst
    e_batch = graph.edge_has_batch.copy()
    value_free_op = np.array([op.target in VALUE_FREE_TARGETS for op in ops], dtype=bool)
    e_value_free = value_free_op[dst] if len(dst) else np.zeros(0, bool)
    src_out = np.array([e.src_output for e in graph.edges], dtype=np.int64)
    uniq, first, e_tensor = np.unique(src * 1024 + src_out, return_index=True, return_inverse=True)
    e_tensor = e_tensor.astype(np.int64)
    t_op = src[first] if len(src) else np.zeros(0, np.int64)
    t_bytes = np.array([output_bytes(ops[int(u)])[int(k)] for u, k in zip(t_op.tolist(), src_out[first].tolist())],
                       dtype=np.float64)
    t_partial = is_compute[t_op] & has_batch[t_op] & ~e_batch[first] if len(src) else np.zeros(0, bool)
    t_read = np.zeros(len(uniq), dtype=bool)
    np.logical_or.at(t_read, e_tensor[~e_value_free], True)
    t_needs_agg = t_partial & t_read
    # post-aggregation ops: non-batch compute ops reading (transitively) aggregated values; the update phase
    post = np.zeros(n, dtype=bool)
    phase = graph.phase_index
    valued = np.nonzero(~e_value_free)[0]
    order = valued[np.argsort(dst[valued], kind="stable")]
    for t, d in zip(e_tensor[order].tolist(), dst[order].tolist()):   # dst ascending = topological
        if (t_needs_agg[t] or post[t_op[t]]) and not has_batch[d] and is_compute[d]:
            post[d] = True
    post |= is_compute & ~has_batch & (phase == 2)
    # under PS these tensors live on the PS and are pulled by the workers' batch ops
    pulled_edge = ~e_value_free & ~e_batch & has_batch[dst] & ~has_batch[src] & (post | placeholder_resident)[src]
    t_pulled = np.zeros(len(uniq), dtype=bool)
    t_pulled[e_tensor[pulled_edge]] = True
    # allocation: resident placeholders (parameters, buffers, optimizer state) and outputs nobody reads (the
    # step's new parameters and state, written into the old ones, and the loss) allocate nothing; every other
    # output, gradients included, is allocated by the instance that makes it (heterog.compiler.memory)
    n_consumers = np.bincount(src, minlength=n) if len(src) else np.zeros(n, int)
    no_alloc = placeholder_resident | (is_compute & (n_consumers == 0))
    out_fixed[no_alloc] = 0.0
    out_batch[no_alloc] = 0.0
    resident = np.array([op.param_bytes + op.state_bytes for op in ops], dtype=np.float64)
    # compute ops by phase (forward, backward, update: the first three categories), placeholders as inputs
    cat = np.where(is_compute, TaskCategory.FORWARD + phase, TaskCategory.INPUT).astype(np.int64)
    idx = GraphIndex(n, has_batch, post, placeholder_resident, is_compute, out_fixed, out_batch,
                     resident, cat, is_grad, src, dst, graph.edge_bytes.copy(), e_batch,
                     e_value_free, e_tensor, t_op, t_bytes, t_needs_agg, t_pulled,
                     np.bincount(t_op[t_needs_agg], weights=t_bytes[t_needs_agg], minlength=n),
                     np.bincount(t_op[t_needs_agg], minlength=n) > 0,
                     t_partial & np.array([ops[o].target in STATISTICS_TARGETS for o in t_op.tolist()], dtype=bool))
    return idx


@dataclass(frozen=True)
class Paths:
    """Routes of a cluster as TaskGraph resources: ``tab`` (M, M, Lmax) resource ids of the links on each
    path (-1 padded; links come after the M device resources), ``length`` (M, M) path lengths, ``host``
    (M,) devices that drive their own communication (``DeviceType.host_driven_comm``)."""

    tab: np.ndarray
    length: np.ndarray
    host: np.ndarray

    def resources(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(res_len, flat res_idx) of transfers ``src[i] -> dst[i]``: the links of each path, then the
        endpoints that drive their own communication (a CPU worker's cores copy the bytes, so the worker
        computes nothing else meanwhile)."""
        plen = self.length[src, dst]
        links = np.where(np.arange(self.tab.shape[2])[None, :] < plen[:, None], self.tab[src, dst], -1)
        ends = np.stack([np.where(self.host[src], src, -1), np.where(self.host[dst], dst, -1)], axis=1)
        res = np.concatenate([links, ends], axis=1)
        keep = res >= 0
        return keep.sum(axis=1), res[keep]


def path_table(cluster: Cluster) -> Paths:
    """The cluster's ``Paths`` (built once per cluster object)."""
    return _PATHS.get(cluster, lambda: _build_paths(cluster))


def _build_paths(cluster: Cluster) -> Paths:
    """``path_table`` computed."""
    m = cluster.n_devices
    paths = [[tuple(cluster.path(a, b)) for b in range(m)] for a in range(m)]
    lmax = max(1, max(len(p) for row in paths for p in row))
    tab = np.full((m, m, lmax), -1, dtype=np.int64)
    plen = np.zeros((m, m), dtype=np.int64)
    for a in range(m):
        for b in range(m):
            p = paths[a][b]
            plen[a, b] = len(p)
            tab[a, b, :len(p)] = np.asarray(p, dtype=np.int64) + m
    host = np.array([bool(d.type.host_driven_comm) for d in cluster.devices], dtype=bool)
    return Paths(tab, plen, host)
