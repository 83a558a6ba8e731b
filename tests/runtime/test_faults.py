"""Faults: a killed or hung worker stops the whole run quickly with a message naming the rank, leaving no
process behind; a failing op is reported first (rank, step, op, exception), before its peers' closed
connections; a strategy made for another graph or cluster is refused before any process starts."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from heterog import baselines
from heterog.cluster import load_cluster
from heterog.errors import StrategyError
from heterog.runtime import WorkerFailure, WorkerPool, prepare, run_prepared
from heterog.runtime.instructions import Compute, Zeros
from tests.runtime.conftest import model

LONG = 100_000          # steps: the run only ends by the fault


def _start_long_run(pool, cluster):
    m = model("tiny_mlp")
    prepared = prepare(m, cluster, baselines.run("ev-ar", m.graph, cluster))
    box: dict = {}

    def target() -> None:
        try:
            run_prepared(prepared, [m.example_inputs], LONG, pool=pool, return_state=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    while pool.status[0] < 2 and time.monotonic() < deadline:   # rank 0 is past step 2: training runs
        time.sleep(0.05)
    return th, box


def _all_gone(pool) -> bool:
    return all(not p.is_alive() for p in pool.procs)


def test_killed_worker_fails_the_run_naming_the_rank_and_its_signal() -> None:
    cluster = load_cluster("local-cpu-2")
    pool = WorkerPool(2, hang_timeout_s=30.0, device_names=cluster.device_names)
    th, box = _start_long_run(pool, cluster)
    os.kill(pool.procs[1].pid, signal.SIGKILL)
    th.join(timeout=30)
    assert isinstance(box.get("error"), WorkerFailure)
    msg = str(box["error"])
    assert "rank 1" in msg and "SIGKILL" in msg and "localhost/cpu1" in msg    # its death, not the 30 s timeout
    assert box["error"].lost == (1,)                                           # its device is lost to the run
    assert _all_gone(pool)
    with pytest.raises(Exception, match="closed"):
        pool.run([None, None])


def test_hung_worker_is_named_and_everything_is_stopped() -> None:
    cluster = load_cluster("local-cpu-2")
    pool = WorkerPool(2, hang_timeout_s=60.0, device_names=cluster.device_names)
    th, box = _start_long_run(pool, cluster)
    assert "error" not in box, box.get("error")
    # the short timeout only once training runs: setting up the job on a loaded machine can take seconds
    pool.hang_timeout_s = 2.0
    os.kill(pool.procs[1].pid, signal.SIGSTOP)
    th.join(timeout=30)
    assert isinstance(box.get("error"), WorkerFailure)
    assert "made no progress for 2 s" in str(box["error"]) and "localhost/cpu1 (rank 1)" in str(box["error"])
    assert 1 in box["error"].lost                   # the stuck rank (and any it left standing at the same place)
    assert _all_gone(pool)


def test_strategy_for_another_graph_or_cluster_is_refused_before_any_process_starts(hetero3) -> None:
    mlp, cnn = model("tiny_mlp"), model("tiny_cnn")
    before = set(multiprocessing.active_children())
    with pytest.raises(StrategyError, match="graph"):
        prepare(mlp, hetero3, baselines.run("ev-ar", cnn.graph, hetero3))
    two = load_cluster("local-cpu-2")
    with pytest.raises(StrategyError, match="cluster"):
        prepare(mlp, hetero3, baselines.run("ev-ar", mlp.graph, two))
    assert set(multiprocessing.active_children()) == before


def _break_first_compute(prepared, rank: int) -> str:
    """Feed the first forward compute of ``rank`` an input of the wrong shape; returns the op's target."""
    rp = prepared.lowered.ranks[rank]
    for k, ins in enumerate(rp.instrs):
        if isinstance(ins, Compute) and ins.inputs:
            bad = ins.inputs[0]._replace(source=Zeros((7, 5, 3), torch.float32, None))
            rp.instrs[k] = replace(ins, inputs=(bad, *ins.inputs[1:]))
            return prepared.model.prog.op_target[ins.op]
    raise AssertionError("no compute instruction")


