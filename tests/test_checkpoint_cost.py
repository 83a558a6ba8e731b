"""The checkpoint term (``heterog.checkpoint_cost``): the bytes each device writes under a plan, hand-computed
for whole, replicated, divided and sharded state; the time at each server's storage bandwidth; and
``Evaluator(checkpoint_every_steps=K)`` adding 1/K of it to the iteration time planners compare."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from heterog import baselines
from heterog.checkpoint_cost import checkpoint_bytes, checkpoint_time_s
from heterog.cluster.loader import cluster_from_dict
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.sharded import ShardedState
from heterog.shares import split_shares_of
from heterog.strategy import ParallelConfig


@pytest.fixture(scope="module")
def graph():
    return capture_model("tiny_mlp", 8, "adam")


@pytest.fixture(scope="module")
def cluster():
    """Two servers of two GPUs; server a writes at 2 GB/s, server b at 1 GB/s."""
    servers = [{"name": n, "gpus": ["V100-16GB"] * 2, "intra": {"kind": "nvlink", "bandwidth": "100 GB/s"},
                "nic": {"bandwidth": "100 Gbit/s"}, "storage": {"bandwidth": bw}}
               for n, bw in (("a", "2 GB/s"), ("b", "1 GB/s"))]
    return cluster_from_dict({"name": "two-by-two", "servers": servers})


def state_bytes(graph) -> float:
    """Parameters with their Adam state (two moments and a step counter each)."""
    return float(sum(op.param_bytes + op.state_bytes for op in graph.ops if op.kind == "param"))


def written(graph, cluster, strategy) -> np.ndarray:
    return checkpoint_bytes(graph, cluster, Evaluator(graph, cluster).compile(strategy))


def test_whole_and_replicated_state_is_written_once_by_its_first_holder(graph, cluster) -> None:
    total = state_bytes(graph)
    assert total == sum(3 * op.param_bytes + 4 for op in graph.ops if op.kind == "param")    # p, m, v, step
    on_2 = written(graph, cluster, baselines.run("single", graph, cluster, device=2))
    assert list(on_2) == [0.0, 0.0, total, 0.0]
    replicated = written(graph, cluster, baselines.run("ev-ar", graph, cluster))
    assert list(replicated) == [total, 0.0, 0.0, 0.0]
    assert checkpoint_time_s(cluster, on_2) == pytest.approx(total / 1e9)          # server b: 1 GB/s
    assert checkpoint_time_s(cluster, replicated) == pytest.approx(total / 2e9)    # server a: 2 GB/s


def test_divided_and_sharded_state_is_written_by_every_holder_its_part(graph, cluster) -> None:
    total = state_bytes(graph)
    s = baselines.run("ev-ar", graph, cluster)
    divided = dataclasses.replace(s, configs=[ParallelConfig.split_over((1, 3), (3, 1), graph.batch_size)
                                              for _ in s.configs])
    got = written(graph, cluster, divided)
    assert got[0] == got[2] == 0.0 and got[1] + got[3] == pytest.approx(total)
    assert got[1] > 2 * got[3]                                  # the 3:1 shares of the divided weights
    sharded = dataclasses.replace(s, configs=[dataclasses.replace(c, sharded=ShardedState(1, (1, 1, 1, 1)))
                                              for c in s.configs])
    got = written(graph, cluster, sharded)
    params = sum(op.param_bytes for op in graph.ops if op.kind == "param")
    # each replica its rows of each parameter's optimizer state, in whole rows as the runtime cuts them (a
    # quarter where the parameter has fewer rows than replicas)
    parts = np.zeros(4)
    for op in graph.ops:
        if op.kind == "param":
            rows = op.output_shapes[0][0] if op.output_shapes[0] else 0
            share = np.array(split_shares_of(rows, (1, 1, 1, 1))) / rows if rows >= 4 else np.full(4, 0.25)
            parts += op.state_bytes * share
    assert parts.sum() == pytest.approx(total - params)
    assert got == pytest.approx(parts + [params, 0, 0, 0])
    # server a writes devices 0 and 1, server b (half as fast) devices 2 and 3
    assert checkpoint_time_s(cluster, got) == pytest.approx(max(got[0] + got[1], (got[2] + got[3]) * 2) / 2e9)


def test_the_evaluator_adds_a_checkpoints_share_to_the_iteration_time(graph, cluster) -> None:
    s = baselines.run("cp-ar", graph, cluster)
    plain = Evaluator(graph, cluster)
    every = Evaluator(graph, cluster, checkpoint_every_steps=10)
    t = checkpoint_time_s(cluster, written(graph, cluster, s))
    assert every.iteration_time(s)[0] == pytest.approx(plain.iteration_time(s)[0] + t / 10)
    res = every.evaluate(s)
    assert res.checkpoint_time_s == pytest.approx(t) and res.iteration_time_s == pytest.approx(
        plain.evaluate(s).iteration_time_s + t / 10)
    assert res.record()["checkpoint_bytes"] == dict(zip(cluster.device_names, written(graph, cluster, s)))
    assert plain.evaluate(s).checkpoint_time_s == 0.0
    with pytest.raises(HeterogError, match="at least 1"):
        Evaluator(graph, cluster, checkpoint_every_steps=0)
