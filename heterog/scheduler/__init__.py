"""Task priorities for list scheduling: rank-based (HeteroG/HEFT upward rank) and FIFO.

rank(t) = p(t) + max over successors s of rank(s), p = the task's compute or transfer time.
Each resource then runs its ready task of highest rank (the simulator's rule). FIFO, the comparison
point, serves ready tasks in the order they became ready (TensorFlow's default executor); ``est``
(earliest possible start first) is a third, static comparison point.
"""
from __future__ import annotations

import numpy as np
from numba import njit

ORDERS = ("rank", "fifo", "est", "rank-links")


@njit(cache=True)
def _upward_rank_kernel(duration, succ_ptr, succ_idx):  # pragma: no cover - compiled
    n = duration.shape[0]
    rank = np.empty(n, dtype=np.float64)
    for t in range(n - 1, -1, -1):
        best = 0.0
        for k in range(succ_ptr[t], succ_ptr[t + 1]):
            r = rank[succ_idx[k]]
            if r > best:
                best = r
        rank[t] = duration[t] + best
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
    return _upward_rank_kernel(np.ascontiguousarray(duration, dtype=np.float64),
                               np.ascontiguousarray(succ_ptr, dtype=np.int64),
                               np.ascontiguousarray(succ_idx, dtype=np.int64))


@njit(cache=True)
def _earliest_start_kernel(duration, dep_ptr, dep_idx):  # pragma: no cover - compiled
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


def priorities(tg, order: str = "rank", comm_mask: np.ndarray | None = None) -> np.ndarray:
    """Static priorities for the simulator's list scheduler over TaskGraph ``tg`` (higher runs first).

    ``rank``: upward rank (HeteroG). ``est``: earliest start first (the start each task could have with
    unlimited resources). ``fifo``: zeros; FIFO is dynamic (the order tasks become ready), so the
    simulator must also be run with ``fifo=True`` (see ``is_dynamic``). ``rank-links``: upward rank for
    communication tasks (``comm_mask``) and earliest start first for computation: rank decides which
    transfer or collective a link serves next, while GPUs serve work as it becomes ready, so that
    gradients feeding a busy link are not starved behind the backward critical path.
    """
    if order == "rank":
        ptr, idx = tg.successors()
        return upward_rank(tg.duration, ptr, idx)
    if order == "est":
        ptr, idx = tg.dependencies()
        return -earliest_start(tg.duration, ptr, idx)
    if order == "fifo":
        return np.zeros(tg.n_tasks)
    if order == "rank-links":
        if comm_mask is None:
            from heterog.errors import HeterogError

            raise HeterogError("order 'rank-links' needs to know which tasks communicate (comm_mask)")
        return np.where(comm_mask, priorities(tg, "rank"), priorities(tg, "est"))
    from heterog.errors import HeterogError

    raise HeterogError(f"unknown order {order!r} (choose from {', '.join(ORDERS)})")


def is_dynamic(order: str) -> bool:
    """Whether the order is decided while simulating (FIFO) rather than by static priorities."""
    return order == "fifo"
