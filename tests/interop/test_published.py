"""Sailor's published runs against the simulator (heterog.interop.published): the runs found in a validation
folder, the cluster each ran on, inconsistent figures kept out, the summary's arithmetic, and one run simulated
end to end on a small model of the same layer structure."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import heterog
from heterog import zoo
from heterog.interop.published import (
    MemoryOverhead,
    RunRecord,
    cluster_summary,
    find_runs,
    fit_memory_overhead,
    inconsistencies,
    load_sailor_predictions,
    published_report,
    repair_layer_lists,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "sailor"
PREDICTIONS = Path(__file__).resolve().parents[2] / "experiments" / "data" / "sailor" / "simulator_predictions.json"
# copied plan file -> its path under Sailor's validation folder (tests/data/sailor/README.md)
LAYOUT = {"clariden_OPT-350_N2_plan_config_N2_D1.json": "clariden/OPT-350/N2/plan_config_N2_D1.json",
          "clariden_OPT-350_N16_plan_config_N16_D4.json": "clariden/OPT-350/N16/plan_config_N16_D4.json",
          "mit_N6_plan_config_N6_D3.json": "mit/N6/plan_config_N6_D3.json"}


@pytest.fixture()
def validation(tmp_path: Path) -> Path:
    """The copied plan files laid out as in Sailor's validation folder."""
    root = tmp_path / "validation"
    for name, rel in LAYOUT.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DATA / name, root / rel)
    return root


