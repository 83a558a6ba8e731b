"""TaskGraph construction: ids, CSR storage, bulk add_tasks versus add_task, validation messages.

Bad input raises ValueError naming the offending task and leaves the graph unchanged.
"""
from __future__ import annotations

import numpy as np
import pytest

import simulator


def _two_gpu_graph() -> simulator.TaskGraph:
    tg = simulator.TaskGraph()
    tg.add_resource("gpu0", memory_capacity_bytes=16e9, resident_bytes=1000)
    tg.add_resource("gpu1")
    tg.add_resource("link0")
    return tg


def test_ids_and_csr_storage() -> None:
    tg = _two_gpu_graph()
    assert tg.n_resources == 3 and tg.resource_names == ["gpu0", "gpu1", "link0"]
    assert tg.resource_id("link0") == 2
    assert tg.memory_capacity_bytes.tolist() == [16_000_000_000, -1, -1]
    assert tg.resident_bytes.tolist() == [1000, 0, 0]
    a = tg.add_task([0], duration=1.0, mem={0: 5}, name="fwd", cat="compute")
    b = tg.add_task([2, 1], duration=0.5, deps=[a], priority=2.0, frees=[a], cat="transfer")
    c = tg.add_task([], deps=[a, b])
    assert (a, b, c) == (0, 1, 2) and tg.n_tasks == len(tg) == 3
    assert tg.duration.tolist() == [1.0, 0.5, 0.0]
    assert tg.priority.tolist() == [0.0, 2.0, 0.0]
    ptr, idx = tg.resources()
    assert ptr.tolist() == [0, 1, 3, 3] and idx.tolist() == [0, 2, 1]
    ptr, idx = tg.dependencies()
    assert ptr.tolist() == [0, 0, 1, 3] and idx.tolist() == [0, 0, 1]
    ptr, idx = tg.successors()
    assert ptr.tolist() == [0, 2, 3, 3] and idx.tolist() == [1, 2, 2]
    ptr, res, nbytes = tg.memory()
    assert ptr.tolist() == [0, 1, 1, 1] and res.tolist() == [0] and nbytes.tolist() == [5]
    ptr, idx = tg.frees()
    assert ptr.tolist() == [0, 0, 1, 1] and idx.tolist() == [0]
    assert [tg.task_name(t) for t in range(3)] == ["fwd", "t1", "t2"]
    assert [tg.task_cat(t) for t in range(3)] == ["compute", "transfer", ""]
    assert tg.category_names == ["", "compute", "transfer"]
    assert tg.task_resources(1).tolist() == [2, 1] and tg.task_deps(2).tolist() == [0, 1]
    with pytest.raises(ValueError, match="read-only"):  # the structure stays as validated
        tg.duration[0] = -1.0
    with pytest.raises(ValueError, match="read-only"):
        tg.dependencies()[1][0] = 2


def test_successors_cache_follows_new_tasks() -> None:
    tg = _two_gpu_graph()
    a = tg.add_task([0])
    assert tg.successors()[1].tolist() == []
    tg.add_task([0], deps=[a])
    assert tg.successors()[0].tolist() == [0, 1, 1] and tg.successors()[1].tolist() == [1]


def test_buffers_grow_past_their_initial_capacity() -> None:
    tg = _two_gpu_graph()
    for t in range(100):
        tg.add_task([t % 2], duration=1.0, deps=[t - 1] if t else [])
    assert tg.n_tasks == 100
    assert tg.dependencies()[1].tolist() == list(range(99))
    assert simulator.simulate(tg).makespan == 100.0


def test_add_tasks_batch_with_internal_deps_and_category_codes() -> None:
    tg = _two_gpu_graph()
    tg.add_task([0], duration=1.0)
    compute = tg.category("compute")
    ids = tg.add_tasks(np.array([1.0, 2.0, 3.0]), 1.5, np.array([0, 1, 2, 2]), np.array([0, 1]),
                       np.array([0, 1, 2, 4]), np.array([0, 1, 1, 2]), cats=np.array([compute, 0, compute]),
                       names=["x", "y", "z"])
    assert ids.tolist() == [1, 2, 3]
    assert tg.priority.tolist() == [0.0, 1.5, 1.5, 1.5]
    assert [tg.task_cat(t) for t in range(4)] == ["", "compute", "", "compute"]
    assert [tg.task_name(t) for t in range(4)] == ["t0", "x", "y", "z"]
    assert simulator.simulate(tg).finish.tolist() == [1.0, 2.0, 4.0, 7.0]


