"""Exact timelines of the simulator on small hand-computed graphs (kernel and reference alike).

Each case states the expected start/finish times worked out by hand from the scheduling rule.
"""
from __future__ import annotations

import numpy as np
import pytest

import simulator

BOTH = pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])


@BOTH
def test_chain_runs_back_to_back(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu0")
    a = tg.add_task([g], duration=1.0)
    b = tg.add_task([g], duration=2.0, deps=[a])
    tg.add_task([g], duration=0.5, deps=[b])
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 3.0]
    assert res.finish.tolist() == [1.0, 3.0, 3.5]
    assert res.makespan == 3.5
    assert res.busy.tolist() == [3.5]
    assert res.utilization().tolist() == [1.0]


@BOTH
def test_fork_join_waits_for_the_slower_branch(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g0, g1 = tg.add_resource("gpu0"), tg.add_resource("gpu1")
    a = tg.add_task([g0], duration=1.0)
    b = tg.add_task([g0], duration=2.0, deps=[a])
    c = tg.add_task([g1], duration=3.0, deps=[a])
    tg.add_task([g0], duration=1.0, deps=[b, c])
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 1.0, 4.0]
    assert res.finish.tolist() == [1.0, 3.0, 4.0, 5.0]
    assert res.makespan == 5.0
    assert res.busy.tolist() == [4.0, 3.0]
    assert res.utilization().tolist() == [0.8, 0.6]


