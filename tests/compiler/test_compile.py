"""Compiler semantics: exact timelines on a hand-made graph, aggregation, shares, memory, AllReduce choice."""
from __future__ import annotations

import numpy as np
import pytest

from heterog.actions import decode_action
from heterog.cluster import load_cluster
from heterog.cluster.loader import cluster_from_dict
from heterog.compiler import TaskKind
from heterog.compiler.index import graph_index
from heterog.cost import CostModel
from heterog.evaluate import Evaluator
from heterog.strategy import ParallelConfig, Strategy
from tests.compiler.helpers import chain_graph, linear_graph


class FakeCost:
    """Transparent costs: an op takes its FLOPs (at its batch fraction) in seconds on every device;
    a transfer takes bytes * 1e-9 s and is in flight ``latency_s`` more; an AllReduce 2(n-1)/n * bytes * 1e-9;
    aggregation n * bytes * 1e-10."""

    def __init__(self, cluster, latency_s: float = 0.0):
        self.cluster = cluster
        self.latency_s = latency_s

    def op_times(self, graph, ops, devices, fractions):
        f = np.where(graph.has_batch[ops], fractions, 1.0)
        return np.where(graph.is_compute[ops], graph.flops[ops] * f, 0.0)

    def full_batch_times(self, graph):
        return np.repeat(np.where(graph.is_compute, graph.flops, 0.0)[:, None], self.cluster.n_devices, 1)

    comm_blocks_compute = False

    def profiled_layers(self, graph):
        return np.zeros((graph.n_ops, self.cluster.n_devices), dtype=bool)

    def gradient_allreduce_times(self, devices, nbytes):
        return self.allreduce_times(devices, nbytes)

    def transfer_times(self, src, dst, nbytes):
        return np.where(np.asarray(src) == np.asarray(dst), 0.0, np.asarray(nbytes, float) * 1e-9)

    def transfer_latencies(self, src, dst, nbytes):
        return np.where(np.asarray(src) == np.asarray(dst), 0.0, self.latency_s)

    def allreduce_times(self, devices, nbytes):
        n = len(devices)
        return 2 * (n - 1) / n * np.asarray(nbytes, float) * 1e-9, ["ring"] * len(nbytes)

    def allreduce_links(self, devices, algo="ring"):
        devices = list(devices)
        return tuple(sorted({x for a, b in zip(devices, devices[1:] + devices[:1]) for x in self.cluster.path(a, b)}))

    def aggregate_times(self, device, nbytes, n_inputs):
        return n_inputs * np.asarray(nbytes, float) * 1e-10

    def copy_times(self, devices, nbytes):
        return np.asarray(nbytes, float) * 1e-10


def two_gpu(memory: str = "16 GiB", n: int = 2, host_driven_comm: bool = False) -> object:
    gpu = {"name": "G", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": memory}
    if host_driven_comm:
        gpu["host_driven_comm"] = True
    return cluster_from_dict({"name": f"test-{n}gpu", "servers": [{
        "name": "s0", "gpus": [gpu] * n, "intra": {"kind": "pcie", "bandwidth": "10 GB/s", "latency_us": 5}}]})


def strategy_for(graph, cluster, configs, group_of=None):
    group_of = np.zeros(graph.n_ops, dtype=np.int64) if group_of is None else np.asarray(group_of)
    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, graph.batch_size, group_of, configs)


def run(graph, cluster, strategy, cost=None):
    ev = Evaluator(graph, cluster, cost if cost is not None else FakeCost(cluster))
    return ev.evaluate(strategy)


# ------------------------------------------------------------------------------- exact timelines
def test_single_device_timeline_is_the_chain_of_op_flops():
    g, c = linear_graph(), two_gpu()
    res = run(g, c, strategy_for(g, c, [ParallelConfig.single(0, 8)]))
    # mm 128 + loss 16 + ones 1 + gout 16 + gW 128 + update 16
    assert res.iteration_time_s == pytest.approx(305.0, rel=1e-12)
    assert res.comm_time_s == 0.0


