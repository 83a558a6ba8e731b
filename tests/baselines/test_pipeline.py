"""The pipeline planner: contiguous stages of layers over groups of devices, data parallelism inside a
stage, micro-batches chosen; never slower than the data-parallel plans it also tries, and a plan that
fits where data parallelism does not."""
from __future__ import annotations

import numpy as np
import pytest

from heterog import baselines
from heterog.baselines.expert import op_layers
from heterog.baselines.pipeline import equal_stages, stage_groups, with_best_micro_batches
from heterog.errors import HeterogError, StrategyError
from heterog.evaluate import Evaluator
from tests.baselines.helpers import gpu_cluster, layered_graph


def layers_per_stage(strategy, graph) -> list[set[int]]:
    """The layers of each stage (a group per layer; a stage's groups share its config), stages in order."""
    layer_of, _ = op_layers(graph)
    stages: dict = {}
    for g, cfg in enumerate(strategy.configs):
        stages.setdefault(cfg, set()).update(layer_of[strategy.group_of == g].tolist())
    return list(stages.values())


def test_stage_groups_cut_the_devices_in_index_order():
    # one stage of all first (the data-parallel plans), then the servers
    assert stage_groups(4, [[0, 1], [2, 3]]) == [[[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]]]
    assert stage_groups(3, [[0, 1, 2]]) == [[[0, 1, 2]], [[0], [1], [2]], [[0, 1], [2]]]
    # a stage per run of one device type, after the servers (the cut into pairs is the servers', listed once)
    assert stage_groups(6, [[0, 1], [2, 3], [4, 5]], ["a", "a", "a", "b", "b", "b"]) == [
        [[0, 1, 2, 3, 4, 5]], [[0, 1], [2, 3], [4, 5]], [[0, 1, 2], [3, 4, 5]], [[0], [1], [2], [3], [4], [5]],
        [[0, 1, 2, 3], [4, 5]]]


def test_pipeline_is_never_slower_than_the_data_parallel_plans_it_tries():
    graph, cluster = layered_graph(8, 1 << 16, batch=16), gpu_cluster(4)
    ev = Evaluator(graph, cluster)
    s = baselines.run("pipeline", graph, cluster, evaluator=ev, budget_s=20.0)
    t = ev.evaluate(s).iteration_time_s
    for dp in ("ev-ar", "cp-ar"):
        assert t <= ev.evaluate(baselines.run(dp, graph, cluster, evaluator=ev)).iteration_time_s * (1 + 1e-9)
    # stages hold contiguous layers: a layer's forward ops in one group, groups in layer order
    stages = [layers for layers in layers_per_stage(s, graph) if layers]
    firsts = [min(layers) for layers in stages]
    assert firsts == sorted(firsts) and all(max(x) - min(x) + 1 == len(x) for x in stages)
    assert s.meta["candidates"] >= 1 and s.meta["micro_batches"] == s.n_micro


def test_pipeline_fits_where_every_data_parallel_plan_is_out_of_memory():
    # 8 layers of 64 MiB weights (+ gradients): 1 GiB of parameter state, on GPUs of 400 MiB
    graph, cluster = layered_graph(8, 64 << 20, batch=8), gpu_cluster(4, memory="400 MiB")
    ev = Evaluator(graph, cluster)
    for dp in ("ev-ar", "cp-ar", "single"):
        assert ev.evaluate(baselines.run(dp, graph, cluster, evaluator=ev)).oom
    s = baselines.run("pipeline", graph, cluster, evaluator=ev, budget_s=20.0)
    res = ev.evaluate(s)
    assert not res.oom
    assert len(s.meta["stages"]) >= 3                        # at least 3 stages hold the 8 layers


def test_the_homogeneous_baseline_gives_every_device_equal_layers():
    assert equal_stages(7, 3).tolist() == [0, 0, 0, 1, 1, 2, 2]
    graph, cluster = layered_graph(8, 4096, batch=8), gpu_cluster(4)
    s = baselines.run("pipeline", graph, cluster, budget_s=5.0, balance="equal")
    counts = [len(layers) for layers in layers_per_stage(s, graph)]
    assert len(counts) == 4 and max(counts) - min(counts) <= 1
    assert all(len(c.devices) == 1 for c in s.configs)


@pytest.mark.parametrize("opts, match", [({"schedule": "zigzag"}, "schedule"),
                                         ({"max_micro_batches": 0}, "max_micro_batches"),
                                         ({"balance": "random"}, "balance")])
def test_bad_options_are_refused(opts, match):
    graph, cluster = layered_graph(2, 4096), gpu_cluster(2)
    with pytest.raises(HeterogError, match=match):
        baselines.run("pipeline", graph, cluster, **opts)


