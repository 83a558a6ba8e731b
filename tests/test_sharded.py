"""The sharded-state record (heterog.sharded): shard weights and the runtime's one-line refusal of offloaded
parameters."""
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


def test_the_runtime_runs_every_stage_and_refuses_offloaded_parameters_in_one_line():
    plain = ParallelConfig((0, 1), (2, 2))
    held = [ParallelConfig((0, 1), (2, 2), sharded=ShardedState(s, (1, 1))) for s in (1, 2, 3)]
    refuse_in_runtime([plain, *held, ParallelConfig((0, 1), (2, 2), sharded=ShardedState(2, (1, 1), "optimizer"))])
    cfg = ParallelConfig((0, 1), (2, 2), sharded=ShardedState(3, (1, 1), "parameters"))
    with pytest.raises(SimulatorOnlyError) as err:
        refuse_in_runtime([plain, cfg])
    assert str(err.value) == ("offloaded parameters (offload='parameters') do not run yet: offload the optimizer "
                              "state (offload='optimizer')")
    assert isinstance(err.value, HeterogError)
