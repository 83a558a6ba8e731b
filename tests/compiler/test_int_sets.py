"""The sort-based set operations on integer arrays of ``heterog.compiler.tasks`` (the compiler's hot paths use
them instead of numpy's hash-table ``unique`` and its lexsorts) agree with numpy's, and the in-place write chains
of ``heterog.compiler.memory._closure`` are those of composing the writes until nothing is new."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from heterog.compiler.memory import _MAX_CHAIN, _closure, _code, _sorted_distinct
from heterog.compiler.tasks import isin_ints, pair_order, unique_ints

ints = arrays(np.int64, st.tuples(st.integers(0, 40)), elements=st.integers(-6, 30))


@settings(max_examples=200, deadline=None)
@given(ints, ints)
def test_unique_and_isin_agree_with_numpy(a, b):
    assert np.array_equal(unique_ints(a), np.unique(a))
    assert np.array_equal(unique_ints(a, nearly_sorted=True), np.unique(a))
    assert np.array_equal(isin_ints(a, b), np.isin(a, b))
    grid = np.resize(a, (2, 3)) if len(a) else np.zeros((2, 3), dtype=np.int64)
    assert np.array_equal(isin_ints(grid, b), np.isin(grid, b))
    wide_a, wide_b = a * 10**9, b * 10**9 + (b % 2)       # values far apart: the sorting path, not the table
    assert np.array_equal(isin_ints(wide_a, wide_b), np.isin(wide_a, wide_b))


pairs = st.lists(st.tuples(st.integers(-1, 9), st.integers(-1, 9), st.integers(-1, 3)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(pairs, st.booleans())
def test_pair_order_and_distinct_columns_agree_with_lexsort(cols, nearly_sorted):
    if nearly_sorted:
        cols = sorted(cols)[::-1][:3] + sorted(cols)[3:]
    a = np.array(cols, dtype=np.int64).reshape(-1, 3).T
    assert np.array_equal(pair_order(a[0], a[1], 10), np.lexsort((a[1], a[0])))
    tasks = a[:, (a[0] >= 0) & (a[1] >= 0)]             # releases name tasks: ids from 0
    want = np.unique(tasks, axis=1) if tasks.shape[1] else tasks
    assert np.array_equal(_sorted_distinct(tasks, 10), want)


def _chains_by_hand(writes: np.ndarray) -> set[tuple[int, int, int]]:
    """Every (u, b', e') with u writing into b and b, directly or along a chain, into (b', e')."""
    direct = {(int(u), int(b), int(e)) for u, b, e in writes.T}
    out = set(direct)
    for _ in range(_MAX_CHAIN):
        more = {(u, b2, e2) for u, b, _ in out for w, b2, e2 in direct if w == b} - out
        if not more:
            break
        out |= more
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(-1, 2)), max_size=30))
def test_the_write_chains_are_the_closure_of_the_writes(cols):
    writes = np.array(cols, dtype=np.int64).reshape(-1, 3).T
    n, span = 14, 5
    got = _closure(writes, n, span)
    assert {tuple(map(int, c)) for c in got.T} == _chains_by_hand(writes)
    assert len(np.unique(_code(got[:, len(cols):], n, span))) == got.shape[1] - len(cols)   # each found once
