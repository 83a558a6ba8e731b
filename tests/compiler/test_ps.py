"""Load-aware parameter-server choice (heterog.compiler.ps): hand-computed timelines on small clusters,
the greedy's preferences, and the compiled kernel against its plain-Python reference."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.cluster.loader import cluster_from_dict
from heterog.compiler import TaskKind
from heterog.compiler.index import graph_index
from heterog.compiler.ps import PSProblem, choose_ps_kernel, choose_ps_reference
from heterog.cost import CostModel
from heterog.evaluate import Evaluator
from heterog.strategy import ParallelConfig, Strategy
from tests.compiler.helpers import branches_graph
from tests.compiler.test_compile import FakeCost

GB = 1e9


class LinkCost(FakeCost):
    """Transfers take bytes / path bandwidth (no latency); computation, aggregation and copies are free."""

    def op_times(self, graph, ops, devices, fractions):
        return np.zeros(np.broadcast(ops, devices, fractions).shape)

    def transfer_times(self, src, dst, nbytes):
        bw = self.cluster.bandwidth_Bps[np.asarray(src), np.asarray(dst)]
        return np.where(np.asarray(src) == np.asarray(dst), 0.0, np.asarray(nbytes, float) / bw)

    def aggregate_times(self, device, nbytes, n_inputs):
        return np.zeros(np.broadcast(device, nbytes, n_inputs).shape)

    def copy_times(self, devices, nbytes):
        return np.zeros(np.broadcast(devices, nbytes).shape)


def servers(gpus_per_server: list[int], nic: str = "1 GB/s", intra: str = "100 GB/s",
            gpu: dict | None = None) -> object:
    gpu = gpu or {"name": "G", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": "16 GiB"}
    return cluster_from_dict({"name": "ps-test", "servers": [
        {"name": f"s{i}", "gpus": [gpu] * n, "intra": {"kind": "pcie", "bandwidth": intra, "latency_us": 0},
         "nic": {"bandwidth": nic, "latency_us": 0}} for i, n in enumerate(gpus_per_server)]})


def ev_ps(graph, cluster, k: int, ps_device: int | None = None) -> Strategy:
    """Every branch its own group, each data parallel over all devices with even shares and a PS."""
    m = cluster.n_devices
    cfg = ParallelConfig.of([(d, graph.batch_size // m) for d in range(m)], sync="ps", ps_device=ps_device)
    group_of = np.zeros(graph.n_ops, dtype=np.int64)
    group_of[1:] = np.arange(graph.n_ops - 1) // 7                  # 7 ops per branch after the input
    return Strategy(graph.fingerprint, cluster.name, m, graph.batch_size, group_of, [cfg] * k)


def test_equal_tensors_spread_evenly_and_sync_takes_bytes_per_nic_direction_over_bandwidth():
    # 2 servers x 2 GPUs, 4 equal weights of b bytes. Each PS serves 2 remote workers: 2 pushes into its
    # server's NIC and 2 pulls out of it. Spread 2 PS per server, every NIC direction carries
    # 2 groups x 2 transfers x b of pulls and as much of pushes, back to back: 8 b / bandwidth.
    b, k = 8_000_000, 4
    g, c = branches_graph(k, b, batch=8), servers([2, 2])
    ev = Evaluator(g, c, LinkCost(c))
    res = ev.evaluate(ev_ps(g, c, k))
    per_server = np.bincount([d // 2 for d in res.plan.placements.ps_device.values()], minlength=2)
    assert per_server.tolist() == [2, 2]
    assert res.iteration_time_s == pytest.approx(8 * b / (1 * GB), rel=1e-9)
    nic = {link.name: i + c.n_devices for i, link in enumerate(c.links) if "nic" in link.name}
    busy = np.asarray(res.sim.busy)
    assert all(busy[r] == pytest.approx(8 * b / GB, rel=1e-9) for r in nic.values())
    # the same traffic through one PS device: one server's NIC carries every push, the other's every pull
    one = ev.evaluate(ev_ps(g, c, k, ps_device=0))
    assert one.iteration_time_s > res.iteration_time_s * 1.1


def test_each_push_and_pull_crosses_the_nics_it_should():
    b, k = 1_000_000, 4
    g, c = branches_graph(k, b, batch=8), servers([2, 2])
    plan = Evaluator(g, c, LinkCost(c)).compile(ev_ps(g, c, k))
    kinds = plan.task_kind
    assert np.sum(kinds == TaskKind.PUSH) == k * 3                    # 3 workers per PS
    assert np.sum(kinds == TaskKind.AGGREGATE) == k


def test_a_device_that_aggregates_faster_hosts_more():
    # one server of 2 GPUs on a fast link; aggregation (memory bound) dominates: the GPU with 10x the
    # memory bandwidth should take most of the PS groups
    fast = {"name": "F", "peak_tflops": 10, "memory_bandwidth": "2000 GB/s", "memory": "16 GiB"}
    slow = {"name": "S", "peak_tflops": 10, "memory_bandwidth": "200 GB/s", "memory": "16 GiB"}
    c = cluster_from_dict({"name": "agg-test", "servers": [
        {"name": "s0", "gpus": [slow, fast], "intra": {"kind": "nvlink", "bandwidth": "5000 GB/s", "latency_us": 0}}]})
    k = 10
    g = branches_graph(k, 4_000_000, batch=8)
    plan = Evaluator(g, c, CostModel(c)).compile(ev_ps(g, c, k))
    on_fast = sum(d == 1 for d in plan.placements.ps_device.values())
    assert on_fast >= 8


def test_an_explicit_ps_device_wins():
    b, k = 1_000_000, 4
    g, c = branches_graph(k, b, batch=8), servers([2, 2])
    plan = Evaluator(g, c, LinkCost(c)).compile(ev_ps(g, c, k, ps_device=3))
    assert set(plan.placements.ps_device.values()) == {3}


def test_the_runtime_layout_follows_the_chosen_ps():
    b, k = 1_000_000, 4
    g, c = branches_graph(k, b, batch=8), servers([2, 2])
    plan = Evaluator(g, c, LinkCost(c)).compile(ev_ps(g, c, k))
    placed = plan.placements
    assert placed.aggregation
    for t, how in placed.aggregation.items():
        assert how.kind == "ps" and how.devices == (placed.ps_device[int(placed.op_group[graph_index(g).t_op[t]])],)
        assert placed.layouts[placed.tensor_layout[t]].devices == how.devices  # the aggregated value lives on its PS


# ------------------------------------------------------------------------------- kernel vs reference
@st.composite
def problems(draw) -> PSProblem:
    m = draw(st.integers(2, 5))
    n_res = m + draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    g = draw(st.integers(1, 12))
    reps = [tuple(sorted(rng.choice(m, size=rng.integers(2, m + 1), replace=False).tolist())) for _ in range(g)]
    cands = [r if rng.random() < 0.8 else (r[int(rng.integers(len(r)))],) for r in reps]
    path_len = rng.integers(0, 3, size=m * m)
    path_len[np.arange(m) * m + np.arange(m)] = 0
    a = rng.integers(0, 3)
    return PSProblem(
        order=rng.permutation(g).astype(np.int64),
        need=rng.uniform(0, 2, size=(g, m)), amount=rng.integers(0, 5, size=(g, 4)).astype(np.float64),
        rep_ptr=np.concatenate([[0], np.cumsum([len(r) for r in reps])]).astype(np.int64),
        rep_dev=np.array([d for r in reps for d in r], dtype=np.int64),
        cand_ptr=np.concatenate([[0], np.cumsum([len(x) for x in cands])]).astype(np.int64),
        cand_dev=np.array([d for x in cands for d in x], dtype=np.int64),
        agg_coef=rng.uniform(0, 0.1, size=(sum(len(x) for x in cands), 2)),
        alpha=rng.uniform(0, 0.1, size=(m, m)), beta=rng.uniform(0, 1, size=(m, m)),
        path_ptr=np.concatenate([[0], np.cumsum(path_len)]).astype(np.int64),
        path_res=rng.integers(0, n_res, size=int(path_len.sum())).astype(np.int64),
        ar_dur=rng.uniform(0, 1, size=a), ar_ptr=np.arange(a + 1, dtype=np.int64) * 2,
        ar_res=rng.integers(0, n_res, size=2 * a).astype(np.int64), n_res=n_res)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_kernel_equals_reference(problem):
    got = choose_ps_kernel(*problem.args())
    want = choose_ps_reference(*problem.args())
    assert got.tolist() == want.tolist()
    for g, d in enumerate(got.tolist()):                              # every group on one of its candidates
        assert d in problem.cand_dev[problem.cand_ptr[g]:problem.cand_ptr[g + 1]].tolist()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_the_problem_built_per_config_equals_the_problem_built_per_group(seed):
    rng = np.random.default_rng(seed)
    c = servers([2, 3, 1])
    cost = CostModel(c)
    m = c.n_devices
    configs = [tuple(sorted(rng.choice(m, size=rng.integers(2, m + 1), replace=False).tolist())) for _ in range(4)]
    fixed = np.array([-1 if rng.random() < 0.6 else int(rng.choice(r)) for r in configs], dtype=np.int64)
    ps_groups = np.sort(rng.choice(50, size=int(rng.integers(1, 20)), replace=False))
    cfg = rng.integers(0, len(configs), size=len(ps_groups))
    amount = rng.integers(0, 9, size=(len(ps_groups), 4)).astype(np.float64)
    need = rng.uniform(0, 1, size=(len(ps_groups), m))
    ars = [(float(rng.uniform()), (m, m + 1))]
    from heterog.compiler.index import path_table
    from heterog.compiler.ps import build_problem, problem_from_configs

    paths = path_table(c)
    got = problem_from_configs(ps_groups, cfg, dict(enumerate(configs)), fixed, amount, need, ars, cost, paths, 20)
    want = build_problem(ps_groups, [configs[k] for k in cfg.tolist()],
                         {int(g): int(fixed[k]) for g, k in zip(ps_groups.tolist(), cfg.tolist()) if fixed[k] >= 0},
                         amount, need, ars, cost, paths, 20)
    for name in PSProblem.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
