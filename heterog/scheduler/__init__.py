"""Task priorities for list scheduling: rank-based (HeteroG/HEFT upward rank) and FIFO.

rank(t) = p(t) + max over successors s of rank(s), p = the task's compute or transfer time (a transfer's
time includes its latency in flight, the simulator's task ``lag``, during which its links are free).
Each resource then runs its ready task of highest rank (the simulator's rule). FIFO, the comparison
point, serves ready tasks in the order they became ready (TensorFlow's default executor); ``est``
(earliest possible start first) is a third, static comparison point.

``rank-contention`` bounds the upward rank by the work queued on each resource. Upward rank is the
length of the longest chain from a task to the end with unlimited resources; on a shared link the
collectives after a task still have to pass one by one, so the time from a task's start to the end
is also at least the work its resource serves from it on (in rank order) plus the shortest tail
after those tasks:

    floor(t) = max over t's resources r of [ sum of p(u) over u on r ranked at or below t
                                             + min over those u of (rank(u) - p(u)) ]
    rank_c(t) = max(p(t) + max over successors s of rank_c(s), floor(t))

so gradients that feed a busy link rise above the backward critical path when the link, not the
GPU, decides the end of the step.

The default order is ``best``: per plan, each order of ``PORTFOLIO`` (rank-contention, FIFO and the plain
upward rank) is simulated and the fastest is kept (none of them wins on every plan). ``best`` and
``plan`` (the strategy's own op order, e.g. DPOS's) are resolved by ``heterog.evaluate.Evaluator``, which
knows the plan; ``priorities`` here computes the static orders of a bare TaskGraph.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from simulator import TaskGraph

ORDERS = ("best", "rank-contention", "fifo", "rank", "est", "rank-links", "plan")
DEFAULT_ORDER = "best"
PORTFOLIO = ("rank-contention", "fifo", "rank")   # what ``best`` tries, in this order (ties keep the first)
PLAN_ORDERS = ("best", "plan")              # orders that need the plan, not only its TaskGraph


@njit(cache=True)
def _upward_rank_kernel(duration: np.ndarray, succ_ptr: np.ndarray, succ_idx: np.ndarray,  # pragma: no cover
                        floor: np.ndarray) -> np.ndarray:
    """rank(t) = max(p(t) + max over successors of rank, floor(t)); floor 0 gives the upward rank."""
    n = duration.shape[0]
    rank = np.empty(n, dtype=np.float64)
    for t in range(n - 1, -1, -1):
        best = 0.0
        for k in range(succ_ptr[t], succ_ptr[t + 1]):
            r = rank[succ_idx[k]]
            if r > best:
                best = r
        rank[t] = max(duration[t] + best, floor[t])
    return rank


def upward_rank_reference(duration: np.ndarray, succ_ptr: np.ndarray, succ_idx: np.ndarray) -> np.ndarray:
    """Plain-Python upward rank over tasks numbered topologically (every successor has a larger id)."""
    n = len(duration)
    rank = [0.0] * n
    for t in range(n - 1, -1, -1):
        best = 0.0
        for k in range(int(succ_ptr[t]), int(succ_ptr[t + 1])):
            best = max(best, rank[int(succ_idx[k])])
        rank[t] = float(duration[t]) + best
    return np.asarray(rank, dtype=np.float64)


def upward_rank(duration: np.ndarray, succ_ptr: np.ndarray, succ_idx: np.ndarray) -> np.ndarray:
    """Compiled upward rank (same result as ``upward_rank_reference``)."""
    duration = np.ascontiguousarray(duration, dtype=np.float64)
    return _upward_rank_kernel(duration, np.ascontiguousarray(succ_ptr, dtype=np.int64),
                               np.ascontiguousarray(succ_idx, dtype=np.int64), np.zeros(len(duration)))


@njit(cache=True)
def _contention_rank_kernel(duration: np.ndarray, lag: np.ndarray, succ_ptr: np.ndarray,  # pragma: no cover
                            succ_idx: np.ndarray, res_ptr: np.ndarray, res_idx: np.ndarray,
                            n_res: int) -> np.ndarray:
    n = duration.shape[0]
    path = duration + lag
    rank = _upward_rank_kernel(path, succ_ptr, succ_idx, np.zeros(n))
    # tasks of each resource (CSR by resource, increasing task id), those with work only
    cnt = np.zeros(n_res + 1, dtype=np.int64)
    for t in range(n):
        if duration[t] > 0:
            for k in range(res_ptr[t], res_ptr[t + 1]):
                cnt[res_idx[k] + 1] += 1
    for r in range(n_res):
        cnt[r + 1] += cnt[r]
    pos = cnt[:n_res].copy()
    members = np.empty(cnt[n_res], dtype=np.int64)
    for t in range(n):
        if duration[t] > 0:
            for k in range(res_ptr[t], res_ptr[t + 1]):
                r = res_idx[k]
                members[pos[r]] = t
                pos[r] += 1
    floor = np.zeros(n, dtype=np.float64)
    for r in range(n_res):
        tasks = members[cnt[r]:cnt[r + 1]]
        m = tasks.shape[0]
        if m < 2:
            continue
        order = tasks[np.argsort(-rank[tasks], kind="mergesort")]      # rank descending, ties by id
        work = 0.0
        tail = np.inf
        for j in range(m - 1, -1, -1):
            u = order[j]
            work += duration[u]
            tail = min(tail, rank[u] - duration[u])
            if work + tail > floor[u]:
                floor[u] = work + tail
    return _upward_rank_kernel(path, succ_ptr, succ_idx, floor)


def contention_rank_reference(duration: np.ndarray, succ_ptr: np.ndarray, succ_idx: np.ndarray,
                              res_ptr: np.ndarray, res_idx: np.ndarray, n_res: int,
                              lag: np.ndarray | None = None) -> np.ndarray:
    """Plain-Python ``rank-contention`` (module docstring) over topologically numbered tasks. A task's
    ``lag`` lengthens the paths through it but is no work of its resources."""
    n = len(duration)
    path = np.asarray(duration, dtype=np.float64) + (0.0 if lag is None else np.asarray(lag, dtype=np.float64))
    rank = upward_rank_reference(path, succ_ptr, succ_idx)
    on: dict[int, list[int]] = {r: [] for r in range(n_res)}
    for t in range(n):
        if duration[t] > 0:
            for k in range(int(res_ptr[t]), int(res_ptr[t + 1])):
                on[int(res_idx[k])].append(t)
    floor = [0.0] * n
    for tasks in on.values():
        if len(tasks) < 2:
            continue
        order = sorted(tasks, key=lambda u: (-rank[u], u))
        work, tail = 0.0, float("inf")
        for u in reversed(order):
            work += float(duration[u])
            tail = min(tail, float(rank[u] - duration[u]))
            floor[u] = max(floor[u], work + tail)
    out = [0.0] * n
    for t in range(n - 1, -1, -1):
        best = max((out[int(succ_idx[k])] for k in range(int(succ_ptr[t]), int(succ_ptr[t + 1]))), default=0.0)
        out[t] = max(float(path[t]) + best, floor[t])
    return np.asarray(out, dtype=np.float64)


def contention_rank(duration: np.ndarray, succ_ptr: np.ndarray, succ_idx: np.ndarray, res_ptr: np.ndarray,
                    res_idx: np.ndarray, n_res: int, lag: np.ndarray | None = None) -> np.ndarray:
    """Compiled ``rank-contention`` (same result as ``contention_rank_reference``)."""
    c = np.ascontiguousarray
    duration = c(duration, dtype=np.float64)
    lag = np.zeros_like(duration) if lag is None else c(lag, dtype=np.float64)
    return _contention_rank_kernel(duration, lag, c(succ_ptr, dtype=np.int64),
                                   c(succ_idx, dtype=np.int64), c(res_ptr, dtype=np.int64),
                                   c(res_idx, dtype=np.int64), int(n_res))


@njit(cache=True)
def _earliest_start_kernel(duration: np.ndarray, dep_ptr: np.ndarray,  # pragma: no cover - compiled
                           dep_idx: np.ndarray) -> np.ndarray:
    n = duration.shape[0]
    est = np.zeros(n, dtype=np.float64)
    for t in range(n):
        best = 0.0
        for k in range(dep_ptr[t], dep_ptr[t + 1]):
            d = dep_idx[k]
            f = est[d] + duration[d]
            if f > best:
                best = f
        est[t] = best
    return est


def earliest_start(duration: np.ndarray, dep_ptr: np.ndarray, dep_idx: np.ndarray) -> np.ndarray:
    """Earliest start of each task with unlimited resources (the 'top level')."""
    return _earliest_start_kernel(np.ascontiguousarray(duration, dtype=np.float64),
                                  np.ascontiguousarray(dep_ptr, dtype=np.int64),
                                  np.ascontiguousarray(dep_idx, dtype=np.int64))


def priorities(tg: TaskGraph, order: str = "rank", comm_mask: np.ndarray | None = None) -> np.ndarray:
    """Static priorities for the simulator's list scheduler over TaskGraph ``tg`` (higher runs first).

    ``rank``: upward rank (HeteroG). ``est``: earliest start first (the start each task could have with
    unlimited resources). ``fifo``: zeros; FIFO is dynamic (the order tasks become ready), so the
    simulator must also be run with ``fifo=True`` (see ``is_dynamic``). ``rank-links``: upward rank for
    communication tasks (``comm_mask``) and earliest start first for computation: rank decides which
    transfer or collective a link serves next, while GPUs serve work as it becomes ready, so that
    gradients feeding a busy link are not starved behind the backward critical path.
    ``rank-contention``: upward rank bounded below by the work queued on each resource (module docstring).
    """
    if order == "rank":
        ptr, idx = tg.successors()
        return upward_rank(tg.duration + tg.lag, ptr, idx)
    if order == "rank-contention":
        ptr, idx = tg.successors()
        res_ptr, res_idx = tg.resources()
        return contention_rank(tg.duration, ptr, idx, res_ptr, res_idx, tg.n_resources, lag=tg.lag)
    if order == "est":
        ptr, idx = tg.dependencies()
        return -earliest_start(tg.duration + tg.lag, ptr, idx)
    if order == "fifo":
        return np.zeros(tg.n_tasks)
    from heterog.errors import HeterogError

    if order == "rank-links":
        if comm_mask is None:
            raise HeterogError("order 'rank-links' needs to know which tasks communicate (comm_mask)")
        return np.where(comm_mask, priorities(tg, "rank"), priorities(tg, "est"))
    if order in PLAN_ORDERS:
        raise HeterogError(f"order {order!r} is chosen per plan: use heterog.evaluate.Evaluator")
    raise HeterogError(f"unknown order {order!r} (choose from {', '.join(ORDERS)})")


def check_order(order: str) -> str:
    """``order`` if it is a known order name, else a HeterogError naming the choices."""
    if order not in ORDERS:
        from heterog.errors import HeterogError

        raise HeterogError(f"unknown order {order!r} (choose from {', '.join(ORDERS)})")
    return order


def is_dynamic(order: str) -> bool:
    """Whether the order is decided while simulating (FIFO) rather than by static priorities."""
    return order == "fifo"
