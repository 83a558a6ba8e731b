"""Making a plan fit in memory (heterog.baselines.fit) and the planners that offer sharded state: on a
layered graph with Adam's state (each parameter P bytes: P of weights and 2 P of moments resident, its
gradient of P allocated by the op that makes it until the update) and clusters whose GPUs hold a few tens
of P."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from heterog.baselines.chains import ActionSearch
from heterog.baselines.expert import group_strategy, op_layers
from heterog.baselines.fit import fit, recompute_way, sharded_way, with_sharded
from heterog.baselines.mcmc import mcmc
from heterog.baselines.pipeline import pipeline
from heterog.cluster.loader import cluster_from_dict
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.opgraph import OpGraph
from heterog.moves import moves_from_uniform
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
    # two layers of 4 P on four GPUs of 3.5 P: a GPU that holds a layer whole holds 4 P, so no stage
    # grouping fits; data parallel over 2 or 4 GPUs with the state in shards (stage 1: 3 P) does
    graph = with_adam_state(layered_graph(2, 1 << 20, batch=64, width=256))
    ev = Evaluator(graph, cluster(3.5 * (1 << 20), n=4))
    plain = pipeline(ev, budget_s=2.0, max_micro_batches=2)
    assert ev.iteration_time(plain)[1] and plain.meta["sharded_groups"] == 0
    st = pipeline(ev, budget_s=2.0, max_micro_batches=2, sharded=True)
    assert not ev.iteration_time(st)[1] and st.meta["sharded_groups"] > 0
    assert st.meta["fit"] in ("sharded", "sharded+recompute")
