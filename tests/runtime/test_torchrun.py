"""``heterog run`` under torchrun: each process names its device (``--node-devices``), rank 0 plans for the
devices present (the given plan on the cluster's own devices, a re-plan on any other set) and resumes from
the newest checkpoint of its own job (torchrun's run id), so that torchrun's restarts (``--max-restarts``)
and its rendezvous (nodes that leave or join) continue the run under a plan for the devices there are.

The planning step and the warning about agents that would stall on a joining node are checked in this
process; ``make conformance`` (``HETEROG_SURVIVE_MORE=1``) launches torchrun: two processes on two of
local-cpu-3's devices, a worker killed mid-run that torchrun restarts, and a third node that joins a
two-node job through the c10d rendezvous on loopback.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heterog.atomic import read_json
from heterog.cli import build_parser
from heterog.errors import HeterogError
from heterog.runtime.checkpoint import MARKER, CheckpointSettings, complete_checkpoints

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
    model, prepared, resumed, record = _env_plan(args, ck, _elastic(), names)
    assert prepared.strategy.method == "cp-ar" and resumed is None and record is None   # the cluster's own: its plan
    model, prepared, _, record = _env_plan(args, ck, _elastic(), ["localhost/cpu2", "localhost/cpu0"])
    assert prepared.cluster.device_names == ["localhost/cpu2", "localhost/cpu0"]     # device i is rank i's
    assert prepared.strategy.method == "ev-ps" and list(prepared.cluster.slowdown) == [3.0, 1.0]   # re-planned
    assert record is not None and record["devices"] == prepared.cluster.device_names
    assert (record["method"], record["chosen"], record["budget_s"]) == ("ev-ps", "ev-ps", 2.5)
    # a checkpoint of this job is resumed; one of another job is not
    train_single_process(model, [model.example_inputs], 2, checkpoint=ck)
    other = CheckpointSettings(tmp_path, every_steps=3, job="job-b")
    train_single_process(model, [model.example_inputs], 3, checkpoint=other)
    _, _, resumed, _ = _env_plan(args, ck, _elastic(), names)
    assert resumed is not None and resumed.step == 2
    with pytest.raises(HeterogError, match="3 devices of .*name each node's devices with --node-devices"):
        _env_plan(args, ck, _elastic(), [None, None])
    with pytest.raises(HeterogError, match="some ranks name their device"):
        _env_plan(args, ck, _elastic(), ["localhost/cpu0", None])


@pytest.mark.parametrize(("argv", "environ", "nodes", "stalls"), [
    (["torchrun", "--nnodes", "2:3", "-m", "heterog"], {"TORCHELASTIC_USE_AGENT_STORE": "True"}, (2, 3), True),
    (["torchrun", "--nnodes=1:4"], {"TORCHELASTIC_USE_AGENT_STORE": "True"}, (1, 4), True),
    (["torchrun", "--nnodes", "2:3"], {"TORCHELASTIC_USE_AGENT_STORE": "False"}, (2, 3), False),   # switched off
    (["torchrun", "--standalone"], {"TORCHELASTIC_USE_AGENT_STORE": "True"}, None, False),           # one node
    (["torchrun", "--nnodes", "2"], {"TORCHELASTIC_USE_AGENT_STORE": "True"}, (2, 2), False),        # fixed size
    (["torchrun"], {"TORCHELASTIC_USE_AGENT_STORE": "True", "PET_NNODES": "1:2"}, (1, 2), True),     # torchrun's env
    (["torchrun", "--nnodes", "a:b"], {"TORCHELASTIC_USE_AGENT_STORE": "True"}, None, False),
    ([], {}, None, False),                                                                          # no torchrun
])
def test_a_job_whose_agents_would_stall_on_a_joining_node_is_told(argv, environ, nodes, stalls) -> None:
    from heterog.runtime.launcher import joins_stall, nnodes_of

    assert nnodes_of(argv, environ) == nodes
    why = joins_stall(argv, environ)
    assert (why is not None) == stalls
    if stalls:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in why and f"{nodes[0]}:{nodes[1]}" in why


def _elastic():
    from heterog.runtime.elastic import ElasticSettings

    return ElasticSettings(replan_method="ev-ps", replan_budget_s=2.5)


def test_restarts_under_torchrun_are_torchruns(capsys) -> None:
    from heterog.cli import main

    os.environ.update(RANK="0", WORLD_SIZE="1")
    try:
        rc = main(["run", "--model", "tiny_mlp", "--cluster", "local-cpu-2", "--method", "cp-ar", "--max-restarts",
                   "1"])
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]
    assert rc == 2 and "give --max-restarts to torchrun" in capsys.readouterr().err


def torchrun(args: list[str], tmp_path: Path, launch: tuple[str, ...] = ("--standalone", "--nproc-per-node", "2"),
             **env: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([str(TORCHRUN), *launch, "--monitor-interval", "0.2", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (Linux's /proc)."""
    try:
        direct = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return direct + [g for c in direct for g in children(c)]


