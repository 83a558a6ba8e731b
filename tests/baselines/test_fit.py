"""Making a plan fit in memory (heterog.baselines.fit) and the planners that offer sharded state: on a
layered graph with Adam's state (each parameter P bytes: P of weights and 2 P of moments resident, its
gradient of P allocated by the op that makes it until the update) and clusters whose GPUs hold a few tens
of P."""
from __future__ import annotations

import dataclasses
from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.baselines.chains import ActionSearch
from heterog.baselines.expert import group_strategy, op_layers
from heterog.baselines.fit import STATE_CHOICES, fit, recompute_way, sharded_variants, sharded_way, with_sharded
from heterog.baselines.mcmc import mcmc
from heterog.baselines.pipeline import least_state_bytes, pipeline
from heterog.cluster.loader import cluster_from_dict
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.opgraph import OpGraph
from heterog.moves import moves_from_uniform
from heterog.sharded import SHARD_BY, ShardedState
from heterog.strategy import ParallelConfig
from tests.baselines.helpers import layered_graph

P = 1 << 16                         # bytes of each layer's weight


def with_adam_state(graph: OpGraph) -> OpGraph:
    """``graph`` with two moments per parameter (Adam's), resident beside its weight."""
    ops = [dataclasses.replace(o, state_bytes=2 * o.param_bytes) if o.kind == "param" else o for o in graph.ops]
    return OpGraph(graph.name + "-adam", graph.batch_size, ops, graph.edges)


