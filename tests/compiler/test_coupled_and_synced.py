"""The compiler's placement of ops that couple samples (heterog.compiler.coupled) and of synchronized batch
statistics (heterog.compiler.sync_stats): where they run, what they wait for, what they cost, and the
strategy file that carries the option."""
from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import heterog
from heterog import baselines
from heterog.cluster import load_cluster
from heterog.compiler import Compiler, TaskKind, compile_strategy
from heterog.compiler.index import graph_index
from heterog.evaluate import Evaluator
from heterog.strategy import STRATEGY_VERSION, ParallelConfig, Strategy
from tests.compiler.test_delta import assert_same_plan
from tests.graph.test_coupling import Towers, towers_inputs

CLUSTER = "local-cpu-3:slowdown=1,2,3"


class BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3))), y)


@pytest.fixture(scope="module")
def towers():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    return heterog.capture(Towers(), towers_inputs())


@pytest.fixture(scope="module")
def bn_graph():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(0)
    return heterog.capture(BnNet(), (torch.randn(6, 3, 6, 6, generator=g), torch.randint(0, 2, (6,), generator=g)))


def _plan(graph, method: str = "cp-ar", **kw):
    cluster = load_cluster(CLUSTER)
    s = baselines.run(method, graph, cluster, evaluator=Evaluator(graph, cluster))
    s = dataclasses.replace(s, **kw)
    return s, Evaluator(graph, cluster).compile(s)


# ---------------------------------------------------------------------------- coupled ops
def test_coupled_ops_run_once_over_the_whole_batch_on_the_largest_replica(towers) -> None:
    s, plan = _plan(towers)
    cfg = s.configs[0]
    big = cfg.devices[int(np.argmax(cfg.shares))]
    lay = plan.placements.layouts
    for o in np.nonzero(towers.coupled)[0].tolist():
        entries = lay[int(plan.placements.op_layout[o])]
        assert (entries.devices, entries.shares) == ((big,), (towers.batch_size,)), towers.ops[o].name
        assert np.count_nonzero((plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE)) == 1
    aggregated = {int(graph_index(towers).t_op[t]) for t in plan.placements.aggregation}
    assert not aggregated & set(np.nonzero(towers.coupled)[0].tolist())
    # the embeddings' pieces move to it: transfers into the coupled device of the replicas' rows
    moved = (plan.task_kind == TaskKind.TRANSFER) & (plan.task_device == big)
    assert moved.any()


def test_micro_batched_plans_with_coupled_ops_run_gpipe(towers) -> None:
    s, plan = _plan(towers, micro_batches=(2, 2, 2), schedule="1f1b")
    assert plan.schedule == "gpipe" and plan.n_micro == 3


@pytest.mark.parametrize("seed", [0, 1])
def test_patched_plans_with_coupled_ops_are_the_plans_compiled_from_scratch(towers, seed) -> None:
    cluster = load_cluster(CLUSTER)
    ev = Evaluator(towers, cluster)
    compiler = Compiler(towers, cluster, ev.cost)
    rng = np.random.default_rng(seed)
    base = baselines.run("random", towers, cluster, evaluator=ev, seed=seed)
    pool = [ParallelConfig.of([(0, 2), (1, 2), (2, 2)]), ParallelConfig.of([(1, 6)]),
            ParallelConfig.of([(0, 3), (2, 3)], sync="ps")]
    for _ in range(4):
        configs = list(base.configs)
        configs[int(rng.integers(len(configs)))] = pool[int(rng.integers(len(pool)))]
        base = dataclasses.replace(base, configs=configs)
        assert_same_plan(compiler.compile(base), compile_strategy(towers, cluster, base, ev.cost))


class DeepTowers(nn.Module):
    """Two towers, one with a hidden layer, and a per-sample square of CLIP's row loss: the coupled loss's
    backward reads a value each micro-batch's backward makes, so everything after it shares the last slot."""

    def __init__(self) -> None:
        super().__init__()
        self.a1, self.a2, self.b = nn.Linear(5, 8), nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        za, zb = F.normalize(self.a2(F.gelu(self.a1(x))), dim=1), F.normalize(self.b(y), dim=1)
        per = F.cross_entropy(za @ zb.t() * 10.0, torch.arange(len(x)), reduction="none")
        return (per * per).mean()


@pytest.mark.parametrize("micro", [(1, 3, 2)])
def test_recomputed_groups_after_a_coupled_op_over_micro_batches_compile_in_dependency_order(micro) -> None:
    """The hidden layer's forward (a1, gelu) and its backward readers form a recomputed group whose first
    backward op accumulates a weight gradient over micro-batches: its trigger for micro-batch m waits for
    that op's instance of m - 1, which the order key puts after it; the order still follows the dependencies."""
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(0)
    graph = heterog.capture(DeepTowers(), (torch.randn(6, 5, generator=g), torch.randn(6, 6, generator=g)))
    gi = graph_index(graph)
    cluster = load_cluster("local-cpu-2")
    names = [op.name for op in graph.ops]
    hidden = [names.index("addmm"), names.index("gelu")]
    group_of = np.zeros(len(names), dtype=np.int64)
    group_of[hidden] = 1
    readers = gi.e_dst[np.isin(gi.e_src, hidden) & (graph.phase_index[gi.e_dst] == 1)]
    group_of[readers] = 1
    cfg = ParallelConfig.of([(0, 3), (1, 3)])
    s = Strategy(graph.fingerprint, cluster.name, cluster.n_devices, 6, group_of, [cfg, cfg],
                 micro_batches=micro, recompute=(0, 1), schedule="gpipe")
    plan = Evaluator(graph, cluster).compile(s)
    n = len(plan.task_kind)
    task = np.repeat(np.arange(n), np.diff(plan.dep_ptr))
    assert np.all(plan.dep_idx < task)
    gelu = names.index("gelu")
    recomputed = (plan.task_kind == TaskKind.RECOMPUTE) & (plan.task_op == gelu)
    assert sorted(set(plan.task_micro[recomputed].tolist())) == [0, 1, 2]
    # the coupled similarity: one instance, after the hidden layer's forward of every micro-batch
    assert graph.coupled[names.index("mm")]
    sim = np.nonzero((plan.task_kind == TaskKind.COMPUTE) & (plan.task_op == names.index("mm")))[0]
    assert len(sim) == 1
    before = np.zeros(n, dtype=bool)
    todo = [int(sim[0])]
    while todo:
        t = todo.pop()
        for o in plan.dep_idx[plan.dep_ptr[t]:plan.dep_ptr[t + 1]].tolist():
            if not before[o]:
                before[o] = True
                todo.append(o)
    forward_gelu = before & (plan.task_kind == TaskKind.COMPUTE) & (plan.task_op == gelu)
    assert sorted(set(plan.task_micro[forward_gelu].tolist())) == [0, 1, 2]
    assert np.count_nonzero(forward_gelu) == np.count_nonzero(recomputed)


