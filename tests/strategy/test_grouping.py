"""Grouping: at most N groups, fewest-hops assignment, parameters stay with their gradients."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.errors import StrategyError
from heterog.graph.grouping import group_ops, units_on_groups
from heterog.graph.opgraph import Edge, Op, OpGraph
from tests.compiler.helpers import linear_graph


def chain_with_island() -> OpGraph:
    """a-b-c-d-e chain plus an island f-g with no edge to the chain."""
    ops = [Op(n, "aten.add.Tensor", output_shapes=[[1]], output_dtypes=["float32"], batch_dims=[None])
           for n in "abcdefg"]
    edges = [Edge(0, 1, 4), Edge(1, 2, 4), Edge(2, 3, 4), Edge(3, 4, 4), Edge(5, 6, 4)]
    return OpGraph("island", 1, ops, edges)


def test_ops_join_the_nearest_centre_and_islands_never_add_groups():
    g = chain_with_island()
    cost = np.array([10.0, 1, 1, 1, 9, 0, 0])            # centres: a (0) and e (4)
    group = group_ops(g, cost, max_groups=2)
    assert group.max() + 1 == 2
    # b is 1 hop from a; d is 1 hop from e; c is 2 hops from both -> the lower centre (a)
    assert group.tolist() == [0, 0, 0, 1, 1, 1, 1]       # island joins the cheapest centre (e)


def test_parameters_and_updates_follow_their_gradient():
    g = linear_graph()
    group = group_ops(g, np.arange(g.n_ops, dtype=float), max_groups=3)
    by_name = {op.name: int(group[i]) for i, op in enumerate(g.ops)}
    assert by_name["W"] == by_name["gW"] == by_name["upd"]
    assert group.max() + 1 <= 3


def _units_on_groups_reference(unit_of, group_of, weight):
    """Plain Python: each group's ops in its heaviest unit, the lowest on a tie."""
    total: dict[tuple[int, int], float] = {}
    for u, g, w in zip(unit_of, group_of, weight):
        total[(g, u)] = total.get((g, u), 0.0) + w
    best = {}
    for (g, u), w in sorted(total.items()):
        if g not in best or w > total[(g, best[g])]:
            best[g] = u
    return [best[g] for g in group_of]


def test_a_group_split_over_units_joins_its_heaviest_unit():
    # group 0 spans units 5 (weight 1) and 7 (weight 3): all in 7; group 1 spans 5 and 7 evenly: the lower (5)
    units = np.array([5, 7, 7, 5, 7, 9])
    groups = np.array([0, 0, 0, 1, 1, 2])
    out = units_on_groups(units, groups, np.array([1.0, 2.0, 1.0, 2.0, 2.0, 0.0]))
    assert out.tolist() == [7, 7, 7, 5, 5, 9]
    aligned = np.array([3, 3, 1, 1])
    assert units_on_groups(aligned, np.array([0, 0, 1, 1]), np.ones(4)).tolist() == [3, 3, 1, 1]
    with pytest.raises(StrategyError, match="differ"):
        units_on_groups(units, groups[:3], np.ones(6))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 6), st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=40))
def test_units_on_groups_agrees_with_the_plain_python_reference(rows):
    units, groups, weights = (np.array(c) for c in zip(*rows))
    out = units_on_groups(units, groups, weights.astype(float))
    assert out.tolist() == _units_on_groups_reference(units.tolist(), groups.tolist(), weights.tolist())
    for g in np.unique(groups):                   # one unit per group, one the group's ops had
        assert len(set(out[groups == g])) == 1 and out[groups == g][0] in units[groups == g]
