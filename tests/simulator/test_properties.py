"""Invariants of the simulator on random DAGs (hypothesis) and kernel/reference agreement.

Random graphs use few resources, tied priorities, zero or equal durations and lags drawn from the same
values, so that simultaneous events (finishes and arrivals), blocking and backfilling all occur.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import simulator

SETTINGS = settings(max_examples=40, deadline=None)
DURATIONS_S = [0.0, 0.1, 0.3, 0.5, 1.0, 2.0]
LAGS_S = [0.1, 0.2, 0.5, 1.0]  # drawn for about half the tasks; the others have lag 0


@dataclass
class Spec:
    """A graph as plain Python: per resource (capacity, resident), per task the add_task arguments."""

    resources: list[tuple[int | None, int]]
    tasks: list[dict]

    def build(self, batches: list[int] | None = None) -> simulator.TaskGraph:
        """With ``batches`` (sizes), through add_tasks in those batches; otherwise task by task."""
        tg = simulator.TaskGraph()
        for r, (capacity, resident) in enumerate(self.resources):
            tg.add_resource(f"r{r}", memory_capacity_bytes=capacity, resident_bytes=resident)
        if batches is None:
            for task in self.tasks:
                tg.add_task(**task)
            return tg
        first = 0
        for size in batches:
            part = self.tasks[first:first + size]
            first += size

            def csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
                ptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
                return ptr, np.array([v for x in lists for v in x], dtype=np.int64)

            res_ptr, res_idx = csr([t["resources"] for t in part])
            dep_ptr, dep_idx = csr([t["deps"] for t in part])
            free_ptr, free_idx = csr([t["frees"] for t in part])
            mem_ptr, mem_res = csr([list(t["mem"]) for t in part])
            mem_bytes = np.array([b for t in part for b in t["mem"].values()], dtype=np.int64)
            tg.add_tasks(np.array([t["duration"] for t in part], dtype=float),
                         np.array([t["priority"] for t in part], dtype=float), res_ptr, res_idx,
                         dep_ptr, dep_idx, mem_ptr, mem_res, mem_bytes, free_ptr, free_idx,
                         names=[t["name"] for t in part], cats=[t["cat"] for t in part],
                         lag=np.array([t["lag"] for t in part], dtype=float))
        return tg


@st.composite
def specs(draw: st.DrawFn, max_tasks: int = 24) -> Spec:
    n_res = draw(st.integers(1, 4))
    resources = [(draw(st.one_of(st.none(), st.integers(0, 400))), draw(st.integers(0, 50)))
                 for _ in range(n_res)]
    tasks = []
    for t in range(draw(st.integers(0, max_tasks))):
        tasks.append({
            "resources": draw(st.lists(st.integers(0, n_res - 1), max_size=min(3, n_res), unique=True)),
            "duration": draw(st.sampled_from(DURATIONS_S)),
            "deps": draw(st.lists(st.integers(0, t - 1), max_size=3)) if t else [],
            "priority": float(draw(st.integers(0, 3))),
            "mem": draw(st.dictionaries(st.integers(0, n_res - 1), st.integers(0, 100), max_size=2)),
            "frees": draw(st.lists(st.integers(0, t), max_size=2)),
            "name": f"task{t}",
            "cat": draw(st.sampled_from(["compute", "transfer", ""])),
            "lag": draw(st.one_of(st.just(0.0), st.sampled_from(LAGS_S))),
        })
    return Spec(resources, tasks)


def _critical_path_s(tg: simulator.TaskGraph) -> float:
    """Last arrival with unlimited resources: each task starts when its deps have arrived."""
    ptr, idx = tg.dependencies()
    arrival = np.zeros(tg.n_tasks)
    for t in range(tg.n_tasks):
        ready = max((arrival[d] for d in idx[ptr[t]:ptr[t + 1]]), default=0.0)
        arrival[t] = ready + tg.duration[t] + tg.lag[t]
    return float(arrival.max(initial=0.0))


def _with_lag(tg: simulator.TaskGraph, lag: np.ndarray) -> simulator.TaskGraph:
    """A copy of ``tg`` (names aside) rebuilt through add_tasks with per-task ``lag``."""
    out = simulator.TaskGraph()
    for r, name in enumerate(tg.resource_names):
        cap = int(tg.memory_capacity_bytes[r])
        out.add_resource(name, None if cap < 0 else cap, int(tg.resident_bytes[r]))
    for c in tg.category_names[1:]:
        out.category(c)
    out.add_tasks(tg.duration, tg.priority, *tg.resources(), *tg.dependencies(), *tg.memory(), *tg.frees(),
                  cats=tg.task_category.copy(), lag=lag)
    return out


def _assert_same_result(a: simulator.SimResult, b: simulator.SimResult) -> None:
    for name in ("start", "finish", "arrival", "release_time", "busy", "peak_memory"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name  # bit-identical
    assert a.makespan == b.makespan and a.oom == b.oom and a.oom_resources == b.oom_resources


@SETTINGS
@given(specs())
def test_schedule_invariants(spec: Spec) -> None:
    tg = spec.build()
    res = simulator.simulate(tg)
    n = tg.n_tasks
    assert np.array_equal(res.finish, res.start + tg.duration)
    assert np.array_equal(res.arrival, res.finish + tg.lag)
    # every dependency respected: a task starts no earlier than each dependency's arrival (finish + lag)
    ptr, idx = tg.dependencies()
    for t in range(n):
        for d in idx[ptr[t]:ptr[t + 1]]:
            assert res.start[t] >= res.finish[d] + tg.lag[d]
    # no two tasks overlap on a resource
    rptr, ridx = tg.resources()
    for r in range(tg.n_resources):
        on_r = [t for t in range(n) if r in ridx[rptr[t]:rptr[t + 1]]]
        intervals = sorted((res.start[t], res.finish[t]) for t in on_r)
        for (_, f0), (s1, _) in pairwise(intervals):
            assert s1 >= f0
        assert res.busy[r] == sum(tg.duration[t] for t in on_r)
    # makespan bounds: the last arrival; at every instant before it some task runs or is in its lag
    assert res.makespan == res.arrival.max(initial=0.0)
    total_s = float(tg.duration.sum() + tg.lag.sum())
    assert res.makespan >= _critical_path_s(tg) - 1e-12
    assert res.makespan >= res.busy.max(initial=0.0) - 1e-12
    assert res.makespan <= total_s + 1e-9
    assert np.all(res.utilization() <= 1.0 + 1e-12)


@SETTINGS
@given(specs())
def test_memory_invariants(spec: Spec) -> None:
    tg = spec.build()
    res = simulator.simulate(tg)
    fptr, fidx = tg.frees()
    mptr, mres, mbytes = tg.memory()
    # an allocation is released when the task and every task freeing it have finished (a task that
    # allocates nothing releases nothing)
    for x in range(tg.n_tasks):
        holders = [t for t in range(tg.n_tasks) if x in fidx[fptr[t]:fptr[t + 1]]]
        expected = max(res.finish[t] for t in holders + [x]) if holders and mptr[x + 1] > mptr[x] else np.inf
        assert res.release_time[x] == expected
    # the peak is at least resident plus any one allocation, and at most resident plus all of them
    for r in range(tg.n_resources):
        on_r = mbytes[mres == r]
        assert tg.resident_bytes[r] + on_r.max(initial=0) <= res.peak_memory[r]
        assert res.peak_memory[r] <= tg.resident_bytes[r] + on_r.sum()
        if fidx.size == 0:  # nothing is ever released
            assert res.peak_memory[r] == tg.resident_bytes[r] + on_r.sum()
        _, level_bytes = res.memory_timeline(r)
        assert level_bytes.max() <= res.peak_memory[r] and level_bytes[0] >= tg.resident_bytes[r]
    over = [r for r in range(tg.n_resources)
            if tg.memory_capacity_bytes[r] >= 0 and res.peak_memory[r] > tg.memory_capacity_bytes[r]]
    assert res.oom_resources == over and res.oom == bool(over)


@SETTINGS
@given(specs(), st.data())
def test_kernel_equals_reference(spec: Spec, data: st.DataObject) -> None:
    tg = spec.build()
    _assert_same_result(simulator.simulate(tg), simulator.simulate(tg, reference=True))
    override = np.array(data.draw(st.lists(st.integers(-2, 2), min_size=tg.n_tasks, max_size=tg.n_tasks)),
                        dtype=float)
    _assert_same_result(simulator.simulate(tg, priority=override),
                        simulator.simulate(tg, priority=override, reference=True))
    # FIFO: the ready time is the arrival of the last dependency
    _assert_same_result(simulator.simulate(tg, fifo=True), simulator.simulate(tg, fifo=True, reference=True))


@SETTINGS
@given(specs(), st.data())
def test_bulk_add_tasks_equals_repeated_add_task(spec: Spec, data: st.DataObject) -> None:
    n = len(spec.tasks)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3)))
    batches = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    one, bulk = spec.build(), spec.build(batches)
    for part in ("resources", "dependencies", "successors", "memory", "frees"):
        for x, y in zip(getattr(one, part)(), getattr(bulk, part)()):
            assert np.array_equal(x, y), part
    assert np.array_equal(one.duration, bulk.duration) and np.array_equal(one.priority, bulk.priority)
    assert np.array_equal(one.lag, bulk.lag) and one.lag.tolist() == [t["lag"] for t in spec.tasks]
    assert [one.task_cat(t) for t in range(n)] == [bulk.task_cat(t) for t in range(n)]
    assert [one.task_name(t) for t in range(n)] == [bulk.task_name(t) for t in range(n)]
    _assert_same_result(simulator.simulate(one), simulator.simulate(bulk))


@settings(max_examples=12, deadline=None)
@given(st.integers(50, 800), st.integers(1, 6), st.integers(0, 5), st.integers(1, 40), st.integers(0, 2**31),
       st.booleans(), st.booleans())
def test_kernel_equals_reference_on_layered_graphs(n_tasks: int, n_gpus: int, n_links: int, width: int,
                                                   seed: int, tied: bool, lagged: bool) -> None:
    tg = simulator.random_taskgraph(n_tasks, n_gpus, n_links, seed, width=width)
    if tied:  # few distinct priorities: many ties broken by id
        tg.priority = np.floor(tg.priority * 3)
    if lagged:  # transfers get a latency of up to twice their duration
        transfer = tg.task_category == tg.category("transfer")
        lag = np.where(transfer, 2.0 * np.random.default_rng(seed).random(tg.n_tasks) * tg.duration, 0.0)
        tg = _with_lag(tg, lag)
        assert np.array_equal(tg.lag, lag)
    _assert_same_result(simulator.simulate(tg), simulator.simulate(tg, reference=True))
    _assert_same_result(simulator.simulate(tg, fifo=True), simulator.simulate(tg, fifo=True, reference=True))


@SETTINGS
@given(specs(), st.data())
def test_kernel_equals_reference_when_frees_name_one_entry(spec: Spec, data: st.DataObject) -> None:
    """Frees that name one memory entry of the freed task (its position; -1 all of them, a position past
    its entries none), a task's frees of its own entries among them: kernel and reference agree bit for bit,
    entry by entry, and an entry goes once its task and every free naming it have finished."""
    base = spec.build()
    tg = simulator.TaskGraph()
    for r, name in enumerate(base.resource_names):
        cap = int(base.memory_capacity_bytes[r])
        tg.add_resource(name, None if cap < 0 else cap, int(base.resident_bytes[r]))
    fptr, fidx = base.frees()
    entry = np.array(data.draw(st.lists(st.integers(-1, 2), min_size=len(fidx), max_size=len(fidx))), dtype=np.int64)
    mptr, mres, mbytes = base.memory()
    tg.adopt_tasks(base.duration, base.lag, np.zeros(base.n_tasks, dtype=np.int64), *base.resources(),
                   *base.dependencies(), mptr, mres, mbytes, frees=(fptr, fidx), free_entry=entry)
    a, b = simulator.simulate(tg), simulator.simulate(tg, reference=True)
    _assert_same_result(a, b)
    assert np.array_equal(a.entry_release_time(), b.entry_release_time())
    releasing = np.repeat(np.arange(base.n_tasks), np.diff(fptr))
    for x in range(base.n_tasks):
        for k in range(int(mptr[x + 1] - mptr[x])):
            names = (fidx == x) & ((entry == -1) | (entry == k))
            expected = max(a.finish[t] for t in [x, *releasing[names].tolist()]) if names.any() else np.inf
            assert a.entry_release_time()[mptr[x] + k] == expected


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(2, 6), st.integers(1, 6), st.integers(20, 400), st.booleans(),
       st.booleans())
def test_kernel_equals_reference_where_tasks_share_routes(seed: int, n_res: int, n_routes: int, n_tasks: int,
                                                          tied: bool, lagged: bool) -> None:
    """Many tasks holding the same two or three resources (a parameter server's pushes and pulls over a few
    routes), ready together: the kernel's waiting sets against the reference's full scan."""
    rng = np.random.default_rng(seed)
    routes = [rng.choice(n_res, size=int(rng.integers(2, min(3, n_res) + 1)), replace=False).tolist()
              for _ in range(n_routes)]
    tg = simulator.TaskGraph()
    for r in range(n_res):
        tg.add_resource(f"r{r}")
    for t in range(n_tasks):
        kind = rng.random()
        resources = routes[int(rng.integers(n_routes))] if kind < 0.6 else \
            [int(rng.integers(n_res))] if kind < 0.9 else []
        deps = sorted(set(rng.integers(0, t, size=int(rng.integers(0, 3))).tolist())) if t > 8 else []
        tg.add_task(resources, float(rng.choice(DURATIONS_S)), deps, name=f"t{t}",
                    priority=float(rng.integers(0, 3) if tied else rng.random()),
                    lag=float(rng.choice(LAGS_S)) if lagged and rng.random() < 0.5 else 0.0)
    _assert_same_result(simulator.simulate(tg), simulator.simulate(tg, reference=True))
    _assert_same_result(simulator.simulate(tg, fifo=True), simulator.simulate(tg, fifo=True, reference=True))


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=60))
def test_resource_sets_number_equal_lists_of_two_or_more_in_order_of_first_appearance(lists: list[list[int]]) -> None:
    from simulator._kernel import resource_sets

    ptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
    idx = np.array([r for x in lists for r in x], dtype=np.int64)
    set_of, n_sets = resource_sets(ptr, idx)
    seen: dict[tuple[int, ...], int] = {}
    want = [seen.setdefault(tuple(x), len(seen)) if len(x) >= 2 else -1 for x in lists]
    assert set_of.tolist() == want and n_sets == len(seen)
