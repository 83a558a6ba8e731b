"""experiments.moves: how many local-search moves a plan lies from the uniform plans."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from experiments.moves import block_units, main, min_moves, nearest_starts


def test_block_units_take_the_largest_of_nested_blocks():
    blocks = [SimpleNamespace(groups=np.array([2, 3])), SimpleNamespace(groups=np.array([1, 2, 3, 4])),
              SimpleNamespace(groups=np.array([6, 7]))]
    assert block_units(blocks, 9).tolist() == [0, -2, -2, -2, -2, 5, -7, -7, 8]


def test_min_moves_counts_one_move_per_block_and_action():
    unit = np.array([0, -2, -2, -2, -2, 5])                   # groups 1-4 form one block
    start = np.zeros(6, dtype=np.int64)
    assert min_moves(start, start, unit) == 0
    # the block to action 3 (one move), group 5 to action 1 (one move)
    assert min_moves(np.array([0, 3, 3, 3, 3, 1]), start, unit) == 2
    # the block split over two actions needs two moves; group 0 a third
    assert min_moves(np.array([2, 3, 3, 1, 0, 0]), start, unit) == 3
    plan = np.array([0, 3, 3, 3, 3, 0])
    assert nearest_starts(plan, 4, unit)[:2] == [(1, 4, 0), (2, 2, 3)]


def test_cli_reports_the_nearest_uniform_plan(tmp_path, capsys):
    from heterog.cli.args import graph_and_cluster
    from heterog.evaluate import Evaluator
    from heterog.strategy import strategy_from_actions

    graph, cluster = graph_and_cluster(SimpleNamespace(graph="tiny_mlp", batch_size=16, optimizer="sgd",
                                                       cluster="paper-8gpu"))
    ev = Evaluator(graph, cluster)
    actions = np.full(int(np.max(ev.group_of)) + 1, 11)            # cp-ar everywhere (8 devices + 3)
    actions[0] = 2
    path = strategy_from_actions(actions, np.asarray(ev.group_of), graph, cluster).save(tmp_path / "plan.json")
    assert main(["--graph", "tiny_mlp", "--batch-size", "16", "--cluster", "paper-8gpu", str(path), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["nearest_start"], row["moves"], row["groups_differ"]) == ("dp-prop-ar", 1, 1)
    bare = strategy_from_actions(actions, np.asarray(ev.group_of), graph, cluster)
    bare.meta.clear()
    bare.save(tmp_path / "bare.json")
    assert main(["--graph", "tiny_mlp", "--batch-size", "16", "--cluster", "paper-8gpu",
                 str(tmp_path / "bare.json")]) == 2
    assert "no actions" in capsys.readouterr().err
