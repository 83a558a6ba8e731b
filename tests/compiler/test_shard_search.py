"""The min-sum labelling behind each op's split option (heterog.compiler.shard_search): the vectorised solve
equals its plain-Python reference, is exact on chains and trees, and ends at a local minimum."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.compiler.shard_search import FORBIDDEN, energy, solve, solve_reference


@st.composite
def problems(draw: st.DrawFn, tree: str | None = None, max_nodes: int = 7) -> tuple:
    """A labelling problem on a DAG in topological order: integer costs (exact float sums), some pairs
    forbidden. ``tree``: "chain", "in" (each node feeds at most one later node) or "out" (each node has at
    most one producer); None: any DAG."""
    n = draw(st.integers(1, max_nodes))
    labels = [draw(st.integers(1, 3)) for _ in range(n)]
    src: list[int] = []
    dst: list[int] = []
    for v in range(1, n):
        if tree == "chain":
            preds = [v - 1]
        elif tree == "out":
            preds = [draw(st.integers(0, v - 1))]
        elif tree == "in":
            free = [u for u in range(v) if u not in src]
            preds = draw(st.lists(st.sampled_from(free), unique=True, max_size=2)) if free else []
        else:
            preds = draw(st.lists(st.integers(0, v - 1), unique=True, max_size=3))
        for u in preds:
            src.append(u)
            dst.append(v)
    cost = st.integers(0, 9).map(float)
    unary = [np.array([draw(cost) for _ in range(L)]) for L in labels]
    pair = []
    for u, v in zip(src, dst):
        m = np.array([[draw(cost) for _ in range(labels[v])] for _ in range(labels[u])])
        if draw(st.booleans()):
            m[draw(st.integers(0, labels[u] - 1)), draw(st.integers(0, labels[v] - 1))] = FORBIDDEN
        pair.append(m)
    return unary, src, dst, pair


def brute_force(unary: list, src: list, dst: list, pair: list) -> float:
    return min(energy(lab, unary, src, dst, pair) for lab in itertools.product(*(range(len(u)) for u in unary)))


@settings(max_examples=60, deadline=None)
@given(problems())
def test_solve_equals_its_reference(p: tuple) -> None:
    unary, src, dst, pair = p
    assert solve(unary, src, dst, pair).tolist() == solve_reference(unary, src, dst, pair)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["chain", "in", "out"]).flatmap(lambda t: problems(tree=t)))
def test_exact_on_chains_and_trees(p: tuple) -> None:
    unary, src, dst, pair = p
    assert energy(solve(unary, src, dst, pair), unary, src, dst, pair) == brute_force(unary, src, dst, pair)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_ends_at_a_local_minimum(p: tuple) -> None:
    unary, src, dst, pair = p
    labels = solve(unary, src, dst, pair, sweeps=100)
    best = energy(labels, unary, src, dst, pair)
    for v in range(len(unary)):
        for k in range(len(unary[v])):
            moved = labels.copy()
            moved[v] = k
            assert energy(moved, unary, src, dst, pair) >= best


def test_a_shared_source_agrees_with_all_its_readers() -> None:
    """A parameter (node 0, held whole or divided) read by two ops that can each read it only whole or only
    divided at a price: the pass towards the sources weighs both readers at once, where deciding the readers
    first leaves the parameter between two conflicting wishes."""
    whole = 0                                           # label 1: divided
    unary = [np.array([1.0, 0.0]), np.array([0.0, 3.0]), np.array([0.0, 3.0])]
    read = np.array([[0.0, 0.0], [FORBIDDEN, 0.0]])     # held divided, read whole: forbidden
    labels = solve(unary, [0, 0], [1, 2], [read, read])
    assert labels.tolist() == [whole, whole, whole]
    assert energy(labels, unary, [0, 0], [1, 2], [read, read]) == 1.0


def test_refuses_edges_against_the_order() -> None:
    with pytest.raises(ValueError, match="topological order"):
        solve([np.zeros(1), np.zeros(1)], [1], [0], [np.zeros((1, 1))])
