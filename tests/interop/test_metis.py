"""Metis plans (the fields of Sailor's copy of Metis' planner) imported as strategies, hand-checked and
round-tripped through Sailor's format; the errors of inconsistent files."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from heterog.interop import PlanImportError, read_metis, read_plan, read_sailor, to_strategy, write_sailor
from heterog.strategy import ParallelConfig

SAMPLE = Path(__file__).with_name("metis_plan_sample.json")


def test_sample_plan_hand_checked(opt_graph, mixed_cluster):
    plan = read_plan("metis", SAMPLE)
    assert plan.micro_batches == 2 and plan.global_batch == 8
    s = to_strategy(plan, opt_graph, mixed_cluster)
    # stage 0 (layers 0, 1): one replica, tp 2 over the two RTX-3090s; stage 1 (2, 3): two Titan RTX replicas
    assert s.configs == [ParallelConfig.split_grid([[0, 1]], [1, 1], [8], kind="tensor"),
                         ParallelConfig((2, 3), (4, 4), sync="allreduce")]
    assert s.configs[0].grid == 1 and s.micro_batches == (4, 4) and s.method == "import-metis"
    assert s.meta["cost"] == pytest.approx(0.0123)


def test_round_trip_through_sailor(opt_graph, mixed_cluster):
    s = to_strategy(read_plan("metis", SAMPLE), opt_graph, mixed_cluster)
    sailor = write_sailor(s, opt_graph, mixed_cluster, zone="z")
    # Sailor's conversion of a Metis plan: mbs = gbs // (batches x dp of the first stage) = 8 // (2 x 1)
    assert sailor["mbs"] == 4 and sailor["pipeline_list"][0]["dp"] == [1, 2]
    assert sailor["pipeline_list"][0]["tmp_per_stage"] == [[[[["RTX-3090", 2, "z"]], 2]],
                                                           [[[["Titan-RTX", 2, "z"]], 1]] * 2]
    again = to_strategy(read_sailor(sailor), opt_graph, mixed_cluster)
    assert again.configs == s.configs and again.micro_batches == s.micro_batches
    np.testing.assert_array_equal(again.group_of, s.group_of)


def _edit(**fields):
    d = json.loads(SAMPLE.read_text())
    d.update(fields)
    return d


@pytest.mark.parametrize("plan, message", [
    (_edit(strategies=[[1, 2], [1, 1]]), r"stage 1: dp 1 x tp 1 != its 2 GPUs"),
    (_edit(rank_map=[["RTX_3090", "RTX_3090"]]), r"rank_map has 1 entries for 2 stages"),
    (_edit(batches=3), r"gbs 8 is not divisible by 3 micro-batches x dp 1"),
    (_edit(layer_partition=[0, 2]), r"layer_partition must hold 3 stage boundaries"),
    (_edit(layer_partition=[0, 2, 2]), r"stage 1: empty layer range"),
    (_edit(layer_partition=[0, 2, 5]), r"outside 0\.\.3 \[4\]"),
    (_edit(rank_map=[["RTX_3090", "A100_40"], ["Titan_RTX", "Titan_RTX"]]),
     r"rank_map names GPU types \['A100-40'\] not in node_sequence"),
    (_edit(gbs=None), r"gbs must be a positive integer"),
])
def test_bad_plans(plan, message, opt_graph, mixed_cluster):
    with pytest.raises(PlanImportError, match=message):
        to_strategy(read_metis(copy.deepcopy(plan), source="metis.json"), opt_graph, mixed_cluster)


def test_read_plan_errors(tmp_path):
    with pytest.raises(PlanImportError, match="unknown plan format 'amp'"):
        read_plan("amp", SAMPLE)
    with pytest.raises(PlanImportError, match="does not exist"):
        read_plan("metis", tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanImportError, match="not valid JSON"):
        read_plan("sailor", tmp_path / "bad.json")


def test_interop_imports_no_torch():
    code = "import sys, heterog.interop, heterog.cli.import_plan; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