def stop(p: subprocess.Popen) -> None:
    """Kill torchrun ``p`` and its workers, if they still run."""
    for child in children(p.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.kill()


def finish(p: subprocess.Popen, timeout_s: float = 600) -> tuple[str, str]:
    """The output of torchrun ``p`` once it ends (killed, with its workers, if it has not in ``timeout_s``)."""
    try:
        return p.communicate(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        stop(p)
        out, err = p.communicate()
        raise AssertionError(f"torchrun did not end in {timeout_s:.0f} s: {err[-2000:]}") from None


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def term_pending(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM waiting (it is stopped), or is gone (Linux's /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    pending = int(next(line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:")), 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not MORE, reason="make conformance (HETEROG_SURVIVE_MORE=1)")
def test_a_node_that_joins_through_the_rendezvous_is_planned_for_and_the_run_resumes(tmp_path) -> None:
    """Two torchrun agents (one CPU device each, of local-cpu-4) start a job with --nnodes 2:3 on a c10d
    rendezvous on loopback. Once the two devices have written a checkpoint their workers are paused (SIGSTOP:
    training slower than a node starts, whatever the machine's load) and a third agent joins; the agents stop
    their workers (SIGTERM, delivered once they resume) and start a round of three, whose rank 0 re-plans for
    the three devices within the budget and resumes from the newest checkpoint; the run ends with the
    parameters of one process (dropout on)."""
    steps, budget, cluster = 24, 3.0, "local-cpu-4"
    ck = tmp_path / "ck"
    launch = ("--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{free_port()}", "--rdzv-id", f"join-{os.getpid()}", "--local-addr", "127.0.0.1",
              "--rdzv-conf", "last_call_timeout=1")

    def agent(device: str) -> subprocess.Popen:
        return torchrun(["-m", "heterog", "run", "--model", f"{ROOT}/tests/runtime/conformance_models.py:"
                         "build_dropout_net", "--batch-size", "6", "--cluster", cluster, "--node-devices", device,
                         "--method", "cp-ar", "--lr", "0.1", "--steps", str(steps), "--checkpoint-dir", str(ck),
                         "--checkpoint-every", "2", "--replan-budget-s", str(budget), "--hang-timeout-s", "300",
                         "--check-equivalence", "--json"], tmp_path, launch, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    deadline = time.monotonic() + 600
    agents = [agent("localhost/cpu0"), agent("localhost/cpu1")]
    paused: list[int] = []
    try:
        while not (ck / "step-2").is_dir() and time.monotonic() < deadline and all(p.poll() is None for p in agents):
            time.sleep(0.01)
        paused = [w for p in agents for w in children(p.pid)]
        for w in paused:
            os.kill(w, signal.SIGSTOP)
        assert (ck / "step-2").is_dir() and len(paused) == 2, "the two-device job wrote no checkpoint"
        agents.append(agent("localhost/cpu2"))
        while not all(term_pending(w) for w in paused) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(term_pending(w) for w in paused), "the agents did not stop their workers for the new node"
        for w in paused:
            os.kill(w, signal.SIGCONT)
        outputs = [finish(p, deadline - time.monotonic()) for p in agents]
    finally:
        for w in paused:
            try:
                os.kill(w, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for p in agents:
            if p.poll() is None:
                stop(p)
    assert [p.returncode for p in agents] == [0, 0, 0], "\n".join(err[-1500:] for _, err in outputs)
    (rec,) = [result_of(out) for out, _ in outputs if "{" in out]         # rank 0 of the last round prints it
    written = {step: read_json(path / MARKER)["plan"]["devices"] for step, path in complete_checkpoints(ck)}
    replan = rec["replan"]
    assert sorted(replan["devices"]) == ["localhost/cpu0", "localhost/cpu1", "localhost/cpu2"]
    assert rec["cluster"] == f"{cluster}[{','.join(replan['devices'])}]"
    assert replan["method"] == "auto" and replan["budget_s"] == budget and replan["chosen"] == rec["method"]
    # resumed from the newest checkpoint the two devices wrote; every later one is the three devices'
    assert 2 <= rec["first_step"] < steps
    assert rec["first_step"] == max(step for step, devices in written.items() if len(devices) == 2)
    assert all(len(written[step]) == 3 for step in written if step > rec["first_step"])
    assert rec["equivalent"] is True and len(rec["losses"]) == steps
