"""Cost model: time of an op on a device at a batch share (roofline or profile), of a transfer
between devices (path latency + bytes / bottleneck bandwidth), of AllReduce, PS aggregation and copies.

Compute (per op i on device d at batch fraction f = share / global batch):

    f_i     = f if the op carries the batch else 1
    flops   = flops_i * f_i                      bytes = bytes_total_i - bytes_batch_i * (1 - f_i)
    t       = (max(flops / (peak_d * ce_d), bytes / (bw_d * me_d)) + launch_d) * slowdown_d

An op that draws random values for its samples (dropout; ``Op.draws``) draws them in blocks of
``DRAW_BLOCK_SAMPLES`` samples (``heterog.runtime.rng``), each a call of its own: at a share of ``s``
samples it computes ``n = min(ceil(s / K) + 1, ceil(B / K))`` blocks (``+ 1``: a replica's first and last
block may be held in part; the whole batch: none), so ``f_i = min(1, n K / B)`` and ``n`` launches.

``peak_d`` is the fp32 peak, or the fp16/bf16 tensor-core peak for ops whose outputs are all half
precision (the fp32 peak where the type has no tensor cores). A profile entry for the device's
type and the op's signature replaces the bracket by ``max(t(f_i * batch_size), 0)``, where t is the
piecewise-linear function through the op's measured points (``ProfileTable.op_points``) or, without
points or with ``op_points=False``, its line ``a + b * samples`` (entries are measured at slowdown 1,
so the slowdown still applies). Graph inputs (params, buffers, optimizer state, model inputs) take 0.

A per-layer profile (``LayerProfile``, Metis' format; ``heterog.cost.layer_profile``) overrides both on
the device types it profiles. Units: a layer (its forward and backward compute ops, numbered by
``layer_numbering``, e.g. ``heterog.baselines.expert.block_layers``) or a parameter (its update compute
ops). An instance of op i of unit u on device d at fraction f and split s takes

    t_i = T_u * slowdown_d * own_i(d, f, s) / sum over ops j of u of own_j(d, f, s)

where own is the time above (roofline or op entry) and T_u the measured time: for a layer, its forward
+ backward at ``f * batch_size`` samples per micro-batch and tensor-parallel degree ``1 / s``; for a
parameter, the optimizer step at degree ``1 / s`` times the parameter's share of the updated parameter
bytes. So each unit sums to its measurement when its ops run at the same (d, f, s), and the split between
them (forward : backward included: the files give none) is the roofline's. A layer's measurement at degree
t > 1 includes its tensor-parallel collectives, so the collectives of values its ops make over profiled
devices take no time of their own (``profiled_layers``; they keep their place in the order). Ops outside
the units (update ops without a parameter) and devices of other types keep ``own``. ``time_sources`` says
which is which.

Transfers: ``sum of alpha + bytes * max of beta`` over the links of the path, where a link's
(alpha, beta) is its profiled fit (looked up by link name, then by link kind) or else
(latency, 1 / bandwidth), NIC links capped by the switch. Without a profile this is exactly
``latency + bytes / bottleneck bandwidth``. That is how long a transfer holds its links; a profiled
latency in flight (``ProfileTable.link_latency``, ``latency + bytes * s_per_byte`` summed over the
path) is added after it without
holding them (``transfer_latencies``; the compiler gives it to the task as its simulator ``lag``), so
messages streamed on one link overlap their latencies. Without a profiled latency it is 0.

AllReduce over n devices (ring order as given; T(x) below is bytes):

    ring          2(n-1)/n * x * beta_max + 2(n-1) * alpha_max      over the n ring hops
    hierarchical  reduce within each server  (k-1)/k * x * beta + (k-1) * alpha   (max over servers)
                + ring across one leader per server (formula above, n = servers)
                + broadcast within each server (same as the reduce)

The intra-server reduce and broadcast are the reduce-scatter and all-gather halves of a ring, so
their sum equals a ring AllReduce inside the server. "auto" picks the cheaper (ring on a tie).
A profiled AllReduce of exactly this device set (``ProfileTable.collectives``, measured through the
runtime) replaces both formulas, as ``alpha + beta * x`` holding the ring's links.

All-gather and reduce-scatter of uneven shards (a tensor split over n devices in shares of its own,
s_i bytes on the i-th device of the ring): n - 1 steps; in step t the i-th device passes the shard that
started on device i - t (mod n) to device i + 1, and the step lasts as long as its slowest hop:

    sum over t of  max over i of  alpha(i, i+1) + s_{i-t} * beta(i, i+1)

With even shards of x / n bytes on uniform links this is half the ring AllReduce above.

PS aggregation of n partial tensors of x bytes and split/concat copies are memory bound:
((n + 1) * x, resp. 2 * x) / (bw_d * me_d) + launch_d, times slowdown_d.

The profile is copied when the model is built: build a new CostModel after adding measurements.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from heterog.cluster.topology import Cluster
from heterog.cost.layer_profile import LayerNumbering, LayerProfile, LayerProfileError, LayerUnits, layer_units
from heterog.cost.profile import ProfileTable, op_signature
from heterog.errors import StrategyError
from heterog.graph.opgraph import DRAW_BLOCK_SAMPLES, OpGraph

ALLREDUCE_ALGOS = ("auto", "ring", "hierarchical", "none")   # "none": only for a single device
_HALF_DTYPES = frozenset({"float16", "bfloat16", "half"})


@functools.lru_cache(maxsize=64)
def _ring_steps(n: int) -> np.ndarray:
    """(n - 1, n): at step t of a ring over n devices, the device whose shard hop i passes, i - t mod n."""
    return (np.arange(n)[None, :] - np.arange(n - 1)[:, None]) % n


@dataclass(frozen=True)
class CollectiveCost:
    """Time of one collective, the algorithm used, and the link resources it holds."""

    time_s: float
    algo: str                  # "ring" | "hierarchical" | "none" (a single device)
    links: tuple[int, ...]


@dataclass
class _GraphTables:
    """Per-graph arrays the model derives once (keyed by the graph's fingerprint)."""

    half_precision: np.ndarray            # (n_ops,) bool
    profile_a_s: np.ndarray | None        # (n_ops, M, S) profiled intercept per segment, NaN where absent
    profile_b_s: np.ndarray | None        # (n_ops, M, S) profiled slope per sample, per segment
    profile_breaks: np.ndarray | None     # (n_ops, M, S-1) samples where segment k+1 starts; +inf padding
    full_batch_s: np.ndarray | None = None
    units: LayerUnits | None = None       # the graph's units under the layer profile


@dataclass(frozen=True)
class _Stage:
    """Coefficients of a set of parallel rings: time(x) = max over rings of (alpha + beta * x)."""

    alpha_s: np.ndarray                   # (R,)
    beta_s_per_byte: np.ndarray           # (R,)

    def times(self, nbytes: np.ndarray) -> np.ndarray:
        if self.alpha_s.size == 0:
            return np.zeros_like(nbytes)
        return np.max(self.alpha_s[None, :] + self.beta_s_per_byte[None, :] * nbytes[:, None], axis=1)


@dataclass(frozen=True)
class _AllreducePlan:
    ring: _Stage
    ring_links: tuple[int, ...]
    hier: tuple[_Stage, _Stage, _Stage]
    hier_links: tuple[int, ...]


class CostModel:
    """Times for the compiler. Args: ``cluster``; ``profile`` (measured overrides, optional);
    ``op_points``: interpolate between an op's measured points where the profile has them (default),
    else use its fitted line. Two habits of the training runtime the times assume: gradients all-reduced
    in buckets of ``allreduce_bucket_bytes`` (``gradient_allreduce_times``; 0: one by one, as heterog's
    runtime does), and ``comm_blocks_compute``: a device computes nothing while it sends, receives or
    takes part in a collective (DeepSpeed's PipelineEngine runs its send, receive and reduce
    instructions in line with its compute; heterog's runtime overlaps them), which the compiler
    expresses by having every communication task hold its endpoint devices.

    Shapes: ``op_times`` takes equal-length (K,) arrays and returns (K,) seconds;
    ``full_batch_times`` returns (n_ops, M); ``transfer_times`` (K,) -> (K,);
    ``allreduce_times`` (K,) bytes -> (K,) seconds and (K,) algorithm names.
    """

    def __init__(self, cluster: Cluster, profile: ProfileTable | None = None, *, op_points: bool = True,
                 layer_profile: LayerProfile | None = None, layer_numbering: LayerNumbering | None = None,
                 allreduce_bucket_bytes: float = 0.0, comm_blocks_compute: bool = False) -> None:
        self.cluster = cluster
        self.comm_blocks_compute = bool(comm_blocks_compute)
        if not allreduce_bucket_bytes >= 0:
            raise StrategyError(f"allreduce_bucket_bytes must be >= 0, got {allreduce_bucket_bytes}")
        self.allreduce_bucket_bytes = float(allreduce_bucket_bytes)
        self.profile = profile.copy() if profile is not None else ProfileTable()
        self.op_points = bool(op_points)
        if layer_profile is not None and layer_numbering is None:
            raise LayerProfileError("a layer profile needs the graph's layer numbering (layer_numbering, e.g. "
                                    "heterog.baselines.expert.block_layers)")
        self.layer_profile, self.layer_numbering = layer_profile, layer_numbering
        types = [d.type for d in cluster.devices]
        # (M,) index into layer_profile.gpus of each device's type, -1 where it is not profiled
        self._profiled_gpu = np.full(len(types), -1, dtype=np.int64)
        for j, t in enumerate(types if layer_profile is not None else ()):
            assert layer_profile is not None
            gpu = layer_profile.gpu_for(t.name)
            if gpu is not None:
                self._profiled_gpu[j] = layer_profile.gpus.index(gpu)
        self._fp32_flops = np.array([t.effective_flops for t in types])
        self._half_flops = np.array([t.effective_tensor_flops for t in types])
        self._memory_Bps = np.array([t.effective_memory_Bps for t in types])
        self._launch_s = np.array([t.launch_overhead_s for t in types])
        self._slowdown = cluster.slowdown.copy()
        self._alpha_s, self._beta_s_per_byte, self._latency_s = self._path_coefficients()
        self._graphs: dict[str, _GraphTables] = {}
        self._allreduce_plans: dict[tuple[int, ...], _AllreducePlan] = {}

    def __repr__(self) -> str:
        layers = f", layer profile {self.layer_profile.model!r}" if self.layer_profile is not None else ""
        return f"CostModel({self.cluster.name!r}, profile entries={len(self.profile)}{layers})"

    # ------------------------------------------------------------------ compute
    def _tables(self, graph: OpGraph) -> _GraphTables:
        key = graph.fingerprint
        tables = self._graphs.get(key)
        if tables is None:
            half = np.array([bool(op.output_dtypes) and all(str(dt).removeprefix("torch.") in _HALF_DTYPES
                                                               for dt in op.output_dtypes)
                             for op in graph.ops], dtype=bool)
            a = b = breaks = None
            type_names = [d.type.name for d in self.cluster.devices]
            if any(self.profile.ops.get(t) for t in set(type_names)):
                entries = {}
                for i, op in enumerate(graph.ops):
                    if op.kind != "compute":
                        continue
                    sig = op_signature(op)
                    for j, t in enumerate(type_names):
                        entry = self.profile.op_segments(t, sig, points=self.op_points)
                        if entry is not None:
                            entries[i, j] = entry
                n_seg = max((len(e[1]) for e in entries.values()), default=1)
                a = np.full((graph.n_ops, self.cluster.n_devices, n_seg), np.nan)
                b = np.full_like(a, np.nan)
                breaks = np.full((graph.n_ops, self.cluster.n_devices, n_seg - 1), np.inf)
                for (i, j), (brk, aa, bb) in entries.items():
                    a[i, j, :len(aa)], b[i, j, :len(bb)], breaks[i, j, :len(brk)] = aa, bb, brk
            tables = _GraphTables(half, a, b, breaks)
            self._graphs[key] = tables
        return tables

    def op_times(self, graph: OpGraph, ops: np.ndarray, devices: np.ndarray, fractions: np.ndarray,
                 splits: np.ndarray | None = None) -> np.ndarray:
        """Seconds of ``ops[i]`` on ``devices[i]`` at batch fraction ``fractions[i]`` (share / global batch).

        ``splits[i]``: the op runs on that share of a dimension divided beyond the batch (its shard's shape:
        FLOPs and bytes scale with it, a launch does not; a measured time scales less its launch).
        Arrays broadcast against each other; the result has their common shape. With a layer profile,
        ops of its layers on its device types take their share of the measured time (module docstring).
        """
        t = self._own_times(graph, ops, devices, fractions, splits)
        if self.layer_profile is None or t.size == 0 or not (self._profiled_gpu >= 0).any():
            return t
        return self._layer_profile_times(graph, ops, devices, fractions, splits, t)

    def _own_times(self, graph: OpGraph, ops: np.ndarray, devices: np.ndarray, fractions: np.ndarray,
                   splits: np.ndarray | None = None) -> np.ndarray:
        """``op_times`` without the layer profile: the roofline, or the op's profile entry."""
        if splits is not None:
            s = np.asarray(splits, dtype=np.float64)
            whole = self._own_times(graph, ops, devices, fractions)
            launch = np.where(graph.is_compute[np.asarray(ops, dtype=np.int64)],
                              self._launch_s[np.asarray(devices, dtype=np.int64)] *
                              self._slowdown[np.asarray(devices, dtype=np.int64)], 0.0)
            launch = np.minimum(launch, whole)
            return np.where(s == 1.0, whole, launch + (whole - launch) * s)
        ops, devices, fractions = np.broadcast_arrays(np.asarray(ops, dtype=np.int64),
                                                      np.asarray(devices, dtype=np.int64),
                                                      np.asarray(fractions, dtype=np.float64))
        if ops.size == 0:
            return np.zeros(ops.shape)
        if ops.min() < 0 or ops.max() >= graph.n_ops:
            raise IndexError(f"op index out of range 0..{graph.n_ops - 1} for graph {graph.name!r}")
        if devices.min() < 0 or devices.max() >= self.cluster.n_devices:
            raise IndexError(f"device index out of range 0..{self.cluster.n_devices - 1} "
                             f"for cluster {self.cluster.name!r}")
        if fractions.min() < 0 or fractions.max() > 1:
            raise ValueError(f"batch fractions must be in [0, 1], got {fractions.min()}..{fractions.max()}")
        tables = self._tables(graph)
        f = np.where(graph.has_batch[ops], fractions, 1.0)
        blocks = np.zeros(ops.shape)
        draws = graph.draws_batch[ops]
        if draws.any():                       # random values are drawn in whole blocks (at most 2 held in part)
            k, batch = DRAW_BLOCK_SAMPLES, graph.batch_size
            blocks = np.where(draws, np.minimum(np.ceil(f * batch / k) + (f < 1), np.ceil(batch / k)), 0.0)
            f = np.where(draws, np.minimum(blocks * k / batch, 1.0), f)
        flops = graph.flops[ops] * f
        nbytes = graph.bytes_total[ops] - graph.bytes_batch[ops] * (1.0 - f)
        rate = np.where(tables.half_precision[ops], self._half_flops[devices], self._fp32_flops[devices])
        launches = np.maximum(blocks, 1.0)
        t = np.maximum(flops / rate, nbytes / self._memory_Bps[devices]) + launches * self._launch_s[devices]
        if tables.profile_a_s is not None:
            # the three profile arrays are built together
            assert tables.profile_b_s is not None and tables.profile_breaks is not None
            a = tables.profile_a_s[ops, devices]          # (..., S)
            measured = ~np.isnan(a[..., 0])
            if measured.any():
                b = tables.profile_b_s[ops, devices]
                x = f * graph.batch_size
                if a.shape[-1] > 1:                       # the segment each x falls in
                    seg = np.sum(tables.profile_breaks[ops, devices] <= x[..., None], axis=-1)[..., None]
                    a, b = np.take_along_axis(a, seg, -1), np.take_along_axis(b, seg, -1)
                t = np.where(measured, np.maximum(a[..., 0] + b[..., 0] * x, 0.0), t)
        t = t * self._slowdown[devices]
        return np.where(graph.is_compute[ops], t, 0.0)

    def _units(self, graph: OpGraph) -> LayerUnits:
        tables = self._tables(graph)
        if tables.units is None:
            assert self.layer_profile is not None and self.layer_numbering is not None
            tables.units = layer_units(graph, self.layer_numbering, self.layer_profile)
        return tables.units

    def _layer_profile_times(self, graph: OpGraph, ops: np.ndarray, devices: np.ndarray, fractions: np.ndarray,
                             splits: np.ndarray | None, own: np.ndarray) -> np.ndarray:
        """``own`` with the instances of profiled units on profiled devices scaled so that a unit's ops,
        all at the instance's (device, fraction, split), sum to the unit's measured time there."""
        assert self.layer_profile is not None
        units = self._units(graph)
        ops, devices, fractions, split = np.broadcast_arrays(
            np.asarray(ops, dtype=np.int64), np.asarray(devices, dtype=np.int64),
            np.asarray(fractions, dtype=np.float64), np.asarray(1.0 if splits is None else splits, dtype=np.float64))
        unit = units.unit_of[ops]
        sel = np.nonzero(((unit >= 0) & (self._profiled_gpu[devices] >= 0)).ravel())[0]
        if len(sel) == 0:
            return own
        keys = np.stack([unit.ravel()[sel], devices.ravel()[sel], fractions.ravel()[sel], split.ravel()[sel]], 1)
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        k_unit, k_dev = uniq[:, 0].astype(np.int64), uniq[:, 1].astype(np.int64)
        k_frac, k_split = uniq[:, 2], uniq[:, 3]
        counts = units.unit_ptr[k_unit + 1] - units.unit_ptr[k_unit]
        rows = np.repeat(np.arange(len(uniq)), counts)
        local = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        members = units.unit_ops[units.unit_ptr[k_unit][rows] + local]
        member_s = self._own_times(graph, members, k_dev[rows], k_frac[rows], k_split[rows])
        unit_own = np.bincount(rows, weights=member_s, minlength=len(uniq))
        measured = np.empty(len(uniq))
        lp, batch = self.layer_profile, graph.batch_size
        for k in range(len(uniq)):
            gpu = lp.gpus[self._profiled_gpu[k_dev[k]]]
            if k_unit[k] < units.n_layers:
                measured[k] = lp.layer_times_s(gpu, k_frac[k] * batch, 1.0 / k_split[k])[k_unit[k]]
            else:
                measured[k] = lp.optimizer_time_s(gpu, 1.0 / k_split[k]) * units.param_share[k_unit[k] - units.n_layers]
        factor = np.where(unit_own > 0, measured * self._slowdown[k_dev] / np.where(unit_own > 0, unit_own, 1.0), 1.0)
        out = own.copy().ravel()
        out[sel] = out[sel] * factor[inverse.ravel()]
        return out.reshape(own.shape)

    def profiled_layers(self, graph: OpGraph) -> np.ndarray:
        """(n_ops, M) bool: which op on which device takes its time from a profiled *layer* (not an optimizer
        unit). A profiled layer's time covers its tensor-parallel collectives (Metis measures them with the
        layer), so the compiler prices a collective of a value such an op makes over such devices at 0."""
        if self.layer_profile is None or not (self._profiled_gpu >= 0).any():
            return np.zeros((graph.n_ops, self.cluster.n_devices), dtype=bool)
        units = self._units(graph)
        return ((units.unit_of >= 0) & (units.unit_of < units.n_layers))[:, None] & (self._profiled_gpu >= 0)[None, :]

    def time_sources(self, graph: OpGraph) -> np.ndarray:
        """(n_ops, M) bool: which op on which device takes its time from the layer profile (the others
        keep the roofline, or their op profile entry)."""
        if self.layer_profile is None or not (self._profiled_gpu >= 0).any():
            return np.zeros((graph.n_ops, self.cluster.n_devices), dtype=bool)
        return (self._units(graph).unit_of >= 0)[:, None] & (self._profiled_gpu >= 0)[None, :]

    def full_batch_times(self, graph: OpGraph) -> np.ndarray:
        """(n_ops, M) seconds of every op on every device at the global batch (read-only, cached)."""
        tables = self._tables(graph)
        if tables.full_batch_s is None:
            n, m = graph.n_ops, self.cluster.n_devices
            ops = np.repeat(np.arange(n), m)
            devices = np.tile(np.arange(m), n)
            times = self.op_times(graph, ops, devices, np.ones(n * m)).reshape(n, m)
            times.setflags(write=False)
            tables.full_batch_s = times
        return tables.full_batch_s

    # ------------------------------------------------------------------ transfers
    def _path_coefficients(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(M, M) alpha (s), beta (s/byte) and (M, M, 2) latency in flight (s, s/byte) of each path; all 0
        on the diagonal."""
        c = self.cluster
        alpha = c.latency_s.copy()
        with np.errstate(divide="ignore"):
            beta = 1.0 / c.bandwidth_Bps
        latency = np.zeros(alpha.shape + (2,))
        if not self.profile.links and not self.profile.link_latency:
            return alpha, beta, latency
        link_latency = [self.profile.link_latency_entry(link.name) or self.profile.link_latency_entry(link.kind)
                        or (0.0, 0.0) for link in c.links]
        link_coeffs = []
        for link in c.links:
            entry = self.profile.link_entry(link.name) or self.profile.link_entry(link.kind)
            if entry is None:
                bw = link.bandwidth_Bps
                if link.kind in ("nic-out", "nic-in"):
                    bw = min(bw, c.switch_bandwidth_Bps)
                entry = (link.latency_s, 1.0 / bw)
            link_coeffs.append(entry)
        for a in range(c.n_devices):
            for b in range(c.n_devices):
                path = c.path(a, b)
                if path:
                    alpha[a, b] = sum(link_coeffs[k][0] for k in path)
                    beta[a, b] = max(link_coeffs[k][1] for k in path)
                    latency[a, b] = np.sum([link_latency[k] for k in path], axis=0)
        return alpha, beta, latency

    def transfer_times(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Seconds to move ``nbytes[i]`` from device ``src[i]`` to ``dst[i]`` (0 where src == dst)."""
        src, dst, nbytes = np.broadcast_arrays(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
                                               np.asarray(nbytes, dtype=np.float64))
        return self._alpha_s[src, dst] + nbytes * self._beta_s_per_byte[src, dst]

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        return float(self.transfer_times(np.array([src]), np.array([dst]), np.array([nbytes]))[0])

    def transfer_latencies(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Seconds a message of ``nbytes[i]`` from ``src[i]`` to ``dst[i]`` is in flight after
        ``transfer_times`` (its links already free): the profiled latencies of the path's links, 0 without
        them or where src == dst."""
        src, dst, nbytes = np.broadcast_arrays(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
                                               np.asarray(nbytes, dtype=np.float64))
        lat = self._latency_s[src, dst]
        return lat[..., 0] + nbytes * lat[..., 1]

    # ------------------------------------------------------------------ collectives
    def _ring_stage(self, rings: list[list[int]], fraction: float) -> tuple[_Stage, set[int]]:
        """Rings running in parallel; each costs fraction * (n-1)/n * x * beta_max + fraction * (n-1) * alpha_max.

        ``fraction`` is 2 for an AllReduce and 1 for a reduce(-scatter) or broadcast(all-gather) half.
        """
        alphas: list[float] = []
        betas: list[float] = []
        links: set[int] = set()
        for ring in rings:
            n = len(ring)
            if n < 2:
                continue
            hops = [(ring[i], ring[(i + 1) % n]) for i in range(n)]
            alpha_max = max(self._alpha_s[a, b] for a, b in hops)
            beta_max = max(self._beta_s_per_byte[a, b] for a, b in hops)
            alphas.append(fraction * (n - 1) * alpha_max)
            betas.append(fraction * (n - 1) / n * beta_max)
            for a, b in hops:
                links.update(self.cluster.path(a, b))
        return _Stage(np.array(alphas, dtype=np.float64), np.array(betas, dtype=np.float64)), links

    def _check_devices(self, devices: Sequence[int]) -> tuple[int, ...]:
        order = tuple(dict.fromkeys(int(d) for d in devices))
        for d in order:
            if not 0 <= d < self.cluster.n_devices:
                raise IndexError(f"device {d} out of range 0..{self.cluster.n_devices - 1} "
                                 f"for cluster {self.cluster.name!r}")
        return order

    def _allreduce_plan(self, devices: tuple[int, ...]) -> _AllreducePlan:
        plan = self._allreduce_plans.get(devices)
        if plan is None:
            ring, ring_links = self._ring_stage([list(devices)], 2.0)
            by_server: dict[int, list[int]] = {}
            for d in devices:
                by_server.setdefault(int(self.cluster.server_of[d]), []).append(d)
            groups = list(by_server.values())
            reduce, intra_links = self._ring_stage(groups, 1.0)
            across, across_links = self._ring_stage([[g[0] for g in groups]], 2.0)
            plan = _AllreducePlan(ring, tuple(sorted(ring_links)), (reduce, across, reduce),
                                  tuple(sorted(intra_links | across_links)))
            self._allreduce_plans[devices] = plan
        return plan

    def allreduce_times(self, devices: Sequence[int], nbytes: np.ndarray,
                        algo: str = "auto") -> tuple[np.ndarray, np.ndarray]:
        """(K,) seconds and (K,) algorithm names for AllReduce of each ``nbytes[k]`` over ``devices``.

        Repeated devices count once; the ring follows the given order. Plans are cached per device tuple.
        One device: times 0 and algorithm "none" whatever ``algo`` says.
        """
        if algo not in ALLREDUCE_ALGOS:
            raise StrategyError(f"unknown AllReduce algorithm {algo!r}; known: {', '.join(ALLREDUCE_ALGOS)}")
        x = np.atleast_1d(np.asarray(nbytes, dtype=np.float64))
        order = self._check_devices(devices)
        if len(order) < 2:
            return np.zeros(x.shape), np.full(x.shape, "none", dtype="<U12")
        if algo == "none":
            raise StrategyError(f"AllReduce algorithm 'none' is for one device, got devices {list(order)}")
        measured = self.profile.collective_entry("allreduce", [self.cluster.devices[d].name for d in order]) \
            if self.profile.collectives else None
        if measured is not None:            # what the runtime's collective costs, whatever its algorithm
            return np.maximum(measured[0] + measured[1] * x, 0.0), np.full(x.shape, "ring", dtype="<U12")
        plan = self._allreduce_plan(order)
        ring_s = plan.ring.times(x)
        reduce_s, across_s, broadcast_s = (stage.times(x) for stage in plan.hier)
        hier_s = reduce_s + across_s + broadcast_s
        if algo == "ring":
            return ring_s, np.full(x.shape, "ring", dtype="<U12")
        if algo == "hierarchical":
            return hier_s, np.full(x.shape, "hierarchical", dtype="<U12")
        use_ring = ring_s <= hier_s
        return np.where(use_ring, ring_s, hier_s), np.where(use_ring, "ring", "hierarchical").astype("<U12")

    def gradient_allreduce_times(self, devices: Sequence[int], nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``allreduce_times`` of gradients, which the training runtime may fuse into buckets of
        ``allreduce_bucket_bytes`` (PyTorch DDP's ``bucket_cap_mb``, DeepSpeed's ``reduce_bucket_size``): a
        bucket pays its algorithm's fixed time (the time at 0 bytes: the latencies of its steps) once, so a
        gradient of b bytes is priced at its bandwidth time plus ``min(1, b / bucket)`` of that fixed time
        (a bucket's gradients together pay it once). Without buckets (0, the default) each pays it whole."""
        if self.allreduce_bucket_bytes <= 0:
            return self.allreduce_times(devices, nbytes)
        x = np.atleast_1d(np.asarray(nbytes, dtype=np.float64))
        share = np.minimum(x / self.allreduce_bucket_bytes, 1.0)
        best: tuple[np.ndarray, np.ndarray] | None = None
        for algo in ("ring", "hierarchical"):
            t, names = self.allreduce_times(devices, x, algo)
            fixed = self.allreduce_times(devices, np.zeros(1), algo)[0][0]
            t = t - fixed * (1.0 - share)
            if best is None:
                best = (t, names)
            else:
                keep = best[0] <= t
                best = (np.where(keep, best[0], t), np.where(keep, best[1], names))
        assert best is not None
        return best

    def allreduce_links(self, devices: Sequence[int], algo: str) -> tuple[int, ...]:
        """Link ids the ``algo`` ("ring" or "hierarchical") AllReduce over ``devices`` holds."""
        order = self._check_devices(devices)
        if len(order) < 2:
            return ()
        plan = self._allreduce_plan(order)
        if algo == "ring":
            return plan.ring_links
        if algo == "hierarchical":
            return plan.hier_links
        raise StrategyError(f"AllReduce over {len(order)} devices needs algorithm 'ring' or 'hierarchical', "
                            f"got {algo!r}")

    def allreduce(self, devices: Sequence[int], nbytes: float, algo: str = "auto") -> CollectiveCost:
        """Cost of one AllReduce of ``nbytes`` over ``devices`` (time 0, algo "none" for one device)."""
        times, names = self.allreduce_times(devices, np.array([nbytes], dtype=np.float64), algo)
        chosen = str(names[0])
        return CollectiveCost(float(times[0]), chosen, self.allreduce_links(devices, chosen))

    def sharded_ring_times(self, devices: Sequence[int], shard_bytes: np.ndarray) -> np.ndarray:
        """(K,) seconds of a ring all-gather (or reduce-scatter: the same steps, partial sums passed on) of
        tensors split over ``devices`` (in ring order) in uneven shards: ``shard_bytes`` (K, n), shard i on
        ``devices[i]`` (module docstring). One device: 0."""
        order = self._check_devices(devices)
        x = np.atleast_2d(np.asarray(shard_bytes, dtype=np.float64))
        n = len(order)
        if x.shape[1] != n or len(devices) != n:
            raise StrategyError(f"need one shard per device of {list(devices)} (each device once), got shards "
                                f"of shape {x.shape}")
        if n < 2:
            return np.zeros(x.shape[0])
        src = np.array(order, dtype=np.int64)
        dst = np.roll(src, -1)
        alpha, beta = self._alpha_s[src, dst], self._beta_s_per_byte[src, dst]     # hop i: devices[i] -> [i+1]
        # step t: hop i passes the shard that started on device i - t; the steps' slowest hops, summed in order
        passed = x[:, _ring_steps(n)]                                               # (K, n - 1, n)
        return np.cumsum(np.max(alpha + passed * beta, axis=2), axis=1)[:, -1]

    def alltoall_times(self, devices: Sequence[int], shard_bytes: np.ndarray) -> np.ndarray:
        """(K,) seconds of an all-to-all that re-divides tensors split over ``devices`` (in ring order) in
        uneven shards, ``shard_bytes`` (K, n) as ``sharded_ring_times``'s: each device sends about 1/n of its
        shard to each other one, priced as the ring passing shards of 1/n the size."""
        x = np.atleast_2d(np.asarray(shard_bytes, dtype=np.float64))
        return self.sharded_ring_times(devices, x / max(len(devices), 1))

    # ------------------------------------------------------------------ memory-bound helpers
    def _memory_bound_times(self, devices: np.ndarray, bytes_moved: np.ndarray) -> np.ndarray:
        """(bytes_moved / effective bandwidth + launch) * slowdown; 0 where nothing moves."""
        t = (bytes_moved / self._memory_Bps[devices] + self._launch_s[devices]) * self._slowdown[devices]
        return np.where(bytes_moved > 0, t, 0.0)

    def aggregate_times(self, devices: np.ndarray, nbytes: np.ndarray, n_inputs: np.ndarray) -> np.ndarray:
        """Seconds for a PS on ``devices[i]`` to sum ``n_inputs[i]`` partial tensors of ``nbytes[i]``:
        memory bound, (n_inputs + 1) * nbytes moved, plus launch, times slowdown; 0 with no inputs."""
        devices, nbytes, n_inputs = np.broadcast_arrays(np.asarray(devices, dtype=np.int64),
                                                        np.asarray(nbytes, dtype=np.float64),
                                                        np.asarray(n_inputs, dtype=np.float64))
        return self._memory_bound_times(devices, np.where(n_inputs > 0, (n_inputs + 1.0) * nbytes, 0.0))

    def aggregate_time(self, device: int, nbytes: float, n_inputs: int) -> float:
        return float(self.aggregate_times(np.array([device]), np.array([nbytes]), np.array([n_inputs]))[0])

    def copy_times(self, devices: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Seconds for a split or concat that copies ``nbytes[i]`` on ``devices[i]`` (read + write)."""
        devices, nbytes = np.broadcast_arrays(np.asarray(devices, dtype=np.int64), np.asarray(nbytes, dtype=np.float64))
        return self._memory_bound_times(devices, 2.0 * nbytes)
