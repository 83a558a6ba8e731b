"""``heterog run`` under torchrun: each process names its device (``--node-devices``), rank 0 plans for the
devices present (the given plan on the cluster's own devices, a re-plan on any other set) and resumes from
the newest checkpoint of its own job (torchrun's run id), so that torchrun's restarts (``--max-restarts``)
and its rendezvous (nodes that leave or join) continue the run under a plan for the devices there are.

The planning step is checked in this process; ``make conformance`` (``HETEROG_SURVIVE_MORE=1``) launches
torchrun: two processes on two of local-cpu-3's devices, and a worker killed mid-run that torchrun restarts.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heterog.cli import build_parser
from heterog.errors import HeterogError
from heterog.runtime.checkpoint import CheckpointSettings

ROOT = Path(__file__).resolve().parents[2]
MORE = bool(os.environ.get("HETEROG_SURVIVE_MORE"))
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", "--model", "tiny_mlp", "--batch-size", "6", "--cluster",
                                      "local-cpu-3:slowdown=1,2,3", "--method", "cp-ar", "--lr", "0.1",
                                      "--replan-method", "ev-ps", *extra])


def test_rank_zero_plans_for_the_devices_the_ranks_name(tmp_path, monkeypatch) -> None:
    import heterog.cli.run as run
    from heterog.cli.run import _env_plan
    from heterog.runtime.api import train_single_process

    model_and_cluster = run._model(run_args("--steps", "4"))
    monkeypatch.setattr(run, "_model", lambda args: model_and_cluster)      # captured once
    args = run_args("--steps", "4")
    ck = CheckpointSettings(tmp_path, every_steps=2, job="job-a")
    names = ["localhost/cpu0", "localhost/cpu1", "localhost/cpu2"]
    model, prepared, resumed = _env_plan(args, ck, _elastic(), names)
    assert prepared.strategy.method == "cp-ar" and resumed is None          # the cluster's own devices: its plan
    model, prepared, _ = _env_plan(args, ck, _elastic(), ["localhost/cpu2", "localhost/cpu0"])
    assert prepared.cluster.device_names == ["localhost/cpu2", "localhost/cpu0"]     # device i is rank i's
    assert prepared.strategy.method == "ev-ps" and list(prepared.cluster.slowdown) == [3.0, 1.0]   # re-planned
    # a checkpoint of this job is resumed; one of another job is not
    train_single_process(model, [model.example_inputs], 2, checkpoint=ck)
    other = CheckpointSettings(tmp_path, every_steps=3, job="job-b")
    train_single_process(model, [model.example_inputs], 3, checkpoint=other)
    _, _, resumed = _env_plan(args, ck, _elastic(), names)
    assert resumed is not None and resumed.step == 2
    with pytest.raises(HeterogError, match="3 devices of .*name each node's devices with --node-devices"):
        _env_plan(args, ck, _elastic(), [None, None])
    with pytest.raises(HeterogError, match="some ranks name their device"):
        _env_plan(args, ck, _elastic(), ["localhost/cpu0", None])


def _elastic():
    from heterog.runtime.elastic import ElasticSettings

    return ElasticSettings(replan_method="ev-ps")


def test_restarts_under_torchrun_are_torchruns(capsys) -> None:
    from heterog.cli import main

    os.environ.update(RANK="0", WORLD_SIZE="1")
    try:
        rc = main(["run", "--model", "tiny_mlp", "--cluster", "local-cpu-2", "--method", "cp-ar", "--max-restarts",
                   "1"])
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]
    assert rc == 2 and "give --max-restarts to torchrun" in capsys.readouterr().err


def torchrun(args: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.2",
                             *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (Linux's /proc)."""
    try:
        direct = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return direct + [g for c in direct for g in children(c)]


def finish(p: subprocess.Popen) -> tuple[str, str]:
    """The output of torchrun ``p`` once it ends (killed, with its workers, if it has not in 10 minutes)."""
    try:
        return p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        for child in children(p.pid):
            os.kill(child, signal.SIGKILL)
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"torchrun did not end in 10 minutes: {err[-2000:]}") from None


def result_of(out: str) -> dict:
    return json.loads(out[out.index("{"):out.rindex("}") + 1])


@pytest.mark.skipif(not MORE, reason="make conformance (HETEROG_SURVIVE_MORE=1)")
def test_two_processes_on_two_of_three_devices_train_like_one(tmp_path) -> None:
    p = torchrun(["-m", "heterog", "run", "--model", "tiny_mlp", "--batch-size", "6", "--cluster", "local-cpu-3",
                  "--node-devices", "localhost/cpu2,localhost/cpu0", "--method", "cp-ar", "--steps", "3",
                  "--check-equivalence", "--replan-budget-s", "2", "--json"], tmp_path)
    out, err = finish(p)
    assert p.returncode == 0, err[-2000:]
    rec = result_of(out)
    assert rec["cluster"] == "local-cpu-3[localhost/cpu2,localhost/cpu0]" and rec["equivalent"] is True


@pytest.mark.skipif(not MORE, reason="make conformance (HETEROG_SURVIVE_MORE=1)")
def test_a_worker_killed_under_torchrun_is_restarted_from_the_jobs_checkpoint(tmp_path) -> None:
    steps = 40
    ck = tmp_path / "ck"
    p = torchrun(["--max-restarts", "1", "-m", "heterog", "run", "--model", "tiny_mlp", "--batch-size", "6",
                  "--cluster", "local-cpu-2:latency_us=20000", "--method", "cp-ar", "--steps", str(steps),
                  "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--check-equivalence", "--json"], tmp_path)
    deadline = time.monotonic() + 300
    while not (ck / "step-4").is_dir() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    workers = children(p.pid)
    assert workers and (ck / "step-4").is_dir()
    os.kill(workers[-1], signal.SIGKILL)
    out, err = finish(p)
    assert p.returncode == 0, err[-2000:]
    rec = result_of(out)
    assert rec["equivalent"] is True and rec["first_step"] >= 4 and len(rec["losses"]) == steps
    assert rec["first_step"] < steps, "the worker was killed after the run ended"
