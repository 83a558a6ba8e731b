"""Conformance of plans that keep sharded or offloaded state (``heterog.runtime.state_lowering``): models of the
equivalence suites train with momentum SGD under random plans whose data-parallel groups hold their optimizer
state, gradients and parameters in shards (stages 1-3 drawn per group, uneven shard weights 1-3), alone or mixed
with groups divided beyond the batch, with micro-batches, with recomputed layers, or with the optimizer state
offloaded to the host, on local-cpu-2 and local-cpu-3, exactly as in one process; the programs lowered for
NCCL compute the same step in one process. With Adam the models whose one-process training the summation
order of data parallelism leaves unchanged (``ADAM_MODELS``: not the attention models, whose key bias has a
gradient of rounding noise that Adam scales to a full step, under plain data parallelism too) train the same.
``make test`` runs one seeded case of each of the ten models quickest to capture (every mix on both clusters),
three with Adam and the NCCL programs of three; ``make conformance`` (``HETEROG_SHARDED_SWEEP=1``) every model under
every mix on both clusters from two seeds, every Adam model under every mix, five Hugging Face models of
``transformers_models.py`` (dropout on, global batch 12) under every mix, and every NCCL program.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import numpy as np
import pytest

from heterog.cluster import load_cluster
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.runtime import capture_model_for_runtime, compare_values, prepare, run_prepared, train_single_process
from heterog.runtime.instructions import AllGather, Post, ReduceScatter
from heterog.sharded import ShardedState
from heterog.shares import proportional_shares
from heterog.strategy import ParallelConfig, Strategy
from tests.runtime import conformance_models as cm
from tests.runtime.test_conformance import ATOL, BATCH, LR, POOLS, RTOL, STEPS, plan, with_micro_batches
from tests.runtime.test_split_conformance import with_splits

OPTIMIZER = "momentum"
HOST = "Xeon-Gold-6148"
CLUSTERS = {"local-cpu-2": f"local-cpu-2:slowdown=1,2:host={HOST}",
            "local-cpu-3": f"local-cpu-3:slowdown=1,2,3:host={HOST}"}
MIXES = ("plain", "splits", "micro", "recompute", "offload")
MODELS = list(cm.EQUIVALENCE_MODELS)
ADAM_MODELS = ["wide_embeddings", "embedding_bag", "lstm_tagger", "gru_classifier", "residual_glu", "view_chains",
               "made_inside", "dropout_net", "keyword_tagger"]
HF_MODELS = ["bert", "gpt2", "llama", "t5", "vit"]      # of transformers_models.py, at its batch of 12
HF_BATCH = 12
SWEEP = bool(os.environ.get("HETEROG_SHARDED_SWEEP"))
if SWEEP:
    CASES = [(n, c, mix, seed) for n in MODELS for c in CLUSTERS for mix in MIXES for seed in (0, 1)]
    CASES += [(n, c, mix, 0) for n in HF_MODELS for c in CLUSTERS for mix in MIXES]
    ADAM_CASES = [(n, c, mix, 3) for n in ADAM_MODELS for c in CLUSTERS for mix in MIXES]
    NCCL_MODELS = MODELS
else:     # the models quick to capture and plan, each once, covering every mix on both clusters
    DEAL = {"wide_embeddings": ("local-cpu-3", "offload"), "sdpa_classifier": ("local-cpu-2", "micro"),
            "mha_classifier": ("local-cpu-3", "recompute"), "embedding_bag": ("local-cpu-3", "splits"),
            "residual_glu": ("local-cpu-2", "recompute"), "view_chains": ("local-cpu-3", "plain"),
            "made_inside": ("local-cpu-2", "offload"), "dropout_net": ("local-cpu-3", "micro"),
            "keyword_tagger": ("local-cpu-2", "splits"), "seq2seq": ("local-cpu-3", "micro")}
    CASES = [(n, *DEAL[n], i) for i, n in enumerate(DEAL)]
    ADAM_CASES = [("residual_glu", "local-cpu-3", "splits", 0), ("made_inside", "local-cpu-2", "micro", 1),
                  ("embedding_bag", "local-cpu-3", "offload", 2)]
    NCCL_MODELS = ["residual_glu", "made_inside", "view_chains"]


@functools.cache
def captured(name: str, optimizer: str = OPTIMIZER):
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    if name in cm.EQUIVALENCE_MODELS:
        module, inputs = cm.EQUIVALENCE_MODELS[name](BATCH)
    else:                                       # imported here: transformers takes seconds to import
        from tests.runtime import transformers_models as tm

        module, inputs = tm.EQUIVALENCE_MODELS[name](HF_BATCH)
    return capture_model_for_runtime(module, inputs, optimizer=optimizer, lr=LR, name=name)


@functools.cache
def reference(name: str, steps: int = STEPS, optimizer: str = OPTIMIZER):
    m = captured(name, optimizer)
    return train_single_process(m, [m.example_inputs], steps)


@functools.cache
def cluster_of(name: str):
    return load_cluster(CLUSTERS[name])


def sharded_config(rng: np.random.Generator, n_devices: int, batch: int, offload: bool,
                   parameters: bool = False) -> ParallelConfig:
    """An AllReduce data-parallel config over a random set of at least two devices, random batch shares, its
    state in shards of random weights 1-3 at a random stage (1-3; 0-3 when ``offload`` keeps it on the host,
    at stage 3 with the parameters too where ``parameters``)."""
    k = int(rng.integers(2, n_devices + 1))
    devs = tuple(sorted(int(d) for d in rng.choice(n_devices, size=k, replace=False)))
    shares = proportional_shares(batch, rng.integers(1, 4, size=k))
    if min(shares) < 1:
        shares = proportional_shares(batch, [1] * k)
    stage = int(rng.integers(0 if offload else 1, 4))
    weights = tuple(int(w) for w in rng.integers(1, 4, size=k))
    where = ("parameters" if parameters and stage == 3 else "optimizer") if offload else "none"
    return ParallelConfig(devs, tuple(shares), sharded=ShardedState(stage, weights, where))


def with_sharded_state(strategy: Strategy, n_devices: int, seed: int, offload: bool) -> Strategy:
    """``strategy`` with about half of its groups that are not divided beyond the batch made sharded data-parallel
    groups (``sharded_config``); with ``offload`` a quarter of the others offload their whole state from one
    device; those at stage 3 of even index offload their parameters too."""
    rng = np.random.default_rng(7000 + seed)
    configs = list(strategy.configs)
    for g, c in enumerate(configs):
        if c.split is not None:
            continue
        x = rng.random()
        if x < 0.5:
            configs[g] = sharded_config(rng, n_devices, strategy.batch_size, offload, g % 2 == 0)
        elif offload and x < 0.75:
            configs[g] = ParallelConfig((int(rng.integers(n_devices)),), (strategy.batch_size,),
                                        sharded=ShardedState(0, (1,), "optimizer"))
    return dataclasses.replace(strategy, configs=configs)


def sharded_plan(name: str, cluster_name: str, mix: str, seed: int, optimizer: str = OPTIMIZER) -> Strategy:
    """The first random plan from ``seed`` on (seeds 100 apart) of ``mix`` in which a parameter keeps sharded (or,
    with ``offload``, offloaded) state; ``splits``, ``micro`` and ``recompute`` mix it with groups divided beyond
    the batch, micro-batches or recomputed layers (``tests.runtime.test_conformance.plan``)."""
    m, cluster = captured(name, optimizer), cluster_of(cluster_name)
    n = cluster.n_devices
    params = np.array([op.kind == "param" for op in m.graph.ops])
    for k in range(10):
        s0 = seed + 100 * k
        base = plan(m, cluster, "random", s0)
        if mix == "splits":
            base = with_splits(base, n, s0)
        s = with_sharded_state(base, n, s0, mix == "offload")
        if mix == "micro":
            s = with_micro_batches(s, s0)
        if mix == "recompute":
            s = recomputed(s, m, cluster, s0)
            if s is None:
                continue
        try:
            state = Evaluator(m.graph, cluster).compile(s).placements.state
        except StrategyError as exc:            # a micro-batch too small for a grid, a layer that cannot recompute
            logging.getLogger(__name__).info("seed %d: %s", s0, exc)
            continue
        if state is not None and np.any((state.op_offload if mix == "offload" else state.op_stage)[params] > 0):
            return s
    raise AssertionError(f"{name}: no random {mix} plan keeps sharded state")


def recomputed(s: Strategy, m, cluster, seed: int) -> Strategy | None:
    """``s`` by layers, some recomputed (``with_recompute``), its layers' configs drawn again with sharded
    state (the regrouping takes each layer's config from its first op's group)."""
    from tests.runtime.test_conformance import with_recompute

    try:
        by_layers = with_recompute(s, m.graph, cluster, seed)
    except AssertionError:
        return None
    return with_sharded_state(by_layers, cluster.n_devices, seed + 1, False)


def assert_trains_like_one_process(name: str, strategy: Strategy, cluster_name: str, pool,
                                   optimizer: str = OPTIMIZER) -> None:
    m = captured(name, optimizer)
    result = run_prepared(prepare(m, cluster_of(cluster_name), strategy), [m.example_inputs], STEPS, pool=pool)
    ref_losses, ref_values = reference(name, STEPS, optimizer)
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{name} on {cluster_name}: {bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)
    for ph, v in result.values.items():           # the state too, put back together from its rows
        np.testing.assert_allclose(v.double().numpy(), ref_values[ph].double().numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name,cluster_name,mix,seed", CASES, ids=[f"{n}-{c}-{x}-{s}" for n, c, x, s in CASES])
def test_random_sharded_plans_train_like_one_process(name, cluster_name, mix, seed, request) -> None:
    strategy = sharded_plan(name, cluster_name, mix, seed)
    assert_trains_like_one_process(name, strategy, cluster_name, request.getfixturevalue(POOLS[cluster_name]))


@pytest.mark.parametrize("name,cluster_name,mix,seed", ADAM_CASES,
                         ids=[f"{n}-{c}-{x}-{s}" for n, c, x, s in ADAM_CASES])
def test_random_sharded_plans_train_with_adam_like_one_process(name, cluster_name, mix, seed, request) -> None:
    strategy = sharded_plan(name, cluster_name, mix, seed, "adam")
    assert_trains_like_one_process(name, strategy, cluster_name, request.getfixturevalue(POOLS[cluster_name]),
                                   "adam")


@pytest.mark.parametrize("name", NCCL_MODELS)
def test_sharded_programs_lowered_for_nccl_compute_one_step_like_one_process(name) -> None:
    """NCCL's programs (receives posted in message order) of a random sharded plan mixed with splits on
    local-cpu-3, run in one process (``heterog.runtime.check``), give one step of single-process training."""
    from heterog.runtime.check import check_prepared

    m = captured(name)
    prepared = prepare(m, cluster_of("local-cpu-3"), sharded_plan(name, "local-cpu-3", "splits", 2), backend="nccl",
                       check=False)
    instrs = [ins for rp in prepared.lowered.ranks for ins in rp.instrs]
    assert any(isinstance(ins, Post) for ins in instrs)
    assert any(isinstance(ins, (AllGather, ReduceScatter)) and ins.key[0].startswith("z") for ins in instrs)
    dry = check_prepared(prepared)
    assert dry is not None
    losses, want = reference(name, 1)
    ok, diff, bad = compare_values(m, dry.values, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{name}: {bad[:4]} differ (max |diff| {diff:.3g})"
    assert dry.loss == pytest.approx(losses[0], rel=RTOL)


def test_the_sweep_covers_every_stage_mix_and_cluster() -> None:
    """The cases of this run cover both clusters and every mix; the plans they draw shard at every stage."""
    assert {c for _, c, _, _ in CASES} == set(CLUSTERS)
    assert {x for _, _, x, _ in CASES} == set(MIXES)
    stages = set()
    for name, cluster_name, mix, seed in CASES[:6]:
        s = sharded_plan(name, cluster_name, mix, seed)
        stages |= {c.sharded.stage for c in s.configs if c.sharded is not None}
    assert {1, 2, 3} <= stages
