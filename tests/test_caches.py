"""Derived caches (heterog.caches): one value per source object, built once, dropped with the source, never
carried by the source itself (a copy or a pickled graph starts with none)."""
from __future__ import annotations

import copy
import gc
import pickle

from heterog.caches import DerivedCache
from heterog.compiler.index import graph_index
from tests.compiler.helpers import linear_graph


class Source:
    pass


def test_a_value_is_built_once_per_source_and_goes_with_it():
    cache: DerivedCache[Source, list[int]] = DerivedCache("test values")
    builds: list[int] = []

    def build(n: int) -> list[int]:
        builds.append(n)
        return [n]

    a, b = Source(), Source()
    first = cache.get(a, lambda: build(1))
    assert cache.get(a, lambda: build(2)) is first and first == [1]
    assert cache.get(b, lambda: build(3)) == [3]
    assert builds == [1, 3] and len(cache) == 2 and a in cache
    del a
    gc.collect()
    assert len(cache) == 1 and b in cache


def test_a_failed_build_keeps_nothing():
    cache: DerivedCache[Source, int] = DerivedCache("test values")
    s = Source()

    def fail() -> int:
        raise ValueError("no")

    try:
        cache.get(s, fail)
    except ValueError:
        pass
    assert s not in cache and cache.get(s, lambda: 7) == 7


def test_the_graph_index_is_kept_per_graph_object_and_not_on_the_graph():
    g = linear_graph()
    gi = graph_index(g)
    assert graph_index(g) is gi
    assert not any(k.startswith("_") for k in vars(g))           # the graph itself carries nothing
    twin = copy.copy(g)
    assert graph_index(twin) is not gi and graph_index(twin).n_ops == gi.n_ops
    back = pickle.loads(pickle.dumps(g))
    assert graph_index(back) is not gi
