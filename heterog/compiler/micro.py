"""Micro-batches: the order of their tasks (the plan's schedule) and their place in the task list.

Semantics: docs/design.md, "Micro-batches". A plan of k micro-batches has one op instance per layout
entry, i.e. per (replica, micro-batch) (``heterog.compiler.registries.LayoutTable``); what orders the
micro-batches on a device is the schedule, added here as zero-time SYNC tasks and dependencies:

  gpipe   every backward instance on a device waits for every forward instance on it (all forwards,
          then all backwards, as ``torch.distributed.pipelining.ScheduleGPipe``)
  1f1b    the forward instances of micro-batch m + w_d on device d wait for the backward instances of
          micro-batch m on d (``Schedule1F1B``): at most w_d micro-batches in flight on d, where
          w_d = S - s_d, S the number of pipeline positions and s_d the position of d (devices ordered by
          the first forward op they run; devices that start at the same op share a position, so a plan
          without stages has S = 1: one forward, then its backward, as gradient accumulation). The
          forward ops a value summed over the whole batch is computed from (``window_exempt``: a loss
          normaliser, a batch statistic) are not held back: the backwards reading it wait for it on
          every micro-batch. A graph whose batch ops read a sum that backward ops make
          (``backward_coupled``), or with ops that couple samples (run once over the whole batch after
          every micro-batch's forward, ``heterog.compiler.coupled``), or synchronized batch statistics
          (``heterog.compiler.sync_stats``), runs 1F1B as GPipe: its backwards wait for one another

Task ids must be topological. With one micro-batch the canonical order key is (``heterog.compiler.tasks``);
with several, a task's *slot* comes first: the micro-batch of an op instance (under GPipe, backward
instances after every forward: k + m), lifted to the largest slot of the tasks it waits for. A
dependency then never points to a later slot, and within a slot the dependencies are mostly those of one
micro-batch, which the order key already sorts. Not after an op that couples samples: its one instance
reads every micro-batch's value, so every task after it shares its slot (the last), where a task of one
micro-batch may wait for one of another that the key puts later (a recomputation trigger of micro-batch m,
keyed before its first backward op, waits for that op's instance of micro-batch m - 1, whose result it
accumulates). Within a slot the order is therefore the topological one that takes the smallest key first:
the key order itself wherever that is topological. ``slots_kernel`` is the compiled lifting,
``slots_reference`` its plain-Python twin, ``ranked_order_kernel`` the compiled smallest-key-first order,
``ranked_order_reference`` its twin (tests assert each pair agrees).
"""
from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from heterog.compiler.context import CompileContext
from heterog.compiler.tasks import TaskBatch, TaskCategory, TaskKind, Tasks


def window_exempt(ctx: CompileContext, op_lay: np.ndarray) -> np.ndarray:
    """(n_ops,) forward ops that 1F1B's window does not hold back under layouts ``op_lay``: those that a
    partial result read during the step through its sum over the whole batch is computed from (a loss
    normaliser; a batch statistic read under another layout than its producer's, whereas one read under
    the same layout is each instance's own). Every backward that reads such a sum waits for it on every
    micro-batch, so holding any of them back behind a backward would close a cycle."""
    gi, graph = ctx.index, ctx.graph
    forward = graph.phase_index == 0
    t = gi.e_tensor
    # read during the step (not by the update, which runs after every micro-batch), but not as a statistic
    # by a batch op of its producer's layout
    summed = gi.t_needs_agg[t] & ~gi.e_value_free & forward[gi.e_src] & (graph.phase_index[gi.e_dst] < 2)
    summed &= ~(gi.t_statistic[t] & gi.has_batch[gi.e_dst] & (op_lay[gi.e_src] == op_lay[gi.e_dst]))
    out = np.zeros(gi.n_ops, dtype=bool)
    todo = np.unique(gi.e_src[summed]).tolist()
    while todo:
        o = todo.pop()
        if out[o]:
            continue
        out[o] = True
        todo.extend(u for u in graph.pred[o] if forward[u] and not out[u])
    return out


