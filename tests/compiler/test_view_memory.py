"""The memory of a view op left in the graph (a buffer expanded to the batch): it allocates nothing, its readers
hold the value it is a view of, as the runtime's view shares its input's storage (``heterog.compiler.memory``)."""
from __future__ import annotations

import numpy as np

from heterog.cluster.loader import cluster_from_dict
from heterog.compiler import TaskKind, compile_strategy
from heterog.evaluate import Evaluator, cost_model
from heterog.graph.opgraph import Edge, Op, OpGraph
from heterog.strategy import ParallelConfig, Strategy

B, W = 8, 16                     # samples, floats per sample: 64 B a sample


def graph() -> OpGraph:
    """x (the batch), c = zeros(W) (no batch), e = c.expand(B, W), f = x + e, h = f * f."""
    def op(name: str, target: str, shape: list[int], bd: int | None, nbytes: int) -> Op:
        return Op(name, target, "compute", "forward", [shape], ["torch.float32"], [bd], flops=nbytes // 4,
                  bytes_read=nbytes, bytes_written=nbytes, batch_bytes=nbytes if bd is not None else 0)

    row = B * W * 4
    ops = [Op("x", "placeholder", "input", "forward", [[B, W]], ["torch.float32"], [0], bytes_written=row,
              batch_bytes=row),
           op("c", "aten.zeros.default", [W], None, W * 4),
           Op("e", "aten.expand.default", "compute", "forward", [[B, W]], ["torch.float32"], [0]),
           op("f", "aten.add.Tensor", [B, W], 0, row),
           op("h", "aten.mul.Tensor", [B, W], 0, row)]
    edges = [Edge(1, 2, W * 4, None), Edge(0, 3, row, 0), Edge(2, 3, row, 0), Edge(3, 4, row, 0)]
    return OpGraph("expanded-buffer", B, ops, edges)


def one_device():
    gpu = {"name": "G", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": "16 GiB"}
    return cluster_from_dict({"name": "one", "servers": [
        {"name": "s", "gpus": [gpu], "intra": {"kind": "pcie", "bandwidth": "1 GB/s", "latency_us": 2}}]})


def test_a_view_allocates_nothing_and_its_readers_hold_its_input():
    g, cl = graph(), one_device()
    s = Strategy(g.fingerprint, cl.name, 1, B, np.zeros(g.n_ops, dtype=np.int64), [ParallelConfig((0,), (B,))])
    plan = compile_strategy(g, cl, s, cost_model(cl))
    mem_ptr, _, mem_bytes = plan.tg.memory()
    free_ptr, free_idx = plan.tg.frees()
    index = {op.name: i for i, op in enumerate(g.ops)}

    def task(name: str) -> int:
        (t,) = np.nonzero((plan.task_kind == TaskKind.COMPUTE) & (plan.task_op == index[name]))[0]
        return int(t)

    def held(name: str) -> list[int]:
        t = task(name)
        return mem_bytes[mem_ptr[t]:mem_ptr[t + 1]].tolist()

    def released_by(name: str) -> set[str]:
        t = task(name)
        return {g.ops[int(plan.task_op[u])].name for u in range(plan.n_tasks)
                if t in free_idx[free_ptr[u]:free_ptr[u + 1]]}

    assert held("c") == [W * 4] and held("e") == [] and held("f") == [B * W * 4]
    assert released_by("c") == {"f"}                  # the view's reader holds the buffer, not the view
    sim = Evaluator(g, cl).simulate_plan(plan)
    _, level = sim.memory_timeline(0)
    assert level.tolist() == [B * W * 4 + W * 4, 2 * B * W * 4 + W * 4, B * W * 4, 0]    # x, c; f; x, c go; f goes