def test_runs_are_found_with_their_model_and_cluster(validation):
    runs = {r.name: r for r in find_runs(validation)}
    assert sorted(runs) == sorted(LAYOUT.values())
    n2 = runs["clariden/OPT-350/N2/plan_config_N2_D1.json"]
    assert (n2.cluster_kind, n2.model, n2.profile_model) == ("clariden", "opt_350m_megatron", "OPT-350")
    assert (n2.measured_s, n2.measured_peak_bytes, n2.global_batch) == (0.65705, 26942111744.0, 32)
    assert n2.gpus() == {"GH-96": 8} and n2.cluster_spec() == "clariden:nodes=2"
    assert runs["clariden/OPT-350/N16/plan_config_N16_D4.json"].cluster_spec() == "clariden:nodes=16"
    mit = runs["mit/N6/plan_config_N6_D3.json"]
    # 2 stages x 3 replicas of tp 8: one replica per node, RTX-3090 / RTX-2080 / Titan-RTX as the file lists
    gpus = mit.gpus()
    assert sum(gpus.values()) == 48 and mit.model == "opt_350m_megatron"
    assert mit.cluster_spec() == ("mit:rtx3090={},titan-rtx={},rtx2080={}".format(
        gpus.get("RTX-3090", 0) // 8, gpus.get("Titan-RTX", 0) // 8, gpus.get("RTX-2080", 0) // 8))
    # a run of the validation folder itself, or of one cluster's folder, is found the same way
    assert [r.name for r in find_runs(validation / "mit")] == ["mit/N6/plan_config_N6_D3.json"]


def test_identical_figures_of_different_plans_and_foreign_layer_counts_are_listed(validation):
    a = validation / "mit/N6/plan_config_N6_D3.json"
    twin = json.loads(a.read_text())
    twin["mbs"] = 1                                         # the same figures under another plan
    (validation / "mit/N9").mkdir()
    (validation / "mit/N9/plan_config_N9_D3.json").write_text(json.dumps(twin))
    runs = find_runs(validation)
    bad = inconsistencies(runs, lambda model: 26)
    assert set(bad) == {"mit/N6/plan_config_N6_D3.json", "mit/N9/plan_config_N9_D3.json"}
    assert "as the different plan mit/N9/plan_config_N9_D3.json" in bad["mit/N6/plan_config_N6_D3.json"]
    assert inconsistencies(runs[:1], lambda model: 34) == {
        runs[0].name: "the plan holds 26 layers, opt_350m_megatron has 34 (Metis' numbering)"}


def test_summary_of_hand_made_records():
    recs = [RunRecord("a", "c", "m", 8, 4, 1.0, 10.0, simulated_s=1.1, simulated_peak_bytes=9.0, sailor_s=0.8,
                      sailor_peak_bytes=10.0),
            RunRecord("b", "c", "m", 8, 4, 2.0, 20.0, simulated_s=1.5, simulated_peak_bytes=30.0, sailor_s=2.0,
                      sailor_peak_bytes=20.0),
            RunRecord("c", "c", "m", 8, 4, 3.0, 30.0, simulated_s=3.3, simulated_peak_bytes=30.0),
            RunRecord("x", "c", "m", 8, 4, 9.0, 9.0, simulated_s=1.0, simulated_peak_bytes=1.0, excluded="dup")]
    s = cluster_summary(recs)["c"]
    assert s["runs"] == 3 and s["sailor_runs"] == 2
    assert s["time_mape_pct"] == pytest.approx(100 * (0.1 + 0.25 + 0.1) / 3)
    assert s["memory_mape_pct"] == pytest.approx(100 * (0.1 + 0.5 + 0.0) / 3)
    assert s["memory_max_error_pct"] == pytest.approx(50.0)
    assert s["kendall_tau"] == pytest.approx(1.0)               # 1.1 < 1.5 < 3.3 as 1 < 2 < 3
    assert s["sailor_time_mape_pct"] == pytest.approx(100 * (0.2 + 0.0) / 2)
    assert s["sailor_memory_mape_pct"] == pytest.approx(0.0)
    assert s["sailor_kendall_tau"] == pytest.approx(1.0)


def test_memory_overhead_is_fitted_on_clariden_alone_and_recovers_a_known_one():
    """Clariden runs whose memory in use is 1.08 x the tensors' peak + 2.5 GB: the fit finds both terms; mit
    runs, however far off, change nothing (they are the held-out check); excluded runs are left out."""
    true = MemoryOverhead(2.5e9, 0.08, "by hand")
    peaks = [3e9, 8e9, 15e9, 22e9, 31e9]
    recs = [RunRecord(f"c{i}", "clariden", "m", 8, 4, 1.0, true.in_use(p), simulated_s=1.0, simulated_peak_bytes=p)
            for i, p in enumerate(peaks)]
    recs += [RunRecord("m0", "mit", "m", 8, 4, 1.0, 4e9, simulated_s=1.0, simulated_peak_bytes=20e9),
             RunRecord("dup", "clariden", "m", 8, 4, 1.0, 1e9, simulated_s=1.0, simulated_peak_bytes=30e9,
                       excluded="same figures as another plan")]
    fit = fit_memory_overhead(recs)
    assert fit is not None and "5 counted clariden/" in fit.source
    assert fit.fixed_bytes == pytest.approx(2.5e9, rel=1e-4) and fit.reserve == pytest.approx(0.08, rel=1e-3)
    assert fit_memory_overhead([r for r in recs if r.cluster == "mit"]) is None
    rec = recs[0]
    rec.in_use_peak_bytes = fit.in_use(rec.simulated_peak_bytes)
    assert rec.memory_error == pytest.approx(0.0, abs=1e-6) and rec.tensor_memory_error < -0.4


def test_the_committed_predictions_of_sailors_simulator_are_keyed_like_the_runs(validation):
    predictions = load_sailor_predictions(PREDICTIONS)
    assert len(predictions) == 36
    assert {r.name for r in find_runs(validation)} <= set(predictions)
    t, mem = predictions["clariden/OPT-350/N2/plan_config_N2_D1.json"]
    assert math.isfinite(t) and t > 0 and mem > 0


def test_one_published_run_simulated_end_to_end(validation):
    # Sailor's two-stage OPT-350 run with its 24 blocks cut to 2 (layers 0-1 on the first stage, 2-3 on the
    # second) and a model of that structure at a small width: import, compile and simulation as for the
    # full model, the run's measured figures and Sailor's prediction carried along
    path = validation / "clariden/OPT-350/N2/plan_config_N2_D1.json"
    d = json.loads(path.read_text())
    d["pipeline_list"][0]["layers_per_stage"] = [[0, 1], [2, 3]]
    path.write_text(json.dumps(d))

    def graph_of(model: str, batch: int) -> heterog.OpGraph:
        module, inputs = zoo.build(model, batch, device="meta", layers=2, hidden=32, heads=4, ffn=64, vocab=128,
                                   seq_len=16)
        return heterog.capture(module, inputs, optimizer="adam")

    rep = published_report(validation, sailor_predictions=PREDICTIONS, only=["clariden/OPT-350/N2"],
                           graph_of=graph_of)
    (rec,) = rep.records
    assert rec.name == "clariden/OPT-350/N2/plan_config_N2_D1.json" and not rec.error and not rec.excluded
    assert rec.n_gpus == 8 and rec.global_batch == 32 and rec.cluster == "clariden"
    assert (rec.measured_s, rec.measured_peak_bytes) == (0.65705, 26942111744.0)
    assert 0 < rec.simulated_s < math.inf and rec.simulated_peak_bytes > 0 and not rec.oom
    assert rec.sailor_s == pytest.approx(load_sailor_predictions(PREDICTIONS)[rec.name][0])
    assert rep.summary["clariden"]["runs"] == 1 and rep.source == "roofline"
    assert rep.record()["runs"][0]["name"] == rec.name


def test_a_layer_written_for_another_is_repaired_and_noted():
    d = {"pipeline_list": [{"layers_per_stage": [[0, 1, 2], [3, 4, 5, 8, 7], [8, 9]]}]}
    fixed, note = repair_layer_lists(d)
    assert fixed["pipeline_list"][0]["layers_per_stage"] == [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9]]
    assert note == "pipeline 0 stage 1 lists layer 8 for 6 (repaired)"
    assert d["pipeline_list"][0]["layers_per_stage"][1] == [3, 4, 5, 8, 7]          # the input is left alone
    # two layers missing, or a list that is already whole: unchanged, no note
    for stages in ([[0, 1], [5, 5]], [[0, 1], [2, 3]]):
        same, note = repair_layer_lists({"pipeline_list": [{"layers_per_stage": stages}]})
        assert same["pipeline_list"][0]["layers_per_stage"] == stages and note == ""
