"""Rank and FIFO priorities: compiled kernels equal their references; hand-computed ranks."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import simulator
from heterog.scheduler import (
    contention_rank,
    contention_rank_reference,
    earliest_start,
    priorities,
    upward_rank,
    upward_rank_reference,
)


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


def two_gradients() -> simulator.TaskGraph:
    """A backward step in miniature: two weight gradients (w1, w2: 1 s on the GPU) each feed an
    AllReduce (3 s on the one link); the input-gradient chain (c: 4 s, then e: 1 s) needs the GPU too."""
    tg = simulator.TaskGraph()
    g, link = tg.add_resource("gpu"), tg.add_resource("link")
    w1 = tg.add_task(resources=[g], duration=1.0)
    w2 = tg.add_task(resources=[g], duration=1.0)
    c = tg.add_task(resources=[g], duration=4.0)
    tg.add_task(resources=[link], duration=3.0, deps=[w1])
    tg.add_task(resources=[link], duration=3.0, deps=[w2])
    tg.add_task(resources=[g], duration=1.0, deps=[c])
    return tg


def test_contention_rank_by_hand_lifts_gradients_that_feed_a_busy_link():
    tg = two_gradients()
    ptr, idx = tg.successors()
    rp, ri = tg.resources()
    assert upward_rank(tg.duration, ptr, idx).tolist() == [4.0, 4.0, 5.0, 3.0, 3.0, 1.0]
    # floors: link in rank order (a1, a2): a2 3 + 0, a1 6 + 0; GPU (c, w1, w2, e): e 1, w2 2, w1 3, c 7
    # rank_c: e 1; a2 3; a1 max(3, 6) = 6; c max(4 + 1, 7) = 7; w2 max(1 + 3, 2) = 4; w1 max(1 + 6, 3) = 7
    want = [7.0, 4.0, 7.0, 6.0, 3.0, 1.0]
    assert contention_rank(tg.duration, ptr, idx, rp, ri, tg.n_resources).tolist() == want
    assert contention_rank_reference(tg.duration, ptr, idx, rp, ri, tg.n_resources).tolist() == want
    assert priorities(tg, "rank-contention").tolist() == want
    # plain rank: c 0-4, w1 4-5, w2 5-6, e 6-7 on the GPU; the link idles until 5: a1 5-8, a2 8-11
    plain = simulator.simulate(tg, priority=priorities(tg, "rank"))
    assert plain.makespan == 11.0
    # rank-contention: w1 first (ties with c, lower id): w1 0-1, c 1-5, w2 5-6, e 6-7; a1 1-4, a2 6-9
    lifted = simulator.simulate(tg, priority=priorities(tg, "rank-contention"))
    assert lifted.start.tolist() == [0.0, 5.0, 1.0, 1.0, 6.0, 6.0] and lifted.makespan == 9.0


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(0, 10_000))
def test_contention_rank_kernel_equals_reference_and_bounds_rank(n, seed):
    tg = simulator.random_taskgraph(n, 3, 4, seed)
    ptr, idx = tg.successors()
    rp, ri = tg.resources()
    got = contention_rank(tg.duration, ptr, idx, rp, ri, tg.n_resources)
    assert np.array_equal(got, contention_rank_reference(tg.duration, ptr, idx, rp, ri, tg.n_resources))
    assert np.all(got >= upward_rank(tg.duration, ptr, idx))


def test_lag_lengthens_paths_but_is_no_work_of_the_resource():
    tg = simulator.TaskGraph()
    g, link = tg.add_resource("gpu"), tg.add_resource("link")
    a = tg.add_task(resources=[g], duration=1.0)
    b = tg.add_task(resources=[link], duration=1.0, deps=[a], lag=4.0)      # a message 4 s in flight
    c = tg.add_task(resources=[g], duration=3.0, deps=[a])
    tg.add_task(resources=[g], duration=1.0, deps=[b, c])
    ptr, idx = tg.successors()
    rp, ri = tg.resources()
    # d: 1; c: 3 + 1; b: 1 + 4 + 1; a: 1 + max(6, 4)  (without the lag a would be 1 + max(2, 4) = 5)
    assert priorities(tg, "rank").tolist() == [7.0, 6.0, 4.0, 1.0]
    assert priorities(tg, "est").tolist() == [-0.0, -1.0, -1.0, -6.0]
    # GPU floors in rank order (a, c, d): d 1 + 0, c 4 + 0, a 5 + 0; none above the plain rank
    want = [7.0, 6.0, 4.0, 1.0]
    assert contention_rank(tg.duration, ptr, idx, rp, ri, tg.n_resources, lag=tg.lag).tolist() == want
    assert contention_rank_reference(tg.duration, ptr, idx, rp, ri, tg.n_resources, lag=tg.lag).tolist() == want
    res = simulator.simulate(tg, priority=priorities(tg, "rank"))
    assert res.start.tolist() == [0.0, 1.0, 1.0, 6.0] and res.makespan == 7.0 and res.busy[link] == 1.0


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 200), st.integers(0, 10_000))
def test_contention_rank_with_lag_kernel_equals_reference_and_bounds_rank(n, seed):
    base = simulator.random_taskgraph(n, 3, 4, seed)
    lag = np.random.default_rng(seed).choice([0.0, 0.5, 2.0], size=base.n_tasks)
    ptr, idx = base.successors()
    rp, ri = base.resources()
    got = contention_rank(base.duration, ptr, idx, rp, ri, base.n_resources, lag=lag)
    assert np.array_equal(got, contention_rank_reference(base.duration, ptr, idx, rp, ri, base.n_resources, lag=lag))
    assert np.all(got >= upward_rank(base.duration + lag, ptr, idx))