def cluster(memory_bytes: float, n: int = 2, bandwidth: str = "10 GB/s"):
    gpu = {"name": "G", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": f"{int(memory_bytes)} B"}
    return cluster_from_dict({"name": f"tight-{n}", "servers": [
        {"name": "s0", "gpus": [gpu] * n, "intra": {"kind": "pcie", "bandwidth": bandwidth, "latency_us": 5}}]})


def two_layer_groups(width: int, memory_bytes: float, bandwidth: str = "10 GB/s"):
    """8 layers (24 P resident) in 4 groups of two layers (a group recomputes its first layer), each
    group data parallel over both GPUs with AllReduce."""
    graph = with_adam_state(layered_graph(8, P, batch=64, width=width))
    ev = Evaluator(graph, cluster(memory_bytes, bandwidth=bandwidth))
    layer_of, _ = op_layers(graph)
    cfg = ParallelConfig.of([(0, 32), (1, 32)], sync="allreduce")
    return ev, group_strategy(ev, layer_of // 2, [cfg] * 4)


def stage_of(strategy) -> set[int]:
    return {0 if c.sharded is None else c.sharded.stage for c in strategy.configs}


def test_a_plan_whose_state_does_not_fit_gets_sharded_state():
    # resident: 8 x 3 P = 24 P, and at the peak 6 P of gradients and activations (30 P) > 26 P on each GPU;
    # recomputation saves 1 P at most (29 P): it does not fit. Sharded moments: stage 1 peaks at 25 P (the
    # moments halved, 8 P less, but the updated halves all-gathered beside the old weights), stage 2 at 22 P
    # (gradients reduce-scattered), stage 3 at 21 P: all fit. Stage 2 is the fastest: its reduce-scatter and
    # all-gather move what the AllReduce did, and each GPU updates half of each weight; stage 1 all-gathers
    # on top of the AllReduce, stage 3 gathers each weight twice more.
    ev, plain = two_layer_groups(256, 26 * P)
    assert ev.iteration_time(plain)[1]
    assert ev.iteration_time(plain.with_recompute(range(4)))[1]
    found = fit(ev, plain)
    assert found.way == "sharded" and not found.oom and stage_of(found.strategy) == {2}
    assert found.strategy.meta["fit"] == "sharded"
    assert found.strategy.meta["sharded"] == [{"stage": 2, "weights": [1, 1]}] * 4
    assert (found.time_s, False) == ev.iteration_time(found.strategy)
    # the fastest of the stages: each tried on every group
    times = {}
    for stage in (1, 2, 3):
        s = with_sharded(plain, range(4), lambda c, k=stage: dataclasses.replace(
            c, sharded=type(found.strategy.configs[0].sharded)(k, (1, 1))))
        times[stage] = ev.iteration_time(s)
    assert not any(oom for _, oom in times.values())
    assert found.time_s == min(t for t, _ in times.values()) == times[2][0]
    # a plan that fits is left alone, unless asked to improve it
    roomy = Evaluator(ev.graph, cluster(64 * P))
    plain_roomy = dataclasses.replace(plain, cluster_name=roomy.cluster.name)
    assert fit(roomy, plain_roomy).way == "fits"
    assert fit(roomy, plain_roomy, improve=True).way == "sharded"
    with pytest.raises(HeterogError, match="unknown way to fit 'offlaod'"):
        fit(ev, plain, ("offlaod",))


def test_recomputation_wins_where_it_costs_less_than_sharded_state():
    # wide layers: activations dominate (73 P at the peak, next to 24 P resident: 97 P); at 87 P stage 3 fits
    # (86 P) and so does recomputing the first two groups (81 P; the first alone: 89 P), stages 1 and 2 do
    # not (89 P). Over a 10 MB/s link stage 3's gathers (each weight twice more) cost far more than running
    # two layers' forward again, hidden under the AllReduces
    ev, plain = two_layer_groups(4096, 87 * P, bandwidth="10 MB/s")
    assert ev.iteration_time(plain)[1]
    by_sharding, by_recomputing = sharded_way(ev, plain), recompute_way(ev, plain)
    assert by_sharding is not None and 3 in stage_of(by_sharding.strategy)
    assert by_recomputing is not None and by_recomputing.strategy.recompute == (0, 1)
    assert by_recomputing.time_s < by_sharding.time_s
    found = fit(ev, plain)
    assert found.way == "recompute" and found.strategy.recompute == (0, 1) and stage_of(found.strategy) == {0}
    assert "sharded" not in found.strategy.meta


def test_where_no_way_fits_alone_two_are_combined():
    # at 70 P: stage 3 alone holds 86 P, recomputing every group 81 P; both together fit (65 P; stages 1 and
    # 2 with every group recomputed: 73 P)
    ev, plain = two_layer_groups(4096, 70 * P, bandwidth="10 MB/s")
    assert sharded_way(ev, plain) is None and recompute_way(ev, plain) is None
    found = fit(ev, plain, ("sharded", "recompute"))
    assert not found.oom and found.way in ("sharded+recompute", "recompute+sharded")
    assert found.strategy.recompute and 3 in stage_of(found.strategy)
    nothing = fit(ev, plain, ("recompute",))
    assert nothing.way == "none" and nothing.oom and nothing.strategy.recompute == ()


def state_bound():
    """4 layers of 3 P resident, 2 GPUs of 13 P: data parallelism peaks at 17 P, the plain search's best plan
    at 14 P; with sharded state the moments' halves fit (data parallel stage 1: 13 P, stages 2 and 3: 12 P)."""
    graph = with_adam_state(layered_graph(4, P, batch=64, width=256))
    return Evaluator(graph, cluster(13 * P))


def test_mcmc_moves_reach_sharded_state_where_nothing_else_fits():
    ev = state_bound()
    kwargs = {"seed": 0, "starts": ["ev-ar"], "max_evals": 120, "max_micro_batches": 1}
    plain = mcmc(ev, **kwargs)
    assert ev.iteration_time(plain)[1]                          # every plan without sharded state is OOM
    st = mcmc(ev, sharded=True, **kwargs)
    t, oom = ev.iteration_time(st)
    assert not oom and st.meta["sharded_groups"] > 0 and st.meta["best_cost_s"] == pytest.approx(t)
    assert len(st.meta["sharded"]) == ev.n_groups
    again = mcmc(ev, sharded=True, **kwargs)
    assert again.meta["actions"] == st.meta["actions"] and again.meta["sharded"] == st.meta["sharded"]
    # the plain actions stay M + 4-way; each sharded group is a move of its own
    assert max(st.meta["actions"]) < ev.cluster.n_devices + 4
    assert moves_from_uniform(ev, st).moves >= st.meta["sharded_groups"]


def test_shard_moves_set_and_clear_a_groups_sharded_state():
    ev = state_bound()
    search = ActionSearch(ev, sharded=True)
    m = ev.cluster.n_devices
    assert search.n_base == m + 4 and set(search.family) == {m + 1, m + 3}
    # two GPUs alike: even, memory and speed shards are equal, one variant per stage
    assert [search._configs[a].sharded.stage for a in search.family[m + 1][1:]] == [1, 2, 3]
    rng = np.random.default_rng(0)
    for a in search.family[m + 1]:
        others = {search.shard_move(a, rng) for _ in range(60)}
        assert others == set(search.family[m + 1]) - {a}         # another stage, or none
    assert {search.shard_move(0, rng) for _ in range(100)} == set(search.sharded_actions)
    assert ActionSearch(ev).sharded_actions == []


def test_pipeline_with_sharded_state_fits_where_it_did_not():
    # two layers of 4 P on four GPUs of 4 P: a GPU that holds a layer whole peaks at 4.19 P (its weight and
    # moments, the gradient it makes and the activations), so no stage grouping fits; data parallel over the
    # four GPUs with the state in shards does (stage 3 peaks at 3.55 P)
    graph = with_adam_state(layered_graph(2, 1 << 20, batch=64, width=256))
    ev = Evaluator(graph, cluster(4 * (1 << 20), n=4))
    plain = pipeline(ev, budget_s=2.0, max_micro_batches=2)
    assert ev.iteration_time(plain)[1] and plain.meta["sharded_groups"] == 0
    st = pipeline(ev, budget_s=2.0, max_micro_batches=2, sharded=True)
    assert not ev.iteration_time(st)[1] and st.meta["sharded_groups"] > 0
    assert st.meta["fit"] in ("sharded", "sharded+recompute")


# ----------------------------------------------------------------------------- offloading
XEON = {"cpu": "Xeon-Gold-6148", "sockets": 2, "memory": "384 GB", "pcie": {"bandwidth": "12 GB/s", "latency_us": 5}}


def hosted(n_layers: int, memory_bytes: float, n: int, groups: int):
    """``n_layers`` layers with Adam (4 P resident each; the host step priced as Adam's) on ``n`` GPUs of
    one server with a host, in ``groups`` groups of consecutive layers, each data parallel over all GPUs
    (AllReduce) or, on one GPU, the single-device config."""
    graph = dataclasses.replace(with_adam_state(layered_graph(n_layers, P, batch=64, width=256)), optimizer="adam")
    server: dict = {"name": "s0", "gpus": [{"name": "G", "peak_tflops": 10, "memory_bandwidth": "500 GB/s",
                                            "memory": f"{int(memory_bytes)} B"}] * n, "host": XEON}
    if n > 1:
        server["intra"] = {"kind": "pcie", "bandwidth": "10 GB/s", "latency_us": 5}
    ev = Evaluator(graph, cluster_from_dict({"name": f"hosted-{n}", "servers": [server]}))
    layer_of, _ = op_layers(graph)
    cfg = ParallelConfig.of([(d, 64 // n) for d in range(n)], sync="allreduce") if n > 1 else \
        ParallelConfig.single(0, 64)
    return ev, group_strategy(ev, layer_of * groups // n_layers, [cfg] * groups)


def every_group(plan, stage: int, offload: str):
    return with_sharded(plan, range(plan.n_groups), lambda c: dataclasses.replace(
        c, sharded=ShardedState(stage, (1,) * len(c.devices), offload)))


def test_offloading_is_the_only_way_where_each_gpu_cannot_hold_its_shards():
    # 8 layers (8 P of weights, 16 P of moments) over 2 GPUs of 13.5 P. Per GPU, stage 1 peaks at 25 P, stage 2
    # at 22 P (21 P recomputed), stage 3 at 21 P: none fits, recomputed or not. Offloading moves each GPU's
    # half of the moments (8 P) to the host, and at least that much comes off every peak (measured: stage 1
    # 25 -> 14.5 P, stage 2 22 -> 14 P, stage 3 21 -> 12.5 P): of the optimizer offloads only stage 3's fits.
    ev, plain = hosted(8, 13.5 * P, 2, 4)
    peaks = {}
    for stage, offload in product((1, 2, 3), ("none", "optimizer")):
        r = ev.evaluate(every_group(plain, stage, offload))
        peaks[stage, offload] = r.peak_memory_bytes["s0/gpu0"] / P
        assert r.oom == ((stage, offload) != (3, "optimizer"))
    for stage in (1, 2, 3):
        assert peaks[stage, "none"] - peaks[stage, "optimizer"] >= 8.0
    assert ev.iteration_time(every_group(plain, 3, "none").with_recompute(range(4)))[1]
    found = fit(ev, plain)
    assert found.way == "offload" and not found.oom
    assert found.strategy.meta["sharded"] == [{"stage": 3, "weights": [1, 1], "offload": "optimizer"}] * 4
    # the host holds the fp32 master weight, gradient and moments of each GPU's half: 16 bytes per
    # element, (8 layers x P / 4 elements) / 2 per GPU, both GPUs on one host: 32 P
    host = ev.evaluate(found.strategy).sim
    assert host is not None
    assert host.peak_memory[list(host.resource_names).index("host:s0")] == pytest.approx(32 * P)


def test_a_cheaper_way_than_offloading_is_chosen_where_it_fits():
    # at 23 P the plain plan (30 P) does not fit, stage 2 does (22 P) and beats every offloading plan (each
    # adds its copies and host steps to the same collectives): the way is "sharded". At 20 P no stage fits on
    # the GPUs, recomputed or not (21 P at least), and every offloading plan does: stage 2's is the fastest
    # (no gathers of the weights) and chosen.
    ev, plain = hosted(8, 23 * P, 2, 4)
    times = {(st, off): ev.iteration_time(every_group(plain, st, off)) for st, off in product((1, 2, 3),
                                                                                           ("none", "optimizer"))}
    found = fit(ev, plain)
    assert found.way == "sharded" and stage_of(found.strategy) == {2}
    assert found.strategy.meta["sharded"] == [{"stage": 2, "weights": [1, 1]}] * 4
    assert found.time_s == times[2, "none"][0] < min(t for (_, off), (t, _) in times.items() if off != "none")
    tight_ev, tight_plain = hosted(8, 20 * P, 2, 4)
    found = fit(tight_ev, tight_plain)
    assert found.way == "offload"
    assert found.strategy.meta["sharded"] == [{"stage": 2, "weights": [1, 1], "offload": "optimizer"}] * 4
    assert found.time_s == pytest.approx(times[2, "optimizer"][0])
    assert times[2, "optimizer"][0] < times[3, "optimizer"][0]


def test_one_gpu_offloads_the_fewest_groups_that_fit():
    # 4 layers on one GPU (peak 21 P unbounded, recomputed too; the plan or its recomputation fits from
    # 18 P, where the scheduler holds work back): no sharding; offloading the moments of the first 1-4 groups
    # peaks at 19, 17, 13 and 10 P unbounded. At 11 P only all four offloaded fit; at 13 P three of the four
    # (bisection; equal state: the first groups first) fit and are kept: faster than offloading all four.
    # The host holds 16 bytes per offloaded element: P / 4 elements per layer, 4 P per group.
    for capacity, offloaded in ((11, 4), (13, 3)):
        ev, plain = hosted(4, capacity * P, 1, 4)
        assert ev.iteration_time(plain)[1] and ev.iteration_time(plain.with_recompute(range(4)))[1]
        found = fit(ev, plain)
        assert found.way == "offload" and not found.oom
        assert [c.sharded for c in found.strategy.configs] == \
            [ShardedState(0, (1,), "optimizer")] * offloaded + [None] * (4 - offloaded)
        sim = ev.evaluate(found.strategy).sim
        assert sim is not None
        assert sim.peak_memory[list(sim.resource_names).index("host:s0")] == pytest.approx(4 * P * offloaded)
        if offloaded < 4:
            fewer = with_sharded(plain, range(offloaded - 1), lambda c: found.strategy.configs[0])
            assert ev.iteration_time(fewer)[1]
            assert found.time_s < ev.iteration_time(every_group(plain, 0, "optimizer"))[0]


def test_no_search_where_even_every_way_at_its_strongest_does_not_fit():
    # at 7 P stage 3 with the moments and the parameter shards offloaded and every group recomputed is out of
    # memory (it peaks at 8.5 P; at 8 P the scheduler holds work back and it fits): fit simulates the plan,
    # the first way's strongest plan (every group recomputed: recomputation's bisection starts there), then
    # every way at its strongest, and gives up; with sharded state first, its strongest plan (the two GPUs
    # alike: one for every weights) comes second
    strongest = ShardedState(3, (1, 1), "parameters")
    for ways, second in ((("recompute", "sharded"), {"recompute": (0, 1, 2, 3), "sharded": {None}}),
                         (("sharded", "recompute"), {"recompute": (), "sharded": {strongest}})):
        ev, plain = hosted(8, 7 * P, 2, 4)
        calls = []
        simulate = ev.iteration_time
        ev.iteration_time = lambda s, *a, calls=calls, simulate=simulate: calls.append(s) or simulate(s, *a)  # type: ignore[method-assign]
        found = fit(ev, plain, ways)
        assert found.way == "none" and found.oom and len(calls) == 3
        assert calls[1].recompute == second["recompute"] and {c.sharded for c in calls[1].configs} == second["sharded"]
        assert calls[2].recompute == (0, 1, 2, 3)
        assert {c.sharded for c in calls[2].configs} == {strongest}


def uneven(width: int, memory_p: tuple[float, float]):
    """8 layers with Adam (3 P resident each) of ``width`` on two GPUs of one server with a host, of 10 and 25
    TFLOP/s and ``memory_p`` P each (even, memory and speed shards differ), in 4 groups data parallel over
    both (AllReduce, the batch in speed shares)."""
    graph = dataclasses.replace(with_adam_state(layered_graph(8, P, batch=64, width=width)), optimizer="adam")
    gpus = [{"name": n, "peak_tflops": f, "memory_bandwidth": "500 GB/s", "memory": f"{int(m * P)} B"}
            for n, f, m in (("A", 10, memory_p[0]), ("B", 25, memory_p[1]))]
    intra = {"kind": "pcie", "bandwidth": "10 GB/s", "latency_us": 5}
    ev = Evaluator(graph, cluster_from_dict({"name": "uneven", "servers": [
        {"name": "s0", "gpus": gpus, "host": XEON, "intra": intra}]}))
    layer_of, _ = op_layers(graph)
    return ev, group_strategy(ev, layer_of // 2, [ParallelConfig.of([(0, 18), (1, 46)], sync="allreduce")] * 4)


def every_sharded_choice(ev, plan):
    """Every group of ``plan`` under each (choice, weights) of sharded state: choice x SHARD_BY -> plan."""
    return {(i, by): with_sharded(plan, range(plan.n_groups),
                                  lambda c, ch=ch, by=by: sharded_variants(c, ev.cluster, (ch,), (by,))[0])
            for (i, ch), by in product(enumerate(STATE_CHOICES), SHARD_BY)}


def test_sharded_state_is_not_searched_where_its_strongest_does_not_fit():
    # wide layers: activations fill the GPUs, state is a small part; even the strongest state of each weights
    # (stage 3, the moments and the weight shards on the host) is out of memory, so every other choice is too
    # (checked here one by one), and the way simulates only those three plans
    ev, plain = uneven(4096, (60, 90))
    every = every_sharded_choice(ev, plain)
    assert all(ev.iteration_time(s)[1] for s in every.values())
    calls = []
    simulate = ev.iteration_time
    ev.iteration_time = lambda s, *a: calls.append(s) or simulate(s, *a)      # type: ignore[method-assign]
    assert sharded_way(ev, plain) is None
    assert [{c.sharded.offload for c in s.configs} for s in calls] == [{"parameters"}] * 3
    assert len({s.configs[0].sharded.weights for s in calls}) == 3


@settings(max_examples=12, deadline=None)
@given(width=st.sampled_from([256, 1024, 2048, 4096]), memory=st.tuples(st.integers(10, 100), st.integers(10, 200)))
def test_skipping_the_weights_whose_strongest_state_does_not_fit_loses_no_plan_that_fits(width, memory):
    # on random widths and memories of two unlike GPUs: the way's plan (without its bisection over groups) is
    # the fastest that fits of every (choice, weights), each simulated
    ev, plain = uneven(width, memory)
    times = [ev.iteration_time(s) for s in every_sharded_choice(ev, plain).values()]
    fitting = [t for t, oom in times if not oom]
    found = sharded_way(ev, plain, bisect=False)
    assert (found is None) == (not fitting)
    if found is not None:
        assert found.time_s == min(fitting)


@pytest.mark.parametrize("ways", [("sharded", "recompute"), ("recompute", "sharded", "micro-batches")])
def test_a_deadline_stops_the_search_at_what_it_has_simulated(monkeypatch, ways):
    # a clock that counts simulations: a deadline of d lets fit simulate at most d plans (the plan itself
    # always); what it returns fits if it says so and is the fastest of what it simulated, and from the
    # deadline that the full search needs on, it is the full search's plan
    from heterog.baselines import fit as fit_module

    ev, plain = two_layer_groups(4096, 87 * P, bandwidth="10 MB/s")
    calls: list = []
    simulate = ev.iteration_time
    ev.iteration_time = lambda s, *a: calls.append(simulate(s, *a)) or calls[-1]     # type: ignore[method-assign]
    monkeypatch.setattr(fit_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: len(calls))}))
    full = fit(ev, plain, ways)
    n_full = len(calls)
    assert not full.oom and n_full > 3
    for d in range(n_full + 1):
        calls.clear()
        found = fit(ev, plain, ways, deadline=d)
        assert len(calls) == max(d, 1)
        assert (found.time_s, found.oom) == simulate(found.strategy)
        fitting = [t for t, oom in calls if not oom]
        assert found.oom == (not fitting) and (found.way == "none") == found.oom
        if fitting:                       # the fastest of them (here every way at its strongest is the slowest)
            assert found.time_s == min(fitting)
        if d >= n_full:
            assert found.strategy.configs == full.strategy.configs and found.time_s == full.time_s


def test_a_known_result_is_not_simulated_again():
    ev, plain = two_layer_groups(4096, 87 * P, bandwidth="10 MB/s")
    before = ev.n_evaluations
    full = fit(ev, plain, ("sharded", "recompute"))
    n = ev.n_evaluations - before
    before = ev.n_evaluations
    again = fit(ev, plain, ("sharded", "recompute"), known=ev.iteration_time(plain))
    assert ev.n_evaluations - before == n                  # the caller's simulation in place of fit's own
    assert again.strategy.configs == full.strategy.configs and (again.time_s, again.oom) == (full.time_s, full.oom)


def test_shard_moves_offer_offloading_where_the_servers_have_hosts():
    ev, _ = hosted(4, 14 * P, 2, 4)
    search = ActionSearch(ev, sharded=True)
    m = ev.cluster.n_devices
    variants = [search._configs[a].sharded for a in search.family[m + 1][1:]]
    assert [(v.stage, v.offload) for v in variants] == [(c["stage"], c.get("offload", "none")) for c in STATE_CHOICES]
    assert [v.offload for v in variants] == ["none"] * 3 + ["optimizer"] * 3 + ["parameters"]
    # each single-device action offloads too (a move between it and its offloading variant)
    assert set(search.family) == {0, 1, m + 1, m + 3}
    for d in (0, 1):
        assert len(search.family[d]) == 2
        one = search._configs[search.family[d][1]]
        assert one.devices == (d,) and one.sharded == ShardedState(0, (1,), "optimizer")
        rng = np.random.default_rng(d)
        assert {search.shard_move(search.family[d][1], rng) for _ in range(10)} == {d}


def test_least_state_bytes_counts_what_the_strongest_sharded_state_leaves_on_a_gpu():
    # each layer: P of weight and P of gradient stay on the GPUs, 2 P of moments go to the host where the
    # server has one; a stage of two alike GPUs holds half of each, and its weight shards go to the host too
    ev, _ = hosted(4, 14 * P, 2, 4)
    layer_of, _ = op_layers(ev.graph)
    assert (least_state_bytes(ev.graph, ev.cluster, layer_of, [[0], [1]]) == 2 * P).all()
    assert (least_state_bytes(ev.graph, ev.cluster, layer_of, [[0, 1]]) == P / 2).all()
    no_host = cluster(14 * P)
    assert (least_state_bytes(ev.graph, no_host, layer_of, [[0], [1]]) == 4 * P).all()
    assert (least_state_bytes(ev.graph, no_host, layer_of, [[0, 1]]) == 2 * P).all()


def test_pipeline_offloads_where_nothing_else_fits():
    # 4 layers of 4 P over two GPUs of 8 P: a stage of one GPU holds two layers' 8 P, replicated stages
    # all four's 16 P, stage 3 over both 8 P: nothing fits on the GPUs. Two stages of two layers, each
    # GPU's moments on the host (4 P left), fit
    ev, _ = hosted(4, 8 * P, 2, 4)
    plain = pipeline(ev, budget_s=2.0, max_micro_batches=2)
    assert ev.iteration_time(plain)[1]
    st = pipeline(ev, budget_s=2.0, max_micro_batches=2, sharded=True)
    assert not ev.iteration_time(st)[1] and st.meta["fit"] == "offload"
    assert st.meta["stages"] == [(0,), (1,)] and st.meta["layers_per_stage"] == [2, 2]
    assert {c.sharded for c in st.configs} == {ShardedState(0, (1,), "optimizer")}
