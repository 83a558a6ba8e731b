"""TaskGraph: tasks on exclusive resources (GPUs, links) with dependencies, lags, priorities and memory effects.

Stored as growable numpy CSR arrays so that a compiler can add tens of thousands of tasks in milliseconds.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import numpy as np

from simulator import _kernel

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_IntsLike: TypeAlias = np.ndarray | Sequence[int]  # an integer array or what np.asarray makes one of


class _Buffer:
    """A numpy array that grows by doubling; ``view()`` is the filled prefix."""

    __slots__ = ("data", "size")

    def __init__(self, dtype: type, initial: Sequence[int] = ()) -> None:
        self.data: np.ndarray = np.zeros(max(16, len(initial)), dtype=dtype)
        self.size = len(initial)
        self.data[:self.size] = initial

    def extend(self, values: np.ndarray) -> None:
        need = self.size + len(values)
        if need > len(self.data):
            grown = np.zeros(max(need, 2 * len(self.data)), dtype=self.data.dtype)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:need] = values
        self.size = need

    @classmethod
    def adopt(cls, values: np.ndarray) -> _Buffer:
        """A buffer holding ``values`` itself (no copy; the first ``extend`` reallocates)."""
        out = cls.__new__(cls)
        out.data, out.size = values, len(values)
        return out

    def view(self, writeable: bool = False) -> np.ndarray:
        out = self.data[:self.size]
        out.flags.writeable = writeable
        return out


def _int_array(values: _IntsLike | None, what: str) -> np.ndarray:
    arr = np.asarray(values if values is not None else _EMPTY_I64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D integer array, got dtype {arr.dtype} and shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _bytes_array(values: np.ndarray | Sequence[float] | None) -> np.ndarray:
    """Byte counts as int64; real-valued input is rounded to whole bytes."""
    arr = np.asarray(values if values is not None else _EMPTY_I64)
    if arr.size and np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():
            raise ValueError("mem_bytes must be finite")
        arr = np.rint(arr)
    return _int_array(arr.astype(np.int64) if arr.size else arr, "mem_bytes")


def _csr(ptr: _IntsLike | None, idx: _IntsLike | None, n_tasks: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Check a batch-local CSR pair (ptr of length n_tasks + 1 starting at 0); None means all empty."""
    if ptr is None:
        if idx is not None and len(idx) > 0:
            raise ValueError(f"{what}: entries given without a ptr array")
        return np.zeros(n_tasks + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ptr = _int_array(ptr, f"{what} ptr")
    idx = _int_array(idx, f"{what} idx")
    if len(ptr) != n_tasks + 1:
        raise ValueError(f"{what} ptr has length {len(ptr)}, expected {n_tasks + 1} for {n_tasks} tasks")
    if ptr[0] != 0 or ptr[-1] != len(idx) or np.any(ptr[1:] < ptr[:-1]):
        raise ValueError(f"{what} ptr must start at 0, never decrease and end at len(idx) = {len(idx)}")
    return ptr, idx


class TaskGraph:
    """A DAG of tasks on resources; task ids are 0, 1, 2, ... in order of addition and deps point back.

    Per task: resources it holds exclusively while it runs, duration (s), dependencies (earlier tasks),
    priority (higher runs first among ready tasks), memory allocated on resources when it starts
    (``mem``), and ``frees``: earlier tasks (or itself) whose allocations it consumes. The allocation of
    task x is released once x and all tasks naming x in ``frees`` have finished; if nobody names x it is
    never released. A graph filled by ``adopt_tasks`` may name one memory entry of x per free
    (``free_entries``): each entry is then released on its own, once x and the tasks naming it (or all
    of x) have finished. Per resource: a name, an optional memory capacity and bytes resident from time 0.

    A task's ``lag`` (s, default 0) delays only what its dependents see: it holds its resources for its
    duration and frees them (and its memory effects happen) at ``finish = start + duration``, but its
    dependents treat it as done at its arrival ``finish + lag``, like a message whose link is busy for
    the send and whose data lands a latency later (LogGP).

    Array properties (``duration``, ``lag``, ``priority``, the CSR pairs) are views of the internal buffers; read
    them again after adding tasks. Only ``priority`` is writeable: the structure stays as validated.
    """

    def __init__(self) -> None:
        self._res_names: list[str] = []
        self._res_id: dict[str, int] = {}
        self._capacity = _Buffer(np.int64)  # -1: no capacity
        self._resident = _Buffer(np.int64)
        self._duration = _Buffer(np.float64)
        self._lag = _Buffer(np.float64)
        self._priority = _Buffer(np.float64)
        self._cat = _Buffer(np.int64)
        self._res_ptr = _Buffer(np.int64, [0])
        self._res_idx = _Buffer(np.int64)
        self._dep_ptr = _Buffer(np.int64, [0])
        self._dep_idx = _Buffer(np.int64)
        self._mem_ptr = _Buffer(np.int64, [0])
        self._mem_res = _Buffer(np.int64)
        self._mem_bytes = _Buffer(np.int64)
        self._free_ptr = _Buffer(np.int64, [0])
        self._free_idx = _Buffer(np.int64)
        self._free_entry: np.ndarray | None = None  # per free: position of the entry it names, -1 all
        self._names: list[str] | None = None  # created when the first task name arrives
        self._cat_names: list[str] = [""]
        self._cat_code: dict[str, int] = {"": 0}
        self._succ_cache: tuple[int, np.ndarray, np.ndarray] | None = None

    # ---------------------------------------------------------------------------------- resources
    def add_resource(self, name: str, memory_capacity_bytes: float | None = None,
                     resident_bytes: float = 0) -> int:
        """Add a GPU or a link; returns its id (0, 1, 2, ...)."""
        name = str(name)
        if name in self._res_id:
            raise ValueError(f"resource name {name!r} already exists (id {self._res_id[name]})")
        if memory_capacity_bytes is not None and not memory_capacity_bytes >= 0:
            raise ValueError(f"resource {name!r}: memory capacity {memory_capacity_bytes} bytes must be >= 0")
        if not resident_bytes >= 0:
            raise ValueError(f"resource {name!r}: resident bytes {resident_bytes} must be >= 0")
        rid = len(self._res_names)
        self._res_names.append(name)
        self._res_id[name] = rid
        self._capacity.extend(np.array([-1 if memory_capacity_bytes is None else int(memory_capacity_bytes)]))
        self._resident.extend(np.array([int(resident_bytes)]))
        return rid

    @property
    def n_resources(self) -> int:
        return len(self._res_names)

    @property
    def resource_names(self) -> list[str]:
        return list(self._res_names)

    def resource_id(self, name: str) -> int:
        """Id of the resource called ``name``."""
        if name not in self._res_id:
            raise KeyError(f"no resource named {name!r}")
        return self._res_id[name]

    @property
    def memory_capacity_bytes(self) -> np.ndarray:
        """Capacity per resource, -1 where none was given."""
        return self._capacity.view()

    @property
    def resident_bytes(self) -> np.ndarray:
        return self._resident.view()

    # ---------------------------------------------------------------------------------- categories
    def category(self, name: str) -> int:
        """Integer code of task category ``name`` (registered on first use; "" is code 0)."""
        code = self._cat_code.get(name)
        if code is None:
            code = len(self._cat_names)
            self._cat_names.append(str(name))
            self._cat_code[name] = code
        return code

    @property
    def category_names(self) -> list[str]:
        """Category table: code -> name."""
        return list(self._cat_names)

    @property
    def task_category(self) -> np.ndarray:
        """Category code per task."""
        return self._cat.view()

    # ---------------------------------------------------------------------------------- tasks
    def add_task(self, resources: Sequence[int] = (), duration: float = 0.0, deps: Sequence[int] = (),
                 priority: float = 0.0, mem: Mapping[int, int] | None = None, frees: Sequence[int] = (),
                 name: str = "", cat: str = "", lag: float = 0.0) -> int:
        """Add one task (a thin wrapper of ``add_tasks``); returns its id."""
        res = np.asarray(list(resources), dtype=np.int64)
        dep = np.asarray(list(deps), dtype=np.int64)
        free = np.asarray(list(frees), dtype=np.int64)
        mem_items = list((mem or {}).items())
        ids = self.add_tasks(
            np.array([duration], dtype=np.float64), np.array([priority], dtype=np.float64),
            np.array([0, len(res)]), res, np.array([0, len(dep)]), dep,
            mem_ptr=np.array([0, len(mem_items)]),
            mem_res=np.array([r for r, _ in mem_items], dtype=np.int64),
            mem_bytes=np.array([b for _, b in mem_items]),
            free_ptr=np.array([0, len(free)]), free_idx=free,
            names=[name] if name else None, cats=cat, lag=np.array([lag], dtype=np.float64))
        return int(ids[0])

    def add_tasks(self, duration: np.ndarray, priority: np.ndarray | float, res_ptr: np.ndarray,
                  res_idx: np.ndarray, dep_ptr: np.ndarray | None = None, dep_idx: np.ndarray | None = None,
                  mem_ptr: np.ndarray | None = None, mem_res: np.ndarray | None = None,
                  mem_bytes: np.ndarray | None = None, free_ptr: np.ndarray | None = None,
                  free_idx: np.ndarray | None = None, names: Sequence[str] | None = None,
                  cats: str | Sequence[str] | np.ndarray | None = None,
                  lag: np.ndarray | float | None = None) -> np.ndarray:
        """Add k tasks at once from batch-local CSR arrays; returns their ids (n_tasks .. n_tasks + k - 1).

        Args:
            duration: seconds per task, finite and >= 0.
            priority: per task (or one value for all); higher runs first, no NaN.
            res_ptr, res_idx: resources held by each task (no resource twice in one task).
            dep_ptr, dep_idx: dependencies as global task ids, earlier tasks or earlier ones of this batch.
            mem_ptr, mem_res, mem_bytes: bytes allocated on resources when the task starts.
            free_ptr, free_idx: global ids of tasks (earlier ones or the task itself) whose allocations
                this task consumes.
            names: one name per task (optional).
            cats: one category name for all, one per task, or integer codes from ``category``.
            lag: seconds per task (or one value for all; None: 0), finite and >= 0, between a task's
                finish (resources free) and its arrival (dependents may start).

        Shapes:
            duration, priority, lag: (k,); every ptr: (k + 1,) starting at 0; idx arrays: (ptr[-1],).
        The batch is checked as a whole before anything is added; a bad one raises ValueError naming the
        first offending task.
        """
        duration = np.ascontiguousarray(duration, dtype=np.float64)
        if duration.ndim != 1:
            raise ValueError(f"duration must be 1-D, got shape {duration.shape}")
        k = len(duration)
        priority = np.ascontiguousarray(np.broadcast_to(np.asarray(priority, dtype=np.float64), (k,)))
        lag = np.zeros(k) if lag is None else np.asarray(lag, dtype=np.float64)
        if lag.ndim == 0:
            lag = np.full(k, float(lag))
        elif lag.shape != (k,):
            raise ValueError(f"lag has shape {lag.shape}, expected ({k},) for {k} tasks")
        lag = np.ascontiguousarray(lag)
        res_ptr, res_idx = _csr(res_ptr, res_idx, k, "resources")
        dep_ptr, dep_idx = _csr(dep_ptr, dep_idx, k, "deps")
        mem_ptr, mem_res = _csr(mem_ptr, mem_res, k, "mem")
        mem_bytes = _bytes_array(mem_bytes)
        if len(mem_bytes) != len(mem_res):
            raise ValueError(f"mem_bytes has {len(mem_bytes)} entries, mem_res has {len(mem_res)}")
        free_ptr, free_idx = _csr(free_ptr, free_idx, k, "frees")
        if names is not None and len(names) != k:
            raise ValueError(f"names has {len(names)} entries for {k} tasks")
        cat_codes = self._category_codes(cats, k)

        first = self.n_tasks
        code, i, j = _kernel.validate_batch(first, self.n_resources, duration, lag, priority, res_ptr, res_idx,
                                            dep_ptr, dep_idx, mem_ptr, mem_res, mem_bytes, free_ptr, free_idx)
        if code != _kernel.OK:
            raise ValueError(self._batch_error(code, first + i, j, duration, lag, res_idx, dep_idx, mem_res,
                                               mem_bytes, free_idx))

        self._duration.extend(duration)
        self._lag.extend(lag)
        self._priority.extend(priority)
        self._cat.extend(cat_codes)
        for ptr, idx, buf_ptr, buf_idx in ((res_ptr, res_idx, self._res_ptr, self._res_idx),
                                           (dep_ptr, dep_idx, self._dep_ptr, self._dep_idx),
                                           (mem_ptr, mem_res, self._mem_ptr, self._mem_res),
                                           (free_ptr, free_idx, self._free_ptr, self._free_idx)):
            buf_ptr.extend(ptr[1:] + buf_idx.size)
            buf_idx.extend(idx)
        self._mem_bytes.extend(mem_bytes)
        if names is not None:
            if self._names is None:
                self._names = [""] * first
            self._names.extend(str(s) for s in names)
        elif self._names is not None:
            self._names.extend([""] * k)
        return np.arange(first, first + k, dtype=np.int64)

    def empty_copy(self, resident_bytes: np.ndarray | None = None) -> TaskGraph:
        """A graph with this graph's resources and categories and no tasks; ``resident_bytes`` (n_resources,)
        replaces the resident bytes."""
        out = TaskGraph()
        out._res_names, out._res_id = list(self._res_names), dict(self._res_id)
        out._capacity = _Buffer.adopt(self._capacity.view().copy())
        resident = self._resident.view() if resident_bytes is None else np.asarray(resident_bytes)
        if resident.shape != (self.n_resources,) or np.any(resident < 0):
            raise ValueError(f"resident_bytes must be {self.n_resources} non-negative values")
        out._resident = _Buffer.adopt(resident.astype(np.int64))
        out._cat_names, out._cat_code = list(self._cat_names), dict(self._cat_code)
        return out

    def adopt_tasks(self, duration: np.ndarray, lag: np.ndarray, cats: np.ndarray, res_ptr: np.ndarray,
                    res_idx: np.ndarray, dep_ptr: np.ndarray, dep_idx: np.ndarray, mem_ptr: np.ndarray,
                    mem_res: np.ndarray, mem_bytes: np.ndarray, *, validate: bool = True,
                    frees: tuple[np.ndarray, np.ndarray] | None = None,
                    free_entry: np.ndarray | None = None) -> TaskGraph:
        """Fill a graph without tasks from arrays it keeps (no copies: do not modify them afterwards).

        For a compiler that builds every task at once: int64 CSR arrays as in ``add_tasks``, category codes
        registered with ``category``, integer byte counts, each task freeing its dependencies
        (``free_ptr, free_idx = dep_ptr, dep_idx``) unless ``frees`` gives them as (ptr, idx) (a task
        that only orders others frees nothing), priorities 0. ``free_entry`` (one per free): the position,
        among the freed task's memory entries, of the one it releases (-1: all). ``validate`` runs the checks of
        ``add_tasks``; without it the caller vouches for the arrays (deps point back, resources exist,
        durations and lags finite and >= 0).
        """
        if self.n_tasks:
            raise ValueError(f"adopt_tasks needs a graph without tasks, this one has {self.n_tasks}")
        k = len(duration)
        priority = np.zeros(k)
        free_ptr, free_idx = (dep_ptr, dep_idx) if frees is None else frees
        if free_entry is not None and len(free_entry) != len(free_idx):
            raise ValueError(f"free_entry has {len(free_entry)} entries, the frees {len(free_idx)}")
        if validate:
            for name, (ptr, idx) in (("resources", (res_ptr, res_idx)), ("deps", (dep_ptr, dep_idx)),
                                     ("mem", (mem_ptr, mem_res))):
                _csr(ptr, idx, k, name)
            if len(mem_bytes) != len(mem_res):
                raise ValueError(f"mem_bytes has {len(mem_bytes)} entries, mem_res has {len(mem_res)}")
            self._category_codes(cats, k)
            code, i, j = _kernel.validate_batch(0, self.n_resources, duration, lag, priority, res_ptr, res_idx,
                                                dep_ptr, dep_idx, mem_ptr, mem_res, mem_bytes, free_ptr, free_idx)
            if code != _kernel.OK:
                raise ValueError(self._batch_error(code, i, j, duration, lag, res_idx, dep_idx, mem_res,
                                                   mem_bytes, free_idx))
        self._duration, self._lag, self._priority = _Buffer.adopt(duration), _Buffer.adopt(lag), _Buffer.adopt(priority)
        self._cat = _Buffer.adopt(cats)
        self._res_ptr, self._res_idx = _Buffer.adopt(res_ptr), _Buffer.adopt(res_idx)
        self._dep_ptr, self._dep_idx = _Buffer.adopt(dep_ptr), _Buffer.adopt(dep_idx)
        self._free_ptr, self._free_idx = _Buffer.adopt(free_ptr), _Buffer.adopt(free_idx)
        self._free_entry = free_entry
        self._mem_ptr, self._mem_res, self._mem_bytes = _Buffer.adopt(mem_ptr), _Buffer.adopt(mem_res), \
            _Buffer.adopt(mem_bytes)
        return self

    def _category_codes(self, cats: str | Sequence[str] | np.ndarray | None, k: int) -> np.ndarray:
        if cats is None:
            return np.zeros(k, dtype=np.int64)
        if isinstance(cats, str):
            return np.full(k, self.category(cats), dtype=np.int64)
        if isinstance(cats, np.ndarray) and np.issubdtype(cats.dtype, np.integer):
            if cats.shape != (k,):
                raise ValueError(f"cats has shape {cats.shape} for {k} tasks")
            if k and (cats.min() < 0 or cats.max() >= len(self._cat_names)):
                raise ValueError(f"category codes must be in [0, {len(self._cat_names)}); register names "
                                 "with TaskGraph.category first")
            return cats.astype(np.int64)
        if len(cats) != k:
            raise ValueError(f"cats has {len(cats)} entries for {k} tasks")
        return np.fromiter((self.category(c) for c in cats), dtype=np.int64, count=k)

    def _batch_error(self, code: int, t: int, j: int, duration: np.ndarray, lag: np.ndarray, res_idx: np.ndarray,
                     dep_idx: np.ndarray, mem_res: np.ndarray, mem_bytes: np.ndarray, free_idx: np.ndarray) -> str:
        if code == _kernel.BAD_DURATION:
            return f"task {t}: duration {duration[t - self.n_tasks]} s must be finite and >= 0"
        if code == _kernel.BAD_LAG:
            return f"task {t}: lag {lag[t - self.n_tasks]} s must be finite and >= 0"
        if code == _kernel.NAN_PRIORITY:
            return f"task {t}: priority is NaN"
        if code == _kernel.BAD_RESOURCE:
            return f"task {t}: resource {res_idx[j]} does not exist (the graph has {self.n_resources})"
        if code == _kernel.DUPLICATE_RESOURCE:
            return f"task {t}: resource {res_idx[j]} is listed twice"
        if code == _kernel.BAD_DEPENDENCY:
            d = dep_idx[j]
            return f"task {t}: dependency {d} " + ("does not exist yet" if d >= 0 else "is not a task id")
        if code == _kernel.BAD_FREE:
            return f"task {t}: frees task {free_idx[j]}, which is neither an earlier task nor itself"
        if code == _kernel.BAD_MEM_RESOURCE:
            return f"task {t}: memory on resource {mem_res[j]}, which does not exist"
        return f"task {t}: negative memory {mem_bytes[j]} bytes on resource {mem_res[j]}"

    # ---------------------------------------------------------------------------------- reading
    @property
    def n_tasks(self) -> int:
        return self._duration.size

    def __len__(self) -> int:
        return self.n_tasks

    def __repr__(self) -> str:
        return (f"TaskGraph({self.n_tasks} tasks, {self.n_resources} resources, "
                f"{self._dep_idx.size} dependencies)")

    @property
    def duration(self) -> np.ndarray:
        """Seconds per task, shape (n_tasks,)."""
        return self._duration.view()

    @property
    def lag(self) -> np.ndarray:
        """Seconds from each task's finish to its arrival (when dependents see it done), shape (n_tasks,)."""
        return self._lag.view()

    @property
    def priority(self) -> np.ndarray:
        """Priority per task, shape (n_tasks,) (a view: writing into it changes the graph)."""
        return self._priority.view(writeable=True)

    @priority.setter
    def priority(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (self.n_tasks,):
            raise ValueError(f"priority has shape {values.shape}, expected ({self.n_tasks},)")
        if np.isnan(values).any():
            raise ValueError(f"priority of task {int(np.flatnonzero(np.isnan(values))[0])} is NaN")
        self._priority.data[:self.n_tasks] = values

    def resources(self) -> tuple[np.ndarray, np.ndarray]:
        """Resources held per task as CSR (ptr (n_tasks + 1,), idx)."""
        return self._res_ptr.view(), self._res_idx.view()

    def dependencies(self) -> tuple[np.ndarray, np.ndarray]:
        """Dependencies per task as CSR (ptr (n_tasks + 1,), idx)."""
        return self._dep_ptr.view(), self._dep_idx.view()

    def successors(self) -> tuple[np.ndarray, np.ndarray]:
        """Dependents per task as CSR (ptr (n_tasks + 1,), idx), each row in increasing task id."""
        n = self.n_tasks
        if self._succ_cache is None or self._succ_cache[0] != n:
            ptr, idx = _kernel.transpose_csr(self._dep_ptr.view(), self._dep_idx.view(), n)
            ptr.flags.writeable = idx.flags.writeable = False
            self._succ_cache = (n, ptr, idx)
        return self._succ_cache[1], self._succ_cache[2]

    def memory(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Allocations per task as CSR (ptr (n_tasks + 1,), resource, bytes)."""
        return self._mem_ptr.view(), self._mem_res.view(), self._mem_bytes.view()

    def frees(self) -> tuple[np.ndarray, np.ndarray]:
        """Tasks whose allocations each task consumes, as CSR (ptr (n_tasks + 1,), idx)."""
        return self._free_ptr.view(), self._free_idx.view()

    def free_entries(self) -> np.ndarray:
        """Per free (``frees`` order): the position, among the freed task's memory entries, of the one it
        releases; -1 releases all of them."""
        n = self._free_idx.size
        fe = self._free_entry
        if fe is None or len(fe) != n:
            out = np.full(n, -1, dtype=np.int64)
            if fe is not None:
                out[:len(fe)] = fe
            return out
        return fe

    def task_resources(self, t: int) -> np.ndarray:
        ptr, idx = self.resources()
        return idx[ptr[t]:ptr[t + 1]]

    def task_deps(self, t: int) -> np.ndarray:
        ptr, idx = self.dependencies()
        return idx[ptr[t]:ptr[t + 1]]

    def task_name(self, t: int) -> str:
        """The task's name, or ``t<id>`` if it has none."""
        name = self._names[t] if self._names is not None else ""
        return name or f"t{t}"

    def task_cat(self, t: int) -> str:
        return self._cat_names[self._cat.data[t]]

    def prefix(self, n_tasks: int) -> TaskGraph:
        """A copy holding the resources and the first ``n_tasks`` tasks (closed: deps point back)."""
        if not 0 <= n_tasks <= self.n_tasks:
            raise ValueError(f"prefix of {n_tasks} tasks requested from a graph of {self.n_tasks}")
        out = TaskGraph()
        for r, name in enumerate(self._res_names):
            cap = int(self._capacity.data[r])
            out.add_resource(name, None if cap < 0 else cap, int(self._resident.data[r]))
        for c in self._cat_names[1:]:
            out.category(c)

        def cut(buf_ptr: _Buffer, *bufs: _Buffer) -> tuple[np.ndarray, ...]:
            ptr = buf_ptr.data[:n_tasks + 1]
            return (ptr,) + tuple(b.data[:ptr[-1]] for b in bufs)

        res_ptr, res_idx = cut(self._res_ptr, self._res_idx)
        dep_ptr, dep_idx = cut(self._dep_ptr, self._dep_idx)
        mem_ptr, mem_res, mem_bytes = cut(self._mem_ptr, self._mem_res, self._mem_bytes)
        free_ptr, free_idx = cut(self._free_ptr, self._free_idx)
        out.add_tasks(self._duration.data[:n_tasks], self._priority.data[:n_tasks], res_ptr, res_idx,
                      dep_ptr, dep_idx, mem_ptr, mem_res, mem_bytes, free_ptr, free_idx,
                      names=None if self._names is None else self._names[:n_tasks],
                      cats=self._cat.data[:n_tasks].copy(), lag=self._lag.data[:n_tasks])
        if self._free_entry is not None:
            out._free_entry = self.free_entries()[:len(free_idx)].copy()
        return out
