"""Event-driven simulation of a TaskGraph: ``simulate`` and its result, ``SimResult``.

The default path is the compiled kernel; ``reference=True`` runs the plain-Python specification.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simulator import _kernel
from simulator.reference import simulate_reference
from simulator.taskgraph import TaskGraph


@dataclass(repr=False)
class SimResult:
    """Timeline and resource statistics of one simulated run.

    Shapes: start, finish, release_time, arrival (n_tasks,); busy, peak_memory (n_resources,).
    """

    makespan: float
    """Last arrival, the max over tasks of finish + lag (s; the last finish when no task has a lag); 0 for
    an empty graph."""
    start: np.ndarray
    """Start time per task (s)."""
    finish: np.ndarray
    """Finish time per task (s)."""
    busy: np.ndarray
    """Total time each resource is held by tasks (s)."""
    peak_memory: np.ndarray
    """Highest allocated bytes per resource over the run, resident bytes included (int64)."""
    oom: bool
    """Whether some resource with a capacity peaked above it."""
    oom_resources: list[int]
    """Ids of those resources."""
    release_time: np.ndarray
    """When each task's allocation was released (s; its last memory entry's); inf if never, or if it
    allocates nothing."""
    resource_names: list[str] = field(default_factory=list)
    _mem_ptr: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    _mem_res: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _mem_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _resident_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _mem_release: np.ndarray | None = None      # release time of each memory entry (s), inf if never
    arrival: np.ndarray | None = None
    """When each task's dependents see it done: finish + lag (s); None given means no lag (= finish)."""

    def __post_init__(self) -> None:
        if self.arrival is None:
            self.arrival = self.finish

    def utilization(self) -> np.ndarray:
        """Fraction of the makespan each resource is busy, shape (n_resources,)."""
        if self.makespan <= 0:
            return np.zeros_like(self.busy)
        return self.busy / self.makespan

    def memory_timeline(self, resource: int) -> tuple[np.ndarray, np.ndarray]:
        """Allocated bytes on ``resource`` over time as a step function (times_s, bytes).

        ``bytes[i]`` holds from ``times_s[i]`` until ``times_s[i + 1]``; the first point is (0, resident).
        Each point is the state after all events of that instant, so an allocation made and released at
        the same instant (a zero-duration task) shows in ``peak_memory`` but not here.
        """
        counts = np.diff(self._mem_ptr)
        owner = np.repeat(np.arange(len(counts)), counts)
        on = self._mem_res == resource
        task, nbytes = owner[on], self._mem_bytes[on]
        release = self.entry_release_time()[on]
        released = np.isfinite(release)
        times = np.concatenate([[0.0], self.start[task], release[released]])
        deltas = np.concatenate([[self._resident_bytes[resource]], nbytes, -nbytes[released]])
        order = np.argsort(times, kind="stable")
        times, level = times[order], np.cumsum(deltas[order])
        last_of_instant = np.append(times[1:] != times[:-1], True)
        return times[last_of_instant], level[last_of_instant]

    def entry_release_time(self) -> np.ndarray:
        """When each memory entry (``TaskGraph.memory`` order) was released (s); inf if never."""
        if self._mem_release is not None:
            return self._mem_release
        return np.repeat(self.release_time, np.diff(self._mem_ptr))

    def __repr__(self) -> str:
        return (f"SimResult(makespan={self.makespan:.6g} s, {len(self.start)} tasks, "
                f"{len(self.busy)} resources, oom={self.oom})")


def simulate(tg: TaskGraph, priority: np.ndarray | None = None, *, fifo: bool = False,
             reference: bool = False) -> SimResult:
    """Run ``tg`` with greedy list scheduling; ``priority`` overrides ``tg.priority`` for this run.

    A task starts when all its deps have arrived and all its resources are free, then holds them for its
    duration; it arrives ``tg.lag`` after it finishes (at once for lag 0). At each instant, finishes and
    arrivals are processed first (resources and memory releases at the finish, dependents at the
    arrival), then ready tasks are scanned by (higher priority, lower id) and every one whose resources
    are all free starts. Deterministic; ``reference=True`` runs the plain-Python specification, which gives
    bit-identical results. ``fifo=True`` ignores priorities: ready tasks are served in the order they became
    ready (ties by id), as a FIFO ready queue would.
    """
    n = tg.n_tasks
    if n >= 2**31 - 1:
        raise ValueError(f"the graph has {n} tasks; the simulator handles fewer than 2**31 - 1")
    if priority is None:
        priority = tg.priority
    else:
        priority = np.ascontiguousarray(priority, dtype=np.float64)
        if priority.shape != (n,):
            raise ValueError(f"priority has shape {priority.shape}, expected ({n},) for the graph's tasks")
    if np.isnan(priority).any():
        raise ValueError(f"priority of task {int(np.flatnonzero(np.isnan(priority))[0])} is NaN")
    res_ptr, res_idx = tg.resources()
    dep_ptr, dep_idx = tg.dependencies()
    mem_ptr, mem_res, mem_bytes = tg.memory()
    free_ptr, free_idx = tg.frees()
    free_entry = tg.free_entries()
    resident = tg.resident_bytes.copy()

    if reference:
        start, finish, entry_release, busy, peak = simulate_reference(
            tg.duration, priority, res_ptr, res_idx, dep_ptr, dep_idx, mem_ptr, mem_res, mem_bytes,
            free_ptr, free_idx, resident, fifo, tg.lag, free_entry)
    else:
        succ_ptr, succ_idx = tg.successors()
        start, finish, entry_release, busy, peak, n_started = _kernel.simulate_kernel(
            tg.duration, tg.lag, priority, res_ptr, res_idx, dep_ptr, succ_ptr, succ_idx, mem_ptr, mem_res,
            mem_bytes, free_ptr, free_idx, free_entry, resident, bool(fifo))
        if n_started != n:  # cannot happen for a graph built through TaskGraph (a DAG by construction)
            raise RuntimeError(f"simulation stalled: {n_started} of {n} tasks started")

    release_time = np.full(n, np.inf)
    counts = np.diff(mem_ptr)
    has = counts > 0
    if has.any():
        release_time[has] = np.maximum.reduceat(entry_release, mem_ptr[:-1][has])
    arrival = finish + tg.lag
    capacity = tg.memory_capacity_bytes
    over = (capacity >= 0) & (peak > capacity)
    return SimResult(
        makespan=float(arrival.max()) if n else 0.0, start=start, finish=finish, busy=busy,
        peak_memory=peak, oom=bool(over.any()), oom_resources=np.flatnonzero(over).tolist(),
        release_time=release_time, resource_names=tg.resource_names, _mem_ptr=mem_ptr, _mem_res=mem_res,
        _mem_bytes=mem_bytes, _resident_bytes=resident, arrival=arrival,
        _mem_release=entry_release)
