"""Conformance with a model library: Hugging Face ``transformers`` models (``transformers_models.py``),
called with keyword arguments, dropout on at the library's defaults, train under the plan of every
planner and under random plans, on local-cpu-2 and on local-cpu-3, exactly as in one process (`make
conformance` adds ten more families: BART, OPT, Qwen2, Mistral, ELECTRA, ALBERT, DeBERTa-v2, ConvNeXt,
Swin and BERT with eager attention).

The global batch is 12: with random values drawn in blocks of 8 samples, the replicas of even and
proportional plans hold blocks in part. ResNet's batch norm keeps per-replica statistics (docs/design.md,
"The runtime"): its data-parallel plans equal per-replica training of the library's model.
"""
from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from heterog.runtime import capture_model_for_runtime, prepare, run_prepared, train_single_process
from tests.runtime import transformers_models as tm
from tests.runtime.test_conformance import (
    CLUSTERS,
    LR,
    PLANNER_OPTS,
    PLANNERS,
    STEPS,
    assert_data_parallel_equals_per_replica,
    assert_trains_like_one_process,
    cluster_of,
    plan,
)

BATCH = 12
SEEDS = (0, 1)
# `make conformance` also trains the families of transformers_models.MORE_MODELS
MODELS = {**tm.EQUIVALENCE_MODELS, **(tm.MORE_MODELS if os.environ.get("HETEROG_TRANSFORMERS_MORE") else {})}


@functools.cache
def captured(name: str):
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    module, inputs = {**tm.EQUIVALENCE_MODELS, **tm.MORE_MODELS, **tm.BATCH_NORM_MODELS}[name](BATCH)
    return capture_model_for_runtime(module, inputs, lr=LR, name=name)


@functools.cache
def reference(name: str):
    m = captured(name)
    return train_single_process(m, [m.example_inputs], STEPS)


def check(name: str, cluster_name: str, method: str, seed: int, request) -> None:
    assert_trains_like_one_process(name, captured(name), reference(name), cluster_name, method, seed, request)


def test_the_models_draw_dropout_and_take_keyword_inputs() -> None:
    """Dropout is on (the library's defaults, training mode) and the inputs are keyword arguments."""
    for name in tm.EQUIVALENCE_MODELS:
        m = captured(name)
        assert any(op.draws for op in m.graph.ops), name
        assert all(k is not None for k in m.prog.input_spec.keywords), name
    assert PLANNER_OPTS and len(tm.EQUIVALENCE_MODELS) + len(tm.BATCH_NORM_MODELS) >= 8


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_random_plans_train_like_one_process(name, cluster_name, seed, request) -> None:
    check(name, cluster_name, "random", seed, request)


@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_micro_batched_random_plans_train_like_one_process(name, cluster_name, request) -> None:
    """A random plan over 2-4 micro-batches of uneven sizes (1F1B on local-cpu-2, GPipe on local-cpu-3)."""
    check(name, cluster_name, "random+micro", list(CLUSTERS).index(cluster_name), request)


@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_recomputed_random_plans_train_like_one_process(name, cluster_name, request) -> None:
    """A random plan by layers, random layers recomputed (dropout drawn again alike): over 2-4
    micro-batches under GPipe on local-cpu-2, one micro-batch on local-cpu-3."""
    method = "random+micro+recompute" if cluster_name == "local-cpu-2" else "random+recompute"
    check(name, cluster_name, method, 1, request)


@pytest.mark.parametrize("method", PLANNERS)
@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_planner_plans_train_like_one_process(name, cluster_name, method, request) -> None:
    check(name, cluster_name, method, 0, request)


@pytest.mark.parametrize("method", ["ev-ar", "cp-ps", "ev-ar+micro"])
@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
def test_batch_norm_plans_equal_per_replica_training(cluster_name, method, request) -> None:
    m = captured("resnet")
    assert_data_parallel_equals_per_replica(m, tm.BATCH_NORM_MODELS["resnet"](BATCH), cluster_name, method, request)
    assert any("batch statistics" in c for c in m.inexact_causes())


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_norm_under_random_plans_smoke(seed, request) -> None:
    m = captured("resnet")
    cluster = cluster_of("local-cpu-3")
    result = run_prepared(prepare(m, cluster, plan(m, cluster, "random", seed)), [m.example_inputs], STEPS,
                          pool=request.getfixturevalue("pool3"))
    assert all(bool(torch.isfinite(v).all()) for v in result.params(m).values())