def test_even_allreduce_timeline():
    g, c = linear_graph(), two_gpu()
    res = run(g, c, strategy_for(g, c, [ParallelConfig.of([(0, 4), (1, 4)], sync="allreduce")]))
    # per replica: mm 64 + loss 8 + ones 1 + gout 8 + gW 64 = 145; allreduce of 32 bytes: 2*1/2*32e-9; update 16
    assert res.iteration_time_s == pytest.approx(145 + 32e-9 + 16, rel=1e-12)
    kinds = res.plan.task_kind
    assert np.sum(kinds == TaskKind.ALLREDUCE) == 1
    ar_op = res.plan.task_op[kinds == TaskKind.ALLREDUCE]
    assert [g.ops[i].name for i in ar_op] == ["gW"]          # the loss is not aggregated: only its shape is read


def test_even_ps_timeline():
    g, c = linear_graph(), two_gpu()
    res = run(g, c, strategy_for(g, c, [ParallelConfig.of([(0, 4), (1, 4)], sync="ps")]))
    # PS on device 0 (ties -> lowest id). Device 1 first pulls W (32 B: 32e-9 s), computes 145,
    # pushes its partial gradient (32e-9), the PS aggregates 2 inputs (2 * 32 * 1e-10) and updates (16).
    expected = 32e-9 + 145 + 32e-9 + 64e-10 + 16
    assert res.iteration_time_s == pytest.approx(expected, rel=1e-12)
    assert res.plan.placements.ps_device == {0: 0}
    kinds = res.plan.task_kind
    assert np.sum(kinds == TaskKind.PUSH) == 1 and np.sum(kinds == TaskKind.AGGREGATE) == 1
    upd = [i for i, op in enumerate(g.ops) if op.name == "upd"][0]
    assert res.plan.task_device[(res.plan.task_op == upd) & (kinds == TaskKind.COMPUTE)].tolist() == [0]


def test_latency_in_flight_delays_the_consumer_but_not_the_link():
    g, c = linear_graph(), two_gpu()
    cost = FakeCost(c, latency_s=1.0)
    res = run(g, c, strategy_for(g, c, [ParallelConfig.of([(0, 4), (1, 4)], sync="ps")]), cost)
    # as test_even_ps_timeline, with the pull of W and the push of the gradient each 1 s longer in flight
    expected = 32e-9 + 1.0 + 145 + 32e-9 + 1.0 + 64e-10 + 16
    assert res.iteration_time_s == pytest.approx(expected, rel=1e-12)
    plan = res.plan
    comm = (plan.task_kind == TaskKind.TRANSFER) | (plan.task_kind == TaskKind.PUSH)
    assert plan.tg.lag[comm].tolist() == [1.0, 1.0] and not plan.tg.lag[~comm].any()
    assert plan.tg.duration[comm].tolist() == pytest.approx([32e-9, 32e-9])     # the links are held this long


def test_relayout_inserts_split_transfer_concat():
    g, c = linear_graph(), two_gpu()
    # group 0 (x, mm) on device 0 only; everything else DP over both devices
    group_of = np.array([0, 1, 0, 1, 1, 1, 1, 1])
    s = strategy_for(g, c, [ParallelConfig.single(0, 8), ParallelConfig.of([(0, 4), (1, 4)])], group_of)
    res = run(g, c, s)
    k = res.plan.counts()
    # mm's output (B=8 on dev 0) -> loss replicas (4 on dev0, 4 on dev1): one split on dev 0, one transfer;
    # x (dev 0) -> gW replicas: split + transfer. W is needed on device 1 (mm on dev 0 has it locally).
    assert k["relayout"] == 2 and k["concat"] == 0
    assert k["transfer"] == 2
    tr = res.plan.task_kind == TaskKind.TRANSFER
    assert sorted(res.plan.tg.duration[tr].tolist()) == pytest.approx([4 * 2 * 4 * 1e-9, 4 * 4 * 4 * 1e-9])


def test_one_gpu_ev_ar_equals_single():
    g = linear_graph()
    c = two_gpu(n=1)
    ev = Evaluator(g, c)
    t_single = ev.evaluate(ev.strategy(np.zeros(ev.n_groups, dtype=np.int64))).iteration_time_s
    t_evar = ev.evaluate(ev.strategy(np.full(ev.n_groups, 1 + 1))).iteration_time_s
    assert t_single == t_evar


