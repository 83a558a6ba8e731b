"""Rank and FIFO priorities: compiled kernels equal their references; hand-computed ranks."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import simulator
from heterog.scheduler import earliest_start, priorities, upward_rank, upward_rank_reference


def diamond() -> simulator.TaskGraph:
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu")
    a = tg.add_task(resources=[g], duration=1.0)
    b = tg.add_task(resources=[g], duration=2.0, deps=[a])
    c = tg.add_task(resources=[g], duration=5.0, deps=[a])
    tg.add_task(resources=[g], duration=1.0, deps=[b, c])
    return tg


def test_upward_rank_by_hand():
    tg = diamond()
    ptr, idx = tg.successors()
    # d: 1; c: 5 + 1; b: 2 + 1; a: 1 + max(3, 6)
    assert upward_rank(tg.duration, ptr, idx).tolist() == [7.0, 3.0, 6.0, 1.0]


def test_rank_runs_the_longer_branch_first():
    tg = diamond()
    res = simulator.simulate(tg, priority=priorities(tg, "rank"))
    assert res.start.tolist() == [0.0, 6.0, 1.0, 8.0]


def test_earliest_start_by_hand():
    tg = diamond()
    ptr, idx = tg.dependencies()
    assert earliest_start(tg.duration, ptr, idx).tolist() == [0.0, 1.0, 1.0, 6.0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(0, 10_000))
def test_rank_kernel_equals_reference(n, seed):
    tg = simulator.random_taskgraph(n, 3, 4, seed)
    ptr, idx = tg.successors()
    assert np.array_equal(upward_rank(tg.duration, ptr, idx), upward_rank_reference(tg.duration, ptr, idx))


def test_fifo_serves_in_ready_order_not_priority():
    tg = simulator.TaskGraph()
    g, h = tg.add_resource("gpu"), tg.add_resource("other")
    a = tg.add_task(resources=[h], duration=1.0)             # ready at 0 on another resource
    tg.add_task(resources=[g], duration=4.0)                 # b: ready at 0
    tg.add_task(resources=[g], duration=1.0, deps=[a])       # c: ready at 1, high priority
    tg.add_task(resources=[g], duration=1.0)                 # d: ready at 0
    prio = np.array([0.0, 0.0, 100.0, 0.0])
    ranked = simulator.simulate(tg, priority=prio)
    fifo = simulator.simulate(tg, priority=prio, fifo=True)
    # by priority: b (id order) 0-4, then c (prio 100) 4-5, then d 5-6
    assert ranked.start.tolist() == [0.0, 0.0, 4.0, 5.0]
    # FIFO: b and d were ready at 0, before c (ready at 1): b 0-4, d 4-5, c 5-6
    assert fifo.start.tolist() == [0.0, 0.0, 5.0, 4.0]
    ref = simulator.simulate(tg, priority=prio, fifo=True, reference=True)
    assert ref.start.tolist() == fifo.start.tolist()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(0, 10_000))
def test_fifo_kernel_equals_reference(n, seed):
    tg = simulator.random_taskgraph(n, 3, 4, seed)
    a = simulator.simulate(tg, fifo=True)
    b = simulator.simulate(tg, fifo=True, reference=True)
    assert np.array_equal(a.start, b.start) and np.array_equal(a.peak_memory, b.peak_memory)


def test_rank_links_uses_rank_for_communication_and_est_for_compute():
    tg = diamond()
    comm = np.array([False, True, False, False])
    p = priorities(tg, "rank-links", comm_mask=comm)
    assert p.tolist() == [-0.0, 3.0, -1.0, -6.0]