def backward_coupled(ctx: CompileContext) -> bool:
    """Whether a batch op reads a partial result that a backward op produces (a sum over every micro-batch
    of values each micro-batch's backward makes, as a mixture of experts' routing gradients): then every
    backward of one micro-batch waits for the backwards of all, which 1F1B's window would forbid."""
    gi = ctx.index
    phase = ctx.graph.phase_index
    read = gi.t_needs_agg[gi.e_tensor] & ~gi.e_value_free & gi.has_batch[gi.e_dst] & (phase[gi.e_src] > 0)
    return bool(read.any())


def add_schedule(ctx: CompileContext, batch: TaskBatch, schedule: str, n_micro: int, exempt: np.ndarray) -> str:
    """Add the SYNC tasks and dependencies of ``schedule`` over ``n_micro`` micro-batches to ``batch``,
    which holds every other task of the plan (ids from ``batch.first_id``). Returns the schedule applied:
    GPipe for 1F1B on a ``backward_coupled`` graph."""
    tasks = batch.tasks()
    if schedule == "1f1b" and (backward_coupled(ctx) or bool(ctx.graph.coupled.any())
                               or bool(np.any(tasks.kind == TaskKind.STATISTICS))):
        schedule = "gpipe"
    ids = batch.first_id + np.arange(tasks.n, dtype=np.int64)
    inst = (tasks.kind == TaskKind.COMPUTE) & (tasks.micro >= 0)
    fwd = np.nonzero(inst & (tasks.cat == TaskCategory.FORWARD))[0]
    bwd = np.nonzero(inst & (tasks.cat != TaskCategory.FORWARD))[0]
    if not len(fwd) or not len(bwd):
        return schedule
    m_dev = ctx.n_devices
    last_op = ctx.index.n_ops - 1

    def barriers(devs: np.ndarray, subs: np.ndarray) -> np.ndarray:
        return batch.add(dur=np.zeros(len(devs)), kind=TaskKind.SYNC, op=last_op, dev=devs, alloc=0.0,
                         cat=TaskCategory.SYNC, prio_op=last_op, stage="sync", cls=0, tensor=0, sub=subs,
                         owner=last_op, res_len=0, res_idx=np.zeros(0, dtype=np.int64))

    if schedule == "gpipe":                          # recomputed instances wait like backwards
        devs = np.intersect1d(tasks.dev[fwd], tasks.dev[bwd])
        bar = np.full(m_dev, -1, dtype=np.int64)
        bar[devs] = barriers(devs, devs)
        after = np.concatenate([bwd, np.nonzero(tasks.kind == TaskKind.RECOMPUTE)[0]])
        f, b = fwd[bar[tasks.dev[fwd]] >= 0], after[bar[tasks.dev[after]] >= 0]
        batch.deps(bar[tasks.dev[f]], ids[f], last_op)
        batch.deps(ids[b], bar[tasks.dev[b]], last_op)
        return schedule
    window = in_flight_window(tasks.dev[fwd], tasks.op[fwd], m_dev)
    # barrier (d, m): the backward instances of micro-batch m on d are done; for m < n_micro - w_d
    key_b = tasks.dev[bwd] * n_micro + tasks.micro[bwd]
    needed = tasks.micro[bwd] < n_micro - window[tasks.dev[bwd]]
    keys = np.unique(key_b[needed])
    bar = np.full(m_dev * n_micro, -1, dtype=np.int64)
    bar[keys] = barriers(keys // n_micro, (keys % n_micro) * m_dev + keys // n_micro)
    b = bwd[needed]
    batch.deps(bar[key_b[needed]], ids[b], last_op)
    # forward instances of micro-batch m on d wait for barrier (d, m - w_d), but those ``exempt`` (n_ops,)
    fwd = fwd[~exempt[tasks.op[fwd]]]
    back = tasks.micro[fwd] - window[tasks.dev[fwd]]
    ok = back >= 0
    f = fwd[ok]
    waits = bar[tasks.dev[f] * n_micro + back[ok]]
    has = waits >= 0
    batch.deps(ids[f[has]], waits[has], last_op)
    return schedule


def in_flight_window(dev: np.ndarray, op: np.ndarray, n_devices: int) -> np.ndarray:
    """(n_devices,) 1F1B's micro-batches in flight per device: S - s_d, with s_d the position of device d
    among the distinct first forward ops (``op``) that the devices (``dev``) run, S their number; 0 for
    devices without forward instances."""
    first = np.full(n_devices, np.iinfo(np.int64).max)
    np.minimum.at(first, dev, op)
    used = first < np.iinfo(np.int64).max
    starts = np.unique(first[used])
    out = np.zeros(n_devices, dtype=np.int64)
    out[used] = len(starts) - np.searchsorted(starts, first[used])
    return out


def micro_order(tasks: Tasks, dep_task: np.ndarray, dep_on: np.ndarray, schedule: str, n_micro: int,
                exempt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The permutation that puts ``tasks`` (dependency ``dep_task[i]`` waits for ``dep_on[i]``, ids in
    ``tasks``' order) in topological order: by slot, then by order key where that is topological, smallest key
    first otherwise (module docstring); and each
    task's slot. Instances of the ops ``exempt`` (n_ops,) flags (``window_exempt``: every micro-batch's
    backward reads what they make) take slot 0 whatever their micro-batch."""
    hint = np.where((tasks.micro >= 0) & ~exempt[tasks.op], tasks.micro, 0).astype(np.int64)
    if schedule == "gpipe":
        backward = (tasks.micro >= 0) & (((tasks.kind == TaskKind.COMPUTE) & (tasks.cat != TaskCategory.FORWARD))
                                         | (tasks.kind == TaskKind.RECOMPUTE))
        hint = np.where(backward, n_micro + hint, hint)
    succ_ptr, succ_idx = _successors(tasks.n, dep_task, dep_on)
    slot, seen = slots_kernel(succ_ptr, succ_idx, hint)
    if seen != tasks.n:
        raise AssertionError("the micro-batch schedule made the task graph cyclic")
    perm = np.lexsort((tasks.order, slot))
    rank = np.empty(tasks.n, dtype=np.int64)
    rank[perm] = np.arange(tasks.n)
    if np.any(rank[dep_on] >= rank[dep_task]):     # a slot of several micro-batches (module docstring)
        perm = ranked_order_kernel(succ_ptr, succ_idx, rank)
    return perm, slot


def _successors(n: int, dep_task: np.ndarray, dep_on: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR of each task's dependents (``dep_task`` of the dependencies on it)."""
    order = np.argsort(dep_on, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dep_on, minlength=n), out=ptr[1:])
    return ptr, np.asarray(dep_task, dtype=np.int64)[order]


@njit(cache=True)
def slots_kernel(succ_ptr: np.ndarray, succ_idx: np.ndarray,  # pragma: no cover - compiled
                 hint: np.ndarray) -> tuple[np.ndarray, int]:
    """slot(t) = max(hint(t), slot of every task t waits for), in Kahn order; also the number of tasks
    reached (fewer than all: the graph has a cycle)."""
    n = hint.shape[0]
    indeg = np.zeros(n, dtype=np.int64)
    for k in range(succ_idx.shape[0]):
        indeg[succ_idx[k]] += 1
    slot = hint.copy()
    queue = np.empty(n, dtype=np.int64)
    tail = 0
    for t in range(n):
        if indeg[t] == 0:
            queue[tail] = t
            tail += 1
    head = 0
    while head < tail:
        t = queue[head]
        head += 1
        for k in range(succ_ptr[t], succ_ptr[t + 1]):
            s = succ_idx[k]
            if slot[t] > slot[s]:
                slot[s] = slot[t]
            indeg[s] -= 1
            if indeg[s] == 0:
                queue[tail] = s
                tail += 1
    return slot, tail


def slots_reference(succ_ptr: np.ndarray, succ_idx: np.ndarray, hint: np.ndarray) -> tuple[np.ndarray, int]:
    """Plain-Python ``slots_kernel``: a depth-first longest-slot relaxation over the successors."""
    n = len(hint)
    preds: list[list[int]] = [[] for _ in range(n)]
    for t in range(n):
        for s in succ_idx[succ_ptr[t]:succ_ptr[t + 1]].tolist():
            preds[s].append(t)
    slot: dict[int, int] = {}
    state = [0] * n                                  # 0 new, 1 on the stack, 2 done

    def visit(t: int) -> int | None:
        stack = [(t, 0)]
        while stack:
            u, i = stack.pop()
            if i == 0:
                if state[u] == 2:
                    continue
                state[u] = 1
            if i < len(preds[u]):
                stack.append((u, i + 1))
                p = preds[u][i]
                if state[p] == 1:
                    return None                      # a cycle
                if state[p] == 0:
                    stack.append((p, 0))
                continue
            slot[u] = max([int(hint[u])] + [slot[p] for p in preds[u]])
            state[u] = 2
        return slot[t]

    for t in range(n):
        if state[t] == 0 and visit(t) is None:
            return np.array([slot.get(i, int(hint[i])) for i in range(n)], dtype=np.int64), len(slot)
    return np.array([slot[i] for i in range(n)], dtype=np.int64), n


@njit(cache=True)
def _heap_push(heap: np.ndarray, size: int, value: int) -> int:  # pragma: no cover - compiled
    """Put ``value`` into the binary min-heap ``heap[:size]`` (sift up); the new size."""
    heap[size] = value
    i = size
    while i > 0 and heap[(i - 1) // 2] > heap[i]:
        p = (i - 1) // 2
        heap[p], heap[i] = heap[i], heap[p]
        i = p
    return size + 1


@njit(cache=True)
def ranked_order_kernel(succ_ptr: np.ndarray, succ_idx: np.ndarray,  # pragma: no cover - compiled
                        rank: np.ndarray) -> np.ndarray:
    """The topological order of the tasks (successors ``succ_ptr``, ``succ_idx``; acyclic) that takes the
    ready task of smallest ``rank`` (distinct) first: Kahn's algorithm over a binary min-heap of ranks."""
    n = rank.shape[0]
    indeg = np.zeros(n, dtype=np.int64)
    for k in range(succ_idx.shape[0]):
        indeg[succ_idx[k]] += 1
    task_of = np.empty(n, dtype=np.int64)
    task_of[rank] = np.arange(n)
    heap = np.empty(n, dtype=np.int64)             # ranks of the ready tasks
    size = 0
    out = np.empty(n, dtype=np.int64)
    for t in range(n):
        if indeg[t] == 0:
            size = _heap_push(heap, size, rank[t])
    for pos in range(n):
        t = task_of[heap[0]]
        out[pos] = t
        size -= 1
        heap[0] = heap[size]
        i = 0
        while True:                                # sift the last rank down from the root
            c = 2 * i + 1
            if c >= size:
                break
            if c + 1 < size and heap[c + 1] < heap[c]:
                c += 1
            if heap[i] <= heap[c]:
                break
            heap[i], heap[c] = heap[c], heap[i]
            i = c
        for k in range(succ_ptr[t], succ_ptr[t + 1]):
            s = succ_idx[k]
            indeg[s] -= 1
            if indeg[s] == 0:
                size = _heap_push(heap, size, rank[s])
    return out


def ranked_order_reference(succ_ptr: np.ndarray, succ_idx: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Plain-Python ``ranked_order_kernel``: Kahn's algorithm over ``heapq``."""
    n = len(rank)
    indeg = np.bincount(succ_idx, minlength=n).tolist()
    ready = [(int(rank[t]), t) for t in range(n) if indeg[t] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        _, t = heapq.heappop(ready)
        out.append(t)
        for s in succ_idx[succ_ptr[t]:succ_ptr[t + 1]].tolist():
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (int(rank[s]), s))
    return np.array(out, dtype=np.int64)
