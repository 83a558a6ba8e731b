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


@njit(cache=True)
def validate_batch(first_id, n_res, duration, priority, res_ptr, res_idx, dep_ptr, dep_idx,
                   mem_ptr, mem_res, mem_bytes, free_ptr, free_idx):  # pragma: no cover - compiled
    """First problem in a batch of new tasks as (code, batch position, entry index), code 0 if none."""
    for i in range(duration.shape[0]):
        t = first_id + i
        d = duration[i]
        if not (d >= 0.0 and d < np.inf):
            return BAD_DURATION, i, i
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


# ---------------------------------------------------------------------------------------------------------
# Heaps over task ids ordered by (key[t], t): smaller first. The ready order uses key = -priority.


@njit(cache=True)
def _before(a, b, key):  # pragma: no cover - compiled
    ka = key[a]
    kb = key[b]
    return ka < kb or (ka == kb and a < b)


@njit(cache=True)
def _heap_push(heap, size, x, key):  # pragma: no cover - compiled
    """Binary heap insert; returns the new size."""
    i = size
    while i > 0:
        p = (i - 1) >> 1
        y = heap[p]
        if _before(x, y, key):
            heap[i] = y
            i = p
        else:
            break
    heap[i] = x
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size, key):  # pragma: no cover - compiled
    """Remove heap[0] (read it first); returns the new size."""
    size -= 1
    if size <= 0:
        return 0
    x = heap[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _before(heap[c + 1], heap[c], key):
            c += 1
        if _before(heap[c], x, key):
            heap[i] = heap[c]
            i = c
        else:
            break
    heap[i] = x
    return size


@njit(cache=True)
def _pair_meld(a, b, child, sib, key):  # pragma: no cover - compiled
    """Meld two pairing-heap roots; returns the new root."""
    if _before(b, a, key):
        a, b = b, a
    sib[b] = child[a]
    child[a] = b
    return a


@njit(cache=True)
def _pair_insert(root, x, child, sib, key):  # pragma: no cover - compiled
    child[x] = -1
    sib[x] = -1
    if root < 0:
        return x
    return _pair_meld(root, x, child, sib, key)


@njit(cache=True)
def _pair_pop(root, child, sib, key, scratch):  # pragma: no cover - compiled
    """Remove the root of a pairing heap (two-pass pairing); returns the new root or -1."""
    c = child[root]
    if c < 0:
        return -1
    m = 0
    while c >= 0:
        a = c
        b = sib[a]
        sib[a] = -1
        if b < 0:
            scratch[m] = a
            m += 1
            break
        c = sib[b]
        sib[b] = -1
        scratch[m] = _pair_meld(a, b, child, sib, key)
        m += 1
    r = scratch[m - 1]
    for i in range(m - 2, -1, -1):
        r = _pair_meld(scratch[i], r, child, sib, key)
    return r


@njit(cache=True)
def _decref(x, now, refcount, mem_ptr, mem_res, mem_bytes, allocated, release_time):  # pragma: no cover
    """One holder of task x's allocation is done; release it when none is left."""
    refcount[x] -= 1
    if refcount[x] == 0:
        for j in range(mem_ptr[x], mem_ptr[x + 1]):
            allocated[mem_res[j]] -= mem_bytes[j]
        release_time[x] = now


@njit(cache=True)
def simulate_kernel(duration, priority, res_ptr, res_idx, dep_ptr, succ_ptr, succ_idx, mem_ptr, mem_res,
                    mem_bytes, free_ptr, free_idx, resident_bytes):  # pragma: no cover - compiled
    """Greedy list scheduling of a task DAG on exclusive resources; same rule as the reference.

    Ready tasks wait in one candidate heap ordered by (-priority, id). A candidate that finds a resource
    busy is parked on that resource's pairing heap and comes back only when the resource frees: until then
    a full scan would skip it anyway. Per scan, candidates are drawn in global priority order (a resource
    that frees contributes only its best waiter at a time), so the starts equal the reference's scan.
    Returns (start, finish, release_time, busy, peak, n_started).
    """
    n = duration.shape[0]
    n_res = resident_bytes.shape[0]
    key = np.empty(n, dtype=np.float64)
    for t in range(n):
        key[t] = -priority[t]

    busy = np.zeros(n_res, dtype=np.float64)
    for t in range(n):  # task-id order: the reference sums in the same order
        for j in range(res_ptr[t], res_ptr[t + 1]):
            busy[res_idx[j]] += duration[t]

    pending = np.empty(n, dtype=np.int64)
    for t in range(n):
        pending[t] = dep_ptr[t + 1] - dep_ptr[t]
    refcount = np.zeros(n, dtype=np.int64)
    for j in range(free_idx.shape[0]):
        refcount[free_idx[j]] += 1
    for t in range(n):
        if refcount[t] > 0:  # the task's own finish is one more holder
            refcount[t] += 1

    start = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    release_time = np.full(n, np.inf)
    allocated = resident_bytes.copy()
    peak = resident_bytes.copy()
    held = np.zeros(n_res, dtype=np.bool_)
    wait_root = np.full(n_res, -1, dtype=np.int64)
    child = np.empty(n, dtype=np.int64)
    sib = np.empty(n, dtype=np.int64)
    scratch = np.empty(n, dtype=np.int64)
    source = np.full(n, -1, dtype=np.int64)  # resource whose waiting heap a candidate came from
    cand = np.empty(n, dtype=np.int64)
    n_cand = 0
    events = np.empty(n, dtype=np.int64)  # running tasks, ordered by (finish, id)
    n_events = 0

    for t in range(n):
        if pending[t] == 0:
            n_cand = _heap_push(cand, n_cand, t, key)

    now = 0.0
    n_started = 0
    while True:
        # scan: every candidate in priority order starts if all its resources are free
        while n_cand > 0:
            c = cand[0]
            n_cand = _heap_pop(cand, n_cand, key)
            blocker = -1
            for j in range(res_ptr[c], res_ptr[c + 1]):
                if held[res_idx[j]]:
                    blocker = res_idx[j]
                    break
            if blocker < 0:
                for j in range(res_ptr[c], res_ptr[c + 1]):
                    held[res_idx[j]] = True
                for j in range(mem_ptr[c], mem_ptr[c + 1]):
                    r = mem_res[j]
                    allocated[r] += mem_bytes[j]
                    if allocated[r] > peak[r]:
                        peak[r] = allocated[r]
                start[c] = now
                finish[c] = now + duration[c]
                n_events = _heap_push(events, n_events, c, finish)
                n_started += 1
            else:
                wait_root[blocker] = _pair_insert(wait_root[blocker], c, child, sib, key)
            s = source[c]
            if s >= 0 and not held[s] and wait_root[s] >= 0:
                w = wait_root[s]
                wait_root[s] = _pair_pop(w, child, sib, key, scratch)
                source[w] = s
                n_cand = _heap_push(cand, n_cand, w, key)
        if n_events == 0:
            break
        # advance to the next finish time and process every finish at that time
        now = finish[events[0]]
        while n_events > 0 and finish[events[0]] == now:
            f = events[0]
            n_events = _heap_pop(events, n_events, finish)
            for j in range(res_ptr[f], res_ptr[f + 1]):
                r = res_idx[j]
                held[r] = False
                w = wait_root[r]
                if w >= 0:
                    wait_root[r] = _pair_pop(w, child, sib, key, scratch)
                    source[w] = r
                    n_cand = _heap_push(cand, n_cand, w, key)
            if refcount[f] > 0:
                _decref(f, now, refcount, mem_ptr, mem_res, mem_bytes, allocated, release_time)
            for j in range(free_ptr[f], free_ptr[f + 1]):
                _decref(free_idx[j], now, refcount, mem_ptr, mem_res, mem_bytes, allocated, release_time)
            for j in range(succ_ptr[f], succ_ptr[f + 1]):
                s = succ_idx[j]
                pending[s] -= 1
                if pending[s] == 0:
                    source[s] = -1
                    n_cand = _heap_push(cand, n_cand, s, key)
    return start, finish, release_time, busy, peak, n_started
