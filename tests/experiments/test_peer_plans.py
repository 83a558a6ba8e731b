"""experiments.peer_plans on the smallest scenario (4 A100 + 4 V100) with OPT-350M's 24 blocks shrunk to
width 32 and sequence 16 at Sailor's batch of 1024: Metis' plan imports as Sailor's conversion of it does and
simulates to a finite time; Sailor's plan is refused and its data-parallel variant has the shares of hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import peer_plans as pp
from heterog.atomic import read_json

SCENARIO = "4+4"


@pytest.fixture(scope="module")
def tiny_graph():
    pytest.importorskip("transformers")
    import heterog
    from heterog import zoo

    module, inputs = zoo.build(pp.MODEL, pp.BATCH, device="meta", layers=24, hidden=32, heads=4, ffn=64,
                               vocab=100, seq_len=16)
    return heterog.capture(module, inputs, optimizer=pp.OPTIMIZER)


@pytest.fixture(scope="module")
def cluster():
    from heterog.cluster import load_cluster

    return load_cluster(pp.scenario_cluster(SCENARIO))


def test_metis_candidate_is_the_chosen_plan():
    d = read_json(pp.scenario_dir(SCENARIO) / "metis.json")
    cand = pp.metis_candidate(d)
    # the first candidate failed Sailor's memory check; the chosen one runs 128 micro-batches, 20 + 6 layers
    assert cand["batches"] == 128 and cand["layer_partition"] == [0, 20, 26] and cand["gbs"] == 1024
    assert cand["strategies"] == [[4, 1], [4, 1]] and "cost_s" not in cand
    assert math.isclose(cand["cost"], d["planner_output"]["best"]["iter_time"])


def test_sailor_micro_batches_round_up():
    d = read_json(pp.scenario_dir(SCENARIO) / "sailor.json")["plan_config"]
    assert pp.sailor_micro_batches(d) == 103            # ceil(1024 / (mbs 2 x dp 5))


def test_peer_plans_import_and_simulate(tiny_graph, cluster):
    from heterog.evaluate import Evaluator

    plans = {label: (s, note) for label, s, note in pp.peer_plans(SCENARIO, tiny_graph, cluster)}
    metis, note = plans["metis"]
    assert "same plan as Sailor's conversion" in note
    assert metis.n_micro == 128 and set(metis.micro) == {8}
    assert [c.devices for c in metis.configs] == [(0, 1, 2, 3), (4, 5, 6, 7)]   # A100s: layers 0-19
    assert plans["sailor"][0] is None and "mixes tp degrees [1, 4]" in plans["sailor"][1]
    variant = plans["sailor-dp"][0]
    (cfg,) = variant.configs
    # 1024 over 5 replicas: 205 x 4 A100 + 204 for the tp-4 V100 replica, 51 per V100
    assert cfg.devices == (0, 1, 2, 3, 4, 5, 6, 7) and cfg.shares == (205, 205, 205, 205, 51, 51, 51, 51)
    assert variant.n_micro == 103 and sum(variant.micro) == 1024
    row = pp.score(Evaluator(tiny_graph, cluster), metis)
    assert np.isfinite(row["iteration_time_s"]) and row["iteration_time_s"] > 0 and not row["oom"]
    assert row["plan"].startswith("2 stages: L0-19: 4xA100 dp4 tp1 [256]; L20-25: 4xV100 dp4 tp1 [256]")


def test_bad_arguments_exit_2(capsys):
    assert pp.main(["--scenarios", "3+3"]) == 2
    assert pp.main(["--planners", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err
