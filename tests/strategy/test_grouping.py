"""Grouping: at most N groups, fewest-hops assignment, parameters stay with their gradients."""
from __future__ import annotations

import numpy as np

from heterog.graph.grouping import group_ops
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
