"""The memory of a re-layout's cut: pieces of a tensor divided along its first dimension are views of the
producer's output (the cut allocates nothing; every reader of the pieces holds the producer's entry), pieces
along another dimension are copies (the cut allocates the entry's bytes)."""
from __future__ import annotations

import numpy as np
import pytest

from heterog.cluster.loader import cluster_from_dict
from heterog.compiler import TaskKind, compile_strategy
from heterog.evaluate import cost_model
from heterog.graph.opgraph import Edge, Op, OpGraph
from heterog.strategy import ParallelConfig, Strategy

B, W = 8, 16                     # samples, floats per sample: 64 B a sample


def two_layers(batch_dim: int) -> OpGraph:
    """x -> f0 -> f1 (forward only), every batch tensor with its batch at ``batch_dim`` (0 or 1)."""
    def shape() -> list[int]:
        return [B, W] if batch_dim == 0 else [W, B]

    def layer(name: str) -> Op:
        return Op(name, "aten.mul.Tensor", "compute", "forward", [shape()], ["torch.float32"], [batch_dim],
                  flops=B * W, bytes_read=B * W * 4, bytes_written=B * W * 4, batch_bytes=2 * B * W * 4)

    ops = [Op("x", "placeholder", "input", "forward", [shape()], ["torch.float32"], [batch_dim],
              bytes_written=B * W * 4, batch_bytes=B * W * 4), layer("f0"), layer("f1")]
    edges = [Edge(0, 1, B * W * 4, batch_dim), Edge(1, 2, B * W * 4, batch_dim)]
    return OpGraph(f"two-layers-{batch_dim}", B, ops, edges)


def cluster():
    gpus = [{"name": f"G{i}", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": "16 GiB"} for i in range(2)]
    return cluster_from_dict({"name": "two", "servers": [
        {"name": "s", "gpus": gpus, "intra": {"kind": "pcie", "bandwidth": "1 GB/s", "latency_us": 2}}]})


@pytest.mark.parametrize("batch_dim", [0, 1])
def test_a_cut_into_views_allocates_nothing_and_its_readers_hold_the_producer(batch_dim):
    """f0 runs 6:2 on two devices, f1 2:6: device 0's entry of f0 (6 samples, 384 B) is cut into 2 samples it
    keeps and 4 it sends to device 1, which joins them with its own 2."""
    graph, cl = two_layers(batch_dim), cluster()
    configs = [ParallelConfig((0, 1), (6, 2)), ParallelConfig((0, 1), (2, 6))]
    s = Strategy(graph.fingerprint, cl.name, 2, B, np.array([0, 0, 1]), configs)
    plan = compile_strategy(graph, cl, s, cost_model(cl))
    mem_ptr, _, mem_bytes = plan.tg.memory()
    free_ptr, free_idx = plan.tg.frees()
    (cut,) = np.nonzero(plan.task_kind == TaskKind.RELAYOUT)[0]
    assert plan.task_device[cut] == 0
    (f0_dev0,) = np.nonzero((plan.task_kind == TaskKind.COMPUTE) & (plan.task_op == 1) & (plan.task_device == 0))[0]
    assert mem_bytes[mem_ptr[f0_dev0]:mem_ptr[f0_dev0 + 1]].tolist() == [6 * W * 4]
    releasers = {int(t) for t in range(plan.n_tasks) if f0_dev0 in free_idx[free_ptr[t]:free_ptr[t + 1]]}
    readers = {int(t) for t in range(plan.n_tasks) if cut in plan.dep_idx[plan.dep_ptr[t]:plan.dep_ptr[t + 1]]}
    (send,) = [t for t in readers if plan.task_kind[t] == TaskKind.TRANSFER]
    assert plan.task_device[send] == 1 and len(readers) == 2            # the transfer and f1 on device 0
    if batch_dim == 0:            # views: the cut holds nothing, its readers the producer's entry
        assert mem_bytes[mem_ptr[cut]:mem_ptr[cut + 1]].sum() == 0
        assert releasers == readers
    else:                         # copies: the cut holds the entry's bytes, the producer goes when it is cut
        assert mem_bytes[mem_ptr[cut]:mem_ptr[cut + 1]].tolist() == [6 * W * 4]
        assert releasers == {int(cut)}


def test_a_cut_of_an_input_allocates_the_rows_the_device_keeps():
    """x (the batch a job carries) placed 6:2 and read 2:6: device 0 keeps 2 of its 6 rows (128 B) and sends 4,
    as the runtime holds its rows of the global batch only."""
    graph, cl = two_layers(0), cluster()
    configs = [ParallelConfig((0, 1), (6, 2)), ParallelConfig((0, 1), (2, 6))]
    s = Strategy(graph.fingerprint, cl.name, 2, B, np.array([0, 1, 1]), configs)
    plan = compile_strategy(graph, cl, s, cost_model(cl))
    mem_ptr, _, mem_bytes = plan.tg.memory()
    (cut,) = np.nonzero(plan.task_kind == TaskKind.RELAYOUT)[0]
    assert plan.task_op[cut] == 0 and plan.task_device[cut] == 0
    assert mem_bytes[mem_ptr[cut]:mem_ptr[cut + 1]].tolist() == [2 * W * 4]


def test_a_shape_read_under_another_layout_moves_nothing():
    """f1 = ones_like(f0) under another layout reads f0's shape only: no cut, transfer or join of f0's value;
    each instance of f1 waits for f0's first instance."""
    graph = two_layers(0)
    graph.ops[2].target = "aten.ones_like.default"
    graph = OpGraph("shape-read", B, graph.ops, graph.edges)
    cl = cluster()
    configs = [ParallelConfig((0, 1), (6, 2)), ParallelConfig((0, 1), (2, 6))]
    s = Strategy(graph.fingerprint, cl.name, 2, B, np.array([0, 0, 1]), configs)
    plan = compile_strategy(graph, cl, s, cost_model(cl))
    moves = np.isin(plan.task_kind, (TaskKind.RELAYOUT, TaskKind.TRANSFER, TaskKind.CONCAT)) & (plan.task_op == 1)
    assert not moves.any()
    f0 = np.nonzero((plan.task_kind == TaskKind.COMPUTE) & (plan.task_op == 1))[0]
    for t in np.nonzero((plan.task_kind == TaskKind.COMPUTE) & (plan.task_op == 2))[0]:
        assert f0.min() in plan.dep_idx[plan.dep_ptr[t]:plan.dep_ptr[t + 1]]
