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
                       lag: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Run the task graph given as CSR arrays; returns (start, finish, release_time, busy, peak).

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
    The allocation of task x is released once x and every task naming x in its ``frees`` have finished;
    an allocation nobody frees stays.
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
    holders = [0] * n  # tasks that must finish before the allocation of t is released
    for t in range(n):
        for x in frees[t]:
            holders[x] += 1
    for t in range(n):
        if holders[t] > 0:
            holders[t] += 1  # t itself

    start = [float("nan")] * n
    finish = [float("nan")] * n
    release_time = [float("inf")] * n
    resource_free = [True] * n_res
    allocated = [int(b) for b in resident_bytes]
    peak = list(allocated)

    def release_holder(x: int, now: float) -> None:
        holders[x] -= 1
        if holders[x] == 0:
            for r, b in mem[x]:
                allocated[r] -= b
            release_time[x] = now

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
                if holders[t] > 0:
                    release_holder(t, now)
                for x in frees[t]:
                    release_holder(x, now)
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
