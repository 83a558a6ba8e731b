"""The edges of a split region that move nothing (each reader instance reads the producer's instance on its
own device), connected all at once in numpy (``heterog.compiler.reshard.own_shard_reads``), against the
per-tensor path that decides every other edge: the same plan, task for task and dependency for dependency."""
from __future__ import annotations

import numpy as np
import pytest

from envs.actions import full_plan, n_actions, plan_strategy
from heterog.cluster import load_cluster
from heterog.compiler import reshard
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


def dependency_set(plan) -> set[tuple[int, int, int]]:
    return set(zip(*(a.tolist() for a in plan.tg.dependencies())))


@pytest.mark.parametrize("model,batch,cluster", [("tiny_transformer", 8, "paper-8gpu"),
                                                 ("tiny_mlp", 16, "mixed-h100-a100-l4")])
def test_reads_of_own_shards_connected_at_once_give_the_per_tensor_plan(model, batch, cluster, monkeypatch):
    ev = Evaluator(capture_model(model, batch), load_cluster(cluster))
    m, g = ev.cluster.n_devices, ev.n_groups
    rng = np.random.default_rng(0)
    found = []
    real = reshard.own_shard_reads
    seen = []
    monkeypatch.setattr(reshard, "own_shard_reads", lambda *a: seen.append(real(*a)) or seen[-1])
    for i in range(8):
        actions = np.full(g, int(rng.integers(m + 4, n_actions(m, True, True))), dtype=np.int64)
        actions[rng.random(g) < 0.3] = rng.integers(0, n_actions(m, True, True))
        plan = full_plan(actions, g)
        plan[-1] = i % 3                                # 1, 2 and 4 micro-batches
        s = plan_strategy(ev, plan, "x", states=True, splits=True)
        ev.clear_plans()
        seen.clear()
        fast = ev.compile(s)
        found.append(sum(int(x.sum()) for x in seen))
        with monkeypatch.context() as per_tensor:
            per_tensor.setattr(reshard, "own_shard_reads", lambda ctx, lay, edges, place: np.zeros(len(edges), bool))
            ev.clear_plans()
            slow = ev.compile(s)
        tg_fast, tg_slow = fast.tg, slow.tg
        for x, y in [(fast.task_kind, slow.task_kind), (fast.task_op, slow.task_op),
                     (fast.task_device, slow.task_device), (tg_fast.duration, tg_slow.duration),
                     *zip(tg_fast.memory(), tg_slow.memory()), *zip(tg_fast.frees(), tg_slow.frees())]:
            np.testing.assert_array_equal(x, y)
        assert dependency_set(fast) == dependency_set(slow)
        assert ev.simulate_plan(fast).makespan == ev.simulate_plan(slow).makespan
    assert sum(found) > 0                     # the plans had such edges
