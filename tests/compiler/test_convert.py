"""The conversion engine (heterog.compiler.convert): every conversion task of a compiled plan (re-layouts, moves,
pushes, collectives, landings, AllReduces, host copies, synced batch statistics) is made by it; its prices by
hand on two GPUs over a 10 GB/s, 5 us link; order keys of tasks numbered as made; re-layout pieces of uneven shares."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import heterog
from heterog.compiler import TaskKind, compile_strategy
from heterog.compiler.context import CompileContext
from heterog.compiler.convert import Engine, collective_seconds, relayout_pattern, ring_resources
from heterog.compiler.tasks import STAGE, TaskBatch, TaskCategory
from heterog.cost import CostModel
from heterog.cost.host import pcie_time_s
from heterog.sharded import ShardedState, state_weights
from heterog.strategy import ParallelConfig, Strategy
from tests.compiler.helpers import linear_graph
from tests.compiler.test_compile import two_gpu

GRAPHS = Path(__file__).resolve().parents[2] / "experiments" / "data" / "plan_identity" / "graphs"
CONVERSIONS = (TaskKind.TRANSFER, TaskKind.PUSH, TaskKind.RELAYOUT, TaskKind.CONCAT, TaskKind.COLLECTIVE,
               TaskKind.ALLREDUCE)
ALPHA, BETA = 5e-6, 1e-10                    # two_gpu's link: 5 us, 10 GB/s


def engine(cost=None):
    g, c = linear_graph(), two_gpu()
    ctx = CompileContext.of(g, c, cost if cost is not None else CostModel(c))
    return ctx, Engine(ctx, TaskBatch(0, ctx.order_key))


# ----------------------------------------------------------------------------------- provenance
def plans_of_every_kind(graph, cluster):
    """Strategies whose plans hold every conversion: re-layouts between data-parallel layouts, moves of whole
    values, PS pushes, AllReduces, splits and a grid, sharded state at stages 1-3, offloaded optimizer state and
    offloaded parameters (their shards copied up before each gather)."""
    group_of = heterog.baselines.run("single", graph, cluster).group_of
    G = int(group_of.max()) + 1
    B, M = graph.batch_size, cluster.n_devices
    one = ParallelConfig.single(0, B)
    ar = ParallelConfig.of([(0, 3), (1, 5)])
    ps = ParallelConfig.of([(2, 4), (3, 4)], sync="ps")
    split = ParallelConfig.split_over([0, 1, 2, 3], [1, 1, 2, 2], B)
    grid = ParallelConfig.split_grid([[0, 1], [2, 3]], [1, 1], [4, 4])
    devs = tuple(range(4))

    def zero(stage: int, offload: str = "none") -> ParallelConfig:
        w = state_weights("memory", devs, cluster)
        return ParallelConfig(devs, (2,) * 4, sharded=ShardedState(stage, w, offload))

    mixes = [[one, ar, ps], [ar, split, one], [grid, ar, one], [zero(1), one, zero(3)], [zero(2, "optimizer"), ps],
             [zero(3, "parameters"), one]]
    return [Strategy(graph.fingerprint, cluster.name, M, B, group_of, [mix[g * len(mix) // G] for g in range(G)])
            for mix in mixes]


def recorded_kinds(monkeypatch) -> dict[str, list[np.ndarray]]:
    """Module name -> the kinds of the tasks it adds to a TaskBatch (filled as plans are compiled)."""
    made: dict[str, list[np.ndarray]] = {}
    add = TaskBatch.add

    def recording_add(self, **kw):
        module = sys._getframe(1).f_globals["__name__"]
        made.setdefault(module, []).append(np.broadcast_to(np.asarray(kw["kind"]), (len(kw["dur"]),)))
        return add(self, **kw)

    monkeypatch.setattr(TaskBatch, "add", recording_add)
    return made


def test_every_conversion_task_is_made_by_the_engine(monkeypatch):
    graph = heterog.load_graph(GRAPHS / "tiny_transformer.json.gz")
    cluster = heterog.load_cluster("paper-8gpu")
    made = recorded_kinds(monkeypatch)
    cost = CostModel(cluster)
    counts: dict[int, int] = {}
    for s in plans_of_every_kind(graph, cluster):
        plan = compile_strategy(graph, cluster, s, cost)
        for k, n in zip(*np.unique(plan.task_kind, return_counts=True)):
            counts[int(k)] = counts.get(int(k), 0) + int(n)
    names = plan.tg.resource_names     # the last plan offloads its parameters: copies up only before the gathers
    pcie = [t for t in np.nonzero(plan.task_kind == TaskKind.TRANSFER)[0]
            if names[int(plan.tg.task_resources(t)[0])].startswith("pcie-")]
    assert {names[int(plan.tg.task_resources(t)[0])].split(":")[0] for t in pcie} == {"pcie-down", "pcie-up"}
    by_module = {m: set(np.concatenate(kinds).tolist()) for m, kinds in made.items()}
    elsewhere = {m: sorted(TaskKind(k).name for k in kinds & set(CONVERSIONS))
                 for m, kinds in by_module.items() if m != "heterog.compiler.convert"}
    assert all(not v for v in elsewhere.values()), elsewhere
    assert set(CONVERSIONS) <= by_module["heterog.compiler.convert"]
    assert all(counts.get(int(k), 0) > 0 for k in CONVERSIONS), counts       # each kind was compiled


def test_synced_batch_statistics_are_made_by_the_engine(monkeypatch):
    graph = heterog.load_graph(GRAPHS / "resnet50_small.json.gz")
    cluster = heterog.load_cluster("paper-8gpu")
    made = recorded_kinds(monkeypatch)
    group_of = heterog.baselines.run("single", graph, cluster).group_of
    s = Strategy(graph.fingerprint, cluster.name, 8, graph.batch_size, group_of,
                 [ParallelConfig.of([(0, 3), (1, 5)])] * (int(group_of.max()) + 1), sync_batch_stats=True)
    plan = compile_strategy(graph, cluster, s, CostModel(cluster))
    stats = int(np.count_nonzero(plan.task_kind == TaskKind.STATISTICS))
    assert stats == int(np.count_nonzero(plan.placements.op_synced)) > 0       # one per synced batch norm
    by_module = {m: set(np.concatenate(kinds).tolist()) for m, kinds in made.items()}
    assert [m for m, kinds in by_module.items() if TaskKind.STATISTICS in kinds] == ["heterog.compiler.convert"]


# ----------------------------------------------------------------------------------- prices
def test_collectives_are_priced_by_the_side_that_is_sharded():
    ctx, _ = engine()
    parts = np.array([0.25, 0.75])
    x = np.array([1000.0])
    # all-gather of the producer's shards (250 B, 750 B): the ring's one step passes the larger
    np.testing.assert_allclose(collective_seconds(ctx, heterog.placement.Conversion.ALL_GATHER, (0, 1), x, have=parts),
                               [ALPHA + 750 * BETA], rtol=1e-9)
    # reduce-scatter into the consumer's shards, the same steps
    np.testing.assert_allclose(collective_seconds(ctx, heterog.placement.Conversion.REDUCE_SCATTER, (0, 1), x,
                                                  need=parts[::-1]), [ALPHA + 750 * BETA], rtol=1e-9)
    # all-to-all: the ring passing half of each shard
    np.testing.assert_allclose(collective_seconds(ctx, heterog.placement.Conversion.ALL_TO_ALL, (0, 1), x, have=parts),
                               [ALPHA + 375 * BETA], rtol=1e-9)
    with pytest.raises(ValueError, match="no price"):
        collective_seconds(ctx, heterog.placement.Conversion.REDUCE_SCATTER, (0, 1), x, have=parts)


def test_a_sum_of_partial_results_is_priced_as_gradients_apart_from_a_value_all_reduce():
    c = two_gpu()
    cost = CostModel(c, allreduce_bucket_bytes=4096.0)       # gradients pay a bucket's fixed time in part
    ctx, conv = engine(cost)
    ar = heterog.placement.Conversion.ALL_REDUCE
    value = conv.collective(ar, (0, 1), 1024.0, np.zeros((1, 0), dtype=np.int64), op=2, tensor=0, prio_op=2,
                            stage="split", cls=1, owner=10)
    summed = conv.collective(ar, (0, 1), 1024.0, np.zeros((1, 0), dtype=np.int64), op=2, tensor=0, prio_op=2,
                             stage="split", cls=1, owner=10, gradient=True)
    conv.flush()
    dur = conv.batch.tasks().dur
    assert dur[value[0]] == pytest.approx(float(cost.allreduce_times((0, 1), np.array([1024.0]))[0][0]))
    assert dur[summed[0]] == pytest.approx(float(cost.gradient_allreduce_times((0, 1), np.array([1024.0]))[0][0]))
    assert dur[summed[0]] < dur[value[0]]                    # a quarter bucket pays a quarter of the fixed time


def test_a_collective_lands_its_result_and_holds_the_ring():
    ctx, conv = engine()
    gather = heterog.placement.Conversion.ALL_GATHER
    coll = conv.collective(gather, (0, 1), 1000.0, np.array([[0, 1]]), op=2, tensor=3, prio_op=5, stage="split",
                           cls=1, owner=ctx.index.n_ops + 3, have=np.array([0.25, 0.75]))
    lands = conv.land(int(coll[0]), (0, 1), 1000.0, [0.75, 0.25], op=2, tensor=3, prio_op=5, cls=1,
                      owner=ctx.index.n_ops + 3)
    moved = conv.move(int(lands[1]), 1, 0, 400.0, op=2, prio_op=5, tensor=3)
    conv.flush()
    tasks = conv.batch.tasks()
    assert tasks.n == 4 and list(coll) + list(lands) + [moved] == [0, 1, 2, 3]
    assert [TaskKind(k) for k in tasks.kind] == [TaskKind.COLLECTIVE, TaskKind.CONCAT, TaskKind.CONCAT,
                                                 TaskKind.TRANSFER]
    np.testing.assert_allclose(tasks.dur, [ALPHA + 750 * BETA, 0.0, 0.0, ALPHA + 400 * BETA], rtol=1e-9)
    np.testing.assert_allclose(tasks.alloc, [0.0, 750.0, 250.0, 400.0])
    assert list(tasks.dev) == [-1, 0, 1, 0] and tasks.cat[1] == TaskCategory.COLLECTIVE
    assert tuple(tasks.res_idx[tasks.res_ptr[0]:tasks.res_ptr[1]]) == ring_resources(ctx, (0, 1))
    assert tasks.res_len[1] == tasks.res_len[2] == 0
    # numbered as made within the tensor: sub 0, 1, 2, 3 at stages split, transfer, transfer, transfer
    key = ctx.order_key
    want = [key(5, STAGE[s], 1, 3, sub) for sub, s in enumerate(("split", "transfer", "transfer", "transfer"))]
    assert tasks.order.tolist() == [int(w) for w in want]
    task, on, owner = conv.batch.dependencies()
    assert sorted(zip(task.tolist(), on.tolist())) == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 2)]
    assert set(owner.tolist()) == {ctx.index.n_ops + 3}


def test_batch_statistics_are_all_reduced_as_a_value_on_the_ring():
    ctx, conv = engine()
    conv.batch.add(dur=np.ones(2), kind=TaskKind.COMPUTE, op=2, dev=[0, 1], alloc=0.0, cat=TaskCategory.FORWARD,
                   prio_op=2, stage="compute", cls=0, tensor=0, sub=[0, 1], owner=2, res_len=1, res_idx=[0, 1])
    two = conv.statistics(2, (0, 1), 24.0, np.array([0, 1]))          # after the op's instances 0 and 1
    one = conv.statistics(3, (1,), 24.0, np.array([1]))
    conv.flush()
    tasks = conv.batch.tasks()
    assert (two, one) == (2, 3) and [TaskKind(k) for k in tasks.kind[2:]] == [TaskKind.STATISTICS] * 2
    # the ring over two devices: 2 steps of 5 us, each device sending half of 24 B twice; none on one device
    np.testing.assert_allclose(tasks.dur[2:], [2 * ALPHA + 24 * BETA, 0.0], rtol=1e-9)
    assert tasks.res_idx[tasks.res_ptr[2]:tasks.res_ptr[3]].tolist() == list(ctx.allreduce((0, 1)).links[0])
    assert tasks.res_len.tolist()[2:] == [2, 0] and tasks.dev.tolist()[2:] == [-1, -1]
    assert tasks.cat.tolist()[2:] == [TaskCategory.ALLREDUCE] * 2 and tasks.op.tolist()[2:] == [2, 3]
    task, on, owner = conv.batch.dependencies()
    assert sorted(zip(task.tolist(), on.tolist(), owner.tolist())) == [(2, 0, 2), (2, 1, 2), (3, 1, 3)]


def test_tasks_added_behind_the_engines_back_are_refused():
    ctx, conv = engine()
    conv.move(0, 0, 1, 8.0, op=2, prio_op=2, tensor=0)
    conv.batch.add(dur=np.zeros(1), kind=TaskKind.COMPUTE, op=2, dev=0, alloc=0.0, cat=TaskCategory.FORWARD,
                   prio_op=2, stage="compute", cls=0, tensor=0, sub=0, owner=2, res_len=1, res_idx=[0])
    with pytest.raises(AssertionError, match="pending"):
        conv.flush()


def test_a_few_tasks_kept_as_rows_are_the_tasks_a_batch_adds_at_once():
    rng = np.random.default_rng(3)
    calls = []
    for k in (1, 3, 17, 2, 16):                   # 17: added at once, the others kept as rows until flush
        res_len = rng.integers(0, 3, k)
        calls.append(dict(dur=rng.random(k), kind=TaskKind.TRANSFER, op=rng.integers(0, 5, k), dev=-1,
                          alloc=rng.random(k) * 100, cat=TaskCategory.TRANSFER, prio_op=4,
                          stage="transfer" if k % 2 else np.full(k, STAGE["split"]), cls=1,
                          tensor=rng.integers(0, 3, k), sub=np.arange(k), owner=rng.integers(10, 12, k),
                          res_len=res_len, res_idx=rng.integers(0, 9, int(res_len.sum())),
                          lag=0.5 if k == 3 else rng.random(k)))
    ctx, conv = engine()
    made = [conv.add(**dict(c)) for c in calls]
    conv.deps(made[0], [0], 10)                              # one owner for all, spread when read
    conv.flush()
    whole = TaskBatch(0, ctx.order_key)
    want = [whole.add(**dict(c)) for c in calls]
    whole.deps(want[0], [0], np.array([10]))
    assert [m.tolist() for m in made] == [w.tolist() for w in want]
    got, ref = conv.batch.tasks(), whole.tasks()
    for name in ("ints", "floats", "res_ptr", "res_idx"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name))
    for a, b in zip(conv.batch.dependencies(), whole.dependencies()):
        assert a.tolist() == b.tolist()


def test_host_copies_take_the_pcie_link_and_wait_only_for_real_tasks():
    cl = heterog.load_cluster("paper-8gpu")
    ctx = CompileContext.of(linear_graph(), cl, CostModel(cl))
    conv = Engine(ctx, TaskBatch(0, ctx.order_key))
    ids = conv.host_copies(np.array([-1, 0]), np.array([0, 1]), np.array([1e6, 2e6]), np.array([2, 2]),
                           np.array([100, 101]), op=7, prio_op=7, stage="push", cls=0, tensor=4, sub=np.array([0, 1]),
                           owner=7)
    conv.flush()
    tasks = conv.batch.tasks()
    np.testing.assert_allclose(tasks.dur, [pcie_time_s(cl, 0, 1e6, 2), pcie_time_s(cl, 1, 2e6, 2)])
    assert tasks.res_idx.tolist() == [100, 101] and tasks.alloc.tolist() == [0.0, 0.0]
    task, on, _ = conv.batch.dependencies()
    assert task.tolist() == [int(ids[1])] and on.tolist() == [0]


# ----------------------------------------------------------------------------------- re-layouts
def test_relayout_pattern_of_uneven_shares():
    # rows [0, 3) on device 0 and [3, 6) on device 1, read as [0, 2) on device 1 and [2, 6) on device 0
    pat = relayout_pattern((0, 1), (3, 3), (1, 0), (2, 4))
    assert list(zip(pat.pi.tolist(), pat.pj.tolist(), pat.pov.tolist())) == [(0, 0, 2.0), (0, 1, 1.0), (1, 1, 3.0)]
    assert pat.remote.tolist() == [True, False, True]
    assert pat.split_i.tolist() == [0] and pat.split_slot.tolist() == [0, 0, -1]
    assert pat.concat_j.tolist() == [1] and pat.concat_slot.tolist() == [-1, 0, 0]
