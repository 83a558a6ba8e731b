"""Sharded state (ZeRO stages 1-3): which collectives a stage adds, when they run, what they cost and what
each device holds, on a hand-made two-layer MLP with Adam over two devices; invariants on random plans."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heterog.cluster.loader import cluster_from_dict
from heterog.compiler import Compiler, TaskKind, compile_strategy
from heterog.errors import StrategyError
from heterog.evaluate import cost_model
from heterog.graph.opgraph import Edge, Op, OpGraph
from heterog.sharded import ShardedState, state_weights
from heterog.shares import split_shares_of
from heterog.strategy import STRATEGY_VERSION, ParallelConfig, Strategy
from simulator import simulate

B, D = 4, 8
W_BYTES = D * D * 4                         # each weight, its gradient, and each Adam moment
ACT = B * D * 4
F32 = ["torch.float32"]


def mlp_adam() -> OpGraph:
    """h = x W1, y = h W2, mean loss, backward, Adam (m, v; no step counter) per weight.

    0 x  1 W1  2 W2  3 m1  4 v1  5 m2  6 v2  7 h  8 y  9 loss  10 ones  11 gy  12 gW2  13 gh  14 gW1
    15-19 W1's update (lerp, addcmul, sqrt, div, sub), 20-24 W2's.
    """
    def param(name):
        return Op(name, "placeholder", "param", "forward", [[D, D]], F32, [None], bytes_written=W_BYTES,
                  param_bytes=W_BYTES, grad_bytes=W_BYTES, state_bytes=2 * W_BYTES, param=name)

    def state(name, p):
        return Op(name, "placeholder", "state", "update", [[D, D]], F32, [None], bytes_written=W_BYTES, param=p)

    def batch_op(name, target, phase, reads):
        return Op(name, target, "compute", phase, [[B, D]], F32, [0], flops=2 * B * D * D, bytes_read=reads,
                  bytes_written=ACT, batch_bytes=2 * ACT)

    def grad(name, p):
        return Op(name, "aten.mm.default", "compute", "backward", [[D, D]], F32, [None], flops=2 * B * D * D,
                  bytes_read=2 * ACT, bytes_written=W_BYTES, batch_bytes=2 * ACT, param=p, is_grad=True)

    def upd(name, target, p):
        return Op(name, target, "compute", "update", [[D, D]], F32, [None], flops=4 * D * D,
                  bytes_read=2 * W_BYTES, bytes_written=W_BYTES, param=p)

    ops = [Op("x", "placeholder", "input", "forward", [[B, D]], F32, [0], bytes_written=ACT, batch_bytes=ACT),
           param("W1"), param("W2"), state("m1", "W1"), state("v1", "W1"), state("m2", "W2"), state("v2", "W2"),
           batch_op("h", "aten.mm.default", "forward", ACT + W_BYTES),
           batch_op("y", "aten.mm.default", "forward", ACT + W_BYTES),
           Op("loss", "aten.mean.default", "compute", "forward", [[]], F32, [None], flops=B * D, bytes_read=ACT,
              bytes_written=4, batch_bytes=ACT),
           Op("ones", "aten.ones_like.default", "compute", "backward", [[]], F32, [None], flops=1, bytes_read=4,
              bytes_written=4),
           batch_op("gy", "aten.div.Scalar", "backward", 4), grad("gW2", "W2"),
           batch_op("gh", "aten.mm.default", "backward", ACT + W_BYTES), grad("gW1", "W1")]
    edges = [Edge(0, 7, ACT, 0), Edge(1, 7, W_BYTES), Edge(7, 8, ACT, 0), Edge(2, 8, W_BYTES), Edge(8, 9, ACT, 0),
             Edge(9, 10, 4), Edge(10, 11, 4), Edge(7, 12, ACT, 0), Edge(11, 12, ACT, 0), Edge(11, 13, ACT, 0),
             Edge(2, 13, W_BYTES), Edge(0, 14, ACT, 0), Edge(13, 14, ACT, 0)]
    for k, (w, m, v, g) in enumerate([(1, 3, 4, 14), (2, 5, 6, 12)]):
        base = 15 + 5 * k
        p = f"W{k + 1}"
        ops += [upd(f"lerp{k}", "aten.lerp.Scalar", p), upd(f"addcmul{k}", "aten.addcmul.default", p),
                upd(f"sqrt{k}", "aten.sqrt.default", p), upd(f"div{k}", "aten.div.Tensor", p),
                upd(f"sub{k}", "aten.sub.Tensor", p)]
        edges += [Edge(m, base, W_BYTES), Edge(g, base, W_BYTES), Edge(v, base + 1, W_BYTES),
                  Edge(g, base + 1, W_BYTES), Edge(base + 1, base + 2, W_BYTES), Edge(base, base + 3, W_BYTES),
                  Edge(base + 2, base + 3, W_BYTES), Edge(w, base + 4, W_BYTES), Edge(base + 3, base + 4, W_BYTES)]
    return OpGraph("mlp2-adam", B, ops, edges)


def two_gpus(memory=("16 GiB", "16 GiB")):
    gpus = [{"name": f"G{i}", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": m}
            for i, m in enumerate(memory)]
    return cluster_from_dict({"name": "two", "servers": [
        {"name": "s", "gpus": gpus, "intra": {"kind": "pcie", "bandwidth": "1 GB/s", "latency_us": 2}}]})


GRAPH = mlp_adam()
UPDATE_OPS = np.arange(15, 25)


def plan_of(stage: int, weights=(1, 1), cluster=None):
    cluster = cluster or two_gpus()
    cfg = ParallelConfig((0, 1), (2, 2), sharded=ShardedState(stage, weights) if stage else None)
    s = Strategy(GRAPH.fingerprint, cluster.name, 2, B, np.zeros(GRAPH.n_ops, dtype=np.int64), [cfg])
    plan = compile_strategy(GRAPH, cluster, s, cost_model(cluster))
    return plan, simulate(plan.tg, fifo=True), cluster


def ring_s(cluster, shard_bytes) -> float:
    """A two-device ring all-gather / reduce-scatter by hand: one step, each device passes its shard."""
    return max(cluster.latency_s[0, 1] + shard_bytes[0] / cluster.bandwidth_Bps[0, 1],
               cluster.latency_s[1, 0] + shard_bytes[1] / cluster.bandwidth_Bps[1, 0])


def tasks(plan, kind, op=None):
    sel = plan.task_kind == kind
    return np.nonzero(sel if op is None else sel & (plan.task_op == op))[0]


def test_stage_one_all_gathers_each_updated_weight_after_its_half_update():
    p0, r0, cluster = plan_of(0)
    p1, r1, _ = plan_of(1)
    assert len(tasks(p0, TaskKind.ALLREDUCE)) == len(tasks(p1, TaskKind.ALLREDUCE)) == 2   # gW1, gW2
    assert len(tasks(p0, TaskKind.COLLECTIVE)) == 0
    for sub, w in ((19, 1), (24, 2)):                       # the op that writes W's next value
        (ag,) = tasks(p1, TaskKind.COLLECTIVE, sub)
        assert p1.tg.duration[ag] == pytest.approx(ring_s(cluster, [W_BYTES / 2, W_BYTES / 2]))
        writers = tasks(p1, TaskKind.COMPUTE, sub)
        assert r1.start[ag] == pytest.approx(r1.finish[writers].max())
    upd0 = np.isin(p0.task_op, UPDATE_OPS) & (p0.task_kind == TaskKind.COMPUTE)
    upd1 = np.isin(p1.task_op, UPDATE_OPS) & (p1.task_kind == TaskKind.COMPUTE)
    np.testing.assert_allclose(p1.tg.duration[upd1], p0.tg.duration[upd0] / 2)
    # resident: W and its two moments (stage 1: half of them), per weight; gradients are allocated where made
    np.testing.assert_array_equal(p0.tg.resident_bytes[:2], [2 * 3 * W_BYTES] * 2)
    np.testing.assert_array_equal(p1.tg.resident_bytes[:2], [2 * 2 * W_BYTES] * 2)
    assert np.all(r1.peak_memory[:2] < r0.peak_memory[:2])


@pytest.mark.parametrize("stage", [1, 2])
def test_the_gather_of_a_new_weight_waits_for_every_reader_of_the_old_one(stage):
    """The all-gather lands the next W2 in the resident W2 (no allocation), so it waits for every task that
    reads W2: the forward's y and the backward's input gradient gh (which the update itself does not wait for),
    on both devices; the dependency only orders (the gather releases none of their memory)."""
    plan, res, _ = plan_of(stage)
    (ag,) = tasks(plan, TaskKind.COLLECTIVE, 24)
    dep_ptr, dep_idx = plan.tg.dependencies()
    on = set(dep_idx[dep_ptr[ag]:dep_ptr[ag + 1]].tolist())
    readers = np.concatenate([tasks(plan, TaskKind.COMPUTE, 8), tasks(plan, TaskKind.COMPUTE, 13)])
    assert len(readers) == 4 and set(readers.tolist()) <= on
    assert res.start[ag] >= res.finish[readers].max()
    assert plan.tg.memory()[0][ag + 1] == plan.tg.memory()[0][ag]          # it allocates nothing


def test_stage_one_keeps_the_devices_rows_of_the_all_reduced_gradient():
    """ZeRO-1: each replica updates its rows from the all-reduced gradient, so it takes them when the
    AllReduce ends and lets the whole go (the runtime does, ``state_lowering``): the maker holds the gradient
    in two entries, the device's half, released by the update's last read, and the rest, released by the
    AllReduce."""
    p1, r1, _ = plan_of(1)
    ptr, _, nbytes = p1.tg.memory()
    release = r1.entry_release_time()
    for g, first_update in ((12, 20), (14, 15)):
        (ar,) = tasks(p1, TaskKind.ALLREDUCE, g)
        makers = tasks(p1, TaskKind.COMPUTE, g)
        assert [nbytes[ptr[m]:ptr[m + 1]].tolist() for m in makers] == [[W_BYTES / 2, W_BYTES / 2]] * 2
        assert [release[ptr[m] + 1] for m in makers] == [pytest.approx(r1.finish[ar])] * 2
        for m in makers:                    # the half: to the later of the lerp and the addcmul on its device
            readers = tasks(p1, TaskKind.COMPUTE, first_update)
            readers = np.concatenate([readers, tasks(p1, TaskKind.COMPUTE, first_update + 1)])
            mine = readers[p1.task_device[readers] == p1.task_device[m]]
            assert release[ptr[m]] == pytest.approx(r1.finish[mine].max())


def test_stage_two_reduce_scatters_gradients_and_frees_the_full_one():
    p2, r2, cluster = plan_of(2)
    assert len(tasks(p2, TaskKind.ALLREDUCE)) == 0
    for g in (12, 14):
        (rs,) = tasks(p2, TaskKind.COLLECTIVE, g)
        assert p2.tg.duration[rs] == pytest.approx(ring_s(cluster, [W_BYTES / 2, W_BYTES / 2]))
        makers = tasks(p2, TaskKind.COMPUTE, g)
        ptr, _, nbytes = p2.tg.memory()
        # the full local gradient in two entries: the device's shard, which the update reads, and the rest,
        # released when the reduce-scatter (working in the gradient's buffer) ends
        assert [nbytes[ptr[m]:ptr[m + 1]].tolist() for m in makers] == [[W_BYTES / 2, W_BYTES / 2]] * 2
        release = r2.entry_release_time()
        assert [release[ptr[m] + 1] for m in makers] == [pytest.approx(r2.finish[rs])] * 2
        assert r2.start[rs] == pytest.approx(r2.finish[makers].max())
        readers = tasks(p2, TaskKind.COMPUTE, 15 if g == 14 else 20)
        assert r2.start[readers].min() >= r2.finish[rs] - 1e-12
    assert len(tasks(p2, TaskKind.COLLECTIVE)) == 4                     # 2 reduce-scatters, 2 all-gathers
    np.testing.assert_array_equal(p2.tg.resident_bytes[:2], [2 * (W_BYTES + W_BYTES)] * 2)   # W, half m and v
    assert np.all(r2.peak_memory[:2] <= plan_of(1)[1].peak_memory[:2])


def test_stage_three_gathers_before_forward_and_backward_use():
    p3, r3, cluster = plan_of(3)
    coll = tasks(p3, TaskKind.COLLECTIVE)
    # forward gathers of W1 and W2, a backward gather of W2 (gh reads it), 2 reduce-scatters, no gathers
    # after the update
    assert sorted(p3.task_op[coll].tolist()) == [1, 2, 2, 12, 14]
    gathers = coll[np.isin(p3.task_op[coll], (1, 2))]
    for g in gathers:
        assert p3.tg.duration[g] == pytest.approx(ring_s(cluster, [W_BYTES / 2, W_BYTES / 2]))
    lands = np.nonzero((p3.task_kind == TaskKind.CONCAT) & np.isin(p3.task_op, (1, 2)))[0]
    assert len(lands) == 6                              # each gather lands on both devices
    w2 = gathers[p3.task_op[gathers] == 2]
    fwd, bwd = sorted(w2, key=lambda t: r3.start[t])
    h, gy = tasks(p3, TaskKind.COMPUTE, 7), tasks(p3, TaskKind.COMPUTE, 11)
    assert r3.start[fwd] >= r3.finish[h].max() - 1e-12          # W2 gathered once h (its reader's input) ran
    assert r3.start[bwd] >= r3.finish[gy].max() - 1e-12         # and again once the backward reached gy
    assert len(tasks(p3, TaskKind.COLLECTIVE, 19)) == len(tasks(p3, TaskKind.COLLECTIVE, 24)) == 0
    np.testing.assert_array_equal(p3.tg.resident_bytes[:2], [2 * (W_BYTES / 2 + W_BYTES)] * 2)   # half W, m, v
    assert np.all(r3.peak_memory[:2] <= plan_of(2)[1].peak_memory[:2])


def test_shards_by_memory_are_uneven():
    cluster = two_gpus(("16 GiB", "8 GiB"))
    w = state_weights("memory", (0, 1), cluster)
    assert w == (667, 333)
    p1, _, _ = plan_of(1, w, cluster)
    f = np.array([5, 3]) / D            # each weight's 8 rows as the runtime cuts them: split_shares_of(8, w)
    assert split_shares_of(D, w) == [5, 3]
    (ag,) = tasks(p1, TaskKind.COLLECTIVE, 24)
    assert p1.tg.duration[ag] == pytest.approx(ring_s(cluster, W_BYTES * f))
    np.testing.assert_allclose(p1.tg.resident_bytes[:2], 2 * (W_BYTES + 2 * W_BYTES * f), atol=1)


def test_configs_refuse_sharded_state_where_it_has_no_meaning():
    with pytest.raises(StrategyError, match="AllReduce data-parallel config of 2\\+ replicas"):
        ParallelConfig((0, 1), (2, 2), sync="ps", sharded=ShardedState(1, (1, 1)))
    with pytest.raises(StrategyError, match="AllReduce data-parallel config of 2\\+ replicas"):
        ParallelConfig((0,), (4,), sharded=ShardedState(1, (1,)))
    with pytest.raises(StrategyError, match="one shard weight per replica"):
        ParallelConfig((0, 1), (2, 2), sharded=ShardedState(2, (1, 1, 1)))
    with pytest.raises(StrategyError, match="stage 4"):
        ShardedState(4, (1, 1))
    with pytest.raises(StrategyError, match="positive weight"):
        ShardedState(1, (1, 0))


def test_strategy_files_carry_the_stage_and_old_files_load():
    cfg = ParallelConfig((0, 1), (2, 2), sharded=ShardedState(3, (2, 1)))
    s = Strategy(GRAPH.fingerprint, "two", 2, B, np.zeros(GRAPH.n_ops, dtype=np.int64), [cfg])
    d = s.to_dict()
    assert d["version"] == STRATEGY_VERSION
    assert d["configs"][0]["sharded"] == {"stage": 3, "weights": [2, 1]}
    assert Strategy.from_dict(d).configs[0] == cfg
    plain = replace(s, configs=[replace(cfg, sharded=None)]).to_dict()
    assert "sharded" not in plain["configs"][0]
    old = {**plain, "version": 5}
    assert Strategy.from_dict(old).configs[0].sharded is None


# ----------------------------------------------------------------------------------- invariants
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 2), min_size=4, max_size=4), st.integers(0, 3), st.booleans())
def test_random_plans_hold_less_per_device_as_the_stage_grows(cuts, stage_groups, by_memory):
    cluster = two_gpus(("16 GiB", "8 GiB"))
    group_of = np.array([min(o * 4 // GRAPH.n_ops, 3) for o in range(GRAPH.n_ops)], dtype=np.int64)
    from heterog.graph.grouping import attach_params_to_grads as _attach_params_to_grads
    group_of = _attach_params_to_grads(GRAPH, group_of)
    _, group_of = np.unique(group_of, return_inverse=True)
    n = int(group_of.max()) + 1
    shares = [(1 + c, B - 1 - c) for c in cuts[:n]]
    weights = state_weights("memory" if by_memory else "even", (0, 1), cluster)
    times, peaks, compute, resident = [], [], [], []
    for stage in range(4):
        cfgs = [ParallelConfig((0, 1), sh, sharded=ShardedState(stage, weights) if stage and g <= stage_groups
                               else None) for g, sh in enumerate(shares)]
        s = Strategy(GRAPH.fingerprint, cluster.name, 2, B, group_of, cfgs)
        plan = compile_strategy(GRAPH, cluster, s, cost_model(cluster))
        res = simulate(plan.tg, fifo=True)
        comp = (plan.task_kind == TaskKind.COMPUTE) & ~np.isin(plan.task_op, UPDATE_OPS)
        compute.append(np.sort(plan.tg.duration[comp]))
        peaks.append(res.peak_memory[:2])
        resident.append(plan.tg.resident_bytes[:2])
        times.append(res.makespan)
    # what a device holds throughout shrinks stage by stage; its peak, which also depends on the order the
    # changed collectives let the tasks run in, stays below the unsharded plan's
    for k in range(1, 4):
        assert np.all(resident[k] <= resident[k - 1]), (k, resident)
        assert np.all(peaks[k] <= peaks[0]), (k, peaks)
        np.testing.assert_allclose(compute[k], compute[0])          # compute unchanged but for the update


def test_patched_plans_equal_scratch_plans_when_stages_change():
    from tests.compiler.test_delta import assert_same_plan

    cluster = two_gpus(("16 GiB", "8 GiB"))
    group_of = np.zeros(GRAPH.n_ops, dtype=np.int64)
    group_of[[1, 3, 4, 7, 14, *range(15, 20)]] = 1           # W1's layer in group 1, the rest in group 0
    rng = np.random.default_rng(0)
    comp = Compiler(GRAPH, cluster, cost_model(cluster), max_bases=4, delta_fraction=1.0)
    for _ in range(12):
        cfgs = []
        for _g in range(2):
            stage = int(rng.integers(0, 4))
            w = tuple(int(x) for x in rng.integers(1, 4, size=2))
            cfgs.append(ParallelConfig((0, 1), (2, 2), sharded=ShardedState(stage, w) if stage else None))
        s = Strategy(GRAPH.fingerprint, cluster.name, 2, B, group_of, cfgs)
        assert_same_plan(comp.compile(s), compile_strategy(GRAPH, cluster, s, cost_model(cluster)))
    assert comp.n_patched > 0


# ----------------------------------------------------------------------------------- with recomputation
def test_stage_three_recomputation_reads_the_backward_gather():
    """h is recomputed (gW2 reads it): its recomputed instance reads W1 gathered again for the backward, as
    FSDP gathers before checkpointing recomputes, so that W1's forward copy goes after the forward."""
    cluster = two_gpus()
    cfg = ParallelConfig((0, 1), (2, 2), sharded=ShardedState(3, (1, 1)))
    s = Strategy(GRAPH.fingerprint, cluster.name, 2, B, np.zeros(GRAPH.n_ops, dtype=np.int64), [cfg])
    plan = compile_strategy(GRAPH, cluster, s.with_recompute([0]), cost_model(cluster))
    res = simulate(plan.tg, fifo=True)
    coll = tasks(plan, TaskKind.COLLECTIVE)
    # forward and backward gathers of W1 (the backward one for the recomputation) and of W2, 2 reduce-scatters
    assert sorted(plan.task_op[coll].tolist()) == [1, 1, 2, 2, 12, 14]
    w1_fwd, w1_bwd = sorted(coll[plan.task_op[coll] == 1], key=lambda t: res.start[t])
    lands = tasks(plan, TaskKind.CONCAT, 1)
    dep_ptr, dep_idx = plan.tg.dependencies()
    recomputed = tasks(plan, TaskKind.RECOMPUTE, 7)
    assert len(recomputed) == 2
    ptr, _, _ = plan.tg.memory()
    release = res.entry_release_time()
    h = tasks(plan, TaskKind.COMPUTE, 7)
    gy = tasks(plan, TaskKind.COMPUTE, 11)
    for r in recomputed:
        read = set(dep_idx[dep_ptr[r]:dep_ptr[r + 1]].tolist()) & set(lands.tolist())
        (land,) = read                                      # the backward landing on r's device
        assert res.start[land] >= res.finish[w1_bwd] - 1e-12 and res.start[r] >= res.finish[w1_bwd] - 1e-12
    # the backward gather waits for gy (two hops before gW2, the first backward op reading h), the
    # forward landings of W1 are released when h has run, before the backward gather
    assert res.start[w1_bwd] >= res.finish[gy].max() - 1e-12
    fwd_lands = [t for t in lands.tolist() if res.start[t] < res.finish[w1_fwd] + 1e-12]
    assert len(fwd_lands) == 2
    for t in fwd_lands:
        if ptr[t + 1] > ptr[t]:
            assert release[ptr[t]] == pytest.approx(res.finish[h].max())