def test_aggregation_exactly_for_replicated_gradient_producers():
    g = linear_graph()
    c = load_cluster("paper-8gpu")
    ev = Evaluator(g, c)
    for action, kind in ((8 + 1, TaskKind.ALLREDUCE), (8 + 0, TaskKind.AGGREGATE)):
        res = ev.evaluate(ev.strategy(np.full(ev.n_groups, action)))
        agg_ops = set(res.plan.task_op[res.plan.task_kind == kind].tolist())
        assert agg_ops == {i for i, op in enumerate(g.ops) if op.is_grad}
    # model parallelism on one device: no aggregation at all
    res = ev.evaluate(ev.strategy(np.full(ev.n_groups, 3)))
    assert not np.isin(res.plan.task_kind, [TaskKind.ALLREDUCE, TaskKind.AGGREGATE, TaskKind.PUSH]).any()


def test_proportional_shares_sum_to_batch_and_follow_power():
    c = load_cluster("paper-8gpu")
    cfg = decode_action(c.n_devices + 3, c.n_devices, 192, c.power)
    assert sum(cfg.shares) == 192 and cfg.sync == "allreduce"
    shares = np.array(cfg.shares)
    assert np.all(np.abs(shares - 192 * c.power / c.power.sum()) < 1.0)
    order = np.argsort(-c.power, kind="stable")
    assert np.all(np.diff(shares[order]) <= 0)   # more power, no smaller share
    even = decode_action(c.n_devices + 0, c.n_devices, 192, c.power)
    assert even.shares == (24,) * 8 and even.sync == "ps"


def test_too_large_for_one_gpu_is_oom_under_single_but_fits_spread():
    g = chain_graph(4, param_bytes=3 * 2**30)        # 12 GiB of parameters, 8 GiB GPUs
    c = two_gpu(memory="8 GiB")
    cost = FakeCost(c)
    single = run(g, c, strategy_for(g, c, [ParallelConfig.single(0, 4)]), cost)
    assert single.oom
    half = [0] + [0, 0, 0, 0] + [1, 1, 1, 1]          # x + layers 0,1 on device 0; layers 2,3 on device 1
    spread = run(g, c, strategy_for(g, c, [ParallelConfig.single(0, 4), ParallelConfig.single(1, 4)], half), cost)
    assert not spread.oom
    peaks = list(spread.peak_memory_bytes.values())
    assert peaks[0] >= 6 * 2**30 and peaks[1] >= 6 * 2**30


def test_allreduce_picks_the_cheaper_algorithm():
    g = linear_graph(batch=24)                      # every one of the 12 GPUs gets a share
    c = load_cluster("paper-12gpu")
    cost = CostModel(c)
    ev = Evaluator(g, c, cost)
    res = ev.evaluate(ev.strategy(np.full(ev.n_groups, c.n_devices + 1)))
    devs = tuple(range(c.n_devices))
    gi = graph_index(g)
    assert res.plan.placements.aggregation
    for t, how in res.plan.placements.aggregation.items():
        nb = g.ops[int(gi.t_op[t])].bytes_written
        ring, hier = cost.allreduce(devs, nb, "ring").time_s, cost.allreduce(devs, nb, "hierarchical").time_s
        assert how.kind == "allreduce" and how.devices == devs
        assert how.algorithm == ("ring" if ring <= hier else "hierarchical")
    ar = res.plan.task_kind == TaskKind.ALLREDUCE
    nb = g.ops[int(res.plan.task_op[ar][0])].bytes_written
    assert res.plan.tg.duration[ar][0] == pytest.approx(min(cost.allreduce(devs, nb, "ring").time_s,
                                                           cost.allreduce(devs, nb, "hierarchical").time_s))


def test_memory_is_freed_after_last_consumer():
    g, c = linear_graph(), two_gpu()
    res = run(g, c, strategy_for(g, c, [ParallelConfig.single(0, 8)]))
    # resident: the W param (32); its gradient is allocated by gW (32) when it runs, beside x (128) and
    # gout (64), the most alive together; ones (4) is freed by gout, before gW; the loss (4), read by ones for
    # its shape only, stays to the step's end (the runtime reports it).
    peak = res.peak_memory_bytes[c.devices[0].name]
    assert peak == 32 + 128 + 64 + 32 + 4


def test_strategy_for_another_graph_is_refused():
    from heterog.errors import StrategyError

    g, c = linear_graph(), two_gpu()
    other = linear_graph(batch=16)
    s = strategy_for(other, c, [ParallelConfig.single(0, 16)])
    with pytest.raises(StrategyError, match="strategy is for graph"):
        run(g, c, s)


