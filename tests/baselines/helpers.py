"""Hand-made graphs, clusters and a table-driven cost model for the planner tests."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from heterog.cluster.loader import cluster_from_dict
from heterog.cost import CollectiveCost
from heterog.graph.opgraph import Edge, Op, OpGraph


class TableCost:
    """Op ``i`` takes ``times[i, d]`` seconds on device ``d`` (scaled by the batch fraction for ops that
    carry the batch); a transfer of x bytes between distinct devices takes ``x * beta`` seconds; an
    AllReduce 2(n-1)/n * x * beta; aggregation and copies x * 1e-12 s."""

    def __init__(self, cluster, times: np.ndarray, beta_s_per_byte: float = 1.0):
        self.cluster = cluster
        self.times = np.asarray(times, dtype=np.float64)
        self.beta = beta_s_per_byte

    def op_times(self, graph, ops, devices, fractions):
        ops, devices, fractions = np.broadcast_arrays(np.asarray(ops), np.asarray(devices), np.asarray(fractions))
        f = np.where(graph.has_batch[ops], fractions, 1.0)
        return np.where(graph.is_compute[ops], self.times[ops, devices] * f, 0.0)

    def full_batch_times(self, graph):
        return np.where(graph.is_compute[:, None], self.times, 0.0)

    comm_blocks_compute = False

    def profiled_layers(self, graph):
        return np.zeros((graph.n_ops, self.cluster.n_devices), dtype=bool)

    def gradient_allreduce_times(self, devices, nbytes):
        return self.allreduce_times(devices, nbytes)

    def transfer_times(self, src, dst, nbytes):
        src, dst, nbytes = np.broadcast_arrays(np.asarray(src), np.asarray(dst), np.asarray(nbytes, dtype=float))
        return np.where(src == dst, 0.0, nbytes * self.beta)

    def transfer_latencies(self, src, dst, nbytes):
        src, dst, nbytes = np.broadcast_arrays(np.asarray(src), np.asarray(dst), np.asarray(nbytes, dtype=float))
        return np.zeros(src.shape)

    def allreduce_times(self, devices, nbytes, algo="auto"):
        n = len(set(devices))
        x = np.atleast_1d(np.asarray(nbytes, dtype=float))
        return 2 * (n - 1) / n * x * self.beta, np.full(x.shape, "ring")

    def allreduce_links(self, devices, algo="ring"):
        devs = list(dict.fromkeys(int(d) for d in devices))
        return tuple(sorted({x for a, b in zip(devs, devs[1:] + devs[:1]) for x in self.cluster.path(a, b)}))

    def allreduce(self, devices, nbytes, algo="auto"):
        return CollectiveCost(float(self.allreduce_times(devices, [nbytes])[0][0]), "ring",
                              self.allreduce_links(devices))

    def aggregate_times(self, device, nbytes, n_inputs):
        return np.asarray(nbytes, dtype=float) * 1e-12

    def copy_times(self, devices, nbytes):
        return np.asarray(nbytes, dtype=float) * 1e-12


def gpu_cluster(n: int = 2, memory: str = "16 GiB", name: str | None = None):
    """One server of ``n`` identical GPUs on PCIe (speeds come from the cost model under test)."""
    return cluster_from_dict({"name": name or f"test-{n}gpu", "servers": [{
        "name": "s0", "gpus": [{"name": "G", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": memory}] * n,
        "intra": {"kind": "pcie", "bandwidth": "10 GB/s", "latency_us": 5}}]})


def compute_dag(n_ops: int, edges: list[tuple[int, int, int]], name: str = "dag", batch: int = 4) -> OpGraph:
    """Compute ops only, no batch dimension anywhere (so no op is split); ``edges`` are (src, dst, bytes): an
    op's output is as many bytes as its edges carry (what moves between devices), 16 for an op read by none."""
    out = {s: b for s, _, b in sorted(edges, key=lambda e: e[2])}
    ops = [Op(f"op{i}", "aten.mul.Tensor", "compute", "forward", [[out[i]] if i in out else [4]],
              ["torch.uint8" if i in out else "torch.float32"], [None], flops=1.0, bytes_read=16, bytes_written=16)
           for i in range(n_ops)]
    return OpGraph(name, batch, ops, [Edge(s, d, b, None) for s, d, b in edges])


