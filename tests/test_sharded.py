"""The sharded-state record (heterog.sharded): shard weights."""
from __future__ import annotations

from heterog.cluster import load_cluster
from heterog.sharded import state_weights


def test_weights_follow_memory_or_speed_or_are_even():
    cluster = load_cluster("consumer-3090-4090")
    assert state_weights("even", (0, 2)) == (1, 1)
    assert state_weights("memory", (0, 2), cluster) == (500, 500)          # 24 GB each
    speed = state_weights("speed", (0, 2), cluster)
    assert speed[1] > speed[0] and sum(speed) == 1000                       # a 4090 computes faster than a 3090
