"""Chrome trace export and the Gantt chart of a simulated run.

The trace must be valid Chrome trace event JSON with one "X" event per (task, resource).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

import simulator


def _graph() -> simulator.TaskGraph:
    tg = simulator.TaskGraph()
    g0 = tg.add_resource("gpu0", memory_capacity_bytes=1000, resident_bytes=100)
    g1 = tg.add_resource("gpu1")
    link = tg.add_resource("link0")
    tg.add_resource("idle")
    a = tg.add_task([g0], duration=1e-3, mem={g0: 300}, name="fwd", cat="compute")
    b = tg.add_task([link, g1], duration=2e-3, deps=[a], frees=[a], name="send", cat="transfer")
    tg.add_task([], duration=0.0, deps=[b], name="barrier", cat="sync")
    return tg


def test_chrome_trace_events_and_file(tmp_path: Path) -> None:
    tg = _graph()
    res = simulator.simulate(tg)
    path = simulator.write_chrome_trace(tg, res, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 4  # fwd on gpu0, send on link0 and gpu1, barrier on the no-resource thread
    by_tid = {(e["name"], e["tid"]): e for e in spans}
    assert set(by_tid) == {("fwd", 0), ("send", 2), ("send", 1), ("barrier", 4)}
    send = by_tid[("send", 2)]
    assert send["ts"] == 1000.0 and send["dur"] == 2000.0 and send["cat"] == "transfer" and send["pid"] == 0
    assert by_tid[("fwd", 0)]["cat"] == "compute" and by_tid[("fwd", 0)]["args"] == {"task": 0}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {0: "gpu0", 1: "gpu1", 2: "link0", 3: "idle", 4: "(no resource)"}
    counters = [(e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C"]
    assert counters == [(0.0, 400), (3000.0, 100)]  # fwd's 300 B released when send finishes
    assert doc["otherData"]["makespan_s"] == res.makespan
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary file left behind


def test_chrome_trace_gzip_and_replacement(tmp_path: Path) -> None:
    tg = simulator.random_taskgraph(200, 2, 3, seed=1)
    res = simulator.simulate(tg)
    path = tmp_path / "sub" / "trace.json.gz"
    simulator.write_chrome_trace(tg, res, path, memory_counters=False)
    simulator.write_chrome_trace(tg, res, path, memory_counters=False)  # overwrites atomically
    doc = json.loads(gzip.decompress(path.read_bytes()))
    ptr, _ = tg.resources()
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == int(np.maximum(np.diff(ptr), 1).sum())
    assert not any(e["ph"] == "C" for e in doc["traceEvents"])


def test_plot_gantt_smoke(tmp_path: Path) -> None:
    tg = simulator.random_taskgraph(300, 3, 4, seed=2)
    res = simulator.simulate(tg)
    path = simulator.plot_gantt(tg, res, tmp_path / "gantt.png", title="random", max_tasks=100)
    assert path.stat().st_size > 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chrome_trace_span_is_the_duration_and_lag_is_an_arg(tmp_path: Path) -> None:
    tg = simulator.TaskGraph()
    link = tg.add_resource("link0")
    send = tg.add_task([link], duration=1e-3, lag=2e-3, name="send")
    tg.add_task([], duration=0.0, deps=[send], name="recv")
    res = simulator.simulate(tg)
    doc = json.loads(simulator.write_chrome_trace(tg, res, tmp_path / "trace.json").read_text())
    spans = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert spans["send"]["dur"] == 1000.0 and spans["send"]["args"] == {"task": 0, "lag_us": 2000.0}
    assert spans["recv"]["ts"] == 3000.0 and spans["recv"]["args"] == {"task": 1}
    assert doc["otherData"]["makespan_s"] == res.makespan == 3e-3
