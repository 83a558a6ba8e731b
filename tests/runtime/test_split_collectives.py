"""Collectives of groups divided beyond the batch (``heterog.runtime.split_lowering``): a Megatron MLP block
divided 3:1 over two devices reads the row-parallel layer's partial sums as its shards by one reduce-scatter
and puts the output gradient together by one all-gather (uneven shards), issued by both devices at the same
key, with no point-to-point message between them, one per collective task of the simulated plan, and trains
like one process; random
split plans issue their collectives in one order on every member and cannot deadlock; the transport's
all-gather of uneven shards (3:1) gives both ranks the exact tensor over gloo."""
from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from heterog.cluster import load_cluster
from heterog.compiler import TaskKind
from heterog.evaluate import Evaluator
from heterog.graph.shard_exec import shard_of
from heterog.runtime import compare_values, prepare, run_prepared, train_single_process
from heterog.runtime.api import capture_model_for_runtime
from heterog.runtime.instructions import AllGather, AllReduce, AllToAll, Combine, ReduceScatter, Send
from heterog.strategy import ParallelConfig, Strategy
from tests.runtime.test_conformance import ATOL, RTOL, STEPS, captured, cluster_of
from tests.runtime.test_lowering import COLLECTIVES, _abstract_run
from tests.runtime.test_split_conformance import split_plan

D, B = 8, 6


