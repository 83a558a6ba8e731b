"""The compiler pauses Python's cyclic garbage collector while it compiles, and leaves it as it found it."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import heterog.compiler.compile as compile_module
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


@pytest.mark.parametrize("enabled", [True, False])
def test_a_compilation_runs_with_the_collector_off_and_restores_it(monkeypatch, enabled):
    ev = Evaluator(capture_model("tiny_mlp", 16), load_cluster("paper-8gpu"))
    seen: list[bool] = []
    real = compile_module.place
    monkeypatch.setattr(compile_module, "place", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        ev.compile(ev.strategy(np.full(ev.n_groups, 9)))            # DP-even-AR on paper-8gpu
        assert seen == [False] and gc.isenabled() is enabled
        with pytest.raises(ZeroDivisionError):                      # an error inside restores it too
            with compile_module.cycles_paused():
                1 / 0
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
