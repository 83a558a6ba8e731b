"""Micro-batches: gradient accumulation and pipelines in the simulator, with exact timelines, the
micro-batches each schedule keeps in flight, and the topological order of the tasks."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.compiler import TaskKind
from heterog.compiler.micro import (
    _successors,
    in_flight_window,
    ranked_order_kernel,
    ranked_order_reference,
    slots_kernel,
    slots_reference,
)
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.shares import micro_batch_shares
from heterog.strategy import MAX_MICRO_BATCHES, STRATEGY_VERSION, ParallelConfig, Strategy
from tests.compiler.helpers import linear_graph, pipeline_graph
from tests.compiler.test_compile import FakeCost, strategy_for, two_gpu

S, K = 4, 4                     # pipeline stages, micro-batches


class NoComm(FakeCost):
    """FakeCost with free communication, copies and accumulation: timelines are the ops' FLOPs alone."""

    def transfer_times(self, src, dst, nbytes):
        return np.zeros(np.broadcast(np.asarray(src), np.asarray(nbytes)).shape)

    def aggregate_times(self, device, nbytes, n_inputs):
        return np.zeros(np.broadcast(np.asarray(device), np.asarray(nbytes)).shape)

    def copy_times(self, devices, nbytes):
        return np.zeros(np.broadcast(np.asarray(devices), np.asarray(nbytes)).shape)


def stages_of(graph) -> np.ndarray:
    """Layer i's ops (and weight) in group i; the input with layer 0, loss and its seed with the last."""
    out = np.zeros(graph.n_ops, dtype=np.int64)
    for i, op in enumerate(graph.ops):
        digits = "".join(ch for ch in op.name if ch.isdigit())
        out[i] = int(digits) if digits else (0 if op.name == "x" else S - 1)
    return out


def pipeline(schedule: str, micro=(2, 2, 2, 2), order: str = "rank"):
    g, c = pipeline_graph(S), two_gpu(n=S)
    s = strategy_for(g, c, [ParallelConfig.single(d, 8) for d in range(S)], stages_of(g))
    s = dataclasses.replace(s, micro_batches=micro, schedule=schedule)
    return g, Evaluator(g, c, NoComm(c), order=order).evaluate(s)


def in_flight(graph, res, device: int) -> int:
    """Most micro-batches on ``device`` at once between their first forward start and last backward end."""
    plan, sim = res.plan, res.sim
    inst = (plan.task_kind == TaskKind.COMPUTE) & (plan.task_device == device) & (plan.task_micro >= 0)
    fwd = inst & np.array([graph.ops[o].phase == "forward" for o in plan.task_op.tolist()])
    events = []
    for m in np.unique(plan.task_micro[inst]).tolist():
        mine = plan.task_micro == m
        events += [(float(sim.start[fwd & mine].min()), 1), (float(sim.finish[inst & ~fwd & mine].max()), -1)]
    live = best = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        live += step
        best = max(best, live)
    return best


