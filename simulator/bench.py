"""Random layered task graphs shaped like compiled training iterations, and the simulator benchmark.

``bench`` times the compiled kernel against the plain-Python reference in the same run.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from simulator.engine import simulate
from simulator.taskgraph import TaskGraph

GIB = 1 << 30


def random_taskgraph(n_tasks: int, n_gpus: int = 8, n_links: int = 20, seed: int = 0, *,
                     width: int | None = None, mean_deps: float = 2.0,
                     gpu_memory_bytes: int = 16 * GIB) -> TaskGraph:
    """A layered random DAG: ``width`` tasks per layer, each depending on ~``mean_deps`` tasks of the
    layer before (at least one). 60% are compute tasks on one GPU (~1 ms, allocating 1-64 MiB there),
    the rest transfers holding 1 or 2 links (~0.5 ms; all compute when ``n_links`` is 0). Every task frees
    its dependencies' allocations (activations die after their last consumer). Priorities are random in [0, 1)."""
    if n_tasks < 0 or n_gpus < 1 or n_links < 0:
        raise ValueError(f"need n_tasks >= 0, n_gpus >= 1, n_links >= 0; got {n_tasks}, {n_gpus}, {n_links}")
    rng = np.random.default_rng(seed)
    width = width or 2 * n_gpus
    tg = TaskGraph()
    for g in range(n_gpus):
        tg.add_resource(f"gpu{g}", memory_capacity_bytes=gpu_memory_bytes, resident_bytes=GIB)
    for i in range(n_links):
        tg.add_resource(f"link{i}")
    compute_cat, transfer_cat = tg.category("compute"), tg.category("transfer")

    ids = np.arange(n_tasks)
    layer = ids // width
    n_deps = np.where(layer > 0, 1 + rng.poisson(max(mean_deps - 1.0, 0.0), n_tasks), 0)
    n_deps = np.minimum(n_deps, width)
    dep_ptr = np.concatenate([[0], np.cumsum(n_deps)])
    owner = np.repeat(ids, n_deps)
    dep_idx = (layer[owner] - 1) * width + rng.integers(0, width, len(owner))

    compute = rng.random(n_tasks) < (0.6 if n_links else 1.0)
    n_res = np.where(compute, 1, 1 + ((rng.random(n_tasks) < 0.5) & (n_links >= 2)))
    res_ptr = np.concatenate([[0], np.cumsum(n_res)])
    first = np.where(compute, rng.integers(0, n_gpus, n_tasks),
                     n_gpus + rng.integers(0, max(n_links, 1), n_tasks))  # links unused when n_links = 0
    offset = 1 + rng.integers(0, max(n_links - 1, 1), n_tasks)
    second = n_gpus + (first - n_gpus + offset) % max(n_links, 1)  # a link other than the first
    res_idx = np.empty(res_ptr[-1], dtype=np.int64)
    res_idx[res_ptr[:-1]] = first
    two = n_res == 2
    res_idx[res_ptr[:-1][two] + 1] = second[two]

    duration_s = np.where(compute, rng.lognormal(np.log(1e-3), 0.8, n_tasks),
                          rng.lognormal(np.log(5e-4), 0.8, n_tasks))
    mem_ptr = np.concatenate([[0], np.cumsum(compute)])
    mem_res = first[compute]
    mem_bytes = rng.integers(1 << 20, 64 << 20, int(compute.sum()))
    tg.add_tasks(duration_s, rng.random(n_tasks), res_ptr, res_idx, dep_ptr, dep_idx,
                 mem_ptr, mem_res, mem_bytes, dep_ptr, dep_idx,
                 cats=np.where(compute, compute_cat, transfer_cat))
    return tg


def _median_seconds(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.thread_time) -> float:
    """Median over ``repeats`` calls of ``fn`` as measured by ``clock``."""
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(np.median(times))


def bench(n_tasks: int = 50000, seed: int = 0, *, n_reference_tasks: int = 5000, repeats: int = 9) -> dict:
    """Simulator throughput on ``random_taskgraph(n_tasks, 8, 20, seed)``.

    Rates are per CPU-second of the calling thread (``time.thread_time``): tasks per second on one core,
    robust to other processes sharing the machine; ``sim_wall_ms`` is the wall-clock median beside it.
    ``sim_tasks_per_s``: ``simulate(tg)`` (the compiled kernel plus its Python wrapper) on the full graph,
    median of ``repeats`` runs after a warm-up, with the graph's successor lists already built (the rank
    scheduler builds them first in real use); ``sim_cold_ms`` rebuilds them on every run. The reference is
    timed on the graph's first ``n_reference_tasks`` tasks (a closed sub-DAG), and
    ``sim_speedup_vs_reference`` compares it with the kernel on that same subgraph in this run.
    """
    tg = random_taskgraph(n_tasks, 8, 20, seed)
    small = tg.prefix(min(n_reference_tasks, n_tasks))

    def run_cold(graph: TaskGraph) -> None:
        graph._succ_cache = None
        simulate(graph)

    simulate(tg)  # warm-up: loads (or compiles) the cached kernel
    build_s = _median_seconds(lambda: random_taskgraph(n_tasks, 8, 20, seed + 1), 3)
    sim_s = _median_seconds(lambda: simulate(tg), repeats)
    sim_wall_s = _median_seconds(lambda: simulate(tg), repeats, time.perf_counter)
    sim_cold_s = _median_seconds(lambda: run_cold(tg), repeats)
    simulate(small)
    sim_small_s = _median_seconds(lambda: simulate(small), repeats)
    ref_small_s = _median_seconds(lambda: simulate(small, reference=True), 3)
    return {
        "n_tasks": n_tasks,
        "n_reference_tasks": small.n_tasks,
        "sim_ms": sim_s * 1e3,
        "sim_wall_ms": sim_wall_s * 1e3,
        "sim_cold_ms": sim_cold_s * 1e3,
        "sim_tasks_per_s": n_tasks / sim_s,
        "sim_tasks_per_s_reference_graph": small.n_tasks / sim_small_s,
        "ref_tasks_per_s": small.n_tasks / ref_small_s,
        "sim_speedup_vs_reference": ref_small_s / sim_small_s,
        "random_taskgraph_tasks_per_s": n_tasks / build_s,
    }
