"""Tasks as the compiler emits them: kinds, categories, the canonical order, and ``TaskBatch``, the
columns of tasks under construction with the dependencies between them.

Every task has an *order key* that fixes its place in the TaskGraph: ``(stage key, class, tensor, sub)``
packed into one int64. The stage key is ``prio_op * N_STAGES + stage`` (a re-layout before the compute
that consumes it, aggregation after the compute that produces it); within one stage key, tasks sort by
class (0: instances, aggregation and transfers of non-batch values; 1: re-layouts), by the tensor they
move and by their position within it (replica, worker, device or piece). Keys are distinct, so the order
does not depend on the order in which tasks were emitted: a plan compiled at once and a plan patched
group by group (``heterog.compiler.delta``) number their tasks alike.

Every task and every dependency also has an *owner*, the unit of emission that produced it: op ``o``
(its instances and the aggregation of its partial results) or ``n_ops + t`` (the edges of tensor ``t``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

Deps: TypeAlias = tuple[np.ndarray, np.ndarray, np.ndarray]     # dependencies: (task, on, owner), each (D,)

STAGE = {"split": 2, "transfer": 3, "concat": 4, "recompute": 5, "compute": 6, "push": 7, "aggregate": 8, "sync": 9}
N_STAGES = 10


class TaskKind(IntEnum):
    """What a task does (``CompiledPlan.task_kind``)."""

    COMPUTE = 0
    PLACEHOLDER = 1
    TRANSFER = 2
    RELAYOUT = 3      # a value's batch pieces cut for another layout's entries (``heterog.compiler.emit``)
    CONCAT = 4
    PUSH = 5
    AGGREGATE = 6
    ALLREDUCE = 7
    SYNC = 8          # no work: orders tasks (a schedule's barrier, ``heterog.compiler.micro``; a recomputation's
                      # trigger, ``heterog.compiler.recompute``)
    RECOMPUTE = 9     # an op instance's forward run again before its backward (``heterog.compiler.recompute``)
    COLLECTIVE = 10   # all-gather, reduce-scatter, all-reduce or all-to-all of a tensor divided beyond the batch
                      # among a split config's devices (``heterog.compiler.reshard``)
    STATISTICS = 11   # the all-reduce of a synced batch norm's statistics (``heterog.compiler.sync_stats``)


COMM_KINDS = (TaskKind.TRANSFER, TaskKind.PUSH, TaskKind.ALLREDUCE, TaskKind.COLLECTIVE, TaskKind.STATISTICS)
COMPUTE_KINDS = (TaskKind.COMPUTE, TaskKind.RECOMPUTE)


class TaskCategory(IntEnum):
    """How a task is shown in Chrome traces and Gantt charts: compute tasks by the phase of their op (the
    first three follow ``heterog.graph.opgraph.PHASES``), placeholders as inputs, communication by kind.
    ``CATEGORIES[c]`` is category ``c``'s name in the TaskGraph."""

    FORWARD = 0
    BACKWARD = 1
    UPDATE = 2
    INPUT = 3
    TRANSFER = 4
    SPLIT_CONCAT = 5
    PS = 6
    ALLREDUCE = 7
    SYNC = 8
    RECOMPUTE = 9
    COLLECTIVE = 10


CATEGORIES = ("forward", "backward", "update", "input", "transfer", "split/concat", "ps", "allreduce", "sync",
              "recompute", "collective")


@dataclass(frozen=True)
class OrderKey:
    """Packs (prio_op, stage, class, tensor, sub) into one int64 (module docstring)."""

    n_tensors: int
    n_sub: int                   # positions within a tensor: entries, workers, devices, pieces, barriers

    def __call__(self, prio_op: npt.ArrayLike, stage: npt.ArrayLike, cls: npt.ArrayLike, tensor: npt.ArrayLike,
                 sub: npt.ArrayLike) -> np.ndarray:
        key = (np.asarray(prio_op, dtype=np.int64) * N_STAGES + np.asarray(stage, dtype=np.int64)) * 2 \
            + np.asarray(cls, dtype=np.int64)
        return (key * self.n_tensors + np.asarray(tensor, dtype=np.int64)) * self.n_sub \
            + np.asarray(sub, dtype=np.int64)


