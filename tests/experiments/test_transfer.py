"""Time to quality of fine-tuning vs scratch: the arithmetic on hand-made histories, and the command
on two real (tiny) runs."""
from __future__ import annotations

import json

import pytest
import torch

from experiments.train import run
from experiments.transfer import Run, by_graph, compare, main
from heterog.errors import HeterogError
from tests.experiments.test_train_app import SHRINK, config


def history(*points):
    """(cpu_s, best_s) pairs -> history entries (wall = 2 * cpu, episodes = 16 per entry)."""
    return [(2 * c, c, 16 * (i + 1), t) for i, (c, t) in enumerate(points)]


def test_ratio_is_the_fine_tuned_time_to_the_scratch_best_over_the_scratch_time():
    scratch = Run("s", "g", history((1.0, 0.50), (40.0, 0.42), (100.0, 0.40)), (800.0, 400.0), None)
    fine = Run("f", "g", history((0.5, 0.45), (20.0, 0.40), (30.0, 0.39)), (800.0, 400.0), "pre/agent.pt")
    row = compare(scratch, fine)
    assert (row.scratch_best_s, row.scratch_reached_s, row.finetune_reached_s) == (0.40, 100.0, 20.0)
    assert row.ratio == pytest.approx(0.2) and row.finetune_best_s == 0.39 and row.finetune_first_s == 0.45
    assert compare(scratch, fine, "wall_s").ratio == pytest.approx(40.0 / 200.0)
    never = Run("f", "g", history((0.5, 0.45), (300.0, 0.401)), (800.0, 400.0), None)
    assert compare(scratch, never).finetune_reached_s is None and compare(scratch, never).ratio is None
    # within 1% of the scratch best (0.404): scratch gets there at 100 s, the near miss at 300 s
    close = compare(scratch, never, tolerance=0.01)
    assert (close.scratch_best_s, close.scratch_reached_s, close.finetune_reached_s) == (0.40, 100.0, 300.0)
    assert close.ratio == pytest.approx(3.0) and close.tolerance == 0.01
    assert compare(scratch, fine, tolerance=0.06).scratch_reached_s == 40.0     # 0.42 is within 6% of 0.40
    with pytest.raises(HeterogError, match="tolerance"):
        compare(scratch, fine, tolerance=-0.1)
    with pytest.raises(HeterogError, match="different graphs"):
        compare(scratch, Run("f", "h", fine.history, fine.end, None))


def test_a_graph_transfers_when_every_pair_of_it_met_the_limit():
    scratch = Run("s", "g", history((1.0, 0.50), (100.0, 0.40)), (400.0, 400.0), None)
    fast = Run("f", "g", history((10.0, 0.40)), (400.0, 400.0), None)          # ratio 0.1
    slow = Run("f", "g", history((50.0, 0.40)), (400.0, 400.0), None)          # ratio 0.5
    other = Run("s", "h", scratch.history, scratch.end, None)
    rows = [compare(scratch, fast), compare(scratch, slow), compare(other, Run("f", "h", fast.history, fast.end, None))]
    assert by_graph(rows) == {"g": {"pairs": 2, "met": 1}, "h": {"pairs": 1, "met": 1}}
    assert by_graph(rows, limit=0.5)["g"] == {"pairs": 2, "met": 2}


def test_command_on_real_runs(tmp_path, capsys):
    torch.set_num_threads(1)
    out = [f"output_dir={tmp_path}", "graph=tiny_mlp", *SHRINK]
    scratch = run(config(out))
    fine = run(config([*out, "experiment=finetune", f"run.init_from={scratch['checkpoint']}"]))
    plot = tmp_path / "curves.png"
    assert main(["--pair", scratch["run_dir"], fine["run_dir"], "--plot", str(plot), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    row = rec["rows"][0]
    assert row["graph"] == "tiny_mlp-b16" and row["pretrained"] == scratch["checkpoint"]
    assert rec["graphs"] == {"tiny_mlp-b16": {"pairs": 1, "met": rec["met_30_percent"]}}
    assert rec["graphs_met_30_percent"] == rec["met_30_percent"]
    assert row["scratch_best_s"] == pytest.approx(scratch["graphs"]["tiny_mlp-b16"]["best_iteration_time_s"])
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["--pair", scratch["run_dir"], str(tmp_path / "missing")]) == 2
    assert "has no agent.pt" in capsys.readouterr().err
