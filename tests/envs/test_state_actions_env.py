"""The env's state actions (``state_actions=True``): AllReduce data parallelism keeping sharded state, priced by
the Evaluator. A memory-bound case: a layered graph with Adam's state (weights 8 P, moments 16 P, gradients
8 P made during the step) on two GPUs of 21.5 P each, where every plan of the plain actions is out of memory
(data parallelism peaks at 30 P on each replica, model parallelism holds all of it on one GPU, a parameter
server its share of the weights and their gradients beside the whole update) and stage 3 (21 P) or any stage
with the optimizer state offloaded to the host fits, stages 1 and 2 on the GPUs (25 P, 22 P) do not."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from envs import PlacementEnv, plan_nvec
from envs.actions import MICRO_CHOICES
from heterog.actions import N_STATE_CHOICES, STATE_CHOICES, n_actions, state_action
from heterog.cluster.loader import cluster_from_dict
from heterog.errors import StrategyError
from heterog.graph.opgraph import OpGraph
from heterog.sharded import ShardedState
from heterog.strategy import ParallelConfig
from tests.baselines.helpers import layered_graph

P = 1 << 16                         # bytes of each layer's weight


def adam_graph() -> OpGraph:
    """8 layers of a weight P each, with Adam's two moments: 4 P resident per layer, 32 P in all."""
    graph = layered_graph(8, P, batch=64, width=256)
    ops = [dataclasses.replace(o, state_bytes=2 * o.param_bytes) if o.kind == "param" else o for o in graph.ops]
    return OpGraph(graph.name + "-adam", graph.batch_size, ops, graph.edges)


def tight_cluster(memory_bytes: int, host: bool = True):
    gpu = {"name": "G", "peak_tflops": 10, "memory_bandwidth": "500 GB/s", "memory": f"{memory_bytes} B"}
    server = {"name": "s0", "gpus": [gpu] * 2, "intra": {"kind": "pcie", "bandwidth": "10 GB/s", "latency_us": 5}}
    if host:
        server["host"] = {"cpu": "Xeon-Gold-6148", "sockets": 1, "memory": "64 GB",
                          "pcie": {"bandwidth": "12 GB/s", "latency_us": 5}}
    return cluster_from_dict({"name": "tight-2", "servers": [server]})


@pytest.fixture(scope="module")
def env():
    return PlacementEnv(adam_graph(), tight_cluster(43 * P // 2), state_actions=True)


def step(env, groups, recompute=0, micro=0):
    g = env.max_groups
    env.reset(seed=0)
    action = np.concatenate([np.asarray(groups, dtype=np.int64), np.full(g, recompute), [micro]])
    return env.step(action)


def test_the_action_space_has_the_state_actions(env):
    m, g = 2, env.max_groups
    assert n_actions(m, states=True) == m + 4 + 2 * N_STATE_CHOICES
    assert env.action_space.nvec.tolist() == plan_nvec(m, g, states=True).tolist()
    assert env.action_space.nvec[0] == 2 + 4 + 2 * 21
    plain = PlacementEnv(adam_graph(), tight_cluster(43 * P // 2))
    assert plain.action_space.nvec[0] == 6
    plain.reset(seed=0)
    with pytest.raises(StrategyError, match="out of range 0..5"):
        plain.step(np.full(g, state_action(m, m + 1, 0)))


def test_a_memory_bound_plan_fits_only_through_a_state_action(env):
    m, g = 2, env.max_groups
    # the plain data-parallel plans peak at 30 P on each replica, 29 P recomputed; on one GPU more; neither
    # recomputation nor micro-batches free state: every plain uniform plan is out of memory
    for a, recompute, micro in itertools.product(range(n_actions(m)), (0, 1), range(len(MICRO_CHOICES))):
        _, r_plain, _, _, info = step(env, np.full(g, a), recompute, micro)
        assert info["oom"] and info["sharded_groups"] == 0, (a, recompute, micro)
    ev = env.evaluators[0]
    plain = ParallelConfig.of([(0, 32), (1, 32)], sync="allreduce")
    fitting = set()
    for s, (stage, by, offload) in enumerate(STATE_CHOICES):
        _, r, _, _, info = step(env, np.full(g, state_action(m, m + 1, s)))
        assert info["sharded_groups"] == env.features[0].n_groups
        if not info["oom"]:
            fitting.add((stage, by, offload))
            assert r > r_plain
        # what the env priced is the Evaluator's time of the plain plan keeping that state on every group
        # (shards even, by memory and by speed are all even on alike GPUs)
        sharded = dataclasses.replace(plain, sharded=ShardedState(stage, (1, 1), offload))
        expected = ev.iteration_time(dataclasses.replace(ev.strategy(np.full(ev.n_groups, m + 1)),
                                                         configs=[sharded] * ev.n_groups))
        assert (info["iteration_time_s"], info["oom"]) == expected
    assert fitting == {(stage, by, offload) for stage, by, offload in STATE_CHOICES
                       if stage == 3 or offload == "optimizer"}


def test_without_a_host_the_offload_is_dropped():
    env = PlacementEnv(adam_graph(), tight_cluster(43 * P // 2, host=False), state_actions=True)
    m, g = 2, env.max_groups
    _, _, _, _, offloaded = step(env, np.full(g, state_action(m, m + 1, 9 + 3)))      # stage 2 + offload
    _, _, _, _, on_gpu = step(env, np.full(g, state_action(m, m + 1, 3)))             # stage 2
    assert offloaded["peak_memory_bytes"] == on_gpu["peak_memory_bytes"] and offloaded["oom"] and on_gpu["oom"]


def test_an_env_with_state_actions_renders_their_names():
    env = PlacementEnv(adam_graph(), tight_cluster(43 * P // 2), state_actions=True, render_mode="ansi")
    env.reset(seed=0)
    g = env.max_groups
    groups = np.full(g, state_action(2, 3, 4))
    groups[0] = 0
    env.step(np.concatenate([groups, np.zeros(g + 1, dtype=np.int64)]))
    text = env.render()
    assert f"dp-even-ar:s2-memory={env.features[0].n_groups - 1}" in text and "mp:0=1" in text
