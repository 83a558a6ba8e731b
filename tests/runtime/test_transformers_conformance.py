"""Conformance with a model library: Hugging Face ``transformers`` models (``transformers_models.py``),
called with keyword arguments, dropout on at the library's defaults, train under the plan of every
planner and under random plans, on local-cpu-2 and on local-cpu-3, exactly as in one process (`make
conformance` adds eighteen more families: BART, OPT, Qwen2, Mistral, ELECTRA, ALBERT, DeBERTa-v2, ConvNeXt,
Swin, BERT with eager attention, BLOOM, Falcon, GPT-NeoX, Gemma 2, Mamba, ModernBERT, Funnel and BEiT).

The families of ``transformers_families.py`` (losses that couple samples, batch norm with synchronized
statistics, a label check with a CTC loss, a router that casts itself, reversible layers) train exactly under
every plan kind (data parallel, random per group, random splits beyond the batch, random micro-batches with
recomputation): ``make test`` runs three of them under one kind each, ``make conformance`` every family and
the held-out ones under every kind on both clusters. What no plan can fix is refused in one line.

The global batch is 12: with random values drawn in blocks of 8 samples, the replicas of even and
proportional plans hold blocks in part. ResNet's batch norm keeps per-replica statistics (docs/design.md,
"The runtime"): its data-parallel plans equal per-replica training of the library's model.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import heterog
from heterog.errors import HeterogError
from heterog.runtime import capture_model_for_runtime, compare_values, prepare, run_prepared, train_single_process
from tests.runtime import transformers_families as fam
from tests.runtime import transformers_models as tm
from tests.runtime.test_conformance import (
    ATOL,
    CLUSTERS,
    LR,
    PLANNER_OPTS,
    PLANNERS,
    RTOL,
    STEPS,
    assert_data_parallel_equals_per_replica,
    assert_trains_like_one_process,
    cluster_of,
    plan,
)
from tests.runtime.test_split_conformance import with_splits

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


# every planner's plan of every model on both clusters in `make conformance`; `make test`: on one of the two,
# in turn, so each model and each planner meets both clusters
PLANNER_CASES = [(n, c, p) for i, n in enumerate(MODELS) for j, p in enumerate(PLANNERS)
                 for k, c in enumerate(CLUSTERS) if os.environ.get("HETEROG_TRANSFORMERS_MORE") or (i + j + k) % 2 == 0]


@pytest.mark.parametrize("name,cluster_name,method", PLANNER_CASES)
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


# ---------------------------------------------------------------------------- families of every kind
FAMILY_KINDS = ("ev-ar", "random", "split", "random+micro+recompute")
ALL_FAMILIES = {**fam.FAMILIES, **fam.HELD_OUT}
FAMILY_CASES = ([(n, c, k) for n in ALL_FAMILIES for c in CLUSTERS for k in FAMILY_KINDS]
                if os.environ.get("HETEROG_TRANSFORMERS_MORE") else
                [("clip", "local-cpu-3", "random+micro+recompute"), ("segformer", "local-cpu-2", "random"),
                 ("simclr", "local-cpu-2", "split")])


@functools.cache
def family(name: str):
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    module, inputs = ALL_FAMILIES[name](BATCH)
    m = capture_model_for_runtime(module, inputs, lr=LR, name=name)
    return m, train_single_process(m, [m.example_inputs], STEPS)


def family_plan(name: str, m, cluster, kind: str, seed: int):
    """``kind``'s plan: a planner's, random (``+micro``, ``+recompute``: ``plan``), or random groups divided
    beyond the batch (``split``); with synchronized batch statistics for the batch-norm families."""
    s = with_splits(plan(m, cluster, "random", seed), cluster.n_devices, seed) if kind == "split" else \
        plan(m, cluster, kind, seed)
    return dataclasses.replace(s, sync_batch_stats=True) if name in fam.SYNCED | fam.HELD_OUT_SYNCED else s


@pytest.mark.parametrize("name, cluster_name, kind", FAMILY_CASES)
def test_families_of_every_kind_train_like_one_process(name, cluster_name, kind, request) -> None:
    m, (ref_losses, ref_values) = family(name)
    cluster = cluster_of(cluster_name)
    strategy = family_plan(name, m, cluster, kind, 1)
    result = run_prepared(prepare(m, cluster, strategy), [m.example_inputs], STEPS,
                          pool=request.getfixturevalue("pool2" if cluster_name == "local-cpu-2" else "pool3"))
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{name} {kind} on {cluster_name}: {bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)
    n_p = len(m.params)
    for ph in m.prog.placeholders[n_p:n_p + len(m.buffers)]:           # batch norms' running statistics
        torch.testing.assert_close(result.values[ph].double(), ref_values[ph].double(), rtol=RTOL, atol=ATOL)
    assert not m.inexact_causes(strategy), m.inexact_causes(strategy)


def test_the_families_are_of_their_kinds() -> None:
    """The contrastive families couple samples, SegFormer has batch norms, Wav2Vec2 keeps its label check as an
    assumption; the captured CLIP loss is the library's."""
    clip, _ = family("clip")
    assert clip.graph.coupled.any() and family("simclr")[0].graph.coupled.any()
    assert any("batch_norm" in op.target for op in family("segformer")[0].graph.ops)
    module, inputs = fam.build_clip(BATCH)
    torch.testing.assert_close(train_single_process(clip, [clip.example_inputs], 1)[0][0],
                               float(module(**inputs).loss.detach()), rtol=1e-5, atol=1e-6)
    if os.environ.get("HETEROG_TRANSFORMERS_MORE"):
        assumed = family("wav2vec2_ctc")[0].graph.assumptions
        assert [a["code"] for a in assumed] == ["labels.max() >= self.config.vocab_size"]


@pytest.mark.parametrize("name", list(fam.REFUSED) if os.environ.get("HETEROG_TRANSFORMERS_MORE")
                         else list(fam.QUICK_REFUSALS))
def test_what_no_plan_can_fix_is_refused_in_one_line(name) -> None:
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    build, names = fam.REFUSED[name]
    with pytest.raises(HeterogError) as info:
        heterog.capture(*build(BATCH))
    assert re.search(names, str(info.value)) and "\n" not in str(info.value), str(info.value)


def test_the_padded_ctc_loss_equals_torchs() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, 7, generator=g, requires_grad=True)
    labels = torch.randint(1, 7, (5, 4), generator=g)
    labels[1, 2:] = -100
    labels[3, 3:] = -100
    lengths = torch.tensor([9, 7, 9, 8, 6])
    for reduction in ("mean", "sum", "none"):
        got = fam.padded_ctc_loss(logits, labels, lengths, 0, reduction)
        keep = labels >= 0
        want = F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), labels[keep], lengths, keep.sum(-1), blank=0,
                          reduction=reduction)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        g_got, = torch.autograd.grad(got.sum(), logits)
        g_want, = torch.autograd.grad(want.sum(), logits)
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)