# ----------------------------------------------------------------------------------- reduce-scatter order
def branches_plan(stage: int, n: int = 4):
    from tests.compiler.helpers import branches_graph

    g = branches_graph(n, 1 << 20)
    cluster = two_gpus()
    cfg = ParallelConfig((0, 1), (4, 4), sharded=ShardedState(stage, (1, 1)))
    s = Strategy(g.fingerprint, cluster.name, 2, g.batch_size, np.zeros(g.n_ops, dtype=np.int64), [cfg])
    plan = compile_strategy(g, cluster, s, cost_model(cluster))
    return g, plan, simulate(plan.tg, fifo=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_reduce_scatters_run_in_order_and_bound_the_gradients_held(stage):
    """Four equal gradients: reduce-scattered one after another in the order they are made, and the maker of
    gradient j waits for gradient j - 2's reduce-scatter (more than two gradients' bytes would be held)."""
    g, plan, res = branches_plan(stage)
    makers = [i for i, op in enumerate(g.ops) if op.is_grad]
    rs = []
    for o in makers:
        (t,) = tasks(plan, TaskKind.COLLECTIVE, o)
        rs.append(t)
    for a, b in zip(rs, rs[1:]):
        assert res.start[b] >= res.finish[a] - 1e-12
    for j in range(2, len(makers)):
        made = tasks(plan, TaskKind.COMPUTE, makers[j])
        assert res.start[made].min() >= res.finish[rs[j - 2]] - 1e-12
    # the wait binds: gradient 2's maker waits for gradient 0's reduce-scatter, which ends after all else
    # it waits for
    dep_ptr, dep_idx = plan.tg.dependencies()
    for t in tasks(plan, TaskKind.COMPUTE, makers[2]).tolist():
        on = dep_idx[dep_ptr[t]:dep_ptr[t + 1]]
        assert rs[0] in on.tolist()
        assert res.finish[rs[0]] > res.finish[on[on != rs[0]]].max()


def test_patched_plans_equal_scratch_plans_with_ordered_reduce_scatters():
    from tests.compiler.helpers import branches_graph
    from tests.compiler.test_delta import assert_same_plan

    g = branches_graph(4, 1 << 16)
    cluster = two_gpus(("16 GiB", "8 GiB"))
    group_of = np.zeros(g.n_ops, dtype=np.int64)
    for i in range(4):                                   # a group per branch (x in the first)
        group_of[1 + 7 * i:8 + 7 * i] = i
    rng = np.random.default_rng(1)
    comp = Compiler(g, cluster, cost_model(cluster), max_bases=4, delta_fraction=1.0)
    for _ in range(12):
        cfgs = []
        for _g in range(4):
            stage = int(rng.choice([0, 2, 2, 3]))
            cfgs.append(ParallelConfig((0, 1), (4, 4), sharded=ShardedState(stage, (1, 1)) if stage else None))
        s = Strategy(g.fingerprint, cluster.name, 2, g.batch_size, group_of, cfgs)
        assert_same_plan(comp.compile(s), compile_strategy(g, cluster, s, cost_model(cluster)))
    assert comp.n_patched > 0
