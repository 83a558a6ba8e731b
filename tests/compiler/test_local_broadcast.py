"""A value without a batch dimension, broadcast along the batch into a batch op (expand, as XLNet's
relative-position projection): the expand is an op of its own that runs at each replica's share, and each
data-parallel replica reads its own device's copy of the value."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import heterog
from heterog.cluster import load_cluster
from heterog.compiler import TaskKind
from heterog.compiler.index import graph_index
from heterog.evaluate import Evaluator
from heterog.strategy import ParallelConfig, Strategy


class Broadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))
        self.pos = nn.Parameter(torch.randn(16, 64))
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        p = self.pos @ self.w                                    # no batch dimension
        return (self.lin(x) * p.unsqueeze(0).expand(x.shape[0], 16, 64).clone()).square().mean()


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    g = heterog.capture(Broadcast(), (torch.randn(8, 16, 64),))
    gi = graph_index(g)
    mm = [i for i, op in enumerate(g.ops) if op.target == "aten.mm.default" and not g.has_batch[i]]
    expand = [i for i, op in enumerate(g.ops) if op.target == "aten.expand.default" and op.phase == "forward"]
    assert mm and len(expand) == 1 and g.ops[expand[0]].batch_dims == [0] and g.has_batch[expand[0]]
    into_expand = np.isin(gi.e_src, mm) & (gi.e_dst == expand[0])
    assert into_expand.any() and not gi.e_batch[into_expand].any()   # the value reaches it whole
    return g, load_cluster("paper-8gpu"), mm[0]


def _moves_of(plan, op):
    kinds = [int(TaskKind.TRANSFER), int(TaskKind.RELAYOUT), int(TaskKind.CONCAT)]
    return int(np.sum(np.isin(plan.task_kind, kinds) & (plan.task_op == op)))


@pytest.mark.parametrize("action", ["cp-ar", "ev-ar", "cp-ps"])
def test_data_parallel_replicas_read_their_own_copy(setup, action):
    g, c, mm = setup
    ev = Evaluator(g, c)
    m = c.n_devices
    a = {"ev-ar": m + 1, "cp-ps": m + 2, "cp-ar": m + 3}[action]
    plan = ev.compile(ev.strategy(np.full(ev.n_groups, a)))
    assert _moves_of(plan, mm) == 0
    assert ev.evaluate(ev.strategy(np.full(ev.n_groups, a))).iteration_time_s > 0


def test_a_producer_on_one_device_still_moves(setup):
    """The producer on device 0 alone (model parallelism), its consumer data-parallel: the value moves."""
    g, c, mm = setup
    ev = Evaluator(g, c)
    m, B = c.n_devices, g.batch_size
    dp = ParallelConfig.of(list(zip(range(m), [1] * m)))
    configs = [dp] * ev.n_groups
    configs[int(ev.group_of[mm])] = ParallelConfig.single(0, B)
    s = Strategy(g.fingerprint, c.name, m, B, ev.group_of, configs, "mixed")
    plan = ev.compile(s)
    assert _moves_of(plan, mm) > 0