INT_COLS = ("order", "owner", "kind", "op", "dev", "cat", "prio_op", "micro")
FLOAT_COLS = ("dur", "lag", "alloc")


@dataclass
class Tasks:
    """Task columns and resources as CSR; the form a plan keeps its tasks in.

    Integer columns are the rows of ``ints`` (INT_COLS): ``order`` canonical order key (module docstring),
    ``owner`` emission unit (op, or n_ops + tensor), ``kind`` TaskKind, ``op`` the op the task belongs to
    (the producer, for communication), ``dev`` device of a compute task or destination of a transfer (-1
    for collectives), ``cat`` TaskCategory, ``prio_op`` op whose priority the task inherits.
    Float columns are the rows of ``floats`` (FLOAT_COLS): ``dur`` seconds, ``lag`` seconds in flight after
    the task's end (the simulator's lag), ``alloc`` bytes allocated on ``dev`` when the task starts.

    Shapes: ``ints`` (8, n), ``floats`` (3, n); ``res_ptr`` (n + 1,), ``res_idx`` (res_ptr[-1],).
    """

    ints: np.ndarray
    floats: np.ndarray
    res_ptr: np.ndarray
    res_idx: np.ndarray

    order = property(lambda self: self.ints[0])
    owner = property(lambda self: self.ints[1])
    kind = property(lambda self: self.ints[2])
    op = property(lambda self: self.ints[3])
    dev = property(lambda self: self.ints[4])
    cat = property(lambda self: self.ints[5])
    prio_op = property(lambda self: self.ints[6])
    micro = property(lambda self: self.ints[7])
    dur = property(lambda self: self.floats[0])
    lag = property(lambda self: self.floats[1])
    alloc = property(lambda self: self.floats[2])

    @property
    def n(self) -> int:
        return self.ints.shape[1]

    @property
    def res_len(self) -> np.ndarray:
        return np.diff(self.res_ptr)

    def take(self, rows: np.ndarray) -> Tasks:
        """The tasks ``rows`` (in that order)."""
        res_len = self.res_len[rows]
        ints = np.empty((len(INT_COLS), len(rows)), dtype=np.int64)
        floats = np.empty((len(FLOAT_COLS), len(rows)), dtype=np.float64)
        for out, cols in ((ints, self.ints), (floats, self.floats)):
            for i in range(len(cols)):
                out[i] = cols[i][rows]
        return Tasks(ints, floats, _ptr(res_len), self.res_idx[ragged_gather(self.res_ptr[rows], res_len)])


def _column(values: npt.ArrayLike, dtype: npt.DTypeLike, k: int) -> np.ndarray:
    """``values`` as a (k,) array of ``dtype`` (a scalar repeated)."""
    arr = np.asarray(values, dtype=dtype)
    return np.full(k, arr, dtype=dtype) if arr.ndim == 0 else arr