class Block(nn.Module):
    """fc1 (D -> 4D) -> relu -> fc2 (4D -> D), mean squared error; no biases."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D, bias=False)
        self.fc2 = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(torch.relu(self.fc1(x))) - y) ** 2).mean()


@functools.cache
def _block():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    torch.manual_seed(0)
    return capture_model_for_runtime(Block(), (torch.randn(B, D), torch.randn(B, D)), lr=0.1, name="block")


def _divided_block():
    """The block on local-cpu-2, every op in one group divided along parameters in weights 3:1."""
    m, cluster = _block(), load_cluster("local-cpu-2:slowdown=1,2")
    cfg = ParallelConfig.split_over((0, 1), (3, 1), B)
    s = Strategy(m.graph.fingerprint, cluster.name, 2, B, np.zeros(m.graph.n_ops, dtype=np.int64), [cfg])
    return m, cluster, s


def _collectives(rp) -> list[tuple]:
    return [(ins.kind, ins.key, ins.group, k) for ins, k in zip(rp.instrs, rp.keys)
            if isinstance(ins, (AllReduce, AllGather, ReduceScatter, AllToAll))]


def test_a_divided_mlp_puts_values_together_by_collectives_only(request) -> None:
    m, cluster, s = _divided_block()
    prepared = prepare(m, cluster, s)
    low = prepared.lowered
    assert low.messages == [] and low.groups == [(0, 1)]
    for rp in low.ranks:
        assert not any(isinstance(ins, (Send, Combine)) for ins in rp.instrs)
    # the row-parallel fc2's partial sums reduce-scattered into the 6:2 shards the loss's ops read, the output
    # gradient's shards all-gathered for fc2's backward; both devices issue them in the same order at the same keys
    seq = _collectives(low.ranks[0])
    assert [(kind, key) for kind, key, _, _ in seq] == [("reducescatter", ("c", "mm_1", None, 0, "S1", 8, (6, 2), 1.0)),
                                                        ("allgather", ("w", "mul_1", 0))]
    assert _collectives(low.ranks[1]) == seq
    # one collective per collective task of the simulated plan
    compiled = Evaluator(m.graph, cluster).compile(s)
    assert int(np.sum(compiled.task_kind == TaskKind.COLLECTIVE)) == len(seq)
    # the uneven shards: D = 8 units shared 6:2 along dim 1 of the (B, D) gradient
    gathers = [ins for rp in low.ranks for ins in rp.instrs if isinstance(ins, AllGather)]
    assert {(g.placement, g.parts) for g in gathers} == {("S1", ((0, (B, 6)), (1, (B, 2))))}
    assert _abstract_run(low.ranks, post_early=False)
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=request.getfixturevalue("pool2"))
    losses, want = train_single_process(m, [m.example_inputs], STEPS)
    ok, diff, bad = compare_values(m, result.values, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, losses, rtol=RTOL)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("name", ["tied_decoder", "mha_classifier", "seq2seq", "residual_glu"])
def test_random_split_plans_issue_collectives_in_one_order_on_every_member(name, backend) -> None:
    """Every member of a subgroup issues its collectives (the gradient AllReduce and the splits' all-gathers
    and all-reduces) in the same order, each value made whole on the split's devices is put together by one
    collective there, and an execution in any order finishes (no deadlock)."""
    m, cluster = captured(name), cluster_of("local-cpu-3")
    low = prepare(m, cluster, split_plan(name, "local-cpu-3", 2, False), backend=backend, check=False).lowered
    n_split = 0
    for g, devs in enumerate(low.groups):
        seqs = [[(ins.kind, ins.key) for ins in low.ranks[d].instrs if isinstance(ins, COLLECTIVES) and ins.group == g]
                for d in devs]
        assert all(seq == seqs[0] for seq in seqs), (g, devs)
        n_split += sum(key[0] == "w" for _, key in seqs[0])
        for d in devs:
            keys = [k for ins, k in zip(low.ranks[d].instrs, low.ranks[d].keys)
                    if isinstance(ins, COLLECTIVES) and ins.group == g]
            assert keys == [k for ins, k in zip(low.ranks[devs[0]].instrs, low.ranks[devs[0]].keys)
                            if isinstance(ins, COLLECTIVES) and ins.group == g]
    assert n_split > 0
    for rp in low.ranks:            # a value put together by a Combine is a copy received from one holder
        for ins in rp.instrs:
            if isinstance(ins, Combine):
                assert ins.placement == "R" and len(ins.parts) == 1
    assert _abstract_run(low.ranks, post_early=backend == "nccl")


def _whole() -> torch.Tensor:
    return torch.arange(5 * 8, dtype=torch.float32).reshape(5, 8) / 7.0


SHARES = (3, 1)                   # 8 columns: 6 on rank 0, 2 on rank 1


class _GatherJob:
    """Runs on both ranks of the pool (picklable): each rank's 3:1 shard of ``_whole()`` along dim 1 put
    together by ``start_uneven_gather`` on the default group, then by the transport's all-gather (with an
    AllReduce of the same subgroup in flight before it), emulated or not."""

    def __init__(self, emulate: bool) -> None:
        self.emulate = emulate

    def __call__(self, rank: int, device) -> dict:
        from heterog.graph.shard_exec import combine
        from heterog.runtime.resharding import unpack_padded
        from heterog.runtime.transport import NullStatus, Transport, start_uneven_gather

        shards = [shard_of(_whole(), "S1", 4, SHARES, r) for r in range(2)]
        shapes = [tuple(t.shape) for t in shards]
        work, out = start_uneven_gather(shards[rank], shapes, None)
        work.wait()
        padded = combine(unpack_padded(out, shapes), "S1")
        group = dist.new_group([0, 1])
        tr = Transport(device, self.emulate, NullStatus(), rank)
        try:
            summed = tr.allreduce(torch.full((3,), float(rank + 1)), 0, group, [0, 1], rank, 1e-4)
            gathered = tr.allgather(shards[rank], 0, group, [0, 1], rank, list(zip((0, 1), shapes)), "S1", 1e-4)
            out = {"padded": padded, "gathered": tr.finish(gathered).clone(), "summed": tr.finish(summed).clone(),
                   "shapes": shapes}
            tr.flush()
        finally:
            dist.destroy_process_group(group)
        return out


def test_an_uneven_all_gather_gives_both_ranks_the_exact_tensor(pool2) -> None:
    for emulate in (False, True):
        results = pool2.run([_GatherJob(emulate)] * 2)
        assert results[0]["shapes"] == [(5, 6), (5, 2)]
        for res in results:
            assert torch.equal(res["padded"], _whole())
            assert torch.equal(res["gathered"], _whole())
            assert torch.equal(res["summed"], torch.full((3,), 3.0))
