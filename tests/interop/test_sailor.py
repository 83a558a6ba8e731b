"""Sailor plans imported as strategies: a hand-checked plan (pp=2, dp=2, tp=2) asserted config by config and
simulated, data parallelism and single devices, the round trip through ``write_sailor``, Sailor's own
validation plans read, and the errors of bad files."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from heterog.baselines.expert import block_layers
from heterog.interop import PlanImportError, import_plan, read_sailor, to_strategy, write_sailor
from heterog.strategy import MAX_MICRO_BATCHES, ParallelConfig
from tests.interop.conftest import DATA


def replica(gpu: str, per_node: int, tp: int) -> list:
    return [[[gpu, per_node, "z"]], tp]


def plan_pp2_dp2_tp2() -> dict:
    """Two stages of two blocks' worth of layers, each two replicas of two A100s; 8 samples, mbs 2."""
    rep = replica("A100-40", 4, 2)
    return {"zone": "z", "mbs": 2, "gbs": 8, "real": 0.5,
            "pipeline_list": [{"num_stages": 2, "layers_per_stage": [[0, 1], [2, 3]],
                               "tmp_per_stage": [[rep, rep], [rep, rep]], "dp": [2, 2]}]}


def test_hand_checked_plan(opt_graph, a100_cluster):
    s = to_strategy(read_sailor(plan_pp2_dp2_tp2()), opt_graph, a100_cluster)
    # stage 0: replicas (0, 1) and (2, 3) on node n0; stage 1 on node n1; 8 / 2 replicas = 4 samples each
    assert s.configs == [ParallelConfig.split_grid([[0, 1], [2, 3]], [1, 1], [4, 4], kind="tensor"),
                         ParallelConfig.split_grid([[4, 5], [6, 7]], [1, 1], [4, 4], kind="tensor")]
    assert s.configs[0].grid == 2 and s.configs[0].shares == (4, 4, 4, 4)
    # micro-batches = gbs / (mbs x dp) = 8 / (2 x 2) = 2, of mbs x dp = 4 samples each, 1F1B
    assert s.micro_batches == (4, 4) and s.schedule == "1f1b"
    layer_of, L = block_layers(opt_graph)
    assert L == 2
    np.testing.assert_array_equal(s.group_of, np.where(layer_of <= 1, 0, 1))
    assert s.method == "import-sailor" and s.meta["real"] == 0.5 and s.meta["mbs"] == 2


def test_imported_plan_compiles_and_simulates(opt_graph, a100_cluster):
    from heterog.evaluate import Evaluator

    s = to_strategy(read_sailor(plan_pp2_dp2_tp2()), opt_graph, a100_cluster)
    res = Evaluator(opt_graph, a100_cluster).evaluate(s)
    assert not res.oom and 0.0 < res.iteration_time_s < 1.0
    assert res.plan is not None and res.plan.tg.n_tasks > 0


def test_data_parallel_and_single_device(opt_graph, mixed_cluster):
    # stage 0: two RTX-3090 replicas (plain DP); stage 1: one Titan RTX; 8 / (2 x 2) = 2 micro-batches
    plan = {"mbs": 2, "gbs": 8, "pipeline_list": [{
        "num_stages": 2, "layers_per_stage": [[0, 1, 2], [3]], "dp": [2, 1],
        "tmp_per_stage": [[replica("RTX-3090", 2, 1)] * 2, [replica("Titan-RTX", 2, 1)]]}]}
    s = to_strategy(read_sailor(plan), opt_graph, mixed_cluster)
    assert s.configs == [ParallelConfig((0, 1), (4, 4), sync="allreduce"), ParallelConfig.single(2, 8)]
    assert s.micro_batches == (4, 4)


def test_round_trip(opt_graph, a100_cluster):
    plan = plan_pp2_dp2_tp2()
    s = to_strategy(read_sailor(plan), opt_graph, a100_cluster)
    back = write_sailor(s, opt_graph, a100_cluster)
    assert back == {k: plan[k] for k in ("zone", "pipeline_list", "mbs", "gbs")}
    again = to_strategy(read_sailor(back), opt_graph, a100_cluster)
    assert again.configs == s.configs and again.micro_batches == s.micro_batches
    np.testing.assert_array_equal(again.group_of, s.group_of)


def test_import_plan_reads_the_file(tmp_path, opt_graph, a100_cluster):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_pp2_dp2_tp2()))
    s = import_plan("sailor", path, opt_graph, a100_cluster)
    assert s.meta["plan_file"] == str(path) and s.n_groups == 2