def test_prefix_is_a_closed_copy() -> None:
    tg = simulator.random_taskgraph(300, 4, 6, seed=3)
    small = tg.prefix(120)
    assert small.n_tasks == 120 and small.resource_names == tg.resource_names
    for part in ("resources", "dependencies", "frees"):
        big_ptr, big_idx = getattr(tg, part)()
        ptr, idx = getattr(small, part)()
        assert np.array_equal(ptr, big_ptr[:121]) and np.array_equal(idx, big_idx[:ptr[-1]])
    assert np.array_equal(small.task_category, tg.task_category[:120])
    full = simulator.simulate(tg.prefix(tg.n_tasks))
    assert np.array_equal(full.finish, simulator.simulate(tg).finish)


@pytest.mark.parametrize("kwargs, message", [
    ({"deps": [9]}, "task 2: dependency 9 does not exist yet"),
    ({"deps": [2]}, "task 2: dependency 2 does not exist yet"),
    ({"deps": [-1]}, "task 2: dependency -1 is not a task id"),
    ({"resources": [5]}, "task 2: resource 5 does not exist"),
    ({"resources": [1, 1]}, "task 2: resource 1 is listed twice"),
    ({"duration": -1.0}, "task 2: duration -1.0 s must be finite and >= 0"),
    ({"duration": float("inf")}, "task 2: duration inf s must be finite"),
    ({"duration": float("nan")}, "task 2: duration nan s must be finite"),
    ({"lag": -0.5}, "task 2: lag -0.5 s must be finite and >= 0"),
    ({"lag": float("inf")}, "task 2: lag inf s must be finite"),
    ({"lag": float("nan")}, "task 2: lag nan s must be finite"),
    ({"priority": float("nan")}, "task 2: priority is NaN"),
    ({"frees": [3]}, "task 2: frees task 3, which is neither an earlier task nor itself"),
    ({"mem": {7: 10}}, "task 2: memory on resource 7, which does not exist"),
    ({"mem": {0: -10}}, "task 2: negative memory -10 bytes on resource 0"),
])
def test_add_task_rejects_bad_input_and_leaves_the_graph_unchanged(kwargs: dict, message: str) -> None:
    tg = _two_gpu_graph()
    tg.add_task([0])
    tg.add_task([1])
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        tg.add_task(**{"resources": [0], **kwargs})
    assert tg.n_tasks == 2 and tg.dependencies()[1].size == 0


def test_lag_defaults_to_zero_broadcasts_and_is_validated_per_batch() -> None:
    tg = _two_gpu_graph()
    tg.add_task([0], duration=1.0)
    tg.add_task([1], duration=1.0, lag=0.25)
    tg.add_tasks(np.ones(2), 0.0, np.array([0, 0, 0]), None)  # lag None: zeros
    tg.add_tasks(np.ones(2), 0.0, np.array([0, 0, 0]), None, lag=1.5)  # one value for all
    tg.add_tasks(np.ones(2), 0.0, np.array([0, 0, 0]), None, lag=np.array([0.0, 2.0]))
    assert tg.lag.tolist() == [0.0, 0.25, 0.0, 0.0, 1.5, 1.5, 0.0, 2.0]
    with pytest.raises(ValueError, match="read-only"):
        tg.lag[0] = 1.0
    with pytest.raises(ValueError, match=r"lag has shape \(3,\), expected \(2,\) for 2 tasks"):
        tg.add_tasks(np.ones(2), 0.0, np.array([0, 0, 0]), None, lag=np.zeros(3))
    with pytest.raises(ValueError, match="task 9: lag -1.0 s must be finite and >= 0"):
        tg.add_tasks(np.ones(2), 0.0, np.array([0, 0, 0]), None, lag=np.array([0.0, -1.0]))
    assert tg.n_tasks == 8 and tg.lag.size == 8
    assert tg.prefix(7).lag.tolist() == tg.lag[:7].tolist()


def test_add_tasks_rejects_malformed_csr() -> None:
    tg = _two_gpu_graph()
    with pytest.raises(ValueError, match="resources ptr has length 2, expected 3"):
        tg.add_tasks(np.ones(2), 0.0, np.array([0, 1]), np.array([0]))
    with pytest.raises(ValueError, match="must start at 0, never decrease and end at len"):
        tg.add_tasks(np.ones(2), 0.0, np.array([0, 2, 1]), np.array([0]))
    with pytest.raises(ValueError, match="deps idx must be a 1-D integer array"):
        tg.add_tasks(np.ones(1), 0.0, np.array([0, 0]), np.array([]), np.array([0, 1]), np.array([0.5]))
    with pytest.raises(ValueError, match="mem_bytes has 0 entries, mem_res has 1"):
        tg.add_tasks(np.ones(1), 0.0, np.array([0, 0]), None, mem_ptr=np.array([0, 1]), mem_res=np.array([0]))
    with pytest.raises(ValueError, match="category codes must be in"):
        tg.add_tasks(np.ones(1), 0.0, np.array([0, 0]), None, cats=np.array([4]))
    with pytest.raises(ValueError, match="names has 1 entries for 2 tasks"):
        tg.add_tasks(np.ones(2), 0.0, np.array([0, 0, 0]), None, names=["a"])
    assert tg.n_tasks == 0