def test_communication_holds_links_and_compute_holds_its_gpu():
    g = linear_graph(batch=16)
    c = load_cluster("paper-8gpu")
    ev = Evaluator(g, c)
    rng = np.random.default_rng(3)
    for _ in range(5):
        res = ev.evaluate(ev.strategy(rng.integers(0, c.n_devices + 4, size=ev.n_groups)))
        plan, tg = res.plan, res.plan.tg
        for t in range(tg.n_tasks):
            r = tg.task_resources(t).tolist()
            kind = TaskKind(plan.task_kind[t])
            if kind in (TaskKind.COMPUTE, TaskKind.RELAYOUT, TaskKind.CONCAT, TaskKind.AGGREGATE):
                assert r == [plan.task_device[t]]
            elif kind in (TaskKind.TRANSFER, TaskKind.PUSH, TaskKind.ALLREDUCE):
                assert r and all(x >= c.n_devices for x in r)
            else:
                assert r == []


@pytest.mark.parametrize("mode", ["overlapped", "host-driven", "blocking runtime"])
def test_devices_that_hold_their_communication_do_not_compute_meanwhile(mode):
    """CPU workers (``host_driven_comm``), and any device under a runtime that runs communication in line
    with compute (``CostModel.comm_blocks_compute``, DeepSpeed's): a transfer also holds both endpoint
    devices and an AllReduce every member, so communication no longer overlaps computation there."""
    g = linear_graph()
    holds = mode != "overlapped"
    c = two_gpu(host_driven_comm=mode == "host-driven")
    cost = FakeCost(c)
    cost.comm_blocks_compute = mode == "blocking runtime"
    # the loss (and so the rest of the step) on device 1, the forward on device 0: x and mm's output move
    s = strategy_for(g, c, [ParallelConfig.single(0, 8), ParallelConfig.single(1, 8)],
                     np.array([0, 0, 0, 1, 1, 1, 1, 1]))
    res = run(g, c, s, cost)
    plan, sim = res.plan, res.sim
    for t in np.nonzero(plan.task_kind == TaskKind.TRANSFER)[0].tolist():
        devices = sorted(x for x in plan.tg.task_resources(t).tolist() if x < c.n_devices)
        assert devices == ([0, 1] if holds else [])
    ar = run(g, c, strategy_for(g, c, [ParallelConfig.of([(0, 4), (1, 4)], sync="allreduce")]), cost).plan
    t_ar = int(np.nonzero(ar.task_kind == TaskKind.ALLREDUCE)[0][0])
    assert sorted(x for x in ar.tg.task_resources(t_ar).tolist() if x < c.n_devices) == ([0, 1] if holds else [])
    # timelines: x is ready at 0 and moves to device 1 while device 0 runs mm, unless device 0 holds the move
    mm = [i for i, op in enumerate(g.ops) if op.name == "mm"][0]
    t_mm = int(np.nonzero((plan.task_op == mm) & (plan.task_kind == TaskKind.COMPUTE))[0][0])
    transfers = np.nonzero(plan.task_kind == TaskKind.TRANSFER)[0]
    overlap = [t for t in transfers.tolist() if sim.start[t] < sim.finish[t_mm] and sim.start[t_mm] < sim.finish[t]]
    assert bool(overlap) is not holds


# ------------------------------------------------------------------------------- random strategies
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=8, max_size=8), st.integers(8, 40))
def test_random_strategies_cover_every_op_and_split_the_whole_batch(actions, batch):
    g = linear_graph(batch=batch)
    c = load_cluster("paper-8gpu")
    ev = Evaluator(g, c)
    res = ev.evaluate(ev.strategy(np.asarray(actions[:ev.n_groups])))
    plan, sim = res.plan, res.sim
    comp = plan.task_kind == TaskKind.COMPUTE
    for op in range(g.n_ops):
        if not g.ops[op].kind == "compute":
            continue
        layout = plan.placements.layouts[plan.placements.op_layout[op]]
        assert np.sum(comp & (plan.task_op == op)) == len(layout.devices)
        if g.has_batch[op]:
            assert sum(layout.shares) == batch      # split ops cover the whole batch
    dep_ptr, dep_idx = plan.tg.dependencies()
    for t in range(plan.n_tasks):
        deps = dep_idx[dep_ptr[t]:dep_ptr[t + 1]]
        assert np.all(sim.finish[deps] <= sim.start[t])
    assert np.all(np.asarray(sim.peak_memory) >= plan.tg.resident_bytes)
    assert res.iteration_time_s >= res.compute_time_s - 1e-15
