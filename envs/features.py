"""What the policy sees of a (graph, cluster): normalised per-op and per-device features (numpy), the
edge list and the op groups, and their padding into one fixed-size gymnasium observation.

All magnitudes are log-scaled (``log10(1 + x / unit) / 3``: one unit -> 0.1, a thousand units -> 1) and
clipped to ``[-FEATURE_CLIP, FEATURE_CLIP]`` so that graphs and clusters of any size share one scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gymnasium import spaces

from heterog.cluster.topology import Cluster
from heterog.cost.model import CostModel
from heterog.graph.opgraph import KINDS, PHASES, OpGraph
from heterog.shares import even_shares, proportional_shares

FEATURE_CLIP = 10.0

# Op types: a small fixed vocabulary of categories of common ATen targets (the op name without the
# "aten." prefix and the overload); anything else is "other". Graph inputs are told apart by KINDS.
OP_CATEGORIES: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm"),
    "conv": ("convolution",),
    "conv_backward": ("convolution_backward",),
    "norm": ("_native_batch_norm_legit", "_native_batch_norm_legit_functional", "native_batch_norm",
             "native_layer_norm", "native_group_norm"),
    "norm_backward": ("native_batch_norm_backward", "native_layer_norm_backward", "native_group_norm_backward"),
    "activation": ("relu", "gelu", "hardtanh", "tanh", "sigmoid", "silu", "leaky_relu"),
    "activation_backward": ("threshold_backward", "gelu_backward", "hardtanh_backward", "tanh_backward",
                            "sigmoid_backward", "silu_backward", "leaky_relu_backward"),
    "softmax": ("_softmax", "_log_softmax"),
    "softmax_backward": ("_softmax_backward_data", "_log_softmax_backward_data"),
    "loss": ("nll_loss_forward", "nll_loss_backward"),
    "embedding": ("embedding", "embedding_dense_backward"),
    "pool": ("max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "mean"),
    "pool_backward": ("max_pool2d_with_indices_backward", "avg_pool2d_backward", "adaptive_avg_pool2d_backward"),
    "elementwise": ("add", "add_", "sub", "mul", "div", "neg", "pow", "reciprocal", "sqrt", "rsqrt", "exp",
                    "masked_fill", "masked_fill_", "sin", "cos", "where", "eq", "bitwise_not", "addcmul",
                    "addcdiv", "lerp"),
    "reduction": ("sum", "amax", "max", "var_mean"),
    "copy": ("clone", "cat", "stack", "slice_backward", "select_backward", "getitem", "empty", "new_zeros",
             "ones", "ones_like", "zeros", "zeros_like", "arange", "triu", "gather", "scatter_add", "copy"),
}
OP_TYPES = (*OP_CATEGORIES, "other")
_TYPE_OF = {name: i for i, names in enumerate(OP_CATEGORIES.values()) for name in names}

# per-device columns of the op features: full batch, even DP share, proportional DP share
PER_DEVICE_OP_FEATURES = ("time_full_batch", "time_even_share", "time_proportional_share")
SCALAR_OP_FEATURES = (
    "time_mean_full_batch",          # mean over devices of the full-batch time
    "compute_share",                 # op's mean time / graph's total (log-scaled per mille)
    "input_bytes", "output_bytes",
    "output_transfer_time",          # mean over ordered device pairs of moving the output
    "flops", "param_bytes",          # resident bytes: parameter + gradient + optimizer state
    "grad_allreduce_time",           # AllReduce of its gradient bytes over all devices
    "position",                      # op index / number of ops (topological position)
    "has_batch", "is_grad",
)
DEVICE_FEATURES = (
    "power", "power_share",          # peak FLOP/s; its share of the cluster's times M
    "memory", "memory_pressure",     # capacity; the graph's resident bytes / capacity
    "bandwidth_mean", "bandwidth_max", "latency_mean", "server_share",
)
DEVICE_FEATURE_DIM = len(DEVICE_FEATURES)
# the device-free op layout (for the device-token head): each per-device column summarised over devices
DEVICE_SUMMARIES = ("mean", "min", "max")
FEATURE_LAYOUTS = ("per-device", "device-free")
MAX_DEVICES = 16                     # default padded device count of the device-token observation


def op_feature_dim(n_devices: int, layout: str = "per-device") -> int:
    """Size of one op's feature vector for a cluster of ``n_devices``: ``"per-device"`` has one column per
    device for each of PER_DEVICE_OP_FEATURES; ``"device-free"`` their mean, min and max over devices
    (the same size for every cluster)."""
    check_layout(layout)
    per_device = n_devices if layout == "per-device" else len(DEVICE_SUMMARIES)
    return (len(PER_DEVICE_OP_FEATURES) * per_device + len(SCALAR_OP_FEATURES) + len(PHASES) + len(KINDS)
            + len(OP_TYPES))


def check_layout(layout: str) -> None:
    """Raise ValueError for an unknown op feature layout."""
    if layout not in FEATURE_LAYOUTS:
        raise ValueError(f"unknown op feature layout {layout!r}; choose one of {list(FEATURE_LAYOUTS)}")


def op_type_index(target: str) -> int:
    """Index into OP_TYPES of an ATen target such as ``"aten.mm.default"`` (``"other"`` if unknown)."""
    parts = target.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]
    return _TYPE_OF.get(name, len(OP_TYPES) - 1)


def log_scale(x: np.ndarray, unit: float) -> np.ndarray:
    """``log10(1 + x / unit) / 3``: 0 -> 0, one unit -> 0.1, 1000 units -> 1 (x >= 0)."""
    return np.log10(1.0 + np.maximum(np.asarray(x, dtype=np.float64), 0.0) / unit) / 3.0


def _times(x: np.ndarray) -> np.ndarray:
    return log_scale(x, 1e-6)        # microseconds


def _bytes(x: np.ndarray) -> np.ndarray:
    return log_scale(x, 1e3)         # kilobytes


@dataclass(frozen=True)
class GraphFeatures:
    """The unpadded observation of one (graph, cluster).

    Shapes: op_x ``(N, op_feature_dim(M))`` float32, edge_index ``(2, E)`` int64,
    group_of ``(N,)`` int64 in ``0..n_groups-1``, dev_x ``(M, DEVICE_FEATURE_DIM)`` float32.
    """

    op_x: np.ndarray
    edge_index: np.ndarray
    group_of: np.ndarray
    n_groups: int
    dev_x: np.ndarray

    @property
    def n_ops(self) -> int:
        return int(self.op_x.shape[0])

    @property
    def n_edges(self) -> int:
        return int(self.edge_index.shape[1])

    @property
    def n_devices(self) -> int:
        return int(self.dev_x.shape[0])


def op_features(graph: OpGraph, cluster: Cluster, cost: CostModel, layout: str = "per-device") -> np.ndarray:
    """Per-op features ``(n_ops, op_feature_dim(M, layout))`` (see PER_DEVICE_OP_FEATURES,
    SCALAR_OP_FEATURES, then one-hots of phase, kind and op type)."""
    check_layout(layout)
    n, m = graph.n_ops, cluster.n_devices
    batch = graph.batch_size
    full = cost.full_batch_times(graph)                                      # (n, M)
    ops = np.repeat(np.arange(n), m)
    devices = np.tile(np.arange(m), n)
    even = np.array(even_shares(batch, m), dtype=np.float64) / batch
    prop = np.array(proportional_shares(batch, cluster.power), dtype=np.float64) / batch
    t_even = cost.op_times(graph, ops, devices, np.tile(even, n)).reshape(n, m)
    t_prop = cost.op_times(graph, ops, devices, np.tile(prop, n)).reshape(n, m)
    # a device with a zero proportional share gets no replica: its time is 0
    t_prop = np.where(prop[None, :] > 0, t_prop, 0.0)

    mean_full = full.mean(axis=1)
    share = mean_full / max(float(mean_full.sum()), 1e-12)
    in_bytes = np.zeros(n)
    if len(graph.edges):
        np.add.at(in_bytes, graph.edge_dst, graph.edge_bytes)
    out_bytes = np.array([op.output_bytes for op in graph.ops], dtype=np.float64)
    src, dst = np.nonzero(~np.eye(m, dtype=bool))
    if len(src):
        pair_times = cost.transfer_times(src[None, :], dst[None, :], out_bytes[:, None])
        transfer = pair_times.mean(axis=1)
        grad_bytes = np.array([op.grad_bytes for op in graph.ops], dtype=np.float64)
        allreduce, _ = cost.allreduce_times(list(range(m)), grad_bytes)
        allreduce = np.where(grad_bytes > 0, allreduce, 0.0)
    else:
        transfer = np.zeros(n)
        allreduce = np.zeros(n)
    scalars = np.stack([
        _times(mean_full), log_scale(share, 1e-3), _bytes(in_bytes), _bytes(out_bytes), _times(transfer),
        log_scale(graph.flops, 1e6), _bytes(graph.resident_bytes), _times(allreduce),
        np.arange(n) / max(n - 1, 1), graph.has_batch.astype(np.float64),
        np.array([op.is_grad for op in graph.ops], dtype=np.float64),
    ], axis=1)
    phase = np.eye(len(PHASES))[graph.phase_index]
    kind = np.eye(len(KINDS))[[KINDS.index(op.kind) for op in graph.ops]]
    types = np.zeros((n, len(OP_TYPES)))
    compute = graph.is_compute
    types[np.arange(n)[compute], [op_type_index(op.target) for op in graph.ops if op.kind == "compute"]] = 1.0
    per_device = [_times(full), _times(t_even), _times(t_prop)]
    if layout == "device-free":
        per_device = [np.stack([t.mean(axis=1), t.min(axis=1), t.max(axis=1)], axis=1) for t in per_device]
    x = np.concatenate([*per_device, scalars, phase, kind, types], axis=1)
    return np.clip(x, -FEATURE_CLIP, FEATURE_CLIP).astype(np.float32)


def device_features(cluster: Cluster, graph: OpGraph | None = None) -> np.ndarray:
    """Per-device features ``(M, DEVICE_FEATURE_DIM)`` (see DEVICE_FEATURES); memory pressure needs the
    graph (0 without it)."""
    m = cluster.n_devices
    power = np.asarray(cluster.power, dtype=np.float64)
    memory = np.asarray(cluster.memory_bytes, dtype=np.float64)
    off = ~np.eye(m, dtype=bool)
    if m > 1:
        bw = np.where(off, cluster.bandwidth_Bps, np.nan)
        bw_mean, bw_max = np.nanmean(bw, axis=1), np.nanmax(bw, axis=1)
        lat = np.nanmean(np.where(off, cluster.latency_s, np.nan), axis=1)
    else:
        bw_mean = bw_max = lat = np.zeros(1)
    same_server = (cluster.server_of[:, None] == cluster.server_of[None, :]).sum(axis=1) / m
    resident = float(graph.resident_bytes.sum()) if graph is not None else 0.0
    x = np.stack([
        log_scale(power, 1e9), power / power.sum() * m,
        _bytes(memory), resident / memory,
        log_scale(bw_mean, 1e6), log_scale(bw_max, 1e6), _times(lat), same_server,
    ], axis=1)
    return np.clip(x, -FEATURE_CLIP, FEATURE_CLIP).astype(np.float32)


def graph_features(graph: OpGraph, cluster: Cluster, cost: CostModel, group_of: np.ndarray,
                   layout: str = "per-device") -> GraphFeatures:
    """Everything the policy sees of ``graph`` on ``cluster`` (``cost``: its CostModel), unpadded, with
    op features in ``layout`` (see :func:`op_feature_dim`)."""
    group_of = np.asarray(group_of, dtype=np.int64)
    edge_index = np.stack([graph.edge_src, graph.edge_dst]).astype(np.int64).reshape(2, -1)
    return GraphFeatures(op_features(graph, cluster, cost, layout), edge_index, group_of,
                         int(group_of.max()) + 1 if len(group_of) else 0, device_features(cluster, graph))


# ------------------------------------------------------------------------------------------ padding
def observation_space(n_devices: int, max_ops: int, max_edges: int, max_groups: int,
                      max_devices: int | None = None) -> spaces.Dict:
    """The padded observation: ``op_x (max_ops, F_op)``, ``op_mask (max_ops,)``, ``edge_index
    (2, max_edges)``, ``edge_mask (max_edges,)``, ``group_of (max_ops,)`` (-1 on padding ops),
    ``group_mask (max_groups,)``, ``dev_x (M, F_dev)``. Masks are 1 for real entries.

    With ``max_devices`` (device tokens): op features in the device-free layout, ``dev_x
    (max_devices, F_dev)`` padded and ``dev_mask (max_devices,)``, so the space is the same for any
    cluster of at most ``max_devices`` devices."""
    if max_devices is not None and not 1 <= n_devices <= max_devices:
        raise ValueError(f"cluster has {n_devices} devices, more than the observation's max_devices={max_devices}")
    f_op = op_feature_dim(n_devices, "per-device" if max_devices is None else "device-free")
    n_tokens = n_devices if max_devices is None else max_devices
    extra = {} if max_devices is None else {"dev_mask": spaces.MultiBinary(max_devices)}
    return spaces.Dict({
        "op_x": spaces.Box(-FEATURE_CLIP, FEATURE_CLIP, (max_ops, f_op), np.float32),
        "op_mask": spaces.MultiBinary(max_ops),
        "edge_index": spaces.Box(0, max(max_ops - 1, 0), (2, max_edges), np.int64),
        "edge_mask": spaces.MultiBinary(max_edges),
        "group_of": spaces.Box(-1, max(max_groups - 1, 0), (max_ops,), np.int64),
        "group_mask": spaces.MultiBinary(max_groups),
        "dev_x": spaces.Box(-FEATURE_CLIP, FEATURE_CLIP, (n_tokens, DEVICE_FEATURE_DIM), np.float32),
        **extra,
    })


def pad_observation(features: GraphFeatures, max_ops: int, max_edges: int, max_groups: int,
                    max_devices: int | None = None) -> dict:
    """Pad ``features`` at the end to the fixed sizes (real entries first, masks mark them); with
    ``max_devices`` the device rows too (and ``dev_mask``).

    Raises ValueError naming the size that does not fit.
    """
    n, e, g, m = features.n_ops, features.n_edges, features.n_groups, features.n_devices
    limits = [("ops", n, max_ops), ("edges", e, max_edges), ("groups", g, max_groups)]
    if max_devices is not None:
        limits.append(("devices", m, max_devices))
    for what, have, limit in limits:
        if have > limit:
            raise ValueError(f"graph has {have} {what}, more than the observation's max_{what}={limit}")
    op_x = np.zeros((max_ops, features.op_x.shape[1]), dtype=np.float32)
    op_x[:n] = features.op_x
    edge_index = np.zeros((2, max_edges), dtype=np.int64)
    edge_index[:, :e] = features.edge_index
    group_of = np.full(max_ops, -1, dtype=np.int64)
    group_of[:n] = features.group_of
    devices = {"dev_x": features.dev_x.copy()}
    if max_devices is not None:
        dev_x = np.zeros((max_devices, features.dev_x.shape[1]), dtype=np.float32)
        dev_x[:m] = features.dev_x
        devices = {"dev_x": dev_x, "dev_mask": (np.arange(max_devices) < m).astype(np.int8)}
    return {
        "op_x": op_x,
        "op_mask": (np.arange(max_ops) < n).astype(np.int8),
        "edge_index": edge_index,
        "edge_mask": (np.arange(max_edges) < e).astype(np.int8),
        "group_of": group_of,
        "group_mask": (np.arange(max_groups) < g).astype(np.int8),
        **devices,
    }
