"""The compute lower bound: hand-computed LPs, and no plan beats it."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.bounds import compute_bound, unit_times
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from tests.compiler.helpers import linear_graph
from tests.compiler.test_compile import FakeCost, two_gpu


class SlowSecond(FakeCost):
    """FakeCost with device 1 three times slower and a fixed launch of 1 s per op."""

    def op_times(self, graph, ops, devices, fractions):
        t = super().op_times(graph, ops, devices, fractions)
        t = (t + np.where(graph.is_compute[ops], 1.0, 0.0)) * np.where(np.asarray(devices) == 1, 3.0, 1.0)
        return np.broadcast_to(t, np.broadcast(ops, devices, fractions).shape)

    def full_batch_times(self, graph):
        n, m = graph.n_ops, self.cluster.n_devices
        return self.op_times(graph, np.repeat(np.arange(n), m), np.tile(np.arange(m), n), np.ones(n * m)).reshape(n, m)


def test_bound_by_hand_on_two_equal_devices():
    g, c = linear_graph(), two_gpu()
    # ops take their FLOPs in seconds at any share: mm 128, loss 16, ones 1, gout 16, gW 128, update 16
    assert compute_bound(g, c, FakeCost(c)) == pytest.approx(305 / 2)


def test_bound_by_hand_with_launch_and_a_slower_device():
    g, c = linear_graph(), two_gpu()
    cost = SlowSecond(c)
    u = unit_times(g, cost)
    # per unit of batch the launch is cheapest at the whole batch: flops + 1; three times that on device 1
    flops = np.array([0, 0, 128, 16, 1, 16, 128, 16], dtype=float)
    want = np.where(flops > 0, flops + 1, 0)
    np.testing.assert_allclose(u, np.stack([want, 3 * want], axis=1))
    # x on device 0 and 1 - x on device 1: W x = 3 W (1 - x) -> T = 3/4 W, W = 305 + 6 launches
    assert compute_bound(g, c, cost) == pytest.approx(0.75 * 311)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_no_plan_beats_the_bound(seed):
    graph = capture_model("tiny_cnn", 32)
    cluster = load_cluster("paper-8gpu")
    ev = Evaluator(graph, cluster)
    bound = compute_bound(graph, cluster, ev.cost)
    rng = np.random.default_rng(seed)
    for actions in (rng.integers(0, cluster.n_devices + 4, size=ev.n_groups),
                    np.full(ev.n_groups, cluster.n_devices + rng.integers(0, 4))):
        assert ev.evaluate(ev.strategy(actions)).iteration_time_s >= bound * (1 - 1e-9)


@pytest.fixture(scope="module")
def tiny_bounds():
    from heterog.bounds import action_space_bound

    ev = Evaluator(capture_model("tiny_transformer", 16), load_cluster("paper-8gpu"))
    return ev, action_space_bound(ev), action_space_bound(ev, data_parallel_only=True)


def test_action_space_bounds_order(tiny_bounds):
    ev, every, dp = tiny_bounds
    # model parallelism needs no synchronisation: all that is left is the forward pass before any gradient
    assert every["sync_bound_s"] == pytest.approx(every["forward_bound_s"])
    assert 0.0 < every["forward_bound_s"] < every["bound_s"]
    assert compute_bound(ev.graph, ev.cluster, ev.cost) <= every["bound_s"] * (1 + 1e-9)
    assert every["bound_s"] <= dp["bound_s"] * (1 + 1e-9)     # fewer actions: a higher bound
    assert 0.0 < dp["sync_bound_s"] <= dp["bound_s"] * (1 + 1e-9)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_no_plan_beats_the_action_space_bounds(tiny_bounds, seed):
    ev, every, dp = tiny_bounds
    m = ev.cluster.n_devices
    rng = np.random.default_rng(seed)
    mixed = ev.strategy(rng.integers(0, m + 4, size=ev.n_groups))
    data_parallel = ev.strategy(rng.integers(m, m + 4, size=ev.n_groups))
    assert ev.evaluate(mixed).iteration_time_s >= every["bound_s"] * (1 - 1e-9)
    for order in ("best", "fifo", "rank"):
        assert ev.evaluate(data_parallel, order=order).iteration_time_s >= dp["bound_s"] * (1 - 1e-9)


@pytest.fixture(scope="module")
def tiny_dp_lp(tiny_bounds):
    from heterog.bounds import action_space_bound, data_parallel_lp

    ev, _, dp = tiny_bounds
    integral = action_space_bound(ev, data_parallel_only=True, integral_groups=ev.n_groups, time_limit_s=5)
    return ev, dp, integral, data_parallel_lp(ev)


def test_integral_bound_between_lp_and_plans(tiny_dp_lp):
    ev, dp, integral, lp = tiny_dp_lp
    # the same LP, with every group's weights 0 or 1: at least the LP, and the LP solution is the LP's
    assert integral["integral_bound_s"] >= dp["bound_s"] * (1 - 1e-9)
    assert lp["bound_s"] == pytest.approx(dp["bound_s"], rel=1e-9)
    w = lp["weights"]
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-7)
    assert w.shape == (ev.n_groups, 2 * ev.cluster.n_devices + 2) and w.min() >= -1e-9


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000))
def test_no_data_parallel_plan_beats_the_integral_bound(tiny_dp_lp, seed):
    """Random data-parallel plans, PS devices drawn at random too: none beats the MILP bound."""
    from heterog.bounds import dp_action_configs
    from heterog.strategy import Strategy

    ev, _, integral, _ = tiny_dp_lp
    configs = dp_action_configs(ev)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(configs), size=ev.n_groups)
    s = Strategy(ev.graph.fingerprint, ev.cluster.name, ev.cluster.n_devices, ev.graph.batch_size, ev.group_of,
                 [configs[a] for a in pick.tolist()], "random-dp")
    for order in ("best", "fifo"):
        assert ev.evaluate(s, order=order).iteration_time_s >= integral["integral_bound_s"] * (1 - 1e-9)


def test_dp_action_configs_match_the_action_encoding(tiny_bounds):
    from heterog.actions import decode_action
    from heterog.bounds import dp_action_configs

    ev = tiny_bounds[0]
    m, B, power = ev.cluster.n_devices, ev.graph.batch_size, ev.cluster.power
    configs = dp_action_configs(ev)
    assert len(configs) == 2 * m + 2
    assert configs[0] == decode_action(m + 1, m, B, power) and configs[1] == decode_action(m + 3, m, B, power)
    even_ps, prop_ps = decode_action(m, m, B, power), decode_action(m + 2, m, B, power)
    for p in range(m):
        assert configs[2 + p].shares == even_ps.shares and configs[2 + p].ps_device == p
        assert configs[2 + m + p].shares == prop_ps.shares and configs[2 + m + p].ps_device == p


# ----------------------------------------------------------------------------- release times
@pytest.fixture(scope="module")
def tiny_release(tiny_bounds):
    from heterog.bounds import release_bound

    ev = tiny_bounds[0]
    return ev, release_bound(ev, data_parallel_only=True), release_bound(ev, data_parallel_only=False)


def test_release_sets_of_a_language_model_are_its_target_count(tiny_bounds):
    from heterog.bounds import release_sets
    from heterog.compiler.index import graph_index

    ev = tiny_bounds[0]
    g = ev.graph
    c_ops, late, pulled = release_sets(g)
    gi = graph_index(g)
    # every backward reads the loss's normaliser, the count of targets summed over the replicas; it is
    # computed from the targets alone (heterog.graph.normalisers), so C is that count, not the forward pass
    assert {g.ops[i].target for i in np.nonzero(c_ops)[0]} == {"aten.ne.Scalar", "aten.sum.default"}
    assert late.any() and not (late & ~gi.t_needs_agg).any()
    assert gi.t_bytes[late].sum() >= 0.99 * gi.t_bytes[gi.t_needs_agg].sum()
    assert not (pulled & ~gi.t_pulled).any()


def test_release_offsets_grow_along_the_backward_pass(tiny_bounds):
    from heterog.bounds import min_replica_times, release_offsets, release_sets
    from heterog.compiler.index import graph_index

    ev = tiny_bounds[0]
    c_ops, late, _ = release_sets(ev.graph)
    off = release_offsets(ev, c_ops)
    gi = graph_index(ev.graph)
    assert np.all(off >= 0) and np.all(off[late] > 0)
    piece = min_replica_times(ev)
    assert np.all(piece <= ev.cost.full_batch_times(ev.graph).min(axis=1) + 1e-15)
    # a gradient produced later in the backward pass (higher op id) is released no earlier, in the mean
    lt = np.nonzero(late)[0]
    first, last = lt[np.argsort(gi.t_op[lt])][: len(lt) // 3], lt[np.argsort(gi.t_op[lt])][-len(lt) // 3:]
    assert off[last].mean() > off[first].mean()


def test_release_bound_values(tiny_release):
    ev, dp, every = tiny_release
    comp = compute_bound(ev.graph, ev.cluster, ev.cost)
    assert every["bound_s"] >= comp * (1 - 1e-9) and dp["bound_s"] >= every["bound_s"] * (1 - 1e-9)
    assert dp["release_s"] >= dp["release_bound_s"] * (1 - 1e-9) > 0
    assert dp["weights"].shape == (ev.n_groups, 2 * ev.cluster.n_devices + 2)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_no_plan_beats_the_release_bounds(tiny_release, seed):
    """Random plans of the action space (model parallelism included) against the bound over all actions;
    random data-parallel plans, PS devices at random, against the data-parallel one; under every order."""
    from heterog.bounds import dp_action_configs
    from heterog.strategy import Strategy

    ev, dp, every = tiny_release
    m = ev.cluster.n_devices
    rng = np.random.default_rng(seed)
    mixed = ev.strategy(rng.integers(0, m + 4, size=ev.n_groups))
    configs = dp_action_configs(ev)
    pick = rng.integers(0, len(configs), size=ev.n_groups)
    data_parallel = Strategy(ev.graph.fingerprint, ev.cluster.name, m, ev.graph.batch_size, ev.group_of,
                             [configs[a] for a in pick.tolist()], "random-dp")
    for order in ("best", "fifo", "rank"):
        assert ev.evaluate(mixed, order=order).iteration_time_s >= every["bound_s"] * (1 - 1e-9)
        assert ev.evaluate(data_parallel, order=order).iteration_time_s >= dp["bound_s"] * (1 - 1e-9)


@pytest.mark.parametrize("model, batch", [("tiny_cnn", 32), ("tiny_mlp", 32)])
def test_release_bound_holds_on_other_graphs(model, batch):
    from heterog.bounds import release_bound

    try:
        graph = capture_model(model, batch)
    except Exception as exc:          # a zoo without that model
        pytest.skip(str(exc))
    ev = Evaluator(graph, load_cluster("paper-8gpu"))
    m = ev.cluster.n_devices
    b_dp = release_bound(ev, data_parallel_only=True)["bound_s"]
    b_all = release_bound(ev, data_parallel_only=False)["bound_s"]
    rng = np.random.default_rng(0)
    for _ in range(4):
        mixed = ev.strategy(rng.integers(0, m + 4, size=ev.n_groups))
        dp_plan = ev.strategy(rng.integers(m, m + 4, size=ev.n_groups))
        assert ev.evaluate(mixed).iteration_time_s >= b_all * (1 - 1e-9)
        assert ev.evaluate(dp_plan).iteration_time_s >= b_dp * (1 - 1e-9)