# ------------------------------------------------------------------------------- exact timelines
@pytest.mark.parametrize("order", ["rank", "fifo"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_four_stage_pipeline_takes_k_plus_s_minus_one_steps(schedule, order):
    # forward and backward of one micro-batch take 1 s on each stage: (K + S - 1) * (1 + 1) = 14 s, of
    # which each stage computes 8: the bubble is (S - 1) / (K + S - 1) = 3/7 of the step
    g, res = pipeline(schedule, order=order)
    assert res.iteration_time_s == pytest.approx(14.0, abs=1e-12)
    busy = res.sim.busy[:S]
    assert busy.tolist() == pytest.approx([8.0] * S)
    assert 1 - busy[0] / res.iteration_time_s == pytest.approx((S - 1) / (K + S - 1))


def test_without_micro_batches_the_pipeline_runs_one_stage_at_a_time():
    # one micro-batch of 8: forward 4 s and backward 4 s per stage, one stage after another
    g, c = pipeline_graph(S), two_gpu(n=S)
    s = strategy_for(g, c, [ParallelConfig.single(d, 8) for d in range(S)], stages_of(g))
    assert Evaluator(g, c, NoComm(c), order="rank").evaluate(s).iteration_time_s == pytest.approx(32.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_micro_batches_in_flight_per_stage(schedule):
    g, res = pipeline(schedule)
    # GPipe keeps every micro-batch on every stage until its backwards start; 1F1B at most S - s on stage s
    expected = [K] * S if schedule == "gpipe" else [S - s for s in range(S)]
    assert [in_flight(g, res, d) for d in range(S)] == expected
    sync = res.plan.task_kind == TaskKind.SYNC
    assert np.all(res.plan.tg.duration[sync] == 0.0)


U = 2 * 16 * 4                  # one micro-batch's activation: 2 samples x 16 floats
PB = 16 * 16 * 4                # a stage's weight, resident, and its gradient, allocated by each bw instance
RESIDENT = PB


@pytest.mark.parametrize("order", ["rank", "fifo"])
def test_pipeline_memory_peaks(order):
    """From its second backward on, a stage holds its accumulated weight gradient and the one the micro-batch
    makes (2 PB) until that one is added in. Stage 0 then keeps the inputs x of the micro-batches not yet
    back and the gradients g0 received for them: GPipe (rank order) x of 3 and g0 of 2 = 5 U, 1F1B 4 U. The
    last stage keeps, per micro-batch in flight, its received input h2 and its output h3 (both read by the
    backward) and the loss's 4-byte partial of every micro-batch so far (kept to the step's end, as the runtime
    keeps the loss to report it), plus the loss gradient and the input gradient being made: GPipe 3 h2 + 2 h3 +
    2 U + 4 x 4 B + the seed's 4 B = 7 U + 20."""
    _, gp = pipeline("gpipe", order=order)
    peaks = [gp.peak_memory_bytes[f"s0/gpu{d}"] - RESIDENT for d in range(S)]
    assert peaks[0] == 2 * PB + (5 * U if order == "rank" else 4 * U)
    assert peaks[-1] == 2 * PB + (7 * U + 20 if order == "rank" else 6 * U + 16)
    _, fb = pipeline("1f1b", order=order)
    peaks = [fb.peak_memory_bytes[f"s0/gpu{d}"] - RESIDENT for d in range(S)]
    assert peaks[0] == 2 * PB + 4 * U
    if order == "fifo":
        # one micro-batch in flight on the last stage at its last backward: h3 and the loss gradient, the four
        # losses and the seed
        assert peaks[-1] == 2 * PB + 2 * U + 16
    else:
        # rank also receives the next micro-batch's h2 while the current one is in flight
        assert peaks[-1] == 2 * PB + 5 * U + 12


def test_gradient_accumulation_on_one_device():
    g, c = pipeline_graph(S), two_gpu(n=1)
    plain = strategy_for(g, c, [ParallelConfig.single(0, 8)])
    acc = dataclasses.replace(plain, micro_batches=(1,) * 8, schedule="1f1b")
    ev = Evaluator(g, c, NoComm(c), order="rank")
    r1, r8 = ev.evaluate(plain), ev.evaluate(acc)
    # the same work, one micro-batch after another: 4 layers x (4 s forward + 4 s backward)
    assert r1.iteration_time_s == pytest.approx(32.0) and r8.iteration_time_s == pytest.approx(32.0)
    assert in_flight(g, r8, 0) == 1
    act1 = r1.peak_memory_bytes["s0/gpu0"] - S * RESIDENT
    act8 = r8.peak_memory_bytes["s0/gpu0"] - S * RESIDENT
    # one micro-batch's working set is 8 activations (x, h0..h3 kept, the loss gradient, two input
    # gradients in flight): 8 x 512 B at the whole batch, beside the last layer's weight gradient being made
    # (PB; the others are made after activations are freed) and the loss's 4 B (kept to the step's end); with 8
    # micro-batches of 1 sample, 8 x 64 B, plus the other 7 micro-batches' inputs (the batch is loaded at the
    # start of the step) and the losses so far (two: 8 B), beside the 4 layers' accumulated gradients and the one
    # being made (5 PB)
    assert act1 == 8 * 512 + PB + 4
    assert act8 == 8 * 64 + 7 * 64 + 8 + 5 * PB
    # every weight gradient: 8 partial results accumulated on the device, no aggregation task
    k = r8.plan.counts()
    assert k["aggregate"] == 0 and k["allreduce"] == 0 and k["push"] == 0
    bw = [i for i, op in enumerate(g.ops) if op.name.startswith("bw")]
    assert np.sum(np.isin(r8.plan.task_op, bw) & (r8.plan.task_kind == TaskKind.COMPUTE)) == 8 * S


def test_accumulation_costs_an_add_per_micro_batch_after_the_first():
    # linear graph on one device, 2 micro-batches: the second gW adds its 32-byte result to the first's,
    # FakeCost's aggregation of 2 inputs: 2 * 32 * 1e-10 s
    g, c = linear_graph(), two_gpu(n=1)
    plain = strategy_for(g, c, [ParallelConfig.single(0, 8)])
    ev = Evaluator(g, c, FakeCost(c), order="rank")
    t1 = ev.evaluate(plain).iteration_time_s
    t2 = ev.evaluate(dataclasses.replace(plain, micro_batches=(4, 4))).iteration_time_s
    assert t2 == pytest.approx(t1 + 64e-10, rel=1e-12)


def test_data_parallel_micro_batches_aggregate_once_per_device():
    g, c = linear_graph(), two_gpu()
    for sync, kinds in (("allreduce", {"allreduce": 1}), ("ps", {"push": 1, "aggregate": 1})):
        s = strategy_for(g, c, [ParallelConfig.of([(0, 4), (1, 4)], sync=sync)])
        res = Evaluator(g, c, FakeCost(c)).evaluate(dataclasses.replace(s, micro_batches=(2, 2, 2, 2)))
        counts = res.plan.counts()
        assert {k: counts[k] for k in kinds} == kinds
        gw = [i for i, op in enumerate(g.ops) if op.name == "gW"][0]
        assert np.sum((res.plan.task_op == gw) & (res.plan.task_kind == TaskKind.COMPUTE)) == 8


# ------------------------------------------------------------------------------- semantics
def test_micro_batch_shares_split_each_micro_batch_over_the_replicas():
    assert micro_batch_shares([6, 2], [4, 4]) == [[3, 1], [3, 1]]
    assert micro_batch_shares([5, 3], [3, 5]) == [[2, 1], [3, 2]]
    assert [sum(row) for row in micro_batch_shares([7, 1], [2, 2, 2, 2])] == [2, 2, 2, 2]
    with pytest.raises(StrategyError, match="sum to the batch"):
        micro_batch_shares([4, 4], [4, 3])


def test_strategy_file_round_trip_and_version_one_files_load_as_one_micro_batch(tmp_path):
    g, c = linear_graph(), two_gpu()
    s = dataclasses.replace(strategy_for(g, c, [ParallelConfig.single(0, 8)]), micro_batches=(3, 5),
                            schedule="gpipe")
    back = Strategy.load(s.save(tmp_path / "s.json"))
    assert back.micro == (3, 5) and back.schedule == "gpipe" and back.n_micro == 2
    d = s.to_dict()
    assert d["version"] == STRATEGY_VERSION
    for key in ("micro_batches", "schedule", "recompute"):
        del d[key]
    d["version"] = 1
    old = Strategy.from_dict(d)
    assert old.micro == (8,) and old.n_micro == 1


@pytest.mark.parametrize("micro, match", [((4, 3), "sum to the batch"), ((8, 0, 249), "positive"),
                                          ((1,) * (MAX_MICRO_BATCHES + 1), f"at most {MAX_MICRO_BATCHES}")])
def test_bad_micro_batches_are_refused(micro, match):
    batch = MAX_MICRO_BATCHES + 1
    g, c = linear_graph(batch=batch), two_gpu()
    with pytest.raises(StrategyError, match=match):
        dataclasses.replace(strategy_for(g, c, [ParallelConfig.single(0, batch)]), micro_batches=micro)


def test_unknown_schedule_is_refused():
    g, c = linear_graph(), two_gpu()
    with pytest.raises(StrategyError, match="schedule"):
        dataclasses.replace(strategy_for(g, c, [ParallelConfig.single(0, 8)]), schedule="interleaved")


def test_in_flight_window_counts_pipeline_positions():
    # devices 0 and 1 start at op 3 (data parallel), device 2 at op 9, device 3 runs no forward
    assert in_flight_window(np.array([0, 1, 2, 0]), np.array([3, 3, 9, 5]), 4).tolist() == [2, 2, 1, 0]


# ------------------------------------------------------------------------------- invariants
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_micro_batched_plans_are_topological_and_cover_every_sample(data):
    g, c = pipeline_graph(3, batch=12), two_gpu(n=3)
    n_groups = 3
    group_of = stages_of(g).clip(max=n_groups - 1)
    configs = []
    for _ in range(n_groups):
        devs = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
        shares = data.draw(st.lists(st.integers(1, 6), min_size=len(devs), max_size=len(devs)))
        shares[-1] += 12 - sum(shares) if sum(shares) < 12 else 0
        if sum(shares) != 12:
            shares = [12] if len(devs) == 1 else [12 - (len(devs) - 1)] + [1] * (len(devs) - 1)
        configs.append(ParallelConfig.of(list(zip(devs, shares)), sync=data.draw(st.sampled_from(["ps", "allreduce"]))))
    k = data.draw(st.integers(1, 6))
    micro = [12 // k + (1 if i < 12 % k else 0) for i in range(k)]
    s = dataclasses.replace(strategy_for(g, c, configs, group_of), micro_batches=tuple(micro),
                            schedule=data.draw(st.sampled_from(["gpipe", "1f1b"])))
    res = Evaluator(g, c, FakeCost(c)).evaluate(s)
    plan = res.plan
    assert np.all(plan.dep_idx < np.repeat(np.arange(plan.n_tasks), np.diff(plan.dep_ptr)))
    assert np.isfinite(res.iteration_time_s)
    # every forward op's instances cover the batch once per micro-batch: shares sum to each micro-batch
    f0 = [i for i, op in enumerate(g.ops) if op.name == "f0"][0]
    layout = plan.placements.layouts[int(plan.placements.op_layout[f0])]
    sizes = np.bincount(layout.micro, weights=layout.shares, minlength=k)
    assert sizes.tolist() == micro


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_slots_kernel_matches_reference(n, seed):
    rng = np.random.default_rng(seed)
    task = rng.integers(1, n, size=3 * n)
    on = (rng.random(3 * n) * task).astype(np.int64)          # on < task: acyclic
    hint = rng.integers(0, 5, size=n)
    ptr, idx = _successors(n, task, on)
    a, na = slots_kernel(ptr, idx, hint)
    b, nb = slots_reference(ptr, idx, hint)
    assert na == nb == n and a.tolist() == b.tolist()
    for t, o in zip(task.tolist(), on.tolist()):
        assert a[t] >= a[o] and a[t] >= hint[t]


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_ranked_order_is_topological_smallest_rank_first_and_the_rank_order_where_that_is(n, seed):
    rng = np.random.default_rng(seed)
    task = rng.integers(1, n, size=3 * n)
    on = (rng.random(3 * n) * task).astype(np.int64)          # on < task: acyclic
    ptr, idx = _successors(n, task, on)
    rank = rng.permutation(n)
    a, b = ranked_order_kernel(ptr, idx, rank), ranked_order_reference(ptr, idx, rank)
    assert a.tolist() == b.tolist() and sorted(a.tolist()) == list(range(n))
    pos = np.empty(n, dtype=np.int64)
    pos[a] = np.arange(n)
    assert np.all(pos[on] < pos[task])
    # each task taken is the ready one of smallest rank
    indeg = np.bincount(task, minlength=n)
    done = np.zeros(n, dtype=bool)
    for t in a.tolist():
        ready = np.nonzero(~done & (indeg == 0))[0]
        assert rank[t] == rank[ready].min()
        done[t] = True
        for s in idx[ptr[t]:ptr[t + 1]].tolist():
            indeg[s] -= 1
    assert ranked_order_kernel(ptr, idx, np.arange(n)).tolist() == list(range(n))




def test_batch_statistics_are_read_per_instance_and_do_not_couple_micro_batches():
    """A batch norm's backward reads the statistics of its own (replica, micro-batch) instance, as the
    runtime does: it waits for no AllReduce of them, and 1F1B's window holds the norm's forward back."""
    from heterog.cluster import load_cluster
    from heterog.compiler.micro import window_exempt
    from tests.runtime.test_conformance import captured

    g = captured("batchnorm_cnn").graph
    c = load_cluster("local-cpu-2")
    s = Strategy(g.fingerprint, c.name, 2, g.batch_size, np.zeros(g.n_ops, dtype=np.int64),
                 [ParallelConfig.of([(0, 3), (1, 3)])], micro_batches=(3, 3))
    ev = Evaluator(g, c)
    plan = ev.evaluate(s).plan
    bn = [i for i, op in enumerate(g.ops) if op.target == "aten._native_batch_norm_legit_functional.default"]
    bwd = [i for i, op in enumerate(g.ops) if op.target == "aten.native_batch_norm_backward.default"]
    assert bn and bwd
    assert not window_exempt(ev.compiler.context, plan.placements.op_layout)[bn].any()
    ptr, idx = plan.dep_ptr, plan.dep_idx
    for t in np.nonzero(np.isin(plan.task_op, bwd) & (plan.task_kind == TaskKind.COMPUTE))[0].tolist():
        waits = idx[ptr[t]:ptr[t + 1]]
        assert not np.any(plan.task_kind[waits] == TaskKind.ALLREDUCE)
        own = waits[np.isin(plan.task_op[waits], bn)]
        assert own.size and np.all(plan.task_micro[own] == plan.task_micro[t])
        assert np.all(plan.task_device[own] == plan.task_device[t])
