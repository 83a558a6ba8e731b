"""heterog.moves: how many local-search moves a plan lies from the uniform plans."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from heterog.cluster import load_cluster
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.moves import NearestUniform, block_units, min_moves, moves_from_uniform, nearest_starts


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


@pytest.fixture(scope="module")
def ev():
    return Evaluator(capture_model("tiny_mlp", 16), load_cluster("paper-8gpu"))


def test_moves_from_uniform_names_the_nearest_uniform_plan(ev):
    actions = np.full(ev.n_groups, 11)                        # dp-prop-ar everywhere (8 devices + 3)
    actions[0] = 2
    strategy = ev.strategy(actions)
    expected = NearestUniform(action=11, name="dp-prop-ar", moves=1, groups_differ=1)
    assert moves_from_uniform(ev, strategy) == expected
    assert moves_from_uniform(ev, actions.tolist()) == expected
    assert moves_from_uniform(ev, np.full(ev.n_groups, 4)) == NearestUniform(4, "mp:4", 0, 0)


def test_moves_from_uniform_rejects_plans_without_fitting_actions(ev):
    bare = ev.strategy(np.zeros(ev.n_groups, dtype=np.int64))
    bare.meta.clear()
    with pytest.raises(HeterogError, match="carries no actions"):
        moves_from_uniform(ev, bare)
    with pytest.raises(HeterogError, match="carries no actions"):
        moves_from_uniform(ev, [0] * (ev.n_groups + 1))
    with pytest.raises(HeterogError, match=r"has 30 \(0..29\)"):       # M + 4 actions, then the split actions
        moves_from_uniform(ev, [30] * ev.n_groups)
    assert moves_from_uniform(ev, [12] * ev.n_groups).name == "tp-even"