def _ptr(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def ragged_gather(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices ``starts[i] .. starts[i] + lengths[i] - 1`` for every row i, concatenated."""
    total = int(np.sum(lengths))
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    row_start = np.repeat(_ptr(lengths)[:-1], lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64), lengths) + (np.arange(total) - row_start)


def unique_ints(a: np.ndarray, nearly_sorted: bool = False) -> np.ndarray:
    """The sorted distinct values of integer array ``a``, by sorting: ``np.unique`` without indices takes a
    hash table in numpy >= 2.3, 50x slower on a million int64 here (580 ms against 11 ms). ``nearly_sorted``:
    by a merge sort, which runs through an array in near order (0.25 ms against 7 ms on 177,000)."""
    s = np.sort(np.asarray(a).ravel(), kind="stable" if nearly_sorted else None)
    keep = np.ones(len(s), dtype=bool)
    keep[1:] = s[1:] != s[:-1]
    return s[keep]


def isin_ints(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.isin(a, b)`` for integer arrays: by a table over their values where these span about the arrays'
    size (task ids; 0.6 ms against 63 ms by sorting for 400,000 against 20,000), else by sorting and a
    merge-like search (``np.isin`` takes the hash-table ``np.unique`` of both: 700 ms against 120 ms on a
    million int64 here)."""
    a, b = np.asarray(a), np.asarray(b)
    if not a.size or not b.size:
        return np.zeros(a.shape, dtype=bool)
    lo, hi = int(min(a.min(), b.min())), int(max(a.max(), b.max()))
    if hi - lo <= 4 * (a.size + b.size) + (1 << 16):
        table = np.zeros(hi - lo + 1, dtype=bool)
        table[b.ravel() - lo] = True
        return table[a - lo]
    out = np.zeros(a.shape, dtype=bool)
    sb = unique_ints(b)
    order = np.argsort(a, axis=None)
    sa = a.ravel()[order]
    at = np.minimum(np.searchsorted(sb, sa), len(sb) - 1)
    out.ravel()[order] = sb[at] == sa
    return out


def pair_order(first: np.ndarray, second: np.ndarray, n: int) -> np.ndarray:
    """``np.lexsort((second, first))`` for task ids in ``-1 .. n - 1``: one merge sort of a code per pair, which
    runs through the nearly sorted dependency lists the compiler makes (0.44 ms against 8.8 ms for the lexsort on
    200,000; 6.7 against 9.9 ms on the less sorted list of a 32-micro-batch schedule)."""
    return np.argsort((np.asarray(first, dtype=np.int64) + 1) * (n + 1) + (np.asarray(second) + 1), kind="stable")


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ragged rows of the given lengths: (row of each element, position within its row)."""
    rows = np.repeat(np.arange(len(counts)), counts)
    return rows, np.arange(int(np.sum(counts))) - np.repeat(_ptr(counts)[:-1], counts)


class TaskBatch:
    """Tasks under construction, numbered ``first_id, first_id + 1, ...`` as they are added, and the
    dependencies they add (``task`` waits for ``on``; either may be an earlier task of the plan)."""

    def __init__(self, first_id: int, key: OrderKey) -> None:
        self.first_id = first_id
        self.key = key
        self.n = 0
        self._cols: dict[str, list[np.ndarray]] = {k: [] for k in FLOAT_COLS + INT_COLS}
        self._res_len: list[np.ndarray] = []
        self._res_idx: list[np.ndarray] = []
        self._dep: list[tuple[np.ndarray, np.ndarray, np.ndarray | int]] = []      # one owner for all: an int

    @classmethod
    def of(cls, tasks: Tasks, deps: Deps, key: OrderKey) -> TaskBatch:
        """A batch that holds ``tasks`` (ids 0..) and their dependencies ``deps`` already."""
        batch = cls(0, key)
        batch.n = tasks.n
        for names, cols in ((INT_COLS, tasks.ints), (FLOAT_COLS, tasks.floats)):
            for i, name in enumerate(names):
                batch._cols[name].append(cols[i])
        batch._res_len.append(tasks.res_len)
        batch._res_idx.append(tasks.res_idx)
        batch._dep.append(deps)
        return batch

    def add(self, *, dur: np.ndarray, kind: TaskKind | np.ndarray, op: npt.ArrayLike, dev: npt.ArrayLike,
            alloc: npt.ArrayLike, cat: TaskCategory | np.ndarray, prio_op: npt.ArrayLike, stage: str | np.ndarray,
            cls: npt.ArrayLike, tensor: npt.ArrayLike, sub: npt.ArrayLike, owner: npt.ArrayLike,
            res_len: npt.ArrayLike, res_idx: npt.ArrayLike, lag: npt.ArrayLike = 0.0,
            micro: npt.ArrayLike = -1) -> np.ndarray:
        """Add ``len(dur)`` tasks (other per-task arguments broadcast); returns their ids. ``stage``: a name of
        ``STAGE``, or each task's code; ``lag``: seconds after a task's end until its dependents may start, its
        resources already free (a message's latency in flight; the simulator's task lag)."""
        k = len(dur)
        ids = np.arange(self.first_id + self.n, self.first_id + self.n + k, dtype=np.int64)
        self.n += k
        values = {"dur": dur, "lag": lag, "alloc": alloc, "kind": kind, "op": op, "dev": dev, "cat": cat,
                  "prio_op": prio_op, "owner": owner, "micro": micro,
                  "order": self.key(prio_op, STAGE[stage] if isinstance(stage, str) else stage, cls, tensor, sub)}
        for name, val in values.items():
            self._cols[name].append(_column(val, np.float64 if name in FLOAT_COLS else np.int64, k))
        self._res_len.append(_column(res_len, np.int64, k))
        self._res_idx.append(np.asarray(res_idx, dtype=np.int64).ravel())
        return ids

    def deps(self, task: npt.ArrayLike, on: npt.ArrayLike, owner: npt.ArrayLike) -> None:
        """``task[i]`` waits for ``on[i]``; the dependency belongs to emission unit ``owner``."""
        task = np.asarray(task, dtype=np.int64).ravel()
        self._dep.append((task, np.asarray(on, dtype=np.int64).ravel(),
                          int(owner) if isinstance(owner, (int, np.integer)) else      # one owner: spread when read
                          np.broadcast_to(np.asarray(owner, dtype=np.int64), task.shape)))

    def rewire(self, on: np.ndarray) -> None:
        """Make dependency i (in ``dependencies()``' order) wait for ``on[i]`` instead."""
        task, _, owner = self.dependencies()
        self._dep = [(task, np.asarray(on, dtype=np.int64), owner)]

    def tasks(self) -> Tasks:
        """The tasks added, in the order they were added."""
        def column(name: str, dtype: npt.DTypeLike) -> np.ndarray:
            parts = self._cols[name]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        ints = np.stack([column(k, np.int64) for k in INT_COLS]) if self.n else np.zeros((len(INT_COLS), 0), np.int64)
        floats = np.stack([column(k, np.float64) for k in FLOAT_COLS]) if self.n else np.zeros((len(FLOAT_COLS), 0))
        res_len = np.concatenate(self._res_len) if self._res_len else np.zeros(0, dtype=np.int64)
        res_idx = np.concatenate(self._res_idx) if self._res_idx else np.zeros(0, dtype=np.int64)
        return Tasks(ints, floats, _ptr(res_len), res_idx)

    def dependencies(self) -> Deps:
        """(task, on, owner) of the dependencies added."""
        if not self._dep:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        task, on = (np.concatenate([d[i] for d in self._dep]) for i in range(2))
        owner = np.concatenate([np.full(len(t), o, dtype=np.int64) if isinstance(o, int) else o
                                for t, _, o in self._dep])
        return task, on, owner


@dataclass
class Providers:
    """Where values are read from, as task ids: ``inst_start`` (n_ops,) the first instance of each op (its
    replicas follow in layout order); ``at`` (n_tensors, M) the task that provides each tensor's value on
    each device (an instance, or the aggregation), -1 where the value is not; ``layout`` (n_tensors,) the
    layout whose devices hold the (aggregated) value; ``again`` the tasks that provide a value a forward
    instance reads once more for its recomputation in backward, by the task its forward instance reads it
    from (a stage-3 parameter's backward landing and copy up, ``heterog.compiler.sharded_state``), in
    emission ids: the recomputation (``heterog.compiler.recompute``) reads them before the tasks are put
    in canonical order."""

    inst_start: np.ndarray
    at: np.ndarray
    layout: np.ndarray
    again: dict[int, int] = field(default_factory=dict)

    def copy(self) -> Providers:
        """An independent copy (a patch edits the copy, the base plan keeps its own)."""
        return Providers(self.inst_start.copy(), self.at.copy(), self.layout.copy(), dict(self.again))
