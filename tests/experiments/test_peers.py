"""experiments.peers: the committed outputs of Sailor's simulator and planners parse, cover every
validation plan of eth-easl/sailor cf2c8e3, and agree with their own summary; tau and MAPE by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.peers import MAX_PLAIN_BYTES, kendall_tau, summarise, to_plan_config, write_peer_plan
from heterog.atomic import read_json

DATA = Path(__file__).resolve().parents[2] / "experiments" / "data" / "sailor"
VALIDATION = "sailor/Planner/simulations/validation/"
# Every plan_config_*.json under sailor/Planner/simulations/validation at eth-easl/sailor cf2c8e3.
PLAN_FILES = sorted(
    [f"clariden/GPT-NEO/N{n}/plan_config_N{n}_D{d}.json"
     for n, d in [(2, 1), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (16, 4), (16, 8), (32, 8), (32, 16),
                  (64, 8), (64, 16)]]
    + ["clariden/OPT-350/N1/plan_config_N1_D1_M4_G1.json", "clariden/OPT-350/N1/plan_config_N1_D1_M4_G32.json"]
    + [f"clariden/OPT-350/N{n}/plan_config_N{n}_D{d}.json"
       for n, d in [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (16, 4), (16, 8), (16, 16),
                    (32, 8), (32, 16), (32, 32)]]
    + [f"mit/N{n}/plan_config_N{n}_D{d}.json" for n, d in [(2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (4, 4),
                                                             (6, 2), (6, 3), (6, 6)]])
OPT350_LAYERS = 26  # embeddings, 24 blocks, head: Sailor's numbering of OPT-350


def test_kendall_tau_by_hand():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    # pairs (1,2) concordant, (1,3) concordant, (2,3) discordant -> (2 - 1) / 3
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_summarise_by_hand():
    rows = [{"cluster": "c", "model": "m", "predicted_s": 1.1, "measured_s": 1.0,
             "predicted_peak_bytes": 50.0, "measured_peak_bytes": 100.0},
            {"cluster": "c", "model": "m", "predicted_s": 1.8, "measured_s": 2.0,
             "predicted_peak_bytes": 100.0, "measured_peak_bytes": 100.0}]
    s = summarise(rows)["c"]
    assert s["n_plans"] == 2
    assert s["time_mape_pct"] == pytest.approx(10.0)        # (10% + 10%) / 2
    assert s["memory_mape_pct"] == pytest.approx(25.0)      # (50% + 0%) / 2
    assert s["time_kendall_tau"] == 1.0


def test_simulator_predictions_cover_every_validation_plan():
    doc = json.loads((DATA / "simulator_predictions.json").read_text())
    assert doc["source"] == {"repository": "eth-easl/sailor", "commit": "cf2c8e3"}
    files = sorted(row["file"].removeprefix(VALIDATION) for row in doc["plans"])
    assert files == PLAN_FILES
    for row in doc["plans"]:
        assert row["cluster"] == row["file"].removeprefix(VALIDATION).split("/")[0]
        assert row["model"] in ("OPT-350", "GPT-Neo-2.7")
        assert row["predicted_s"] > 0 and row["measured_s"] > 0
        assert row["predicted_peak_bytes"] > 0 and row["measured_peak_bytes"] > 0
    assert doc["summary"] == summarise(doc["plans"])


def _check_plan_config(cfg: dict) -> None:
    pipe = cfg["pipeline_list"][0]
    layers = sorted(layer for stage in pipe["layers_per_stage"] for layer in stage)
    assert layers == list(range(OPT350_LAYERS))
    assert len(pipe["layers_per_stage"]) == pipe["num_stages"] == len(pipe["tmp_per_stage"]) == len(pipe["dp"])
    for dp, stage in zip(pipe["dp"], pipe["tmp_per_stage"]):
        assert len(stage) == dp
        for vms, tp in stage:
            assert tp >= 1 and all(vm[0] in ("A100-40", "V100-16") for vm in vms)
    assert cfg["gbs"] == 1024 and cfg["mbs"] >= 1


def test_peer_plans_parse_and_are_complete_pipelines():
    scenarios = sorted(p.name for p in (DATA / "peer_plans").iterdir() if p.is_dir())
    assert "opt350_a100x4_v100x4" in scenarios
    for scenario in scenarios:
        files = sorted((DATA / "peer_plans" / scenario).glob("*.json*"))
        names = [f.name.split(".")[0] for f in files]
        assert "metis" in names and set(names) <= {"metis", "sailor"} and len(set(names)) == len(names), files
        if scenario in ("opt350_a100x4_v100x4", "opt350_a100x8_v100x8", "opt350_a100x16_v100x16"):
            assert names == ["metis", "sailor"]
        for planner, path in zip(names, files):
            doc = read_json(path)
            assert doc["scenario"] == scenario and doc["planner"] == planner
            assert doc["planner_predicted_s"] > 0 and doc["sailor_simulated_s"] > 0
            _check_plan_config(doc["plan_config"])
            assert to_plan_config(doc["planner_output"]["best"], 1024) == doc["plan_config"]


def test_write_peer_plan_compresses_only_large_files(tmp_path):
    small = {"plan": [1] * 10}
    # indent 1: "{", ' "plan": [', ten ' 1,' lines, ' ]', '}' -> well under the limit: plain JSON
    path = write_peer_plan(tmp_path, "metis", small)
    assert path.name == "metis.json" and path.read_text() == json.dumps(small, indent=1) + "\n"
    big = {"plan": [[["V100-16", 4, "us-central1-a"]]] * 5000}   # about 55 bytes a replica indented
    path = write_peer_plan(tmp_path, "metis", big)
    assert path.name == "metis.json.gz" and not (tmp_path / "metis.json").exists()
    assert path.stat().st_size < MAX_PLAIN_BYTES // 10 and read_json(path) == big
    assert write_peer_plan(tmp_path, "metis", big).read_bytes() == path.read_bytes()  # no timestamp inside
    assert write_peer_plan(tmp_path, "metis", small).name == "metis.json" and not path.exists()


def test_metis_chosen_candidates_read_as_their_sailor_conversion():
    from experiments.peer_plans import metis_candidate
    from heterog.interop import read_metis

    files = sorted((DATA / "peer_plans").glob("*/metis.json*"))
    assert len(files) >= 5
    for path in files:
        doc = read_json(path)
        plan = read_metis(metis_candidate(doc), str(path))
        pipe = doc["plan_config"]["pipeline_list"][0]
        (stages,) = plan.pipelines
        assert [list(st.layers) for st in stages] == pipe["layers_per_stage"]
        assert [len(st.replicas) for st in stages] == pipe["dp"]
        assert [[st.tp] * len(st.replicas) for st in stages] == [[r[1] for r in cfg] for cfg in pipe["tmp_per_stage"]]
        assert [{t for r in st.replicas for t in r} for st in stages] == [
            {vm[0] for r in cfg for vm in r[0]} for cfg in pipe["tmp_per_stage"]]
        assert plan.micro_batches * doc["plan_config"]["mbs"] * pipe["dp"][0] == 1024 == plan.global_batch
    # 128 A100 + 384 V100: layers 0-4 on 128 V100s, 5-12 on 128 pairs of V100s (tp 2), 13-25 on 128 A100s
    big = read_json(DATA / "peer_plans" / "opt350_a100x128_v100x384" / "metis.json.gz")
    (stages,) = read_metis(metis_candidate(big)).pipelines
    assert [(st.layers[0], st.layers[-1], len(st.replicas), st.tp) for st in stages] == [
        (0, 4, 128, 1), (5, 12, 128, 2), (13, 25, 128, 1)]
    assert [st.replicas[0][0] for st in stages] == ["V100-16", "V100-16", "A100-40"]
