"""Caches of values derived from an object that does not change once built (a graph, a cluster, a cost
model, a compile context): each is a typed ``DerivedCache`` declared by the module that derives the value.

Owner and lifetime. The module that declares a cache (a module-level ``DerivedCache``) is its only writer
and reader; an entry lives exactly as long as its source object: it is dropped when the source is
garbage-collected, never earlier. Nothing is invalidated otherwise, because sources are not changed after
construction (a graph after capture, a cluster after loading, a context ever). The source object itself
carries nothing: pickling it (to a worker) sends no cache, and a copy of it starts with none.

A cached value must not refer to its source (directly or through a context): it would keep the source,
and so itself, alive for the life of the process.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

S = TypeVar("S")
V = TypeVar("V")


class DerivedCache(Generic[S, V]):
    """Values of type V derived from sources of type S, one per source object (by identity), built on first
    use by ``get`` and kept while the source lives (module docstring)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._values: dict[int, V] = {}

    def get(self, source: S, build: Callable[[], V]) -> V:
        """The value derived from ``source``: the kept one, or ``build()`` kept from now on."""
        key = id(source)
        hit = self._values.get(key)
        if hit is None:
            hit = self._values[key] = build()
            weakref.finalize(source, self._values.pop, key, None)
        return hit

    def __contains__(self, source: object) -> bool:
        return id(source) in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"DerivedCache({self.what}: {len(self)} sources)"
