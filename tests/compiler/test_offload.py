"""Optimizer state offloaded to the host (ZeRO-Offload): the copies down, the host step and the copies up of
a two-layer MLP with Adam on one GPU and on two (stages 0-2), timed by hand with the formulas of
``heterog.cost.host``; what the GPUs and the host hold; refusals; patched plans equal scratch plans."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from heterog.cluster.loader import cluster_from_dict
from heterog.compiler import Compiler, TaskKind, compile_strategy
from heterog.cost.host import host_memory_need_bytes, host_optimizer_step_s, pcie_time_s
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator, cost_model
from heterog.sharded import ShardedState
from heterog.strategy import STRATEGY_VERSION, ParallelConfig, Strategy
from simulator import simulate
from tests.compiler.test_sharded_state import W_BYTES, B, mlp_adam

GRAPH = replace(mlp_adam(), optimizer="adam")
NUMEL = W_BYTES // 4                               # elements of each weight
GRAD = {1: 14, 2: 12}                              # weight -> the op making its gradient
UPDATES = {1: range(15, 20), 2: range(20, 25)}     # weight -> its update ops (lerp, addcmul, sqrt, div, sub)
WRITER = {1: 19, 2: 24}                            # weight -> the op writing its next value
XEON = {"cpu": "Xeon-Gold-6148", "sockets": 2, "memory": "384 GB", "pcie": {"bandwidth": "12 GB/s", "latency_us": 5}}


def cluster(n: int, host: dict | None = XEON, **override) -> object:
    gpus = [{"name": f"G{i}", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": "16 GiB"} for i in range(n)]
    server: dict = {"name": "s", "gpus": gpus}
    if n > 1:
        server["intra"] = {"kind": "pcie", "bandwidth": "1 GB/s", "latency_us": 2}
    if host is not None:
        server["host"] = {**host, **override}
    return cluster_from_dict({"name": f"host{n}", "servers": [server]})


def strategy(c, n: int, stage: int | None, offload: str = "optimizer") -> Strategy:
    sharded = None if stage is None else ShardedState(stage, (1,) * n, offload)
    cfg = ParallelConfig(tuple(range(n)), (B // n,) * n, sharded=sharded)
    return Strategy(GRAPH.fingerprint, c.name, n, B, np.zeros(GRAPH.n_ops, dtype=np.int64), [cfg])


def run(c, n: int, stage: int | None, offload: str = "optimizer"):
    plan = compile_strategy(GRAPH, c, strategy(c, n, stage, offload), cost_model(c))
    return plan, simulate(plan.tg, fifo=True)


def transfers(plan, op: int, link: str, dev: int) -> int:
    """The one copy of ``op``'s value over device ``dev``'s ``link`` (pcie-down / pcie-up)."""
    names = plan.tg.resource_names
    hits = [t for t in np.nonzero((plan.task_kind == TaskKind.TRANSFER) & (plan.task_op == op))[0]
            if names[int(plan.tg.task_resources(t)[0])] == f"{link}:s/gpu{dev}"]
    assert len(hits) == 1, hits
    return int(hits[0])


def update_tasks(plan, w: int, dev: int) -> np.ndarray:
    sel = (plan.task_kind == TaskKind.COMPUTE) & np.isin(plan.task_op, list(UPDATES[w])) & (plan.task_device == dev)
    return np.nonzero(sel)[0]


def test_one_gpu_copies_each_gradient_down_steps_on_the_host_and_copies_the_weight_up():
    c = cluster(1)
    plan, res = run(c, 1, 1)
    names = plan.tg.resource_names
    assert names[1:] == ["pcie-down:s/gpu0", "pcie-up:s/gpu0", "host:s"]
    b_host = 2 * 127.968e9 * 0.75                              # two sockets of 6 DDR4-2666 channels, 0.75
    pcie_s = 5e-6 + W_BYTES / min(12e9, b_host)
    step_s = NUMEL * 28 / b_host                               # Adam: 28 B a parameter, memory bound
    assert pcie_time_s(c, 0, W_BYTES) == pytest.approx(pcie_s)
    assert host_optimizer_step_s(c, 0, NUMEL, "adam") == pytest.approx(step_s)
    for w in (1, 2):
        (grad,) = np.nonzero((plan.task_kind == TaskKind.COMPUTE) & (plan.task_op == GRAD[w]))[0]
        down, up = transfers(plan, GRAD[w], "pcie-down", 0), transfers(plan, WRITER[w], "pcie-up", 0)
        steps = update_tasks(plan, w, 0)
        assert plan.tg.duration[down] == plan.tg.duration[up] == pytest.approx(pcie_s)
        # the step apportioned to the five update ops by their memory traffic (equal here), on the host CPU
        np.testing.assert_allclose(plan.tg.duration[steps], step_s / 5)
        assert all(names[int(plan.tg.task_resources(t)[0])] == "host:s" for t in steps)
        # timeline: down once the gradient is made, the five steps back to back, then up
        assert res.start[down] == pytest.approx(res.finish[grad])
        np.testing.assert_allclose(res.start[steps], res.finish[down] + step_s / 5 * np.arange(5), rtol=0, atol=1e-15)
        assert res.start[up] == pytest.approx(res.finish[down] + step_s)
        assert res.finish[up] == pytest.approx(res.finish[grad] + 2 * pcie_s + step_s)
    assert res.makespan == pytest.approx(res.finish[transfers(plan, WRITER[1], "pcie-up", 0)])
    # the GPU holds each weight (its gradient is allocated where made), not the two moments; the host the fp32
    # weight, gradient, m, v
    assert plan.tg.resident_bytes.tolist() == [2 * W_BYTES, 0, 0, 2 * NUMEL * 16]
    assert res.peak_memory[3] == 2 * NUMEL * 16 == host_memory_need_bytes(c, [2 * NUMEL])[0]
    plain, plain_res = run(c, 1, None)
    assert plain.tg.resident_bytes.tolist() == [2 * 3 * W_BYTES]           # weight, m, v
    # nor the update ops' outputs: they are made on the host
    ptr, _, _ = plan.tg.memory()
    steps = np.concatenate([update_tasks(plan, w, 0) for w in (1, 2)])
    assert np.all(ptr[steps + 1] == ptr[steps])
    assert res.peak_memory[0] - 2 * W_BYTES < plain_res.peak_memory[0] - 2 * 3 * W_BYTES
    # stages 0 and 2 mean the same on one device
    for stage in (0, 2):
        other, other_res = run(c, 1, stage)
        np.testing.assert_array_equal(other.tg.duration, plan.tg.duration)
        assert other_res.makespan == res.makespan


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_gpus_copy_their_shards_and_step_one_after_another_on_the_shared_host(stage):
    c = cluster(2)
    plan, res = run(c, 2, stage)
    f = 1.0 if stage == 0 else 0.5                            # each device's part of the state
    for w in (1, 2):
        down = [transfers(plan, GRAD[w], "pcie-down", d) for d in (0, 1)]
        up = [transfers(plan, WRITER[w], "pcie-up", d) for d in (0, 1)]
        # both GPUs of the server copy at once: k = 2 (the host memory, not PCIe 3.0, would bind at 96 GB/s)
        for t in down + up:
            assert plan.tg.duration[t] == pytest.approx(pcie_time_s(c, 0, f * W_BYTES, n_concurrent=2))
        # the gradient copied once final: after its all-reduce (stages 0-1) or reduce-scatter (stage 2)
        agg_kind = TaskKind.COLLECTIVE if stage == 2 else TaskKind.ALLREDUCE
        (agg,) = np.nonzero((plan.task_kind == agg_kind) & (plan.task_op == GRAD[w]))[0]
        assert res.start[down[0]] == res.start[down[1]] == pytest.approx(res.finish[agg])
        steps = np.concatenate([update_tasks(plan, w, d) for d in (0, 1)])
        np.testing.assert_allclose(plan.tg.duration[steps], host_optimizer_step_s(c, 0, f * NUMEL) / 5)
        # one host CPU: the two devices' steps never overlap, and end together after the two-way shared step
        iv = sorted(zip(res.start[steps], res.finish[steps]))
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(iv, iv[1:]))
        assert max(res.finish[steps]) - min(res.start[steps]) == pytest.approx(
            host_optimizer_step_s(c, 0, f * NUMEL, n_gpus_sharing=2))
        gathers = np.nonzero((plan.task_kind == TaskKind.COLLECTIVE) & (plan.task_op == WRITER[w]))[0]
        if stage:                                              # the halves gathered once both are up
            assert res.start[gathers[0]] == pytest.approx(max(res.finish[up]))
        else:                                                  # each device stepped the whole weight
            assert len(gathers) == 0
    # the weight, whole below stage 3 (gradients are allocated where made, the state is on the host)
    np.testing.assert_array_equal(plan.tg.resident_bytes[:2], [2 * W_BYTES] * 2)
    assert plan.tg.resident_bytes[-1] == 2 * 2 * f * NUMEL * 16                 # two devices, two weights


def test_the_host_memory_binds_when_many_gpus_copy_at_once():
    c = cluster(2, pcie={"bandwidth": "1000 GB/s", "latency_us": 5})
    plan, _ = run(c, 2, 1)
    down = transfers(plan, GRAD[1], "pcie-down", 0)
    b_host = 2 * 127.968e9 * 0.75
    assert plan.tg.duration[down] == pytest.approx(5e-6 + W_BYTES / 2 / (b_host / 2))


def test_a_plan_beyond_the_host_memory_is_out_of_memory_and_reports_what_the_host_holds():
    small = cluster(1, memory="0.000001 GB")                        # 1000 B: less than the 2 KiB of state
    ev = Evaluator(GRAPH, small, order="fifo")
    r = ev.evaluate(strategy(small, 1, 1))
    assert r.oom and r.host_memory_bytes == {"s": 2 * NUMEL * 16}
    assert all(r.peak_memory_bytes[d] <= r.memory_capacity_bytes[d] for d in r.peak_memory_bytes)
    assert r.record()["host_memory_bytes"] == {"s": 2 * NUMEL * 16}
    fits = Evaluator(GRAPH, cluster(1), order="fifo")
    assert not fits.evaluate(strategy(cluster(1), 1, 1)).oom
    assert fits.evaluate(strategy(cluster(1), 1, None)).host_memory_bytes == {}


def test_offloading_to_a_server_without_a_host_is_refused_naming_it():
    bare = cluster(2, host=None)
    with pytest.raises(StrategyError, match="group 0 offloads .* server 's', which has no 'host:' entry"):
        run(bare, 2, 2)
    run(bare, 2, 2, "none")                                         # sharding alone needs no host
    with pytest.raises(StrategyError, match="group 0 offloads .* server 's'"):
        run(bare, 2, 3, "parameters")


def test_offloaded_parameters_come_up_in_shards_before_each_gather_and_stay_on_the_host():
    c = cluster(2)
    plan, res = run(c, 2, 3, "parameters")
    kept, kept_res = run(c, 2, 3, "optimizer")
    up_s = pcie_time_s(c, 0, W_BYTES / 2, n_concurrent=2)            # each GPU's half, both GPUs at once
    names = plan.tg.resource_names
    for w, phases in ((1, 1), (2, 2)):          # W1 is read in forward only (the input needs no gradient)
        ups = [t for t in np.nonzero((plan.task_kind == TaskKind.TRANSFER) & (plan.task_op == w))[0]]
        gathers = np.nonzero((plan.task_kind == TaskKind.COLLECTIVE) & (plan.task_op == w))[0]
        assert len(ups) == 2 * phases and len(gathers) == phases
        assert sorted(names[int(plan.tg.task_resources(t)[0])] for t in ups) == \
            sorted([f"pcie-up:s/gpu{d}" for d in (0, 1)] * phases)
        np.testing.assert_allclose(plan.tg.duration[ups], up_s)
        for g in gathers:                        # each gather waits for its phase's two copies up
            mine = [t for t in ups if t in plan.tg.task_deps(g)]
            assert len(mine) == 2 and res.start[g] >= max(res.finish[mine]) - 1e-15
        # each copy holds the device's half until the phase's readers on it have run
        mem_ptr, mem_dev, mem_bytes = plan.tg.memory()
        for t in ups:
            assert mem_bytes[mem_ptr[t]:mem_ptr[t + 1]].tolist() == [W_BYTES // 2]
            readers = [v for v in range(plan.n_tasks) if t in plan.tg.task_deps(v)
                       and plan.task_kind[v] == TaskKind.COMPUTE]
            assert readers and res.release_time[t] >= max(res.finish[readers]) - 1e-15
        # the first gather is as fast as the copies allow
        assert res.start[gathers[0]] == pytest.approx(max(res.finish[ups[:2]]))
        # no copy up after the host step: the new rows stay on the host
        assert not np.any((plan.task_kind == TaskKind.TRANSFER) & (plan.task_op == WRITER[w]))
        assert np.any((kept.task_kind == TaskKind.TRANSFER) & (kept.task_op == WRITER[w]))
    # resident (gradients are made and freed within the step): nothing on the GPUs, where offloading the
    # optimizer state keeps the two weights' halves; the host holds the same bytes either way
    np.testing.assert_array_equal(plan.tg.resident_bytes[:2], [0, 0])
    np.testing.assert_array_equal(kept.tg.resident_bytes[:2], [W_BYTES] * 2)
    assert plan.tg.resident_bytes[-1] == kept.tg.resident_bytes[-1] == 2 * 2 * 0.5 * NUMEL * 16
    assert all(res.peak_memory[:2] < kept_res.peak_memory[:2])


def test_configs_state_where_offloading_means_something():
    ParallelConfig((0,), (B,), sharded=ShardedState(1, (1,), "optimizer"))
    with pytest.raises(StrategyError, match="stage 3 on one device shards nothing"):
        ParallelConfig((0,), (B,), sharded=ShardedState(3, (1,), "optimizer"))
    with pytest.raises(StrategyError, match="2\\+ replicas"):
        ParallelConfig((0,), (B,), sharded=ShardedState(1, (1,)))
    with pytest.raises(StrategyError, match="stage 0 shards nothing and offloads nothing"):
        ShardedState(0, (1, 1))
    with pytest.raises(StrategyError, match="needs stage 3"):
        ShardedState(2, (1, 1), "parameters")
    with pytest.raises(StrategyError, match="unknown offload 'gpu'"):
        ShardedState(2, (1, 1), "gpu")


def test_strategy_files_carry_the_offload_and_older_files_load():
    s = strategy(cluster(2), 2, 2)
    d = s.to_dict()
    assert d["version"] == STRATEGY_VERSION >= 7
    assert d["configs"][0]["sharded"] == {"stage": 2, "weights": [1, 1], "offload": "optimizer"}
    assert Strategy.from_dict(d).configs[0] == s.configs[0]
    plain = strategy(cluster(2), 2, 2, "none").to_dict()
    assert "offload" not in plain["configs"][0]["sharded"]
    assert Strategy.from_dict({**plain, "version": 6}).configs[0].sharded == ShardedState(2, (1, 1))


def test_patched_plans_equal_scratch_plans_when_offloading_changes():
    from tests.compiler.test_delta import assert_same_plan

    c = cluster(2)
    group_of = np.zeros(GRAPH.n_ops, dtype=np.int64)
    group_of[[1, 3, 4, 7, 14, *range(15, 20)]] = 1           # W1's layer in group 1, the rest in group 0
    rng = np.random.default_rng(1)
    comp = Compiler(GRAPH, c, cost_model(c), max_bases=4, delta_fraction=1.0)
    for _ in range(16):
        cfgs = []
        for _g in range(2):
            stage, offload = int(rng.integers(0, 4)), str(rng.choice(["none", "optimizer", "parameters"]))
            offload = "optimizer" if offload == "parameters" and stage < 3 else offload
            w = tuple(int(x) for x in rng.integers(1, 4, size=2))
            if stage == 0 and offload == "none":
                cfgs.append(ParallelConfig((0, 1), (2, 2)))
            elif rng.random() < 0.25 and offload != "none" and stage < 3:   # a group on one device alone
                d = int(rng.integers(0, 2))
                cfgs.append(ParallelConfig((d,), (B,), sharded=ShardedState(stage, (1,), offload)))
            else:
                cfgs.append(ParallelConfig((0, 1), (2, 2), sharded=ShardedState(stage, w, offload)))
        s = Strategy(GRAPH.fingerprint, c.name, 2, B, group_of, cfgs)
        assert_same_plan(comp.compile(s), compile_strategy(GRAPH, c, s, cost_model(c)))
    assert comp.n_patched > 0
