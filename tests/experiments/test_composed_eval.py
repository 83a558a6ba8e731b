"""experiments.composed_eval: one row per graph, the composed evaluation identical to the whole one."""
from __future__ import annotations

import json

from experiments.composed_eval import main


def test_a_row_per_graph_says_the_slices_and_that_both_agree(capsys) -> None:
    assert main(["--graph", "tiny_mlp:48", "--cluster", "gcp-a100-v100:a100=2,v100=2,gpus_per_node=4",
                 "--whole-runs", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["slices"], row["slice_devices"], row["identical"]) == (2, 8, True)
    assert row["composed_ms"] > 0 and row["whole_ms"] > 0


def test_a_bad_cluster_or_scenario_is_named(capsys) -> None:
    assert main(["--graph", "tiny_mlp:48", "--cluster", "no-such-cluster", "--whole-runs", "0"]) == 2
    assert "no-such-cluster" in capsys.readouterr().err
    assert main(["--peers", "3+5", "--whole-runs", "0"]) == 2
    assert "3+5" in capsys.readouterr().err
