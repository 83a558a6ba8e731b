"""DPOS and OS-DPOS: exact placement and order on a hand-computed fork-join DAG, ranks, critical path."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.baselines import dpos as D
from heterog.evaluate import Evaluator
from tests.baselines.helpers import TableCost, compute_dag, gpu_cluster, layered_graph

# 0 -> {1, 2, 5}, {1, 2} -> 3 -> 4; every edge moves 1 byte = 1 s between devices.
EDGES = [(0, 1, 1), (0, 2, 1), (1, 3, 1), (2, 3, 1), (3, 4, 1), (0, 5, 1)]
# seconds on device 0 (fast) and device 1 (slow)
TIMES = np.array([[2.0, 4.0], [3.0, 5.0], [4.0, 8.0], [2.0, 4.0], [1.0, 2.0], [1.5, 3.0]])


def hand_problem() -> D.PlacementProblem:
    n = len(TIMES)
    src, dst, nb = (np.array(x, dtype=np.int64 if k < 2 else np.float64) for k, x in enumerate(zip(*EDGES)))
    return D.PlacementProblem(TIMES, src, dst, nb, np.zeros((2, 2)), np.array([[0.0, 1.0], [1.0, 0.0]]),
                              np.zeros(n, bool), np.arange(n), np.zeros(n), np.zeros(n), np.full(2, 1e9))


def test_ranks_and_critical_path_by_hand():
    # worst case w = [4, 5, 8, 4, 2, 3], c = 1: rank_u(4) = 2, (3) = 4+1+2 = 7, (1) = 5+1+7 = 13,
    # (2) = 8+1+7 = 16, (5) = 3, (0) = 4 + 1 + 16 = 21
    prob = hand_problem()
    rank_u, rank_d, _ = D.upward_downward_ranks(prob)
    np.testing.assert_allclose(rank_u, [21, 13, 16, 7, 2, 3])
    np.testing.assert_allclose(rank_d, [0, 5, 5, 14, 19, 5])
    assert D.critical_path(prob, rank_u) == [0, 2, 3, 4]


def test_dpos_schedule_by_hand():
    # critical-path device: dev0 (2+4+2+1 = 9 s < 18 s). In rank order 0, 2, 1, 3, 5, 4:
    #   0 -> dev0 [0, 2]  (critical path)      2 -> dev0 [2, 6]  (critical path)
    #   1: dev0 finishes at 9 (after 2), dev1 at 2 + 1 + 5 = 8 -> dev1 [3, 8]
    #   3 -> dev0 (critical path), ready max(6, 8 + 1) = 9 -> [9, 11]
    #   5: dev0 ready 2, idle gap [6, 9] holds 1.5 s -> [6, 7.5]; dev1 ready 3, free at 8 -> 11
    #   4 -> dev0 [11, 12]
    s = D.dpos_schedule(hand_problem())
    assert s.cp_device == 0
    assert s.device.tolist() == [0, 1, 0, 0, 0, 0]
    np.testing.assert_allclose(s.start_s, [0, 3, 2, 9, 11, 6])
    np.testing.assert_allclose(s.finish_s, [2, 8, 6, 11, 12, 7.5])
    assert s.order.tolist() == [0, 2, 1, 5, 3, 4]
    assert s.makespan_s == pytest.approx(12.0)
    assert s.memory_ok


def test_dpos_planner_exports_placement_and_order_and_the_simulator_follows_it():
    graph = compute_dag(len(TIMES), EDGES)
    cluster = gpu_cluster(2)
    ev = Evaluator(graph, cluster, TableCost(cluster, TIMES))
    st = D.dpos(ev, replicas=1)
    assert [st.op_config(o).devices for o in range(graph.n_ops)] == [(0,), (1,), (0,), (0,), (0,), (0,)]
    assert np.argsort(-st.priorities, kind="stable").tolist() == [0, 2, 1, 5, 3, 4]
    res = ev.evaluate(st)
    assert res.iteration_time_s == pytest.approx(12.0)
    # the simulator runs op 5 in the idle gap before op 3, as DPOS planned
    starts = {int(o): float(s) for o, s, k in zip(res.plan.task_op, res.sim.start, res.plan.task_kind) if k == 0}
    assert starts[5] == pytest.approx(6.0) and starts[3] == pytest.approx(9.0)


def test_memory_decides_the_critical_path_device_and_skips_full_devices():
    # every op holds 1 byte and every input received from the other device 1 byte; dev0 holds 2.5, so
    # one op with one remote input. The critical path (4 bytes) goes to dev1, the device that fits it.
    #   0 -> dev1 [0, 4]   2 -> dev1 [4, 12]
    #   1: dev0 (1 + 1 byte) ready 4 + 1 = 5 -> [5, 8] (EFT 8); dev1 free at 12 -> 17          => dev0
    #   3 -> dev1, ready max(12, 8 + 1) -> [12, 16]
    #   5: dev0 would hold 2 + 2 bytes > 2.5 -> skipped; dev1 after 16 -> [16, 19]
    #   4 -> dev1, ready 16, no gap -> [19, 21]
    prob = hand_problem()
    prob.held_bytes[:] = 1.0
    prob.capacity_bytes[:] = [2.5, 10.0]
    s = D.dpos_schedule(prob)
    assert s.cp_device == 1 and s.memory_ok
    assert s.device.tolist() == [1, 0, 1, 1, 1, 1]
    np.testing.assert_allclose(s.start_s, [0, 5, 4, 12, 19, 16])
    assert s.makespan_s == pytest.approx(21.0)


def test_replicated_problem_has_one_replica_per_device_and_an_allreduce_per_partial_result():
    graph = layered_graph(3, 4096)
    cluster = gpu_cluster(2)
    ev = Evaluator(graph, cluster, TableCost(cluster, np.ones((graph.n_ops, 2))))
    rg = D.replicated_problem(ev)
    n = graph.n_ops
    assert rg.shares == [4, 4] and rg.home == [0, 1]
    loss = next(i for i, op in enumerate(graph.ops) if op.name == "loss")
    grads = [i for i, op in enumerate(graph.ops) if op.is_grad]
    assert sorted(rg.agg_ops.tolist()) == sorted([loss] + grads)      # weight gradients and the loss
    assert rg.problem.n_nodes == 2 * n + len(rg.agg_ops)
    expected = [4.0 if o == loss else 4096.0 for o in rg.agg_ops.tolist()]   # ring of 2: bytes * beta
    np.testing.assert_allclose(rg.problem.collective_s[2 * n:], expected)
    np.testing.assert_allclose(rg.problem.op_time_s[:n, 0], np.where(graph.is_compute,
                                                                     np.where(graph.has_batch, 0.5, 1.0), 0.0))


def test_os_dpos_splits_a_critical_op_only_when_it_helps():
    # a heavy op between two light ones, all on batch tensors: splitting it over both devices halves it
    graph = compute_dag(3, [(0, 1, 1), (1, 2, 1)])
    for op in graph.ops:
        op.batch_dims = [0]
    for e in graph.edges:
        e.batch_dim = 0
    graph = type(graph)(graph.name, graph.batch_size, graph.ops, graph.edges)
    cluster = gpu_cluster(2)
    times = np.array([[1e-3, 1e-3], [10.0, 10.0], [1e-3, 1e-3]])
    ev = Evaluator(graph, cluster, TableCost(cluster, times, beta_s_per_byte=1e-9))
    plain = D.dpos(ev, replicas=1)
    assert ev.iteration_time(plain)[0] == pytest.approx(10.002, rel=1e-3)
    st = D.os_dpos(ev, replicas=1, budget_s=30)
    # op 1 (longest) is split first; splitting its neighbours too then saves the relayout transfers
    assert st.meta["ops_split"] >= 1 and st.meta["os_dpos_cost_s"] < st.meta["dpos_cost_s"]
    assert st.op_config(1).devices == (0, 1) and st.op_config(1).shares == (2, 2)
    assert ev.iteration_time(st)[0] == pytest.approx(5.0, rel=1e-2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 3)), max_size=20), st.floats(0, 40), st.floats(0, 4))
def test_the_gap_kernel_and_its_slots_agree_with_the_plain_python_insertion(gaps_and_lengths, ready, dur):
    # busy slots laid end to end with gaps between them, then one more placed by both
    starts, ends, t = [], [], 0.0
    slots = D._Slots(capacity=2)                      # grows on the way
    for gap, length in gaps_and_lengths:
        k = len(starts)
        starts.insert(k, t + gap)
        ends.insert(k, t + gap + length)
        slots.insert(k, t + gap, t + gap + length)
        t += gap + length
    assert slots.starts[:slots.count].tolist() == starts and slots.ends[:slots.count].tolist() == ends
    expected = D._earliest_gap(starts, ends, ready, dur)
    assert slots.gap(ready, dur) == expected
    k = expected[1]
    starts.insert(k, expected[0])
    ends.insert(k, expected[0] + dur)
    slots.insert(k, expected[0], expected[0] + dur)
    assert slots.starts[:slots.count].tolist() == starts and slots.ends[:slots.count].tolist() == ends
