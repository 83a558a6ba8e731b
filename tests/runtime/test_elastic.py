"""Elastic runs (``heterog.runtime.elastic``): a worker killed with SIGKILL at a random step of a run on
local-cpu-3 under ``max_restarts=1`` is dropped with its device; the run re-plans for the two devices left
(within a budget of 5 s: ``auto`` or the shipped policy's zero-shot plan), resumes from its newest
checkpoint and ends with the parameters of single-process training, dropout on, for a torch model and a
transformers model. A device listed again in the devices file after its loss is used at the next re-plan.

``make conformance`` (``HETEROG_SURVIVE_MORE=1``) adds the device that comes back, killing twice.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from heterog import baselines
from heterog.errors import ClusterError
from heterog.replan import AUTO_PLANNERS
from heterog.runtime import capture_model_for_runtime, compare_values, train_single_process
from heterog.runtime.checkpoint import CheckpointSettings
from heterog.runtime.elastic import ElasticSettings, SurvivingRun, available_devices
from tests.runtime import transformers_models as tm
from tests.runtime.test_conformance import ATOL, RTOL, captured, cluster_of

MORE = bool(os.environ.get("HETEROG_SURVIVE_MORE"))
STEPS = 12
EVERY = 3


def test_the_devices_to_use_after_losses_and_returns(tmp_path) -> None:
    full = cluster_of("local-cpu-3")
    cpu = full.device_names
    assert available_devices(full, {cpu[1]: 10.0}, None) == ([cpu[0], cpu[2]], [])
    listing = tmp_path / "devices"
    assert available_devices(full, {cpu[1]: 10.0}, listing) == ([cpu[0], cpu[2]], [])     # no file yet
    listing.write_text(f"{cpu[2]}\n{cpu[1]}\n# a comment\n")
    os.utime(listing, (100.0, 100.0))
    assert available_devices(full, {cpu[1]: 50.0}, listing) == ([cpu[1], cpu[2]], [cpu[1]])   # back; cpu0 unlisted
    assert available_devices(full, {cpu[1]: 150.0}, listing) == ([cpu[2]], [])      # listed before it was lost
    listing.write_text("localhost/gpu7\n")
    with pytest.raises(ClusterError, match="names localhost/gpu7, not devices of cluster"):
        available_devices(full, {}, listing)


def kill_at(run: SurvivingRun, rank: int, step: int, killed: list) -> threading.Thread:
    """Kill ``rank``'s worker of ``run``'s first pool with SIGKILL once that rank has reached ``step``."""
    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pool = run.pool
            if pool is not None and not pool.closed and pool.status[3 * rank] >= step:
                killed.append((rank, int(pool.status[3 * rank])))
                os.kill(pool.procs[rank].pid, signal.SIGKILL)
                return
            time.sleep(0.002)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    return th


def assert_survives_a_killed_worker(m, method: str, seed: int, tmp_path: Path, **elastic) -> None:
    """Kill a random worker at a random step of a ``STEPS``-step run on local-cpu-3 (checkpoints every
    ``EVERY`` steps): the run ends on the two devices left, equal to single-process training."""
    rng = random.Random(seed)
    rank, step = rng.randrange(3), rng.randrange(1, STEPS - 5)
    cluster = cluster_of("local-cpu-3")
    want_losses, want = train_single_process(m, [m.example_inputs], STEPS)
    run = SurvivingRun(m, cluster, baselines.run(method, m.graph, cluster), [m.example_inputs], STEPS,
                       checkpoint=CheckpointSettings(tmp_path, every_steps=EVERY),
                       elastic=ElasticSettings(max_restarts=1, replan_budget_s=5.0, **elastic))
    killed: list = []
    kill_at(run, rank, step, killed)
    result = run.run()
    assert killed, "the worker was not killed"
    (restart,) = result.restarts
    lost = cluster.device_names[rank]
    left = [d for d in cluster.device_names if d != lost]
    assert restart["lost"] == [lost] and restart["devices"] == left and result.cluster.endswith(f"[{','.join(left)}]")
    assert restart["reached_step"] >= killed[0][1]
    # the newest complete checkpoint: work lost is at most the steps since it (one being written may be lost)
    assert restart["resumed_from"] % EVERY == 0 and 0 <= restart["reached_step"] - restart["resumed_from"] <= EVERY
    assert restart["replan"]["budget_s"] == 5.0 and restart["method"] in AUTO_PLANNERS
    assert result.first_step == restart["resumed_from"]
    ok, diff, bad = compare_values(m, result.values, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{m.name}: {bad[:4]} differ after the restart (max |diff| {diff:.3g})"
    assert result.losses == pytest.approx(want_losses, rel=RTOL)


def test_a_killed_worker_is_dropped_and_the_run_ends_on_a_new_plan(tmp_path) -> None:
    """dropout_net under cp-ar; the re-plan is ``auto``: the best of the planners that fit 5 s."""
    m = captured("dropout_net")
    assert any(op.draws for op in m.graph.ops)
    assert_survives_a_killed_worker(m, "cp-ar", 0, tmp_path)


def test_a_transformers_model_survives_under_the_policys_zero_shot_plan(tmp_path) -> None:
    """BERT (dropout on, keyword inputs) under ev-ar; the re-plan is the shipped policy's zero-shot plan."""
    module, inputs = tm.build_bert(12)
    m = capture_model_for_runtime(module, inputs, lr=0.1, name="bert")
    assert any(op.draws for op in m.graph.ops)
    assert_survives_a_killed_worker(m, "ev-ar", 1, tmp_path, replan_method="agent")


@pytest.mark.skipif(not MORE, reason="make conformance (HETEROG_SURVIVE_MORE=1)")
def test_a_device_listed_again_is_used_at_the_next_re_plan(tmp_path) -> None:
    """cpu2 is killed, the devices file then lists all three again; cpu1 is killed next: the run goes on
    on cpu0 and cpu2, and ends equal to single-process training."""
    m = captured("dropout_net")
    cluster = cluster_of("local-cpu-3")
    names = cluster.device_names
    listing = tmp_path / "devices"
    want_losses, want = train_single_process(m, [m.example_inputs], 2 * STEPS)
    run = SurvivingRun(m, cluster, baselines.run("cp-ar", m.graph, cluster), [m.example_inputs], 2 * STEPS,
                       checkpoint=CheckpointSettings(tmp_path / "ck", every_steps=EVERY),
                       elastic=ElasticSettings(max_restarts=2, replan_budget_s=5.0, devices_file=listing))
    killed: list = []

    def second() -> None:
        while len(run.restarts) < 1:
            time.sleep(0.01)
        listing.write_text("\n".join(names) + "\n")
        while run.pool is None or run.pool.world != 2:
            time.sleep(0.01)
        pool = run.pool
        while pool.status[3] < STEPS + 2 and not pool.closed:
            time.sleep(0.002)
        killed.append(1)
        os.kill(pool.procs[1].pid, signal.SIGKILL)           # cpu1: rank 1 of the two

    kill_at(run, 2, 2, killed)
    threading.Thread(target=second, daemon=True).start()
    result = run.run()
    first, again = result.restarts
    assert first["lost"] == [names[2]] and first["devices"] == names[:2]
    assert again["lost"] == [names[1]] and again["back"] == [names[2]] and again["devices"] == [names[0], names[2]]
    ok, diff, bad = compare_values(m, result.values, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{bad[:4]} differ (max |diff| {diff:.3g})"
    assert result.losses == pytest.approx(want_losses, rel=RTOL)
