"""Plain-Python reference of the simulator: the specification the compiled kernel must match bit for bit.

Written for clarity, not speed; ``simulate(tg, reference=True)`` runs it.
"""
from __future__ import annotations

import heapq

import numpy as np


def simulate_reference(duration: np.ndarray, priority: np.ndarray, res_ptr: np.ndarray, res_idx: np.ndarray,
                       dep_ptr: np.ndarray, dep_idx: np.ndarray, mem_ptr: np.ndarray, mem_res: np.ndarray,
                       mem_bytes: np.ndarray, free_ptr: np.ndarray, free_idx: np.ndarray,
                       resident_bytes: np.ndarray, fifo: bool = False,
                       lag: np.ndarray | None = None, free_entry: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Run the task graph given as CSR arrays; returns (start, finish, release time of each memory entry,
    busy, peak).

    The rule, round by round at one time instant ``now``:
      1. scan the ready tasks in order (higher priority first, ties by lower id) and start every one whose
         resources are all free; it holds them for its duration and allocates its memory now;
      2. advance ``now`` to the earliest event time and process ALL events at that time, in (time, task id)
         order. A task's finish event frees its resources and releases allocations whose last holder it
         was; if its lag is 0 it also makes its dependents ready, otherwise it schedules the task's
         arrival event at ``finish + lag``, and the arrival makes the dependents ready;
      then scan again. Zero-duration tasks started at ``now`` finish at ``now`` and are processed in the
      next round at the same instant. So, at one instant, releases come before allocations.
    The lag models a message's latency: the sender's resources are busy for the duration only, and the
    data reaches the dependents a lag later. ``lag`` None means 0 for every task.
    Each memory entry of task x is released once x and every task naming it in its ``frees`` have
    finished (a free names all of x's entries, or with ``free_entry`` >= 0 the one at that position among
    them); an entry nobody frees stays.
    With ``fifo`` the priority of a task is minus the time it became ready (first ready, first served), set
    when it becomes ready; ``priority`` is ignored.
    """
    n = len(duration)
    n_res = len(resident_bytes)
    durations = duration.tolist()
    lags = [0.0] * n if lag is None else lag.tolist()
    priorities = [0.0] * n if fifo else priority.tolist()

    def segments(ptr: np.ndarray, idx: np.ndarray) -> list[list]:
        ptr_list, idx_list = ptr.tolist(), idx.tolist()
        return [idx_list[ptr_list[t]:ptr_list[t + 1]] for t in range(n)]

    resources = segments(res_ptr, res_idx)
    deps = segments(dep_ptr, dep_idx)
    frees = segments(free_ptr, free_idx)
    mem = [list(zip(r, b)) for r, b in zip(segments(mem_ptr, mem_res), segments(mem_ptr, mem_bytes))]

    busy = [0.0] * n_res
    for t in range(n):
        for r in resources[t]:
            busy[r] += durations[t]

    dependents: list[list[int]] = [[] for _ in range(n)]
    for t in range(n):
        for d in deps[t]:
            dependents[d].append(t)
    deps_left = [len(deps[t]) for t in range(n)]
    mem_ptr_list = mem_ptr.tolist()
    entry_of = free_entry.tolist() if free_entry is not None else [-1] * len(free_idx)
    free_entries = segments(free_ptr, np.asarray(entry_of, dtype=np.int64))

    def named(x: int, k: int) -> list[int]:
        lo, hi = mem_ptr_list[x], mem_ptr_list[x + 1]
        return list(range(lo, hi)) if k < 0 else [lo + k] if lo + k < hi else []

    holders = [0] * len(mem_res)  # tasks that must finish before a memory entry is released
    for t in range(n):
        for x, k in zip(frees[t], free_entries[t]):
            for jm in named(x, k):
                holders[jm] += 1
    for jm in range(len(mem_res)):
        if holders[jm] > 0:
            holders[jm] += 1  # its task itself
    entry_res, entry_bytes = mem_res.tolist(), mem_bytes.tolist()

    start = [float("nan")] * n
    finish = [float("nan")] * n
    release_time = [float("inf")] * len(mem_res)
    resource_free = [True] * n_res
    allocated = [int(b) for b in resident_bytes]
    peak = list(allocated)

    def release_holder(jm: int, now: float) -> None:
        if holders[jm] == 0:
            return
        holders[jm] -= 1
        if holders[jm] == 0:
            allocated[entry_res[jm]] -= entry_bytes[jm]
            release_time[jm] = now

    ready = [t for t in range(n) if deps_left[t] == 0]
    events: list[tuple[float, int]] = []  # heap of (time, task): finishes, then arrivals of lagged tasks
    finished = [False] * n  # finish processed, arrival still to come
    now = 0.0
    while True:
        ready.sort(key=lambda t: (-priorities[t], t))
        waiting = []
        for t in ready:
            if all(resource_free[r] for r in resources[t]):
                for r in resources[t]:
                    resource_free[r] = False
                for r, b in mem[t]:
                    allocated[r] += b
                    peak[r] = max(peak[r], allocated[r])
                start[t] = now
                finish[t] = now + durations[t]
                heapq.heappush(events, (finish[t], t))
            else:
                waiting.append(t)
        ready = waiting
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:
            _, t = heapq.heappop(events)
            if not finished[t]:  # the finish event
                finished[t] = True
                for r in resources[t]:
                    resource_free[r] = True
                for jm in named(t, -1):
                    release_holder(jm, now)
                for x, k in zip(frees[t], free_entries[t]):
                    for jm in named(x, k):
                        release_holder(jm, now)
                if lags[t] > 0:
                    heapq.heappush(events, (finish[t] + lags[t], t))
                    continue
            # t has arrived (at its finish when its lag is 0): its dependents see it done
            for s in dependents[t]:
                deps_left[s] -= 1
                if deps_left[s] == 0:
                    if fifo:
                        priorities[s] = -now
                    ready.append(s)
    return (np.asarray(start, dtype=np.float64), np.asarray(finish, dtype=np.float64),
            np.asarray(release_time, dtype=np.float64), np.asarray(busy, dtype=np.float64),
            np.asarray(peak, dtype=np.int64))