# ---------------------------------------------------------------------------- synchronized statistics
def test_synced_batch_norms_all_reduce_their_statistics_before_any_reader(bn_graph) -> None:
    _, plain = _plan(bn_graph, method="ev-ar")
    s, plan = _plan(bn_graph, method="ev-ar", sync_batch_stats=True)
    bn = [i for i, op in enumerate(bn_graph.ops) if "batch_norm" in op.target]
    assert len(bn) == 2 and not np.any(plain.task_kind == TaskKind.STATISTICS)
    stats = np.nonzero(plan.task_kind == TaskKind.STATISTICS)[0]
    assert sorted(plan.task_op[stats].tolist()) == bn
    assert plan.placements.op_synced is not None and plan.placements.op_synced[bn].all()
    cost = Evaluator(bn_graph, load_cluster(CLUSTER)).cost
    ptr, idx = plan.dep_ptr, plan.dep_idx
    for t in stats.tolist():
        o = int(plan.task_op[t])
        channels = bn_graph.ops[o].output_shapes[0][1]
        want = cost.allreduce_times((0, 1, 2), np.array([8.0 * (2 * channels + 1)]))[0][0]
        assert plan.tg.duration[t] == pytest.approx(want)
        insts = np.nonzero((plan.task_op == o) & (plan.task_kind == TaskKind.COMPUTE))[0]
        assert set(idx[ptr[t]:ptr[t + 1]].tolist()) == set(insts.tolist())        # after every instance
        readers = [x for x in range(plan.n_tasks) if set(idx[ptr[x]:ptr[x + 1]]) & set(insts.tolist())
                   and x != t and plan.task_op[x] != o]
        assert readers and all(t in idx[ptr[x]:ptr[x + 1]] for x in readers)     # and before any reader


def test_the_evaluators_option_compiles_as_the_strategys(bn_graph) -> None:
    cluster = load_cluster(CLUSTER)
    s = baselines.run("ev-ar", bn_graph, cluster, evaluator=Evaluator(bn_graph, cluster))
    by_flag = Evaluator(bn_graph, cluster).compile(dataclasses.replace(s, sync_batch_stats=True))
    by_evaluator = Evaluator(bn_graph, cluster, sync_batch_stats=True).compile(s)
    assert_same_plan(by_evaluator, by_flag)
    one_group = dataclasses.replace(s, configs=[dataclasses.replace(c, sync_batch_stats=True) for c in s.configs])
    assert_same_plan(Evaluator(bn_graph, cluster).compile(one_group), by_flag)


def test_synced_plans_over_micro_batches_run_gpipe_and_split_grids_move_their_batch_norms(bn_graph) -> None:
    s, plan = _plan(bn_graph, method="ev-ar", sync_batch_stats=True, micro_batches=(3, 3), schedule="1f1b")
    assert plan.schedule == "gpipe"
    bn = [i for i, op in enumerate(bn_graph.ops) if "batch_norm" in op.target]
    stat_ops = plan.task_op[plan.task_kind == TaskKind.STATISTICS]
    assert sorted(stat_ops.tolist()) == bn
    over = ParallelConfig.split_over((0, 1, 2), (1, 1, 1), 6)
    split = dataclasses.replace(s, configs=[over] * len(s.configs), micro_batches=(3, 3))
    placed = Evaluator(bn_graph, load_cluster(CLUSTER)).compile(split).placements
    for o in bn:
        assert placed.op_split is not None and placed.op_split[o] == -1
        assert placed.layouts[int(placed.op_layout[o])].devices == (0, 0)     # the group's first device, per micro


def test_strategy_files_carry_the_option_and_older_files_load(bn_graph, tmp_path) -> None:
    s, _ = _plan(bn_graph, method="ev-ar", sync_batch_stats=True)
    s = dataclasses.replace(s, configs=[dataclasses.replace(s.configs[0], sync_batch_stats=True), *s.configs[1:]])
    path = s.save(tmp_path / "s.json")
    d = json.loads(path.read_text())
    assert d["version"] == STRATEGY_VERSION == 8 and d["sync_batch_stats"] is True
    assert d["configs"][0]["sync_batch_stats"] is True
    back = Strategy.load(path)
    assert back.sync_batch_stats and back.configs[0].sync_batch_stats
    d.pop("sync_batch_stats")
    d["configs"][0].pop("sync_batch_stats")
    d["version"] = 7
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = Strategy.load(tmp_path / "old.json")
    assert not old.sync_batch_stats and not any(c.sync_batch_stats for c in old.configs)
