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

# ``a[_u(i)]``: index as unsigned. Numba guards every signed index against negative values (Python's
# wrap-around), a compare and a select per access in the event loop; unsigned indices skip it. The event loop
# indexes only with ids it has checked (its -1 sentinels are tested before use): with these, it runs as fast
# as a line-by-line C translation of it, 1.2x its speed with signed indices (docs/journal.md, "Simulator kernel
# against C").
_u = np.uintp


@njit(cache=True)
def validate_batch(first_id: int, n_res: int, duration: np.ndarray, lag: np.ndarray, priority: np.ndarray,
                   res_ptr: np.ndarray, res_idx: np.ndarray, dep_ptr: np.ndarray, dep_idx: np.ndarray,
                   mem_ptr: np.ndarray, mem_res: np.ndarray, mem_bytes: np.ndarray, free_ptr: np.ndarray,
                   free_idx: np.ndarray) -> tuple[int, int, int]:  # pragma: no cover - compiled
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
def transpose_csr(ptr: np.ndarray, idx: np.ndarray,
                  n: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
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


@njit(inline="always")
def _pop(w: int, child: np.ndarray, sib: np.ndarray, priority: np.ndarray,
         pairs: np.ndarray) -> int:  # pragma: no cover - compiled
    """The new root of a pairing heap (order: higher ``priority``, then lower id) whose root ``w`` is taken
    out: its children melded in pairs left to right, then right to left (``pairs`` is scratch). Inlined
    into the kernel when it compiles: no call, no reference counting."""
    m = 0
    c = child[_u(w)]
    while c >= 0:
        a = c
        b = sib[_u(a)]
        sib[_u(a)] = -1
        if b >= 0:
            c = sib[_u(b)]
            sib[_u(b)] = -1
            if priority[_u(b)] > priority[_u(a)] or (priority[_u(b)] == priority[_u(a)] and b < a):
                a, b = b, a
            sib[_u(b)] = child[_u(a)]
            child[_u(a)] = b
        else:
            c = -1
        pairs[_u(m)] = a
        m += 1
    root = -1
    for i in range(m - 1, -1, -1):
        a = pairs[_u(i)]
        if root >= 0:
            b = root
            if priority[_u(b)] > priority[_u(a)] or (priority[_u(b)] == priority[_u(a)] and b < a):
                a, b = b, a
            sib[_u(b)] = child[_u(a)]
            child[_u(a)] = b
        root = a
    return root


@njit(inline="always")
def _insert(root: int, x: int, child: np.ndarray, sib: np.ndarray,
            priority: np.ndarray) -> int:  # pragma: no cover - compiled
    """The root of the pairing heap of root ``root`` (-1: empty) with ``x`` inserted (inlined, as ``_pop``)."""
    child[_u(x)] = -1
    sib[_u(x)] = -1
    if root < 0:
        return x
    a, b = root, x
    if priority[_u(b)] > priority[_u(a)] or (priority[_u(b)] == priority[_u(a)] and b < a):
        a, b = b, a
    sib[_u(b)] = child[_u(a)]
    child[_u(a)] = b
    return a


@njit(cache=True)
def resource_sets(res_ptr: np.ndarray, res_idx: np.ndarray) -> tuple[np.ndarray, int]:  # pragma: no cover
    """(set of each task, number of sets): tasks holding the same list of two or more resources share a set
    (numbered in order of first appearance); -1 for a task of fewer resources."""
    n = res_ptr.shape[0] - 1
    set_of = np.full(n, -1, dtype=np.int32)
    many = 0
    for t in range(n):
        if res_ptr[t + 1] - res_ptr[t] >= 2:
            many += 1
    if many == 0:
        return set_of, 0
    cap = 1
    while cap < 2 * many:
        cap *= 2
    table = np.full(cap, -1, dtype=np.int32)  # open addressing: a task of each set
    n_sets = 0
    for t in range(n):
        lo, hi = res_ptr[t], res_ptr[t + 1]
        if hi - lo < 2:
            continue
        h = np.uint64(hi - lo)
        for j in range(lo, hi):
            h = (h * np.uint64(1000003)) ^ np.uint64(res_idx[j])
        slot = np.int64(h & np.uint64(cap - 1))
        while True:
            rep = table[slot]
            if rep < 0:
                table[slot] = t
                set_of[t] = n_sets
                n_sets += 1
                break
            rlo = res_ptr[rep]
            same = res_ptr[rep + 1] - rlo == hi - lo
            if same:
                for j in range(hi - lo):
                    if res_idx[rlo + j] != res_idx[lo + j]:
                        same = False
                        break
            if same:
                set_of[t] = set_of[rep]
                break
            slot = (slot + 1) & (cap - 1)
    return set_of, n_sets


@njit(cache=True)
def simulate_kernel(duration: np.ndarray, lag: np.ndarray, priority: np.ndarray,  # pragma: no cover - compiled
                    res_ptr: np.ndarray, res_idx: np.ndarray, dep_ptr: np.ndarray, succ_ptr: np.ndarray,
                    succ_idx: np.ndarray, mem_ptr: np.ndarray, mem_res: np.ndarray, mem_bytes: np.ndarray,
                    free_ptr: np.ndarray, free_idx: np.ndarray, free_entry: np.ndarray, resident_bytes: np.ndarray,
                    fifo: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Greedy list scheduling of a task DAG on exclusive resources; the same rule as the reference.

    Ready tasks wait in one binary heap of candidates ordered by (-priority, id). A candidate that finds a
    resource busy is parked on that resource's pairing heap (same order) and comes back only when the
    resource frees: until then a full scan of the ready tasks would skip it anyway. A freed resource
    contributes only its best waiter at a time, the next one after that waiter is handled, so candidates
    are drawn in global priority order and the starts equal those of the reference's full scan.
    Tasks that hold the same two or more resources (transfers over one route, ``resource_sets``) wait
    together: in one pairing heap per set (same order), whose best task, its head, alone is parked on a
    resource. Another task of the set cannot start before its head (the same resources), so it need not be
    looked at; without sets, a parameter server's pushes, each also wanting its sender's link, would move
    from one resource's waiters to the other's at every free, dozens of times each (59 per task on nasnet's
    EV-PS plan on mixed-a100-v100-t4). An entry of a task that is no longer its set's head (a better task
    joined the set) is stale: skipped when drawn.
    The binary heaps' operations are written out inline and the pairing heaps' are helpers numba inlines
    (``_pop``, ``_insert``): a call taking arrays would cost reference counting in the hot loop.
    With ``fifo`` a task's priority is minus the time it became ready (first ready, first served; ties by
    id), assigned when it becomes ready; ``priority`` is then ignored.
    One binary heap of events keyed by (``finish``, id) holds running tasks; a task with ``lag`` > 0, once
    its finish is processed (resources and memory), goes back in at its arrival ``finish + lag``, and only
    that second event makes its dependents ready. While it waits for that, ``finish`` holds its arrival
    (the heap's key) and ``sent_at`` its finish, put back when it arrives: lag-free tasks cost one read.
    Allocations are reference counted per memory entry: a free names a task's entries (``free_entry`` -1)
    or one of them (its position among the task's entries).
    Returns (start, finish, entry release time, busy, peak, n_started).
    """
    n = duration.shape[0]
    if fifo:
        priority = np.zeros(n, dtype=np.float64)
    n_res = resident_bytes.shape[0]
    pending = np.empty(n, dtype=np.int32)  # dependencies not arrived yet (finish + lag)
    n_ent = mem_res.shape[0]
    refcount = np.zeros(n_ent, dtype=np.int32)  # tasks that must finish before an entry is released
    for j in range(free_idx.shape[0]):
        x = free_idx[j]
        if free_entry[j] < 0:
            for jm in range(mem_ptr[x], mem_ptr[x + 1]):
                refcount[jm] += 1
        elif mem_ptr[x] + free_entry[j] < mem_ptr[x + 1]:
            refcount[mem_ptr[x] + free_entry[j]] += 1
    for jm in range(n_ent):
        if refcount[jm] > 0:
            refcount[jm] += 1  # the task itself
    busy = np.zeros(n_res, dtype=np.float64)
    for t in range(n):
        pending[t] = dep_ptr[t + 1] - dep_ptr[t]
        for j in range(res_ptr[t], res_ptr[t + 1]):  # task-id order, as in the reference
            busy[res_idx[j]] += duration[t]

    start = np.empty(n, dtype=np.float64)
    finish = np.empty(n, dtype=np.float64)
    release_time = np.full(n_ent, np.inf)
    allocated = resident_bytes.copy()
    peak = resident_bytes.copy()
    held = np.zeros(n_res, dtype=np.bool_)
    wait_root = np.full(n_res, -1, dtype=np.int32)  # pairing heap of parked tasks per resource
    child = np.empty(n, dtype=np.int32)
    sib = np.empty(n, dtype=np.int32)
    pairs = np.empty(n + 1, dtype=np.int32)  # scratch of the pairing heap's two-pass pop
    set_of, n_sets = resource_sets(res_ptr, res_idx)
    qroot = np.full(n_sets, -1, dtype=np.int32)  # pairing heap of each set's waiting tasks
    n_in_sets = n if n_sets else 0  # only tasks of a set use these
    qchild = np.empty(n_in_sets, dtype=np.int32)
    qsib = np.empty(n_in_sets, dtype=np.int32)
    entered = np.zeros(n_in_sets, dtype=np.bool_)  # a task of a set whose entry is in a resource's pairing heap
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
                r = promote[_u(n_promote)]
                if held[_u(r)]:
                    continue
                while wait_root[_u(r)] >= 0:
                    w = wait_root[_u(r)]
                    wait_root[_u(r)] = _pop(w, child, sib, priority, pairs)
                    s = set_of[_u(w)]
                    if s >= 0:
                        entered[_u(w)] = False
                        if qroot[_u(s)] != w:
                            continue  # stale: w is not its set's head any more
                        qroot[_u(s)] = _pop(w, qchild, qsib, priority, pairs)
                    source[_u(w)] = r
                    staged[_u(n_staged)] = w
                    n_staged += 1
                    break
            while n_staged > 0:  # push into the candidate heap
                n_staged -= 1
                x = staged[_u(n_staged)]
                i = n_cand
                n_cand += 1
                while i > 0:
                    p = (i - 1) >> 1
                    y = cand[_u(p)]
                    if priority[_u(x)] > priority[_u(y)] or (priority[_u(x)] == priority[_u(y)] and x < y):
                        cand[_u(i)] = y
                        i = p
                    else:
                        break
                cand[_u(i)] = x
            if n_cand == 0:
                break
            # pop the best candidate
            c = cand[_u(0)]
            n_cand -= 1
            if n_cand > 0:
                x = cand[_u(n_cand)]
                i = 0
                while True:
                    k = 2 * i + 1
                    if k >= n_cand:
                        break
                    if k + 1 < n_cand:
                        y = cand[_u(k + 1)]
                        z = cand[_u(k)]
                        if priority[_u(y)] > priority[_u(z)] or (priority[_u(y)] == priority[_u(z)] and y < z):
                            k += 1
                    y = cand[_u(k)]
                    if priority[_u(y)] > priority[_u(x)] or (priority[_u(y)] == priority[_u(x)] and y < x):
                        cand[_u(i)] = y
                        i = k
                    else:
                        break
                cand[_u(i)] = x
            blocker = -1
            for j in range(res_ptr[_u(c)], res_ptr[_u(c + 1)]):
                if held[_u(res_idx[_u(j)])]:
                    blocker = res_idx[_u(j)]
                    break
            if blocker < 0:  # start c
                for j in range(res_ptr[_u(c)], res_ptr[_u(c + 1)]):
                    held[_u(res_idx[_u(j)])] = True
                for j in range(mem_ptr[_u(c)], mem_ptr[_u(c + 1)]):
                    r = mem_res[_u(j)]
                    allocated[_u(r)] += mem_bytes[_u(j)]
                    peak[_u(r)] = max(peak[_u(r)], allocated[_u(r)])
                start[_u(c)] = now
                fc = now + duration[_u(c)]
                finish[_u(c)] = fc
                n_started += 1
                i = n_events
                n_events += 1
                while i > 0:
                    p = (i - 1) >> 1
                    y = events[_u(p)]
                    if fc < finish[_u(y)] or (fc == finish[_u(y)] and c < y):
                        events[_u(i)] = y
                        i = p
                    else:
                        break
                events[_u(i)] = c
                # c's set's head, if it has no entry, waits on c's first resource
                park = -1
                s = set_of[_u(c)]
                if s >= 0 and qroot[_u(s)] >= 0 and not entered[_u(qroot[_u(s)])]:
                    park = qroot[_u(s)]
                    blocker = res_idx[_u(res_ptr[_u(c)])]
            else:
                park = c
                s = set_of[_u(c)]
                if s >= 0:  # into its set's pairing heap; parked on the resource only as the set's head
                    qroot[_u(s)] = _insert(qroot[_u(s)], c, qchild, qsib, priority)
                    if qroot[_u(s)] != c:
                        park = -1
            if park >= 0:  # park on the busy resource
                if set_of[_u(park)] >= 0:
                    entered[_u(park)] = True
                wait_root[_u(blocker)] = _insert(wait_root[_u(blocker)], park, child, sib, priority)
            if source[_u(c)] >= 0:  # the next waiter of c's resource may compete now
                promote[_u(n_promote)] = source[_u(c)]
                n_promote += 1
        if n_events == 0:
            break
        # advance to the next event time and process every event (finish or arrival) at that time
        now = finish[_u(events[_u(0)])]
        while n_events > 0 and finish[_u(events[_u(0)])] == now:
            f = events[_u(0)]
            n_events -= 1
            if n_events > 0:
                x = events[_u(n_events)]
                fx = finish[_u(x)]
                i = 0
                while True:
                    k = 2 * i + 1
                    if k >= n_events:
                        break
                    if k + 1 < n_events:
                        y = events[_u(k + 1)]
                        z = events[_u(k)]
                        if finish[_u(y)] < finish[_u(z)] or (finish[_u(y)] == finish[_u(z)] and y < z):
                            k += 1
                    y = events[_u(k)]
                    if finish[_u(y)] < fx or (finish[_u(y)] == fx and y < x):
                        events[_u(i)] = y
                        i = k
                    else:
                        break
                events[_u(i)] = x
            lf = lag[_u(f)]
            if lf > 0.0 and sent[_u(f)]:  # f arrives
                finish[_u(f)] = sent_at[_u(f)]
            else:  # f finishes: free its resources and memory
                for j in range(res_ptr[_u(f)], res_ptr[_u(f + 1)]):
                    r = res_idx[_u(j)]
                    held[_u(r)] = False
                    if wait_root[_u(r)] >= 0:
                        promote[_u(n_promote)] = r
                        n_promote += 1
                for j in range(free_ptr[_u(f)] - 1, free_ptr[_u(f + 1)]):  # f itself first, then what it frees
                    x = free_idx[_u(j)] if j >= free_ptr[_u(f)] else f
                    lo, hi = mem_ptr[_u(x)], mem_ptr[_u(x + 1)]
                    if j >= free_ptr[_u(f)] and free_entry[_u(j)] >= 0:
                        lo = min(lo + free_entry[_u(j)], hi)
                        hi = min(lo + 1, hi)
                    for jm in range(lo, hi):
                        if refcount[_u(jm)] == 0:  # only f itself, when no task frees it
                            continue
                        refcount[_u(jm)] -= 1
                        if refcount[_u(jm)] == 0:
                            allocated[_u(mem_res[_u(jm)])] -= mem_bytes[_u(jm)]
                            release_time[_u(jm)] = now
                if lf > 0.0:  # its dependents wait for the arrival: push f back at finish + lag
                    sent[_u(f)] = True
                    sent_at[_u(f)] = now
                    ef = now + lf
                    finish[_u(f)] = ef
                    i = n_events
                    n_events += 1
                    while i > 0:
                        p = (i - 1) >> 1
                        y = events[_u(p)]
                        if ef < finish[_u(y)] or (ef == finish[_u(y)] and f < y):
                            events[_u(i)] = y
                            i = p
                        else:
                            break
                    events[_u(i)] = f
                    continue
            for j in range(succ_ptr[_u(f)], succ_ptr[_u(f + 1)]):  # f has arrived: its dependents see it done
                x = succ_idx[_u(j)]
                pending[_u(x)] -= 1
                if pending[_u(x)] == 0:
                    if fifo:
                        priority[_u(x)] = -now
                    source[_u(x)] = -1
                    staged[_u(n_staged)] = x
                    n_staged += 1
    return start, finish, release_time, busy, peak, n_started