def layered_graph(n_layers: int, param_bytes: int | Sequence[int], batch: int = 8, width: int = 256) -> OpGraph:
    """A training graph: n dense layers forward, backward (data and weight gradients), SGD updates.

    0 x (input); per layer i: W_i (param), f_i (forward mm); loss; then backward g_i (data grad) and
    w_i (weight grad, is_grad) in reverse, and u_i (update) per layer. ``param_bytes``: every layer's, or
    one per layer (a layer's FLOPs follow ``width`` alone).
    """
    sizes = [int(param_bytes)] * n_layers if isinstance(param_bytes, int) else [int(b) for b in param_bytes]
    if len(sizes) != n_layers:
        raise ValueError(f"{len(sizes)} parameter sizes for {n_layers} layers")
    act = batch * width * 4
    ops: list[Op] = [Op("x", "placeholder", "input", "forward", [[batch, width]], ["torch.float32"], [0],
                        bytes_written=act, batch_bytes=act)]
    edges: list[Edge] = []
    fw, params = [], []
    prev = 0
    for i in range(n_layers):
        param_bytes = sizes[i]
        params.append(len(ops))
        ops.append(Op(f"W{i}", "placeholder", "param", "forward", [[param_bytes // 4]], ["torch.float32"], [None],
                      bytes_written=param_bytes, param_bytes=param_bytes, grad_bytes=param_bytes,
                      module_path=f"layers.{i}", param=f"W{i}"))
        fw.append(len(ops))
        ops.append(Op(f"f{i}", "aten.mm.default", "compute", "forward", [[batch, width]], ["torch.float32"], [0],
                      flops=2.0 * batch * width * width, bytes_read=act + param_bytes, bytes_written=act,
                      batch_bytes=2 * act, module_path=f"layers.{i}"))
        edges += [Edge(prev, fw[-1], act, 0), Edge(params[-1], fw[-1], param_bytes, None)]
        prev = fw[-1]
    loss = len(ops)
    ops.append(Op("loss", "aten.mean.default", "compute", "forward", [[]], ["torch.float32"], [None],
                  flops=batch * width, bytes_read=act, bytes_written=4, batch_bytes=act))
    edges.append(Edge(prev, loss, act, 0))
    gout = len(ops)
    ops.append(Op("gout", "aten.expand.default", "compute", "backward", [[batch, width]], ["torch.float32"], [0],
                  flops=batch * width, bytes_read=4, bytes_written=act, batch_bytes=act))
    edges.append(Edge(loss, gout, 4, None))
    grad = gout
    for i in reversed(range(n_layers)):
        param_bytes = sizes[i]
        inp = fw[i - 1] if i > 0 else 0
        w = len(ops)
        ops.append(Op(f"w{i}", "aten.mm.default", "compute", "backward", [[param_bytes // 4]], ["torch.float32"],
                      [None], flops=2.0 * batch * width * width, bytes_read=2 * act, bytes_written=param_bytes,
                      batch_bytes=2 * act, module_path=f"layers.{i}", param=f"W{i}", is_grad=True))
        edges += [Edge(grad, w, act, 0), Edge(inp, w, act, 0)]
        if i > 0:
            g = len(ops)
            ops.append(Op(f"g{i}", "aten.mm.default", "compute", "backward", [[batch, width]], ["torch.float32"],
                          [0], flops=2.0 * batch * width * width, bytes_read=act + param_bytes, bytes_written=act,
                          batch_bytes=2 * act, module_path=f"layers.{i}"))
            edges += [Edge(grad, g, act, 0), Edge(params[i], g, param_bytes, None)]
            grad = g
        u = len(ops)
        ops.append(Op(f"u{i}", "aten.sub.Tensor", "compute", "update", [[param_bytes // 4]], ["torch.float32"],
                      [None], flops=param_bytes / 2, bytes_read=2 * param_bytes, bytes_written=param_bytes,
                      module_path=f"layers.{i}", param=f"W{i}"))
        edges += [Edge(params[i], u, param_bytes, None), Edge(w, u, param_bytes, None)]
    return OpGraph(f"layered{n_layers}", batch, ops, edges)
