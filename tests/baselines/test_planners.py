"""Every registered planner returns a valid strategy; memory is respected where a planner promises it;
the expert's layers and balanced contiguous partition."""
from __future__ import annotations

import numpy as np
import pytest

from heterog import baselines
from heterog.baselines.expert import balanced_partition, layer_key, op_layers
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from tests.baselines.helpers import TableCost, gpu_cluster, layered_graph

OPTS = {"budget_s": 3.0, "workers": 1, "seed": 0}          # shared: each planner takes those it uses
OWN_OPTS = {"mcmc": {"max_evals": 40}, "pesto-ilp": {"solver_workers": 1}}


def check_valid(strategy, graph, cluster) -> None:
    strategy.check_fits(graph, cluster)
    assert strategy.group_of.shape == (graph.n_ops,)
    assert set(np.unique(strategy.group_of).tolist()) == set(range(strategy.n_groups))   # every group used
    for cfg in strategy.configs:
        assert sum(cfg.shares) == graph.batch_size
        assert all(0 <= d < cluster.n_devices for d in cfg.devices)
    if strategy.priorities is not None:
        assert strategy.priorities.shape == (graph.n_ops,) and np.all(np.isfinite(strategy.priorities))


@pytest.mark.parametrize("name", baselines.names())
@pytest.mark.parametrize("n_devices", [1, 3])
def test_every_planner_gives_a_valid_strategy(name, n_devices):
    graph = layered_graph(4, 4096)
    cluster = gpu_cluster(n_devices)
    ev = Evaluator(graph, cluster)
    strategy = baselines.run(name, graph, cluster, evaluator=ev, **OPTS, **OWN_OPTS.get(name, {}))
    check_valid(strategy, graph, cluster)
    assert strategy.method == name and strategy.meta["search_time_s"] >= 0
    res = ev.evaluate(strategy)
    assert res.iteration_time_s > 0 and not res.oom


@pytest.mark.parametrize("name, opts", [("dpos", {"replicas": 1}), ("os-dpos", {"replicas": 1}), ("expert", {})])
def test_model_parallel_planners_keep_within_memory(name, opts):
    # pesto-ilp is not among them: its coarse graph leaves each 64 MiB weight a node of its own, whose
    # three readers on another device each count as a received copy, so no split of this graph fits its
    # memory model and it keeps the single device
    graph = layered_graph(6, 64 << 20)             # 384 MiB of parameters, 448 MiB at least with a gradient
    cluster = gpu_cluster(2, memory="440 MiB")
    ev = Evaluator(graph, cluster)
    assert ev.evaluate(baselines.run("single", graph, cluster, evaluator=ev)).oom
    strategy = baselines.run(name, graph, cluster, evaluator=ev, **{**OPTS, **OWN_OPTS.get(name, {}), **opts})
    check_valid(strategy, graph, cluster)
    assert not ev.evaluate(strategy).oom


def test_dpos_on_the_data_parallel_graph_is_never_slower_than_its_start():
    graph = layered_graph(5, 1 << 20, batch=12)
    cluster = gpu_cluster(3)
    times = np.outer(np.where(graph.is_compute, 1e-3, 0.0), [1.0, 2.0, 3.0])   # three device speeds
    ev = Evaluator(graph, cluster, TableCost(cluster, times, beta_s_per_byte=1e-10))
    st = baselines.run("dpos", graph, cluster, evaluator=ev)
    cost = ev.iteration_time(st)[0]
    assert cost == pytest.approx(min(v for k, v in st.meta.items() if k.startswith("cost_s/")))
    assert cost <= st.meta["cost_s/start"]
    assert st.meta["replica_shares"] == [4, 4, 4]          # the GPUs have equal peak FLOP/s


def test_layer_keys():
    assert layer_key("encoder.layers.3.attn.q_proj") == "encoder.layers.3"
    assert layer_key("features.10") == "features.10"
    assert layer_key("pooler.dense") == "pooler"
    assert layer_key("") == ""


