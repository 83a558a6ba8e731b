"""The sharded-state record (heterog.sharded): shard weights and the runtime's one-line refusal."""
from __future__ import annotations

import pytest

from heterog.cluster import load_cluster
from heterog.errors import HeterogError
from heterog.sharded import ShardedState, SimulatorOnlyError, refuse_in_runtime, state_weights
from heterog.strategy import ParallelConfig


def test_weights_follow_memory_or_speed_or_are_even():
    cluster = load_cluster("consumer-3090-4090")
    assert state_weights("even", (0, 2)) == (1, 1)
    assert state_weights("memory", (0, 2), cluster) == (500, 500)          # 24 GB each
    speed = state_weights("speed", (0, 2), cluster)
    assert speed[1] > speed[0] and sum(speed) == 1000                       # a 4090 computes faster than a 3090


def test_the_runtime_refuses_sharded_state_in_one_line():
    plain = ParallelConfig((0, 1), (2, 2))
    refuse_in_runtime([plain])
    cfg = ParallelConfig((0, 1), (2, 2), sharded=ShardedState(2, (1, 1)))
    with pytest.raises(SimulatorOnlyError) as err:
        refuse_in_runtime([plain, cfg])
    assert str(err.value) == "sharded state (stage 2) runs in the simulator only"
    assert isinstance(err.value, HeterogError)
