"""Sharded and offloaded state in the runtime (``heterog.runtime.state_lowering``), checked by hand on a two-layer
MLP trained with Adam on two ranks: which collectives each rank runs at each ZeRO stage, the bytes each holds
from step to step, where offloaded state lives and in which order its copies run, and that every such plan
trains exactly as one process does."""
from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
from torch import nn

from heterog.cluster import load_cluster
from heterog.compiler import TaskKind
from heterog.evaluate import Evaluator
from heterog.runtime import capture_model_for_runtime, compare_values, prepare, run_prepared, train_single_process
from heterog.runtime.check import metered_ranks
from heterog.runtime.instructions import AllGather, AllReduce, Compute, Copy, Env, ReduceScatter, Stash
from heterog.runtime.state_lowering import master_name
from heterog.sharded import ShardedState
from heterog.strategy import ParallelConfig, Strategy

STEPS = 3
CLUSTER = "local-cpu-2:slowdown=1,2:host=Xeon-Gold-6148"
WEIGHTS = (1, 2)


class Mlp(nn.Module):
    """Linear(4, 6), ReLU, Linear(6, 3) and a mean squared error: parameters of 24, 6, 18 and 3 floats."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


@functools.cache
def mlp():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g))
    return capture_model_for_runtime(Mlp(), inputs, optimizer="adam", lr=0.1, name="mlp")


@functools.cache
def cluster():
    return load_cluster(CLUSTER)


def whole_graph(config: ParallelConfig) -> Strategy:
    m = mlp()
    return Strategy(m.graph.fingerprint, cluster().name, 2, m.batch_size, np.zeros(m.graph.n_ops, dtype=np.int64),
                    [config])


def data_parallel(stage: int | None, offload: str = "none") -> Strategy:
    """Even AllReduce data parallelism over both ranks, its state in shards of weights 1:2 at ``stage``."""
    held = None if stage is None else ShardedState(stage, WEIGHTS, offload)
    return whole_graph(ParallelConfig((0, 1), (3, 3), sharded=held))


def persistent_bytes(prepared, host: bool) -> list[int]:
    """Per rank, the bytes of the values it keeps from step to step (in host memory: ``host``)."""
    out = []
    for job in prepared.jobs([mlp().example_inputs], 1):
        rp = job.rank
        out.append(sum(v.numel() * v.element_size() for k, v in rp.persist.items() if (k in rp.host) == host))
    return out


def trains_like_one_process(prepared, pool):
    """``prepared`` run for STEPS steps on ``pool``: its values and losses those of one process; the result."""
    m = mlp()
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=pool)
    losses, want = train_single_process(m, [m.example_inputs], STEPS)
    ok, diff, bad = compare_values(m, result.values, want, rtol=1e-5, atol=1e-6)
    assert ok, f"{bad} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    return result, want


def counts(rp) -> dict[str, int]:
    kinds = (AllReduce, AllGather, ReduceScatter)
    return {k.__name__: sum(isinstance(ins, k) for ins in rp.instrs) for k in kinds}


# rows of dim 0 per rank under weights 1:2 (split_shares_of): a.weight (6, 4) and a.bias (6,) 2 and 4 rows,
# b.weight (3, 6) and b.bias (3,) 1 and 2 rows; per rank that is 2*4 + 2 + 6 + 1 = 17 and 34 of the 51 floats.
# Persistent bytes: the whole parameters 51 x 4 = 204 B (stage 3: their rows, 68 and 136 B), Adam's two moments
# over the rows held (2 x 17 x 4 = 136 and 272 B; unsharded 2 x 204 = 408 B), four step counters of 4 B.
HAND = {
    None: ({"AllReduce": 4, "AllGather": 0, "ReduceScatter": 0}, [204 + 408 + 16] * 2),
    1: ({"AllReduce": 4, "AllGather": 4, "ReduceScatter": 0}, [204 + 136 + 16, 204 + 272 + 16]),
    2: ({"AllReduce": 0, "AllGather": 4, "ReduceScatter": 4}, [204 + 136 + 16, 204 + 272 + 16]),
    # stage 3 gathers the four parameters for forward and b.weight again for backward (the input gradient of the
    # second layer reads it; the first layer's input needs no gradient)
    3: ({"AllReduce": 0, "AllGather": 5, "ReduceScatter": 4}, [68 + 136 + 16, 136 + 272 + 16]),
}


@pytest.mark.parametrize("stage", [None, 1, 2, 3], ids=["unsharded", "stage1", "stage2", "stage3"])
def test_the_mlp_runs_the_collectives_and_holds_the_bytes_worked_out_by_hand(stage, pool2) -> None:
    m = mlp()
    prepared = prepare(m, cluster(), data_parallel(stage))
    want_counts, want_bytes = HAND[stage]
    assert [counts(rp) for rp in prepared.lowered.ranks] == [want_counts] * 2
    assert persistent_bytes(prepared, host=False) == want_bytes
    for rp in prepared.lowered.ranks:                  # shards of uneven rows: 1:2 of each parameter's dim 0
        for ins in rp.instrs:
            if isinstance(ins, ReduceScatter):
                assert ins.need.placement == "S0" and ins.need.shares in ((2, 4), (1, 2))
            if isinstance(ins, AllGather):
                assert [shape[0] for _, shape in ins.parts] in ([2, 4], [1, 2])
    result, want = trains_like_one_process(prepared, pool2)
    for ph, v in result.values.items():            # the state, put back together from its rows, is the same too
        torch.testing.assert_close(v, want[ph], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "none"), (1, "optimizer"), (2, "optimizer"),
                                          (3, "optimizer")])
def test_a_new_parameter_lands_in_the_old_ones_buffer(stage, offload) -> None:
    """A parameter's next value is gathered (stages 1-2) and copied up (offloaded state) into the old parameter,
    as ZeRO's all-gather and copy up write into the parameter and as the simulator counts it (the gather lands
    in the resident parameter): at the step's end each rank's device holds what it keeps from step to step and
    the 36 B that the data-parallel plan holds there too (the loss and its terms), not the old parameters beside
    the new ones (204 B more; 68 and 136 B of stage 3's rows)."""
    m = mlp()
    base = prepare(m, cluster(), data_parallel(None), check=False)
    assert [ex.memory.live for ex in metered_ranks(base)] == [b + 36 for b in persistent_bytes(base, host=False)]
    prepared = prepare(m, cluster(), data_parallel(stage, offload), check=False)
    assert [ex.memory.live for ex in metered_ranks(prepared)] == \
        [b + 36 for b in persistent_bytes(prepared, host=False)]


def test_every_collective_of_sharded_state_runs_at_the_key_of_the_compilers_task() -> None:
    """The runtime's order is the simulated one: each reduce-scatter and all-gather of stage 3 runs at the
    (start, id) key of a COLLECTIVE task of the compiled plan, the same on both ranks."""
    m = mlp()
    ev = Evaluator(m.graph, cluster())
    plan = ev.compile(data_parallel(3))
    start = ev.simulate_plan(plan).start
    prepared = prepare(m, cluster(), data_parallel(3))
    keys = []
    for rp in prepared.lowered.ranks:
        mine = [key for key, ins in zip(rp.keys, rp.instrs) if isinstance(ins, (AllGather, ReduceScatter))]
        for key in mine:
            t = int(key[1])
            assert plan.task_kind[t] == TaskKind.COLLECTIVE and key[0] == pytest.approx(float(start[t]))
        keys.append(mine)
    assert keys[0] == keys[1] and len(set(k[1] for k in keys[0])) == 9


def test_offloaded_state_lives_on_the_host_and_its_update_runs_between_the_copies(pool2) -> None:
    """Stage 1 with the optimizer state offloaded: per rank the host holds the master rows of each parameter and
    Adam's moments over them (rank 0: (17 + 2 x 17) x 4 = 204 B, rank 1: 408 B), the device the whole parameters
    and the step counters (204 + 16 B). Per parameter the gradient's rows are copied down, the update runs on the
    host, the new rows are copied up, then gathered; training is exact."""
    m = mlp()
    prepared = prepare(m, cluster(), data_parallel(1, "optimizer"))
    assert persistent_bytes(prepared, host=True) == [204, 408]
    assert persistent_bytes(prepared, host=False) == [220, 220]
    for rp in prepared.lowered.ranks:
        assert set(rp.host) == {master_name(ph) for ph in m.prog.placeholders[:4]} | {
            ph for ph, (_, slot) in zip(m.prog.placeholders[4:], m.prog.state_names) if slot != "step"}
        on_host = {Env(k) for k in rp.host}            # what lives in host memory so far
        ups, gathers = [], []
        for ins in rp.instrs:
            if isinstance(ins, Copy) and ins.to_host:
                on_host.add(Stash(ins.key))
            elif isinstance(ins, Compute) and ins.host:    # the host update reads host memory only
                assert all(inp.source in on_host for inp in ins.inputs), ins
                on_host |= {Env(name) for name in ins.exports}
            elif isinstance(ins, Copy):
                assert ins.source in on_host                # a new parameter's rows, copied up
                ups.append(Stash(ins.key))
            elif isinstance(ins, AllGather):
                assert ins.source in ups                    # gathered from the rows copied up
                gathers.append(ins)
        assert len(ups) == len(gathers) == 4
    trains_like_one_process(prepared, pool2)


def test_the_copies_of_offloaded_state_run_at_the_keys_of_the_compilers_transfers() -> None:
    """Each copy down of a gradient and each copy up of a parameter runs at the (start, id) key of a TRANSFER
    task of the compiled plan (the PCIe copies the simulator prices) on that rank's device."""
    m = mlp()
    ev = Evaluator(m.graph, cluster())
    strategy = data_parallel(2, "optimizer")
    plan = ev.compile(strategy)
    prepared = prepare(m, cluster(), strategy)
    for rp in prepared.lowered.ranks:
        copies = [(key, ins) for key, ins in zip(rp.keys, rp.instrs) if isinstance(ins, Copy)]
        priced = [key for key, ins in copies if len(key) >= 2 and plan.task_kind[int(key[1])] == TaskKind.TRANSFER]
        assert len(priced) == 8                          # 4 gradients' rows down, 4 parameters' rows up
        assert all(plan.task_device[int(key[1])] == rp.rank for key in priced)


def test_zero_offload_on_one_device_trains_like_one_process(pool2) -> None:
    """Stage 0 on one device (ZeRO-Offload on one GPU): the whole state on the host, exact."""
    m = mlp()
    strategy = whole_graph(ParallelConfig((1,), (6,), sharded=ShardedState(0, (1,), "optimizer")))
    prepared = prepare(m, cluster(), strategy)
    assert persistent_bytes(prepared, host=True) == [0, 204 + 408]
    result, _ = trains_like_one_process(prepared, pool2)
    measured = result.measured_peak_memory_bytes[cluster().device_names[1]]
    assert measured >= 204 + 16                        # the device keeps the parameters and step counters


def test_offloaded_parameters_live_on_the_host_and_come_up_in_rows_before_each_gather(pool2) -> None:
    """Stage 3 with the parameters offloaded: per rank the host holds the parameter's rows themselves (no other
    master copy) and Adam's moments over them (rank 0: 17 x 4 + 2 x 17 x 4 = 204 B, rank 1: 408 B), the device only
    the four step counters (16 B). Before each of the five gathers (four in forward, b.weight again in backward)
    each rank copies its rows up, at the key of the compiler's copy up on its device; the update runs on the host
    and nothing is copied up after it; training is exact."""
    m = mlp()
    strategy = data_parallel(3, "parameters")
    ev = Evaluator(m.graph, cluster())
    plan = ev.compile(strategy)
    names = plan.tg.resource_names
    prepared = prepare(m, cluster(), strategy)
    assert persistent_bytes(prepared, host=True) == [204, 408]
    assert persistent_bytes(prepared, host=False) == [16, 16]
    for rp in prepared.lowered.ranks:
        assert set(rp.host) == set(m.prog.placeholders[:4]) | {
            ph for ph, (_, slot) in zip(m.prog.placeholders[4:], m.prog.state_names) if slot != "step"}
        ups: dict[Stash, tuple] = {}
        gathers = []
        for key, ins in zip(rp.keys, rp.instrs):
            if isinstance(ins, Copy) and not ins.to_host:
                assert ins.source in {Env(k) for k in rp.host}            # the rows held on the host
                t = int(key[1])
                assert plan.task_kind[t] == TaskKind.TRANSFER and names[int(plan.tg.task_resources(t)[0])] == \
                    f"pcie-up:{cluster().device_names[rp.rank]}"
                ups[Stash(ins.key)] = key
            elif isinstance(ins, AllGather):
                assert ins.source in ups and ups[ins.source] < key         # gathered from the rows just copied up
                gathers.append(ins)
        assert len(ups) == len(gathers) == 5
    trains_like_one_process(prepared, pool2)