def test_the_first_failure_is_reported_first_not_a_peers_closed_connection() -> None:
    """Rank 1's op fails in step 0; rank 0, waiting for it in an AllReduce, fails on the closed connection.
    The run names rank 1, the step, the op and its exception first; rank 0's error follows as a consequence."""
    cluster = load_cluster("local-cpu-2")
    m = model("tiny_mlp")
    prepared = prepare(m, cluster, baselines.run("ev-ar", m.graph, cluster))
    target = _break_first_compute(prepared, 1)
    pool = WorkerPool(2, hang_timeout_s=30.0, device_names=cluster.device_names)
    with pytest.raises(WorkerFailure) as info:
        run_prepared(prepared, [m.example_inputs], 2, pool=pool)
    msg = str(info.value)
    head = msg.splitlines()[0]
    assert head.startswith("worker localhost/cpu1 (rank 1) failed at rank 1, step 0, instruction")
    assert target in head and "RuntimeError" in head
    assert "in fx node" in msg                                   # the fx node that raised, with its inputs
    assert "Connection closed" not in head
    assert "(rank 0)" in msg.split("other ranks (consequences):")[1]       # the peer's error comes after
    assert info.value.lost == ()                        # an error raised is no lost device: nothing to re-plan
    assert _all_gone(pool)


def test_a_plan_that_cannot_run_is_refused_before_any_process_starts(monkeypatch) -> None:
    """prepare() runs every rank's program once in this process; an op that cannot run at its local batch
    is refused with the rank, the instruction, the op and the reason, and no worker is started."""
    import heterog.runtime.api as api

    cluster = load_cluster("local-cpu-2")
    m = model("tiny_mlp")
    real_lower = api.lower

    def broken_lower(*args, **kwargs):
        low = real_lower(*args, **kwargs)
        _break_first_compute(SimpleNamespace(lowered=low, model=m), 1)
        return low

    monkeypatch.setattr(api, "lower", broken_lower)
    before = set(multiprocessing.active_children())
    with pytest.raises(StrategyError, match=r"cannot run: rank 1 \(localhost/cpu1\), instruction \d+: compute op "
                                            r"\d+ \(aten.addmm.default.*RuntimeError"):
        prepare(m, cluster, baselines.run("ev-ar", m.graph, cluster))
    assert set(multiprocessing.active_children()) == before


def test_a_receive_ordered_before_its_send_is_refused() -> None:
    """A program whose order would make two ranks wait for each other is refused, naming the message."""
    from heterog.runtime.check import check_prepared

    cluster = load_cluster("local-cpu-2")
    m = model("tiny_mlp")
    prepared = prepare(m, cluster, baselines.run("cp-ps", m.graph, cluster))
    receiver = next(rp for rp in prepared.lowered.ranks if rp.recvs)
    sender = prepared.lowered.ranks[receiver.recvs[0][1]]
    receiver.keys = [(-1.0, -1, i) for i in range(len(receiver.keys))]   # all of it before the sender
    sender.keys = [(0.0, 0, i) for i in range(len(sender.keys))]
    with pytest.raises(StrategyError, match=r"message \d+ from rank \d is read before rank \d sends it"):
        check_prepared(prepared)


@pytest.mark.parametrize("name", ["tiny_transformer", "tiny_cnn"])
def test_large_steps_are_checked_on_fake_tensors(name, monkeypatch) -> None:
    """Steps above REAL_FLOPS_LIMIT are dry-run on fake tensors: a valid plan passes, a broken one is refused."""
    import heterog.runtime.check as check

    monkeypatch.setattr(check, "REAL_FLOPS_LIMIT", 0.0)
    cluster = load_cluster("local-cpu-3:slowdown=1,2,3")
    m = model(name)
    prepared = prepare(m, cluster, baselines.run("random", m.graph, cluster, seed=1), check=False)
    assert check.check_prepared(prepared) is None                  # fake tensors: no values, no error
    _break_first_compute(prepared, 1)
    with pytest.raises(StrategyError, match="cannot run: rank 1"):
        check.check_prepared(prepared)