def test_micro_batches_go_past_the_cap_only_while_nothing_fits():
    # 8 layers of 1 MiB weights and 4 MiB activations per sample on 4 GPUs of 80 MiB: one micro-batch of the
    # 8 samples does not fit on any stage grouping (its stages peak at 131-163 MiB), smaller ones do (8: 79
    # MiB). The weights are small beside the activations: over micro-batches a stage holds a gradient twice
    # while one is added into the accumulated one, which with weights as large as the activations costs
    # what the smaller micro-batches save
    graph, cluster = layered_graph(8, 1 << 20, batch=8, width=1 << 20), gpu_cluster(4, memory="80 MiB")
    ev = Evaluator(graph, cluster)
    s = baselines.run("pipeline", graph, cluster, evaluator=ev, budget_s=20.0, max_micro_batches=1)
    assert s.n_micro > 1 and not ev.evaluate(s).oom
    assert ev.evaluate(s.with_micro_batches(1)).oom
    # where the capped search fits, the cap holds
    small = layered_graph(4, 4096, batch=8)
    assert baselines.run("pipeline", small, gpu_cluster(2), budget_s=5.0, max_micro_batches=1).n_micro == 1


def test_micro_batches_follow_max_micro_batches():
    graph, cluster = layered_graph(4, 4096, batch=8), gpu_cluster(2)
    s = baselines.run("pipeline", graph, cluster, budget_s=5.0, max_micro_batches=1)
    assert s.n_micro == 1
    assert np.all(np.asarray(s.micro) == 8)


@pytest.mark.parametrize("name", ["dpos", "os-dpos", "pesto-ilp"])
def test_placement_planners_plan_at_the_micro_batches_they_are_given(name):
    graph, cluster = layered_graph(4, 4096, batch=8), gpu_cluster(2)
    ev = Evaluator(graph, cluster)
    opts = {"budget_s": 3.0} if name != "dpos" else {}
    s = baselines.run(name, graph, cluster, evaluator=ev, micro_batches=4, **opts)
    assert s.micro == (2, 2, 2, 2)
    assert ev.evaluate(s).plan.n_micro == 4


def test_with_micro_batches_splits_the_batch_evenly_and_refuses_too_many():
    graph, cluster = layered_graph(2, 4096, batch=6), gpu_cluster(2)
    s = baselines.run("single", graph, cluster)
    assert s.with_micro_batches(4, "gpipe").micro == (2, 2, 1, 1)
    assert s.with_micro_batches(4).schedule == s.schedule and s.with_micro_batches(1).micro_batches is None
    with pytest.raises(StrategyError, match="micro-batches for a batch of 6"):
        s.with_micro_batches(7)


def test_no_more_micro_batches_are_tried_past_the_deadline():
    import time

    graph, cluster = layered_graph(4, 4096, batch=8), gpu_cluster(2)
    ev = Evaluator(graph, cluster)
    plan = baselines.run("cp-ar", graph, cluster, evaluator=ev)
    before = ev.n_evaluations
    same = with_best_micro_batches(ev, plan, 8, deadline=time.perf_counter() - 1.0)
    assert same.n_micro == 1 and ev.n_evaluations - before == 1           # the plan itself, fitted
    before = ev.n_evaluations
    with_best_micro_batches(ev, plan, 8)
    assert ev.n_evaluations - before == 1 + 3 * 2                          # k = 2, 4, 8 under each schedule


def test_the_screen_simulates_each_plan_once_and_refinement_fits_the_fastest_first(monkeypatch):
    """Every candidate the screen simulates is a plan of its own (on GPUs alike, even and proportional
    shares are one plan); the candidates made to fit come in the order of their screened times."""
    import heterog.baselines.pipeline as P

    # 1 GiB of parameter state on GPUs of 400 MiB: most candidates are out of memory as built
    graph, cluster = layered_graph(8, 64 << 20, batch=8), gpu_cluster(4, memory="400 MiB")
    ev = Evaluator(graph, cluster)
    screened, fitted, inside, by_fits = [], [], [], []
    real_time, real_fitting = ev.iteration_time, P.fitting

    def timed(strategy, order=None):
        out = real_time(strategy, order)
        (by_fits if inside else screened).append((P.plan_key(strategy), out))
        return out

    def fitting(ev_, strategy, *args, **kwargs):
        fitted.append(dict(screened)[P.plan_key(strategy)])
        fitted_keys.add(P.plan_key(strategy))
        inside.append(1)
        try:
            return real_fitting(ev_, strategy, *args, **kwargs)
        finally:
            inside.pop()

    fitted_keys: set = set()
    monkeypatch.setattr(ev, "iteration_time", timed)
    monkeypatch.setattr(P, "fitting", fitting)
    s = P.pipeline(ev, budget_s=30.0)
    assert by_fits and not fitted_keys & {k for k, _ in by_fits}      # a fit does not simulate its plan again
    keys = [k for k, _ in screened]
    assert s.meta["candidates"] == len(keys) == len(set(keys))
    assert s.meta["fitted"] == len(fitted) >= 2
    assert all(oom for _, oom in fitted)                   # without sharded state, only those out of memory
    assert [t for t, _ in fitted] == sorted(t for t, _ in fitted)
    assert not ev.evaluate(s).oom


def test_a_search_of_one_simulation_returns_a_data_parallel_plan():
    from heterog.baselines.pipeline import pipeline

    graph, cluster = layered_graph(8, 1 << 16, batch=16), gpu_cluster(4)
    s = pipeline(Evaluator(graph, cluster), budget_s=0.0)
    assert s.meta["candidates"] == 1 and s.meta["stages"] == [(0, 1, 2, 3)] and s.n_micro == 1
