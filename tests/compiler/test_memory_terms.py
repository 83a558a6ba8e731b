"""The simulated memory timeline on a hand-computed case: parameters resident, a gradient allocated by the
op that makes it and freed after the update reads it, the update's new value held to the step's end."""
from __future__ import annotations

import numpy as np

from heterog.strategy import ParallelConfig
from tests.compiler.helpers import linear_graph
from tests.compiler.test_compile import run, strategy_for, two_gpu


def test_single_device_memory_timeline_counts_gradients_from_their_production() -> None:
    """linear_graph on one device (times = FLOPs): W 32 B resident, x 128 B from the start; mm (0-128 s,
    64 B) freed when the loss ends (144 s); the loss (4 B) when ones_like ends (145 s); ones (4 B) when gout
    ends (161 s); gW (161-289 s) allocates the gradient (32 B) and frees x and gout at its end; the update
    (289-305 s) allocates the new W (32 B, held to the end) and frees the gradient."""
    g, c = linear_graph(), two_gpu()
    res = run(g, c, strategy_for(g, c, [ParallelConfig.single(0, 8)]))
    times, level = res.sim.memory_timeline(0)
    assert times.tolist() == [0, 128, 144, 145, 161, 289, 305]
    assert level.tolist() == [32 + 128 + 64, 228, 228 - 64 + 4, 168 - 4 + 64, 228 - 4 + 32, 256 - 192 + 32, 64]
    assert res.peak_memory_bytes[c.devices[0].name] == 32 + 128 + 64 + 32       # while gW runs
    assert int(np.asarray(res.sim.peak_memory)[1]) == 0
