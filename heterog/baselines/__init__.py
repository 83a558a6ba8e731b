"""Classic planners that return a Strategy: data-parallel baselines, expert, DPOS, Pesto ILP, MCMC, random.

``run(name, graph, cluster, **opts)`` is the one entry; ``names()`` lists what is registered.
"""
from __future__ import annotations

import time
from typing import Callable

from heterog.errors import HeterogError

_REGISTRY: dict[str, Callable] = {}
ORDER = ["single", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "expert", "dpos", "os-dpos", "pesto-ilp", "mcmc", "random"]


def register(name: str):
    """Decorator: ``fn(evaluator, **opts) -> Strategy`` becomes baseline ``name``."""
    def deco(fn):
        _REGISTRY[name] = fn
        return fn
    return deco


def names() -> list[str]:
    _load_all()
    return [n for n in ORDER if n in _REGISTRY] + sorted(set(_REGISTRY) - set(ORDER))


def _load_all() -> None:
    import importlib

    for mod in ("basic", "expert", "dpos", "pesto", "mcmc", "lpround"):
        try:
            importlib.import_module(f"heterog.baselines.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"heterog.baselines.{mod}":
                raise


def run(name: str, graph, cluster, *, evaluator=None, **opts):
    """Plan ``graph`` on ``cluster`` with baseline ``name``; the strategy's meta records search_time_s."""
    from heterog.evaluate import Evaluator

    _load_all()
    if name not in _REGISTRY:
        raise HeterogError(f"unknown method {name!r}; known: {', '.join(names())}")
    ev = evaluator if evaluator is not None else Evaluator(graph, cluster)
    t0 = time.perf_counter()
    strategy = _REGISTRY[name](ev, **opts)
    strategy.method = name
    strategy.meta["search_time_s"] = time.perf_counter() - t0
    return strategy
