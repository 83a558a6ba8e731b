"""The random layered task graph generator and the simulator benchmark's report.

Throughput targets are benchmarks (``heterog bench``), not timed tests; here only their shape is checked.
"""
from __future__ import annotations

import numpy as np
import pytest

import simulator


def test_random_taskgraph_shape_and_determinism() -> None:
    tg = simulator.random_taskgraph(1000, 4, 6, seed=7, width=10)
    again = simulator.random_taskgraph(1000, 4, 6, seed=7, width=10)
    assert tg.n_tasks == 1000 and tg.n_resources == 10
    assert tg.resource_names[:5] == ["gpu0", "gpu1", "gpu2", "gpu3", "link0"]
    assert np.array_equal(tg.duration, again.duration) and np.array_equal(tg.priority, again.priority)
    ptr, idx = tg.resources()
    counts = np.diff(ptr)
    assert set(counts.tolist()) <= {1, 2}
    compute = tg.task_category == tg.category("compute")
    assert np.all(counts[compute] == 1) and np.all(idx[ptr[:-1][compute]] < 4)  # compute on one GPU
    assert np.all(idx[ptr[:-1][~compute]] >= 4)  # transfers on links
    dep_ptr, dep_idx = tg.dependencies()
    owner = np.repeat(np.arange(1000), np.diff(dep_ptr))
    assert np.all(owner // 10 - dep_idx // 10 == 1)  # deps come from the previous layer
    assert np.all(np.diff(dep_ptr)[10:] >= 1) and np.all(np.diff(dep_ptr)[:10] == 0)
    assert np.array_equal(tg.frees()[1], dep_idx)  # each task frees its inputs
    mem_ptr, _, _ = tg.memory()
    assert np.array_equal(np.diff(mem_ptr) == 1, compute)


def test_random_taskgraph_without_links_is_all_compute() -> None:
    tg = simulator.random_taskgraph(100, 2, 0, seed=0)
    assert tg.n_resources == 2 and np.all(tg.task_category == tg.category("compute"))


def test_bench_report() -> None:
    report = simulator.bench(n_tasks=3000, seed=1, n_reference_tasks=400, repeats=2)
    assert set(report) >= {"sim_tasks_per_s", "ref_tasks_per_s", "sim_speedup_vs_reference"}
    assert report["n_tasks"] == 3000 and report["n_reference_tasks"] == 400
    assert report["sim_tasks_per_s"] > 0 and report["ref_tasks_per_s"] > 0
    # the speed-up is the two rates on the same subgraph; how large it is, `heterog bench` reports
    assert report["sim_speedup_vs_reference"] == pytest.approx(
        report["sim_tasks_per_s_reference_graph"] / report["ref_tasks_per_s"])