def test_expert_layers_follow_forward_order_and_keep_parameters_with_their_layer():
    graph = layered_graph(3, 4096)
    layer_of, names = op_layers(graph)
    assert names == ["layers.0", "layers.1", "layers.2"]
    by_name = {op.name: int(layer_of[i]) for i, op in enumerate(graph.ops)}
    assert by_name["W1"] == by_name["f1"] == by_name["w1"] == by_name["u1"] == 1
    assert by_name["x"] == 0                       # no module path: joins its consumer's layer


def test_modules_beside_the_blocks_of_a_nested_model_are_layers_of_their_own():
    # a Hugging Face OPT nests everything under model.decoder: its embeddings and its final norm are two
    # layers, before and after the blocks, not one "model" layer
    import heterog
    from heterog import zoo

    module, inputs = zoo.build("opt_350m_megatron", 2, device="meta", layers=2, hidden=16, heads=2, ffn=32,
                               vocab=64, seq_len=8)
    _, names = op_layers(heterog.capture(module, inputs))
    assert names.index("model.decoder.embed_tokens") < names.index("model.decoder.layers.0") \
        < names.index("model.decoder.layers.1") < names.index("model.decoder.final_layer_norm") \
        < names.index("lm_head")


def test_balanced_partition_is_contiguous_optimal_and_gives_fast_devices_more():
    # 6 equal layers; device 0 twice as fast as device 1: 4 layers (4 s) vs 2 layers (4 s)
    cost = np.array([[1.0, 2.0]] * 6)
    dev = balanced_partition(cost, np.zeros(6), np.array([np.inf, np.inf]))
    assert dev.tolist() == [0, 0, 0, 0, 1, 1]
    # memory: device 0 holds at most 2 layers -> 2 on device 0, 4 on device 1
    dev = balanced_partition(cost, np.ones(6), np.array([2.0, 10.0]))
    assert dev.tolist() == [0, 0, 1, 1, 1, 1]
    # infeasible memory: the limit is dropped, the split is still balanced
    assert balanced_partition(cost, np.ones(6), np.array([1.0, 1.0])).tolist() == [0, 0, 0, 0, 1, 1]


def test_unknown_method_is_a_one_line_error():
    graph = layered_graph(2, 4096)
    with pytest.raises(HeterogError, match="unknown method 'nope'"):
        baselines.run("nope", graph, gpu_cluster(2))
    with pytest.raises(HeterogError, match="unknown method 'best-dp'"):      # not a classic planner
        baselines.run("best-dp", graph, gpu_cluster(2))


def test_a_misspelled_option_is_an_error_naming_the_options():
    graph = layered_graph(2, 4096)
    with pytest.raises(HeterogError) as info:
        baselines.run("mcmc", graph, gpu_cluster(2), budget=30)
    assert str(info.value) == ("planner 'mcmc' takes no option 'budget' (its options: block_moves, budget_s, keep, "
                               "max_evals, max_micro_batches, oom_factor, order, ray_address, seed, shard_moves, "
                               "sharded, splits, starts, temperature, workers)")
    with pytest.raises(HeterogError, match=r"^planner 'single' takes no option 'max_evals' \(its options: device\)$"):
        baselines.run("single", graph, gpu_cluster(2), max_evals=40)


@pytest.mark.parametrize("name", baselines.names())
def test_every_planner_rejects_an_unknown_option(name):
    graph = layered_graph(2, 4096)
    with pytest.raises(HeterogError, match=rf"^planner '{name}' takes no option 'nope' \("):
        baselines.run(name, graph, gpu_cluster(2), nope=1)


def test_shared_options_reach_only_the_planners_that_take_them():
    graph, cluster = layered_graph(3, 4096), gpu_cluster(3)
    ev = Evaluator(graph, cluster)
    plain = baselines.run("cp-ar", graph, cluster, evaluator=ev)
    shared = baselines.run("cp-ar", graph, cluster, evaluator=ev, seed=5, budget_s=1.0, workers=2, progress=False)
    assert shared.configs == plain.configs
    assert (baselines.run("random", graph, cluster, evaluator=ev, seed=5).meta["actions"]
            != baselines.run("random", graph, cluster, evaluator=ev, seed=6).meta["actions"])