def test_sailor_validation_plans():
    mit = read_sailor(json.loads((DATA / "mit_N6_plan_config_N6_D3.json").read_text()))
    (pipe,) = mit.pipelines
    assert [st.layers for st in pipe] == [tuple(range(12)), tuple(range(12, 26))]
    assert [st.replicas for st in pipe] == [
        (("RTX-3090",) * 8, ("RTX-2080",) * 8, ("RTX-2080",) * 8),
        (("Titan-RTX",) * 8, ("RTX-2080",) * 8, ("Titan-RTX",) * 8)]
    assert (mit.global_batch, mit.micro_batches) == (288, 48)           # 288 / (2 x 3)
    assert mit.meta["real"] == pytest.approx(54.2392) and mit.meta["max_mem"] == 6835666944
    gh = read_sailor(json.loads((DATA / "clariden_OPT-350_N16_plan_config_N16_D4.json").read_text()))
    assert [len(st.layers) for st in gh.pipelines[0]] == [5, 7, 7, 7]
    assert {st.tp for st in gh.pipelines[0]} == {4} and (gh.global_batch, gh.micro_batches) == (1024, 32)
    two = read_sailor(json.loads((DATA / "clariden_OPT-350_N2_plan_config_N2_D1.json").read_text()))
    assert two.micro_batches == 4 and [len(st.replicas) for st in two.pipelines[0]] == [1, 1]


def test_a_24_block_plan_does_not_fit_a_2_block_graph(opt_graph, a100_cluster):
    plan = read_sailor(json.loads((DATA / "clariden_OPT-350_N2_plan_config_N2_D1.json").read_text()))
    plan = type(plan)(plan.source, plan.pipelines, 8, 1, plan.meta)
    with pytest.raises(PlanImportError, match=r"layers 0\.\.3 exactly once.*outside 0\.\.3"):
        to_strategy(plan, opt_graph, a100_cluster)


def _bad(edit):
    plan = plan_pp2_dp2_tp2()
    edit(plan)
    return plan


def _set_layers(layers):
    return lambda p: p["pipeline_list"][0].__setitem__("layers_per_stage", layers)


@pytest.mark.parametrize("plan, message", [
    (_bad(_set_layers([[0, 1], [3]])), r"missing \[2\]"),
    (_bad(_set_layers([[0, 1, 2], [2, 3]])), r"duplicated \[2\]"),
    (_bad(_set_layers([[2, 3], [0, 1]])), r"not in increasing order"),
    (_bad(lambda p: p["pipeline_list"][0].__setitem__("dp", [2])), r"dp has 1 entries for 2 stages"),
    (_bad(lambda p: p["pipeline_list"][0].__setitem__("dp", [2, 1])), r"stage 1: dp is 1 but tmp_per_stage lists 2"),
    (_bad(lambda p: p.__setitem__("gbs", 10)), r"gbs 10 is not divisible by mbs 2 x dp 2"),
    (_bad(lambda p: p.__delitem__("mbs")), r"no 'mbs'"),
    (_bad(lambda p: p["pipeline_list"][0]["tmp_per_stage"][1].__setitem__(0, replica("B200", 4, 2))),
     r"unknown GPU type 'B200'"),
    (_bad(lambda p: p["pipeline_list"][0]["tmp_per_stage"][1].__setitem__(0, replica("V100-16", 4, 2))),
     r"needs GPUs of type 'V100-16' \(V100-16GB\); cluster 'two-a100-nodes' has none"),
    (_bad(lambda p: p["pipeline_list"][0]["tmp_per_stage"][1].__setitem__(0, replica("A100-40", 4, 4))),
     r"needs 10 GPUs of type A100-40GB, cluster 'two-a100-nodes' has 8"),
    (_bad(lambda p: p["pipeline_list"][0]["tmp_per_stage"][1].__setitem__(0, replica("A100-40", 4, 1))),
     r"tensor-parallel degrees \[1, 2\]"),
    (_bad(lambda p: p.update(gbs=16, mbs=1)), r"global batch is 16, graph .* has batch 8"),
    (_bad(lambda p: p.update(gbs=4 * MAX_MICRO_BATCHES, mbs=1)),
     rf"needs {2 * MAX_MICRO_BATCHES} micro-batches; at most {MAX_MICRO_BATCHES}"),
])
def test_bad_plans(plan, message, opt_graph, a100_cluster):
    with pytest.raises(PlanImportError, match=message):
        to_strategy(read_sailor(copy.deepcopy(plan), source="plan.json"), opt_graph, a100_cluster)


def test_write_refuses_uneven_shares(opt_graph, a100_cluster):
    s = to_strategy(read_sailor(plan_pp2_dp2_tp2()), opt_graph, a100_cluster)
    s.configs[1] = ParallelConfig((4, 5), (5, 3))
    with pytest.raises(PlanImportError, match=r"stage 1: uneven batch shares \[5, 3\]"):
        write_sailor(s, opt_graph, a100_cluster)
