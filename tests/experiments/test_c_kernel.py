"""experiments.c_kernel: the C translation of the event loop schedules exactly as the numba kernel (where a C
compiler is installed; the project itself never needs one)."""
from __future__ import annotations

import numpy as np
import pytest

from experiments import c_kernel
from simulator import _kernel
from simulator.bench import random_taskgraph
from simulator.taskgraph import TaskGraph

pytestmark = pytest.mark.skipif(c_kernel.compiler() is None, reason="no C compiler on this machine")


def with_lags(tg: TaskGraph, seed: int) -> TaskGraph:
    """A copy of ``tg`` where a third of the tasks arrive a random lag after they finish."""
    rng = np.random.default_rng(seed)
    out = TaskGraph()
    for name, cap, res in zip(tg.resource_names, tg.memory_capacity_bytes, tg.resident_bytes):
        out.add_resource(name, memory_capacity_bytes=int(cap) if cap >= 0 else None, resident_bytes=int(res))
    lag = np.where(rng.random(tg.n_tasks) < 1 / 3, rng.exponential(5e-4, tg.n_tasks), 0.0)
    out.add_tasks(tg.duration, tg.priority, *tg.resources(), *tg.dependencies(), *tg.memory(), *tg.frees(), lag=lag)
    return out


@pytest.mark.parametrize("fifo", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_c_kernel_gives_the_numba_kernels_schedule(tmp_path, fifo, seed):
    fn = c_kernel.build(tmp_path)
    for tg in (random_taskgraph(3000, 4, 6, seed), with_lags(random_taskgraph(3000, 4, 6, seed), seed)):
        args = c_kernel.kernel_args(tg)
        ours = _kernel.simulate_kernel(*args, fifo)
        theirs = c_kernel.run_c(fn, args, fifo)
        assert theirs[5] == ours[5] == tg.n_tasks
        for a, b in zip(ours[:5], theirs[:5]):
            np.testing.assert_array_equal(a, b)
    assert (tg.lag > 0).any()


def test_compare_reports_both_rates(tmp_path):
    row = c_kernel.compare(c_kernel.build(tmp_path), random_taskgraph(2000, 4, 6, 0), True, repeats=3)
    assert row["tasks"] == 2000 and row["c_tasks_per_s"] > 0 and row["numba_tasks_per_s"] > 0
    assert row["c_over_numba"] == pytest.approx(row["numba_ms"] / row["c_ms"])
