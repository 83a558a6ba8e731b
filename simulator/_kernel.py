"""Numba-compiled kernels of the simulator: batch validation, CSR transpose and the event-driven list scheduler.

Compiled lazily on first use and cached on disk; ``simulator.reference`` is the specification they must match.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# Error codes of ``validate_batch`` (turned into messages by TaskGraph.add_tasks).
OK = 0
BAD_DURATION = 1
NAN_PRIORITY = 2
BAD_RESOURCE = 3
DUPLICATE_RESOURCE = 4
BAD_DEPENDENCY = 5
BAD_FREE = 6
BAD_MEM_RESOURCE = 7
NEGATIVE_MEM = 8
BAD_LAG = 9


@njit(cache=True)
def validate_batch(first_id, n_res, duration, lag, priority, res_ptr, res_idx, dep_ptr, dep_idx,
                   mem_ptr, mem_res, mem_bytes, free_ptr, free_idx):  # pragma: no cover - compiled
    """First problem in a batch of new tasks as (code, batch position, entry index), code 0 if none."""
    for i in range(duration.shape[0]):
        t = first_id + i
        d = duration[i]
        if not (d >= 0.0 and d < np.inf):
            return BAD_DURATION, i, i
        g = lag[i]
        if not (g >= 0.0 and g < np.inf):
            return BAD_LAG, i, i
        if np.isnan(priority[i]):
            return NAN_PRIORITY, i, i
        for j in range(res_ptr[i], res_ptr[i + 1]):
            r = res_idx[j]
            if r < 0 or r >= n_res:
                return BAD_RESOURCE, i, j
            for j2 in range(res_ptr[i], j):
                if res_idx[j2] == r:
                    return DUPLICATE_RESOURCE, i, j
        for j in range(dep_ptr[i], dep_ptr[i + 1]):
            if dep_idx[j] < 0 or dep_idx[j] >= t:
                return BAD_DEPENDENCY, i, j
        for j in range(free_ptr[i], free_ptr[i + 1]):
            if free_idx[j] < 0 or free_idx[j] > t:
                return BAD_FREE, i, j
        for j in range(mem_ptr[i], mem_ptr[i + 1]):
            if mem_res[j] < 0 or mem_res[j] >= n_res:
                return BAD_MEM_RESOURCE, i, j
            if mem_bytes[j] < 0:
                return NEGATIVE_MEM, i, j
    return OK, -1, -1


@njit(cache=True)
def transpose_csr(ptr, idx, n):  # pragma: no cover - compiled
    """Reverse the edges of a CSR adjacency over ``n`` nodes; each output row is in increasing source order."""
    out_ptr = np.zeros(n + 1, dtype=np.int64)
    for e in range(idx.shape[0]):
        out_ptr[idx[e] + 1] += 1
    for v in range(n):
        out_ptr[v + 1] += out_ptr[v]
    pos = out_ptr[:n].copy()
    out_idx = np.empty(idx.shape[0], dtype=np.int64)
    for u in range(n):
        for e in range(ptr[u], ptr[u + 1]):
            v = idx[e]
            out_idx[pos[v]] = u
            pos[v] += 1
    return out_ptr, out_idx


@njit(cache=True)
def simulate_kernel(duration, lag, priority, res_ptr, res_idx, dep_ptr, succ_ptr, succ_idx, mem_ptr,
                    mem_res, mem_bytes, free_ptr, free_idx, resident_bytes, fifo):  # pragma: no cover - compiled
    """Greedy list scheduling of a task DAG on exclusive resources; the same rule as the reference.

    Ready tasks wait in one binary heap of candidates ordered by (-priority, id). A candidate that finds a
    resource busy is parked on that resource's pairing heap (same order) and comes back only when the
    resource frees: until then a full scan of the ready tasks would skip it anyway. A freed resource
    contributes only its best waiter at a time, the next one after that waiter is handled, so candidates
    are drawn in global priority order and the starts equal those of the reference's full scan.
    Every heap operation is written out once, inline: helper calls taking arrays would cost reference
    counting in the hot loop.
    With ``fifo`` a task's priority is minus the time it became ready (first ready, first served; ties by
    id), assigned when it becomes ready; ``priority`` is then ignored.
    One binary heap of events keyed by (``finish``, id) holds running tasks; a task with ``lag`` > 0, once
    its finish is processed (resources and memory), goes back in at its arrival ``finish + lag``, and only
    that second event makes its dependents ready. While it waits for that, ``finish`` holds its arrival
    (the heap's key) and ``sent_at`` its finish, put back when it arrives: lag-free tasks cost one read.
    Returns (start, finish, release_time, busy, peak, n_started).
    """
    n = duration.shape[0]
    if fifo:
        priority = np.zeros(n, dtype=np.float64)
    n_res = resident_bytes.shape[0]
    pending = np.empty(n, dtype=np.int32)  # dependencies not arrived yet (finish + lag)
    refcount = np.zeros(n, dtype=np.int32)  # tasks that must finish before t's allocation is released
    for j in range(free_idx.shape[0]):
        refcount[free_idx[j]] += 1
    busy = np.zeros(n_res, dtype=np.float64)
    for t in range(n):
        pending[t] = dep_ptr[t + 1] - dep_ptr[t]
        if refcount[t] > 0:
            refcount[t] += 1  # the task itself
        for j in range(res_ptr[t], res_ptr[t + 1]):  # task-id order, as in the reference
            busy[res_idx[j]] += duration[t]

    start = np.empty(n, dtype=np.float64)
    finish = np.empty(n, dtype=np.float64)
    release_time = np.full(n, np.inf)
    allocated = resident_bytes.copy()
    peak = resident_bytes.copy()
    held = np.zeros(n_res, dtype=np.bool_)
    wait_root = np.full(n_res, -1, dtype=np.int32)  # pairing heap of parked tasks per resource
    child = np.empty(n, dtype=np.int32)
    sib = np.empty(n, dtype=np.int32)
    pairs = np.empty(n + 1, dtype=np.int32)  # scratch of the pairing heap's two-pass pop
    source = np.empty(n, dtype=np.int32)  # resource whose waiters a candidate came from, or -1
    cand = np.empty(n, dtype=np.int32)  # binary heap of candidates
    n_cand = 0
    staged = np.empty(n, dtype=np.int32)  # tasks to put into the candidate heap
    n_staged = 0
    promote = np.empty(2 * n_res + 1, dtype=np.int64)  # resources whose best waiter should be staged
    n_promote = 0
    events = np.empty(n, dtype=np.int32)  # binary heap of tasks by (finish, id): finishes and arrivals
    n_events = 0
    sent = np.zeros(n, dtype=np.bool_)  # a task with lag > 0 whose finish is processed (arrival pending)
    sent_at = np.empty(n, dtype=np.float64)  # the finish time of such a task

    for t in range(n):
        if pending[t] == 0:
            source[t] = -1
            staged[n_staged] = t
            n_staged += 1

    now = 0.0
    n_started = 0
    while True:
        # scan: candidates in priority order; each starts if all its resources are free
        while True:
            while n_promote > 0:
                n_promote -= 1
                r = promote[n_promote]
                w = wait_root[r]
                if w < 0 or held[r]:
                    continue
                # pop w from r's pairing heap: meld its children in pairs left to right, then right to left
                m = 0
                c = child[w]
                while c >= 0:
                    a = c
                    b = sib[a]
                    sib[a] = -1
                    if b >= 0:
                        c = sib[b]
                        sib[b] = -1
                        if priority[b] > priority[a] or (priority[b] == priority[a] and b < a):
                            a, b = b, a
                        sib[b] = child[a]
                        child[a] = b
                    else:
                        c = -1
                    pairs[m] = a
                    m += 1
                root = -1
                for i in range(m - 1, -1, -1):
                    a = pairs[i]
                    if root >= 0:
                        b = root
                        if priority[b] > priority[a] or (priority[b] == priority[a] and b < a):
                            a, b = b, a
                        sib[b] = child[a]
                        child[a] = b
                    root = a
                wait_root[r] = root
                source[w] = r
                staged[n_staged] = w
                n_staged += 1
            while n_staged > 0:  # push into the candidate heap
                n_staged -= 1
                x = staged[n_staged]
                i = n_cand
                n_cand += 1
                while i > 0:
                    p = (i - 1) >> 1
                    y = cand[p]
                    if priority[x] > priority[y] or (priority[x] == priority[y] and x < y):
                        cand[i] = y
                        i = p
                    else:
                        break
                cand[i] = x
            if n_cand == 0:
                break
            # pop the best candidate
            c = cand[0]
            n_cand -= 1
            if n_cand > 0:
                x = cand[n_cand]
                i = 0
                while True:
                    k = 2 * i + 1
                    if k >= n_cand:
                        break
                    if k + 1 < n_cand:
                        y = cand[k + 1]
                        z = cand[k]
                        if priority[y] > priority[z] or (priority[y] == priority[z] and y < z):
                            k += 1
                    y = cand[k]
                    if priority[y] > priority[x] or (priority[y] == priority[x] and y < x):
                        cand[i] = y
                        i = k
                    else:
                        break
                cand[i] = x
            blocker = -1
            for j in range(res_ptr[c], res_ptr[c + 1]):
                if held[res_idx[j]]:
                    blocker = res_idx[j]
                    break
            if blocker < 0:  # start c
                for j in range(res_ptr[c], res_ptr[c + 1]):
                    held[res_idx[j]] = True
                for j in range(mem_ptr[c], mem_ptr[c + 1]):
                    r = mem_res[j]
                    allocated[r] += mem_bytes[j]
                    peak[r] = max(peak[r], allocated[r])
                start[c] = now
                fc = now + duration[c]
                finish[c] = fc
                n_started += 1
                i = n_events
                n_events += 1
                while i > 0:
                    p = (i - 1) >> 1
                    y = events[p]
                    if fc < finish[y] or (fc == finish[y] and c < y):
                        events[i] = y
                        i = p
                    else:
                        break
                events[i] = c
            else:  # park c on the busy resource (pairing-heap insert)
                child[c] = -1
                sib[c] = -1
                a = wait_root[blocker]
                if a < 0:
                    wait_root[blocker] = c
                else:
                    b = c
                    if priority[b] > priority[a] or (priority[b] == priority[a] and b < a):
                        a, b = b, a
                    sib[b] = child[a]
                    child[a] = b
                    wait_root[blocker] = a
            if source[c] >= 0:  # the next waiter of c's resource may compete now
                promote[n_promote] = source[c]
                n_promote += 1
        if n_events == 0:
            break
        # advance to the next event time and process every event (finish or arrival) at that time
        now = finish[events[0]]
        while n_events > 0 and finish[events[0]] == now:
            f = events[0]
            n_events -= 1
            if n_events > 0:
                x = events[n_events]
                fx = finish[x]
                i = 0
                while True:
                    k = 2 * i + 1
                    if k >= n_events:
                        break
                    if k + 1 < n_events:
                        y = events[k + 1]
                        z = events[k]
                        if finish[y] < finish[z] or (finish[y] == finish[z] and y < z):
                            k += 1
                    y = events[k]
                    if finish[y] < fx or (finish[y] == fx and y < x):
                        events[i] = y
                        i = k
                    else:
                        break
                events[i] = x
            lf = lag[f]
            if lf > 0.0 and sent[f]:  # f arrives
                finish[f] = sent_at[f]
            else:  # f finishes: free its resources and memory
                for j in range(res_ptr[f], res_ptr[f + 1]):
                    r = res_idx[j]
                    held[r] = False
                    if wait_root[r] >= 0:
                        promote[n_promote] = r
                        n_promote += 1
                for j in range(free_ptr[f] - 1, free_ptr[f + 1]):  # f itself first, then the tasks it frees
                    x = free_idx[j] if j >= free_ptr[f] else f
                    if refcount[x] == 0:  # only f itself, when no task frees it
                        continue
                    refcount[x] -= 1
                    if refcount[x] == 0:
                        for jm in range(mem_ptr[x], mem_ptr[x + 1]):
                            allocated[mem_res[jm]] -= mem_bytes[jm]
                        release_time[x] = now
                if lf > 0.0:  # its dependents wait for the arrival: push f back at finish + lag
                    sent[f] = True
                    sent_at[f] = now
                    ef = now + lf
                    finish[f] = ef
                    i = n_events
                    n_events += 1
                    while i > 0:
                        p = (i - 1) >> 1
                        y = events[p]
                        if ef < finish[y] or (ef == finish[y] and f < y):
                            events[i] = y
                            i = p
                        else:
                            break
                    events[i] = f
                    continue
            for j in range(succ_ptr[f], succ_ptr[f + 1]):  # f has arrived: its dependents see it done
                x = succ_idx[j]
                pending[x] -= 1
                if pending[x] == 0:
                    if fifo:
                        priority[x] = -now
                    source[x] = -1
                    staged[n_staged] = x
                    n_staged += 1
    return start, finish, release_time, busy, peak, n_started