@BOTH
def test_higher_priority_first_and_ties_by_lower_id(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu0")
    for p in (0.0, 5.0, 5.0, 1.0):
        tg.add_task([g], duration=1.0, priority=p)
    res = simulator.simulate(tg, reference=reference)
    # order: t1 (5, id 1), t2 (5, id 2), t3 (1), t0 (0)
    assert res.start.tolist() == [3.0, 0.0, 1.0, 2.0]
    # an override replaces tg.priority for this run only: all tied -> id order
    res = simulator.simulate(tg, priority=np.zeros(4), reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert tg.priority.tolist() == [0.0, 5.0, 5.0, 1.0]


@BOTH
def test_priority_array_is_settable(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu0")
    for _ in range(3):
        tg.add_task([g], duration=1.0)
    tg.priority = np.array([0.0, 1.0, 2.0])
    assert simulator.simulate(tg, reference=reference).start.tolist() == [2.0, 1.0, 0.0]
    tg.priority[:] = [2.0, 0.0, 1.0]  # writing into the view works too
    assert simulator.simulate(tg, reference=reference).start.tolist() == [0.0, 2.0, 1.0]


@BOTH
def test_transfer_holding_two_links_blocks_both(reference: bool) -> None:
    tg = simulator.TaskGraph()
    l0, l1 = tg.add_resource("link0"), tg.add_resource("link1")
    tg.add_task([l0, l1], duration=2.0, priority=2.0)  # X: a transfer over two links
    tg.add_task([l0], duration=1.0, priority=1.0)  # Y
    tg.add_task([l1], duration=1.0, priority=1.0)  # Z
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 2.0, 2.0]
    assert res.finish.tolist() == [2.0, 3.0, 3.0]
    assert res.busy.tolist() == [3.0, 3.0]


@BOTH
def test_lower_priority_task_backfills_a_free_resource(reference: bool) -> None:
    tg = simulator.TaskGraph()
    l0, l1 = tg.add_resource("link0"), tg.add_resource("link1")
    tg.add_task([l0, l1], duration=2.0, priority=2.0)  # X, blocked by Y on link0
    tg.add_task([l0], duration=1.0, priority=3.0)  # Y
    tg.add_task([l1], duration=1.0, priority=1.0)  # Z: lower than X but needs only the free link1
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [1.0, 0.0, 0.0]
    assert res.finish.tolist() == [3.0, 1.0, 1.0]
    assert res.makespan == 3.0


@BOTH
def test_blocked_task_waits_for_the_resource_it_needs_while_others_pass(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g0, g1 = tg.add_resource("gpu0"), tg.add_resource("gpu1")
    tg.add_task([g0], duration=2.0, priority=3.0)  # A
    tg.add_task([g0], duration=1.0, priority=2.0)  # B waits for gpu0
    tg.add_task([g1], duration=1.0, priority=1.0)  # C runs at once
    tg.add_task([g1], duration=1.0, priority=0.0)  # D after C
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 2.0, 0.0, 1.0]
    assert res.finish.tolist() == [2.0, 3.0, 1.0, 2.0]


@BOTH
def test_zero_duration_tasks_finish_at_their_start_and_release_within_the_instant(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu0")
    t0 = tg.add_task([g], duration=1.0)
    t1 = tg.add_task([g], duration=0.0, deps=[t0])  # a marker on gpu0
    tg.add_task([g], duration=1.0, deps=[t1])  # ready at 1 once t1's completion is processed at 1
    tg.add_task([], duration=0.0, deps=[t0])  # no resources: starts when its deps are done
    tg.add_task([g], duration=0.0, priority=9.0, deps=[t0])  # holds gpu0 in the first round at t=1
    tg.add_task([], duration=0.0)  # no deps, no resources
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert res.finish.tolist() == [1.0, 1.0, 2.0, 1.0, 1.0, 0.0]
    assert res.makespan == 2.0


@BOTH
def test_empty_graph(reference: bool) -> None:
    tg = simulator.TaskGraph()
    tg.add_resource("gpu0", memory_capacity_bytes=10, resident_bytes=4)
    res = simulator.simulate(tg, reference=reference)
    assert res.makespan == 0.0
    assert len(res.start) == 0
    assert res.peak_memory.tolist() == [4]
    assert res.utilization().tolist() == [0.0]
    assert not res.oom


def _memory_graph(capacity_bytes: int) -> simulator.TaskGraph:
    """gpu g (resident 100) and link l. t0 allocates 300, freed by t1 and t2; t1 allocates 200, freed by
    t3; t3 allocates 250, freed by t4; t4 allocates 600, never freed."""
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu0", memory_capacity_bytes=capacity_bytes, resident_bytes=100)
    link = tg.add_resource("link0")
    t0 = tg.add_task([g], duration=1.0, mem={g: 300}, name="t0", cat="compute")
    t1 = tg.add_task([g], duration=1.0, deps=[t0], mem={g: 200}, frees=[t0], cat="compute")
    t2 = tg.add_task([link], duration=3.0, deps=[t0], frees=[t0], cat="transfer")
    t3 = tg.add_task([g], duration=2.0, deps=[t1], mem={g: 250}, frees=[t1], cat="compute")
    tg.add_task([g], duration=1.0, deps=[t2, t3], mem={g: 600}, frees=[t3], cat="compute")
    return tg


@BOTH
def test_memory_peak_with_reference_counted_frees(reference: bool) -> None:
    res = simulator.simulate(_memory_graph(1000), reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 1.0, 2.0, 4.0]
    # 0: 100 + 300 = 400; 1: +200 = 600 (t0 still held by t2); 2: +250 = 850;
    # 4: t3 and t2 finish: release t1 (-200) and t0 (-300) BEFORE t4 allocates 600 -> 950; 5: -250 -> 700
    assert res.peak_memory.tolist() == [950, 0]
    assert not res.oom and res.oom_resources == []
    assert res.release_time.tolist() == [4.0, 4.0, np.inf, 5.0, np.inf]
    times_s, level_bytes = res.memory_timeline(0)
    assert times_s.tolist() == [0.0, 1.0, 2.0, 4.0, 5.0]
    assert level_bytes.tolist() == [400, 600, 850, 950, 700]
    times_s, level_bytes = res.memory_timeline(1)
    assert times_s.tolist() == [0.0] and level_bytes.tolist() == [0]


@BOTH
def test_oom_flag_and_resources(reference: bool) -> None:
    res = simulator.simulate(_memory_graph(900), reference=reference)
    assert res.oom
    assert res.oom_resources == [0]
    assert res.peak_memory.tolist() == [950, 0]
    # at capacity exactly is not out of memory
    assert not simulator.simulate(_memory_graph(950), reference=reference).oom


@BOTH
def test_resident_bytes_alone_can_exceed_capacity(reference: bool) -> None:
    tg = simulator.TaskGraph()
    tg.add_resource("gpu0", memory_capacity_bytes=10, resident_bytes=11)
    tg.add_resource("gpu1", memory_capacity_bytes=10, resident_bytes=10)
    tg.add_resource("link0", resident_bytes=99)  # no capacity: never out of memory
    res = simulator.simulate(tg, reference=reference)
    assert res.oom and res.oom_resources == [0]
    assert res.peak_memory.tolist() == [11, 10, 99]


@BOTH
def test_zero_duration_allocation_counts_in_the_peak(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu0")
    z = tg.add_task([], duration=0.0, mem={g: 500})
    tg.add_task([], duration=0.0, deps=[z], frees=[z])  # releases z's 500 at t=0, one round later
    tg.add_task([g], duration=1.0, mem={g: 100})
    w = tg.add_task([], duration=0.0, mem={g: 7}, frees=[3])  # frees itself: a workspace
    res = simulator.simulate(tg, reference=reference)
    assert res.peak_memory.tolist() == [607]
    assert res.release_time.tolist() == [0.0, np.inf, np.inf, 0.0]
    times_s, level_bytes = res.memory_timeline(g)
    assert times_s.tolist() == [0.0] and level_bytes.tolist() == [100]
    assert w == 3


@BOTH
def test_a_release_waits_for_the_allocating_task_itself(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g0, g1 = tg.add_resource("gpu0"), tg.add_resource("gpu1")
    a = tg.add_task([g0], duration=5.0, mem={g0: 10})
    tg.add_task([g1], duration=1.0, frees=[a])  # names a without depending on it
    res = simulator.simulate(tg, reference=reference)
    assert res.release_time.tolist() == [5.0, np.inf]
    assert res.peak_memory.tolist() == [10, 0]


# ------------------------------------------------------------------------------ lag (finish -> arrival)
@BOTH
def test_lagged_transfers_free_the_link_at_finish_and_feed_compute_at_arrival(reference: bool) -> None:
    tg = simulator.TaskGraph()
    link, g = tg.add_resource("L0"), tg.add_resource("G")
    a = tg.add_task([link], duration=1.0, lag=3.0)  # data of A arrives at 1 + 3 = 4
    b = tg.add_task([link], duration=1.0, lag=3.0)  # the link is free at 1: B runs [1, 2], arrives at 5
    tg.add_task([g], duration=2.0, deps=[a])  # ready at 4: runs [4, 6]
    tg.add_task([g], duration=2.0, deps=[b])  # ready at 5, G busy until 6: runs [6, 8]
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 4.0, 6.0]
    assert res.finish.tolist() == [1.0, 2.0, 6.0, 8.0]
    assert res.arrival.tolist() == [4.0, 5.0, 6.0, 8.0]
    assert res.makespan == 8.0
    assert res.busy[link] == 2.0 and res.busy[g] == 4.0


@BOTH
def test_lag_of_a_task_without_dependents_extends_the_makespan(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g = tg.add_resource("G")
    tg.add_task([g], duration=1.0, lag=2.0, priority=1.0)  # finishes at 1, arrives at 3
    tg.add_task([g], duration=1.5)  # runs [1, 2.5]: the last finish, but not the last arrival
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 1.0]
    assert res.finish.tolist() == [1.0, 2.5]
    assert res.arrival.tolist() == [3.0, 2.5]
    assert res.makespan == 3.0
    assert res.utilization().tolist() == [2.5 / 3.0]


@BOTH
def test_fifo_orders_ready_tasks_by_arrival_not_finish(reference: bool) -> None:
    tg = simulator.TaskGraph()
    l0, l1, g = tg.add_resource("L0"), tg.add_resource("L1"), tg.add_resource("G")
    a = tg.add_task([l0], duration=1.0, lag=5.0)  # finishes at 1, arrives at 6
    b = tg.add_task([l1], duration=3.0)  # finishes and arrives at 3
    tg.add_task([g], duration=10.0)  # Z keeps G busy until 10
    tg.add_task([g], duration=1.0, deps=[a])  # X: ready at 6
    tg.add_task([g], duration=1.0, deps=[b])  # Y: ready at 3, so first in FIFO order although X's dep finished first
    res = simulator.simulate(tg, fifo=True, reference=reference)
    assert res.start.tolist() == [0.0, 0.0, 0.0, 11.0, 10.0]
    assert res.finish.tolist() == [1.0, 3.0, 10.0, 12.0, 11.0]
    assert res.makespan == 12.0
    # by (tied) priority instead, the lower id X goes first
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 0.0, 0.0, 10.0, 11.0]


@BOTH
def test_lagged_task_releases_memory_at_finish(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g, link = tg.add_resource("G"), tg.add_resource("L0")
    t0 = tg.add_task([g], duration=1.0, mem={g: 100})
    t1 = tg.add_task([link], duration=1.0, lag=2.0, deps=[t0], frees=[t0])  # sends t0's output: [1, 2], arrives 4
    tg.add_task([g], duration=1.0, deps=[t1], mem={g: 50})  # starts at t1's arrival
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 4.0]
    assert res.release_time.tolist() == [2.0, np.inf, np.inf]  # at t1's finish, not its arrival
    assert res.peak_memory.tolist() == [100, 0]
    times_s, level_bytes = res.memory_timeline(g)
    assert times_s.tolist() == [0.0, 2.0, 4.0] and level_bytes.tolist() == [100, 0, 50]


@BOTH
def test_zero_duration_task_with_lag_is_a_pure_delay(reference: bool) -> None:
    tg = simulator.TaskGraph()
    g = tg.add_resource("G")
    a = tg.add_task([g], duration=1.0)
    d = tg.add_task([], duration=0.0, lag=0.5, deps=[a])  # a latency edge: done at 1.5
    tg.add_task([g], duration=1.0, deps=[d])
    res = simulator.simulate(tg, reference=reference)
    assert res.start.tolist() == [0.0, 1.0, 1.5]
    assert res.finish.tolist() == [1.0, 1.0, 2.5]
    assert res.arrival.tolist() == [1.0, 1.5, 2.5]


@BOTH
def test_a_free_may_name_one_memory_entry(reference: bool) -> None:
    """Task 0 allocates two entries (100 B read early, 10 B read late); task 1 (1-2 s) frees entry 0 only,
    task 2 (2-5 s) entry 1 only: 110 B until 2 s, 10 B until 5 s, then nothing."""
    tg = simulator.TaskGraph()
    g = tg.add_resource("gpu0")
    i64 = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    tg.adopt_tasks(np.array([1.0, 1.0, 3.0]), np.zeros(3), i64([0, 0, 0]), i64([0, 1, 2, 3]), i64([g, g, g]),
                   i64([0, 0, 1, 2]), i64([0, 1]), i64([0, 2, 2, 2]), i64([g, g]), i64([100, 10]),
                   frees=(i64([0, 0, 1, 2]), i64([0, 0])), free_entry=i64([0, 1]))
    res = simulator.simulate(tg, reference=reference)
    assert res.entry_release_time().tolist() == [2.0, 5.0]
    assert res.release_time.tolist() == [5.0, np.inf, np.inf]
    times_s, level_bytes = res.memory_timeline(g)
    assert times_s.tolist() == [0.0, 2.0, 5.0] and level_bytes.tolist() == [110, 10, 0]