def test_bad_resources_and_priorities_are_rejected() -> None:
    tg = _two_gpu_graph()
    with pytest.raises(ValueError, match="resource name 'gpu0' already exists"):
        tg.add_resource("gpu0")
    with pytest.raises(ValueError, match="memory capacity -1 bytes must be >= 0"):
        tg.add_resource("gpu9", memory_capacity_bytes=-1)
    with pytest.raises(ValueError, match="resident bytes -5 must be >= 0"):
        tg.add_resource("gpu9", resident_bytes=-5)
    with pytest.raises(KeyError, match="no resource named 'nope'"):
        tg.resource_id("nope")
    tg.add_task([0])
    with pytest.raises(ValueError, match=r"priority has shape \(2,\), expected \(1,\)"):
        tg.priority = np.zeros(2)
    with pytest.raises(ValueError, match="priority of task 0 is NaN"):
        tg.priority = np.array([np.nan])
    with pytest.raises(ValueError, match=r"priority has shape \(3,\), expected \(1,\)"):
        simulator.simulate(tg, priority=np.zeros(3))
    tg.priority[0] = np.nan  # through the view: caught when simulating
    with pytest.raises(ValueError, match="priority of task 0 is NaN"):
        simulator.simulate(tg)


def test_float_byte_counts_are_rounded() -> None:
    tg = _two_gpu_graph()
    tg.add_task([0], mem={0: 2.5e3})
    tg.add_tasks(np.ones(1), 0.0, np.array([0, 0]), None, mem_ptr=np.array([0, 1]), mem_res=np.array([1]),
                 mem_bytes=np.array([7.6]))
    assert tg.memory()[2].tolist() == [2500, 8]
    with pytest.raises(ValueError, match="mem_bytes must be finite"):
        tg.add_tasks(np.ones(1), 0.0, np.array([0, 0]), None, mem_ptr=np.array([0, 1]), mem_res=np.array([1]),
                     mem_bytes=np.array([np.inf]))


def test_empty_copy_and_adopt_tasks_build_what_add_tasks_builds() -> None:
    tg = _two_gpu_graph()
    compute = tg.category("compute")
    i64 = np.int64
    arrays = dict(duration=np.array([1.0, 0.5, 0.0]), lag=np.array([0.0, 0.25, 0.0]),
                  cats=np.array([compute, 0, compute], dtype=i64), res_ptr=np.array([0, 1, 3, 3], dtype=i64),
                  res_idx=np.array([0, 2, 1], dtype=i64), dep_ptr=np.array([0, 0, 1, 3], dtype=i64),
                  dep_idx=np.array([0, 0, 1], dtype=i64), mem_ptr=np.array([0, 1, 1, 1], dtype=i64),
                  mem_res=np.array([0], dtype=i64), mem_bytes=np.array([5], dtype=i64))
    a = tg.empty_copy(resident_bytes=np.array([7, 0, 0])).adopt_tasks(**arrays)
    b = simulator.TaskGraph()
    for name, cap in (("gpu0", 16e9), ("gpu1", None), ("link0", None)):
        b.add_resource(name, memory_capacity_bytes=cap, resident_bytes=7 if name == "gpu0" else 0)
    b.category("compute")
    b.add_tasks(arrays["duration"], 0.0, arrays["res_ptr"], arrays["res_idx"], arrays["dep_ptr"], arrays["dep_idx"],
                arrays["mem_ptr"], arrays["mem_res"], arrays["mem_bytes"], arrays["dep_ptr"], arrays["dep_idx"],
                cats=arrays["cats"], lag=arrays["lag"])
    assert a.resource_names == b.resource_names and a.category_names == b.category_names
    for x, y in [(a.duration, b.duration), (a.lag, b.lag), (a.priority, b.priority), (a.task_category, b.task_category),
                 (a.resident_bytes, b.resident_bytes), (a.memory_capacity_bytes, b.memory_capacity_bytes),
                 *zip(a.resources(), b.resources()), *zip(a.dependencies(), b.dependencies()),
                 *zip(a.memory(), b.memory()), *zip(a.frees(), b.frees())]:
        assert x.tolist() == y.tolist()
    assert simulator.simulate(a).makespan == simulator.simulate(b).makespan == 1.75
    assert tg.n_tasks == 0 and tg.resident_bytes.tolist() == [1000, 0, 0]        # the template is untouched
    a.add_task([1], duration=1.0, deps=[2])                                        # adopted buffers still grow
    assert a.n_tasks == 4 and arrays["duration"].tolist() == [1.0, 0.5, 0.0]
    bad = dict(arrays, dep_idx=np.array([1, 0, 1], dtype=i64))                    # task 1 waits for itself
    with pytest.raises(ValueError, match="task 1: dependency 1 does not exist yet"):
        tg.empty_copy().adopt_tasks(**bad)
