"""Views of a simulated run: Chrome trace event JSON (chrome://tracing, Perfetto) and a Gantt chart PNG.

Both are written to a temporary file next to the target and renamed into place.
"""
from __future__ import annotations

import gzip
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from simulator.engine import SimResult
from simulator.taskgraph import TaskGraph


def _atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` for a temporary file next to ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp"))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def chrome_trace_events(tg: TaskGraph, res: SimResult, *, memory_counters: bool = True) -> list[dict]:
    """Trace events: one "X" event per (task, resource) on thread ``tid = resource`` (tasks without a
    resource on an extra thread), thread names, and memory counters per resource with allocations.
    A span covers the task's duration; a task with a lag also carries ``lag_us`` in its args."""
    names = tg.resource_names
    events: list[dict] = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "simulated iteration"}}]
    res_ptr, res_idx = tg.resources()
    counts = np.diff(res_ptr)
    no_resource_tid = len(names)
    for tid, name in enumerate(names + (["(no resource)"] if (counts == 0).any() else [])):
        events.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": name}})
        events.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    start_us = (res.start * 1e6).tolist()
    dur_us = ((res.finish - res.start) * 1e6).tolist()
    cat_names = tg.category_names
    cat = tg.task_category.tolist()
    ptr, idx = res_ptr.tolist(), res_idx.tolist()
    lag_us = (tg.lag * 1e6).tolist()
    for t in range(tg.n_tasks):
        base = {"ph": "X", "pid": 0, "ts": start_us[t], "dur": dur_us[t], "name": tg.task_name(t),
                "cat": cat_names[cat[t]] or "task",
                "args": {"task": t, "lag_us": lag_us[t]} if lag_us[t] > 0 else {"task": t}}
        for tid in idx[ptr[t]:ptr[t + 1]] or [no_resource_tid]:
            events.append(dict(base, tid=tid))
    if memory_counters:
        _, mem_res, _ = tg.memory()
        for r in range(len(names)):
            if tg.resident_bytes[r] == 0 and not (mem_res == r).any():
                continue
            for time_s, level in zip(*res.memory_timeline(r)):
                events.append({"ph": "C", "pid": 0, "name": f"memory {names[r]}", "ts": float(time_s) * 1e6,
                               "args": {"bytes": int(level)}})
    return events


def write_chrome_trace(tg: TaskGraph, res: SimResult, path: str | os.PathLike, *,
                       memory_counters: bool = True) -> Path:
    """Write the run as Chrome trace event JSON (gzip when ``path`` ends in .gz); returns the path."""
    doc = {"traceEvents": chrome_trace_events(tg, res, memory_counters=memory_counters),
           "displayTimeUnit": "ms", "otherData": {"makespan_s": res.makespan}}
    data = json.dumps(doc, separators=(",", ":")).encode()
    if str(path).endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    return _atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def plot_gantt(tg: TaskGraph, res: SimResult, path: str | os.PathLike, title: str = "",
               max_tasks: int = 20000) -> Path:
    """Gantt chart PNG: one row per resource that runs tasks (in resource order), bars coloured by task
    category, time in ms. Above ``max_tasks`` tasks only the longest ones are drawn (said in the title)."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    res_ptr, res_idx = tg.resources()
    counts = np.diff(res_ptr)
    shown = np.arange(tg.n_tasks)
    if tg.n_tasks > max_tasks:
        shown = np.sort(np.argsort(-(res.finish - res.start), kind="stable")[:max_tasks])
        title = f"{title} ({max_tasks} longest of {tg.n_tasks} tasks shown)".strip()
    task = np.repeat(np.arange(tg.n_tasks), counts)
    keep = np.isin(task, shown)
    task, resource = task[keep], res_idx[keep]
    rows = np.unique(res_idx)  # resources that hold any task, in resource order
    row_of = np.full(tg.n_resources, -1)
    row_of[rows] = np.arange(len(rows))
    cat = tg.task_category[task]
    cat_names = tg.category_names

    fig = Figure(figsize=(12, 1.2 + 0.28 * max(1, len(rows))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used = np.unique(cat)
    palette = colormaps["tab10" if len(used) <= 10 else "tab20"]
    colours = {int(code): palette(i % palette.N) for i, code in enumerate(used)}
    start_ms = res.start[task] * 1e3
    dur_ms = (res.finish[task] - res.start[task]) * 1e3
    for code in used:
        for r in np.unique(resource[cat == code]):
            sel = (cat == code) & (resource == r)
            y = row_of[r]
            ax.broken_barh(list(zip(start_ms[sel], dur_ms[sel])), (y - 0.4, 0.8),
                           facecolors=colours[code], linewidth=0)
    names = tg.resource_names
    ax.set_yticks(np.arange(len(rows)), [names[r] for r in rows], fontsize=7)
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)
    ax.set_xlim(0, max(res.makespan * 1e3, 1e-9))
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"makespan {res.makespan * 1e3:.3f} ms")
    if len(used):
        ax.legend(handles=[Patch(color=colours[int(c)], label=cat_names[c] or "task") for c in used],
                  loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    return _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
