"""Replicas composed (``heterog.compose``): a plan that repeats one slice of the cluster, simulated on the slice,
gives the whole simulation's time, memory peaks and task count exactly; a plan that does not is simulated whole."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heterog.cluster import load_cluster
from heterog.compiler.index import graph_index
from heterog.compose import SliceCost, Unrepeated, find_repetition, rows_only_between_device_sets
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.shares import even_shares, proportional_shares
from heterog.strategy import ParallelConfig, Strategy

# clusters of up to 16 GPUs in servers of GCP's A100 and V100 nodes (several servers alike)
CLUSTERS = ("gcp-a100-v100:a100=2,v100=2,gpus_per_node=4", "gcp-a100-v100:a100=2,v100=4,gpus_per_node=2",
            "gcp-a100-v100:a100=4,v100=0,gpus_per_node=2", "gcp-a100-v100:a100=2,v100=4,gpus_per_node=1",
            "gcp-a100-v100:a100=4,v100=4,gpus_per_node=2")
GRAPHS = ("tiny_mlp", "tiny_transformer", "tiny_cnn")
BATCH = 48

_EVALUATORS: dict[tuple[str, str, bool, bool], Evaluator] = {}


def evaluator(graph: str, cluster: str, synced: bool = False, serialized: bool = False) -> Evaluator:
    key = (graph, cluster, synced, serialized)
    if key not in _EVALUATORS:
        _EVALUATORS[key] = Evaluator(capture_model(graph, BATCH), load_cluster(cluster), sync_batch_stats=synced,
                                     serialize_collectives=serialized)
    return _EVALUATORS[key]


def data_parallel(ev: Evaluator, devices: list[int], proportional: bool) -> ParallelConfig:
    shares = proportional_shares(BATCH, ev.cluster.power[devices]) if proportional else even_shares(BATCH, len(devices))
    return ParallelConfig(tuple(devices), tuple(shares))


def strategy_of(ev: Evaluator, configs: list[ParallelConfig], k: int = 1, schedule: str = "1f1b") -> Strategy:
    c = ev.cluster
    return Strategy(ev.graph.fingerprint, c.name, c.n_devices, BATCH, ev.group_of, configs,
                    micro_batches=None if k == 1 else tuple(even_shares(BATCH, k)), schedule=schedule)


def assert_same(whole, composed) -> None:
    assert composed.iteration_time_s == pytest.approx(whole.iteration_time_s, rel=1e-12, abs=0.0)
    assert composed.oom == whole.oom
    assert composed.peak_memory_bytes == whole.peak_memory_bytes
    assert composed.memory_capacity_bytes == whole.memory_capacity_bytes
    assert composed.host_memory_bytes == whole.host_memory_bytes
    assert composed.n_tasks == whole.n_tasks
    assert composed.compute_time_s == pytest.approx(whole.compute_time_s, rel=1e-12)
    assert composed.comm_time_s == pytest.approx(whole.comm_time_s, rel=1e-9)
    assert composed.overlap_ratio == pytest.approx(whole.overlap_ratio, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------------------ hand-checked cases
def test_data_parallelism_over_two_servers_of_each_kind_is_two_slices_of_one_of_each() -> None:
    """16 GPUs: a100-0, a100-1, v100-0, v100-1, 4 each. Even shares (3 samples each): no row moves, so each
    server is a part of its own; two of each kind make two slices of one A100 and one V100 server (in blocks:
    a100-0 and v100-0 first), 24 samples on 8 devices; the collectives over the 16 devices in their order."""
    ev = evaluator("tiny_mlp", CLUSTERS[0])
    s = strategy_of(ev, [data_parallel(ev, list(range(16)), False)] * ev.n_groups)
    rep = find_repetition(ev.graph, ev.cluster, s)
    assert rep is not None and rep.copies == 2
    assert rep.cluster.device_names == [ev.cluster.device_names[d] for d in (*range(4), *range(8, 12))]
    assert rep.images.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert rep.strategy.batch_size == 24 and rep.strategy.configs[0].shares == (3,) * 8
    assert rep.sets[tuple(range(8))] == tuple(range(16))
    whole, composed = ev.evaluate(s), ev.evaluate(s, compose=True)
    assert composed.composed == 2 and whole.composed == 1
    assert_same(whole, composed)
    assert ev.iteration_time(s) == (composed.iteration_time_s, composed.oom)


def test_a_slice_collective_is_priced_and_held_as_the_whole_one() -> None:
    """The slice's AllReduce over its 8 devices costs the whole one over 16; of the whole ring's links (each
    server's chain a->b->c->d and its NIC both ways) it holds those of its own two servers."""
    ev = evaluator("tiny_mlp", CLUSTERS[0])
    s = strategy_of(ev, [data_parallel(ev, list(range(16)), False)] * ev.n_groups)
    rep = find_repetition(ev.graph, ev.cluster, s)
    cost = SliceCost(ev.cost, rep)
    x = np.array([1e6, 4e8])
    for algo in ("ring", "hierarchical"):
        assert np.array_equal(cost.allreduce_times(tuple(range(8)), x, algo)[0],
                              ev.cost.allreduce_times(tuple(range(16)), x, algo)[0])
    held = sorted(rep.cluster.links[i].name for i in cost.allreduce_links(tuple(range(8)), "ring"))
    chain = [f"{s}/gpu{i}->{s}/gpu{i + 1}" for s in ("a100-0", "v100-0") for i in range(3)]
    assert held == sorted(chain + [f"{s}/{k}" for s in ("a100-0", "v100-0") for k in ("nic-out", "nic-in")])
    with pytest.raises(Unrepeated, match="no collective"):
        cost.allreduce_times((0, 1), x)


def test_idle_servers_stay_idle_and_count_no_memory() -> None:
    """Data parallelism over the four A100 GPUs of two servers alike, the V100 servers idle: two slices of one
    server; the idle devices peak at nothing, as in the whole simulation."""
    ev = evaluator("tiny_transformer", CLUSTERS[0])
    s = strategy_of(ev, [data_parallel(ev, list(range(8)), False)] * ev.n_groups, k=2)
    whole, composed = ev.evaluate(s), ev.evaluate(s, compose=True)
    assert composed.composed == 2
    assert_same(whole, composed)
    assert all(composed.peak_memory_bytes[n] == 0 for n in ev.cluster.device_names[8:])


def test_plans_that_do_not_repeat_are_simulated_whole() -> None:
    ev = evaluator("tiny_mlp", CLUSTERS[0])
    every = list(range(16))
    dp = data_parallel(ev, every, False)
    cases = {
        "a parameter server": dataclasses.replace(dp, sync="ps"),
        "one replica per slice": data_parallel(ev, [0, 8], False),
        "a split beyond the batch": ParallelConfig.split_over(every, [1] * 16, BATCH),
    }
    for what, config in cases.items():
        s = strategy_of(ev, [config] * ev.n_groups)
        assert find_repetition(ev.graph, ev.cluster, s) is None, what
        assert ev.evaluate(s, compose=True).composed == 1, what
    # rows that move between servers of different slices: A100 shares 3 in one group, 4 in the next (rows 12-15
    # on a100-0, then on a100-1)
    skewed = ParallelConfig(tuple(every), (4,) * 8 + (2,) * 8)
    mixed = [dp if g % 2 else skewed for g in range(ev.n_groups)]
    assert find_repetition(ev.graph, ev.cluster, strategy_of(ev, mixed)) is None
    # 8 micro-batches of 6 samples over 16 replicas: some replica of a slice gets none in some micro-batch
    assert find_repetition(ev.graph, ev.cluster, strategy_of(ev, [dp] * ev.n_groups, k=8)) is None
    # a slower link on one server: the servers are no longer alike
    c = ev.cluster
    slow = dataclasses.replace(c, links=[dataclasses.replace(x, bandwidth_Bps=x.bandwidth_Bps / 2)
                                          if x.name == "a100-1/nic-out" else x for x in c.links])
    assert find_repetition(ev.graph, slow, strategy_of(ev, [dp] * ev.n_groups)) is None


def test_a_pipeline_of_a_stage_on_each_kind_is_two_slices_of_one_server_of_each() -> None:
    """tiny_mlp in two stages (groups whose whole values are read across kept together: ``stages_of``), the first
    data-parallel over the A100 servers, the second over the V100 servers, 2 micro-batches: the rows of a100-0
    go to v100-0 and those of a100-1 to v100-1, so a slice is one of each, exactly; the same groups cut in the
    middle read parameters across the stages whole, and are simulated whole."""
    ev = evaluator("tiny_mlp", CLUSTERS[0])
    a, v = data_parallel(ev, list(range(8)), False), data_parallel(ev, list(range(8, 16)), False)
    s = strategy_of(ev, [(a, v)[int(x)] for x in stages_of(ev, 2)], k=2)
    rep = find_repetition(ev.graph, ev.cluster, s)
    assert rep is not None and rep.copies == 2
    assert rep.images.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    for order in ("best", "rank"):
        assert_same(ev.evaluate(s, order), ev.evaluate(s, order, compose=True))
    cut = strategy_of(ev, [a if g < ev.n_groups // 2 else v for g in range(ev.n_groups)], k=4)
    assert not rows_only_between_device_sets(ev.graph, cut)
    assert find_repetition(ev.graph, ev.cluster, cut) is None


def test_the_checkpoint_term_and_a_non_composing_evaluator_simulate_whole() -> None:
    g, c = capture_model("tiny_mlp", BATCH), load_cluster(CLUSTERS[0])
    for ev in (Evaluator(g, c, compose=False), Evaluator(g, c, checkpoint_every_steps=10)):
        s = strategy_of(ev, [data_parallel(ev, list(range(16)), False)] * ev.n_groups)
        assert ev.repetition(s) is None and ev.evaluate(s, compose=True).composed == 1


# ------------------------------------------------------------------------------------------ random plans
def stages_of(ev: Evaluator, n_stages: int) -> np.ndarray:
    """(G,) a stage per group, the groups in contiguous runs of their first ops, such that a value read whole
    (a parameter, a non-batch result) is read in its producer's stage: groups joined by such reads stay together."""
    gi, g_of = graph_index(ev.graph), ev.group_of
    parent = list(range(ev.n_groups))

    def root(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    whole = ~gi.e_value_free & ~(gi.e_batch & gi.has_batch[gi.e_dst])
    for a, b in zip(g_of[gi.e_src[whole]].tolist(), g_of[gi.e_dst[whole]].tolist()):
        parent[root(a)] = root(b)
    first = np.full(ev.n_groups, np.iinfo(np.int64).max)
    np.minimum.at(first, g_of, np.arange(len(g_of)))
    blocks = sorted({root(x) for x in range(ev.n_groups)}, key=lambda r: min(first[x] for x in range(ev.n_groups)
                                                                          if root(x) == r))
    stage_of_block = {r: i * n_stages // len(blocks) for i, r in enumerate(blocks)}
    return np.array([stage_of_block[root(x)] for x in range(ev.n_groups)], dtype=np.int64)


@st.composite
def plans(draw):
    graph = draw(st.sampled_from(GRAPHS))
    cluster = draw(st.sampled_from(CLUSTERS))
    synced = graph == "tiny_cnn" and draw(st.booleans())
    ev = evaluator(graph, cluster, synced, draw(st.booleans()))
    c = ev.cluster
    kinds = sorted({d.type.name for d in c.devices})
    keep = draw(st.sampled_from([kinds] + [[k] for k in kinds]))          # every kind of device, or one
    devices = [d.index for d in c.devices if d.type.name in keep]
    if len(devices) < 2:
        devices = list(range(c.n_devices))

    def layout(devs: list[int]) -> ParallelConfig:
        how = draw(st.sampled_from(["servers", "positions", "shuffled"]))
        order = list(devs)
        if how == "positions":                    # the first device of every server, then the second, ...
            order.sort(key=lambda d: (c.servers[int(c.server_of[d])].devices.index(d), d))
        elif how == "shuffled":
            order = draw(st.permutations(order))
        algo = draw(st.sampled_from(["auto", "ring", "hierarchical"]))
        return dataclasses.replace(data_parallel(ev, list(order), draw(st.booleans())), allreduce=algo)

    n_stages = draw(st.integers(1, 3))
    servers = sorted({int(c.server_of[d]) for d in devices})
    if n_stages > 1 and len(servers) >= n_stages:     # a pipeline: each stage data-parallel over its servers
        how = draw(st.sampled_from(["blocks", "in turn", "by kind"]))
        if how == "by kind" and len(keep) == n_stages == 2:
            part = [0 if c.devices[c.servers[s].devices[0]].type.name == keep[0] else 1 for s in servers]
        elif how == "in turn":
            part = [i % n_stages for i in range(len(servers))]
        else:
            part = [i * n_stages // len(servers) for i in range(len(servers))]
        per = [[d for s, p in zip(servers, part) if p == k for d in c.servers[s].devices] for k in range(n_stages)]
        stage_layouts = [layout(devs) if len(devs) >= 2 else layout(devices) for devs in per]
        configs = [stage_layouts[int(x)] for x in stages_of(ev, n_stages)]
    else:
        layouts = [layout(devices), layout(devices)]
        second = draw(st.lists(st.booleans(), min_size=ev.n_groups, max_size=ev.n_groups)) \
            if draw(st.booleans()) else [False] * ev.n_groups
        configs = [layouts[1] if b else layouts[0] for b in second]
    k = draw(st.integers(1, 8))
    s = strategy_of(ev, configs, k, draw(st.sampled_from(["1f1b", "gpipe"])))
    recompute = draw(st.lists(st.booleans(), min_size=ev.n_groups, max_size=ev.n_groups))
    s = s.with_recompute(np.nonzero(recompute)[0])
    return ev, s, draw(st.sampled_from(["best", "fifo", "rank-contention"]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_a_composed_evaluation_is_the_whole_simulation(case) -> None:
    """Random data-parallel plans and pipelines of data-parallel stages (up to 16 GPUs, 8 micro-batches,
    recomputation, synchronized batch norms, the collectives serialized or not, every order): where the plan
    repeats a slice, its composed evaluation equals the whole simulation."""
    ev, s, order = case
    whole, composed = ev.evaluate(s, order), ev.evaluate(s, order, compose=True)
    assert_same(whole, composed)
    assert ev.iteration_time(s, order) == (composed.iteration_time_s, composed.oom)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_data_parallelism_over_every_device_composes_on_each_cluster(cluster: str) -> None:
    """Even and speed-proportional shares over every device, 1 and 2 micro-batches: each repeats a slice of one
    server of each kind per slice (as many slices as the kind with the fewest servers allows), exactly."""
    ev = evaluator("tiny_transformer", cluster)
    c = ev.cluster
    servers = {}
    for srv in c.servers:
        servers[c.devices[srv.devices[0]].type.name] = servers.get(c.devices[srv.devices[0]].type.name, 0) + 1
    for proportional in (False, True):
        for k in (1, 2):
            s = strategy_of(ev, [data_parallel(ev, list(range(c.n_devices)), proportional)] * ev.n_groups, k)
            composed = ev.evaluate(s, compose=True)
            assert composed.composed == min(servers.values()), (proportional, k)
            assert_same(ev.evaluate(s), composed)


def test_the_event_loop_seconds_count_every_simulation_a_composed_one_on_its_slice(monkeypatch) -> None:
    """``Evaluator.simulate_s`` adds the time of each simulation it makes, a composed plan's slice's included: with a
    clock that moves one second per reading, each event loop adds exactly one second. Order ``best`` simulates
    the three orders of the portfolio; a composed plan is simulated on its slice, whose seconds count for the
    evaluator that asked."""
    import heterog.evaluate as evaluate
    from heterog.scheduler import PORTFOLIO

    class Clock:
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 1.0
            return self.now

    ev = Evaluator(capture_model("tiny_mlp", BATCH), load_cluster(CLUSTERS[0]))
    monkeypatch.setattr(evaluate, "time", Clock())
    s = strategy_of(ev, [data_parallel(ev, list(range(16)), False)] * ev.n_groups)
    ev.evaluate(s)                                          # whole: one event loop per order
    assert ev.simulate_s == len(PORTFOLIO)
    ev.iteration_time(s)                                    # composed: on the slice, counted here as well
    assert ev.repetition(s) is not None and ev.simulate_s == 2 * len(PORTFOLIO)
    ev.iteration_time(s, "fifo")
    assert ev.simulate_s == 2 * len(PORTFOLIO) + 1
