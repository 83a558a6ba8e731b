"""Conformance: models written from the torch.nn blocks users reach for train under any plan exactly as in
one process (``tests/runtime/conformance_models.py``).

Each equivalence model runs 2 SGD steps under random strategies from 2 seeds (``HETEROG_CONFORMANCE_SEEDS``;
``make conformance`` sweeps 16) on local-cpu-2 and
local-cpu-3 (emulated slowdowns 1,2 and 1,2,3, so proportional shares are uneven) and under the plan of
every planner on local-cpu-3 (the baselines and searches with small budgets, the agent after one
episode); parameters and losses must match single-process training. The per-rank programs lowered for
NCCL run in one process (no GPU needed) and must give the same step as gloo's. Batch norm keeps
per-replica statistics (docs/design.md, "The runtime"): its data-parallel runs equal per-replica (DDP-style)
training. One worker pool per cluster serves every run of a pytest worker. The regression tests of the
root causes found with these models come first.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog import baselines
from heterog.baselines.expert import op_layers
from heterog.cluster import load_cluster
from heterog.compiler import TaskKind
from heterog.compiler.place import recomputed_ops
from heterog.evaluate import Evaluator
from heterog.graph.capture import select_loss
from heterog.runtime import capture_model_for_runtime, compare_values, prepare, run_prepared, train_single_process
from heterog.runtime.instructions import Post
from heterog.runtime.layout import cat_batch, in_memory_order, narrow_batch
from heterog.runtime.scaling import positional_step
from heterog.shares import micro_batch_shares
from tests.runtime import conformance_models as cm

STEPS = 2
BATCH = 6
LR = 0.1
RTOL, ATOL = 1e-4, 1e-5          # float32 noise after 2 steps is ~1e-7; the bugs these tests caught were >= 1e-3
SEEDS = tuple(range(int(os.environ.get("HETEROG_CONFORMANCE_SEEDS", "2"))))   # `make conformance`: 16
CLUSTERS = {"local-cpu-2": "local-cpu-2:slowdown=1,2", "local-cpu-3": "local-cpu-3:slowdown=1,2,3"}
POOLS = {"local-cpu-2": "pool2", "local-cpu-3": "pool3"}
PLANNERS = [n for n in baselines.names() if n != "random"] + ["agent"]      # the agent: 1 episode of learning
PLANNER_OPTS = {"mcmc": {"max_evals": 100}, "os-dpos": {"budget_s": 0.3}, "pesto-ilp": {"budget_s": 0.5},
                "pipeline": {"budget_s": 0.5}}


@functools.cache
def captured(name: str):
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    build = cm.EQUIVALENCE_MODELS.get(name) or getattr(cm, f"build_{name}")
    module, inputs = build(BATCH)
    return capture_model_for_runtime(module, inputs, lr=LR, name=name)


@functools.cache
def reference(name: str):
    m = captured(name)
    return train_single_process(m, [m.example_inputs], STEPS)


@functools.cache
def cluster_of(name: str):
    return load_cluster(CLUSTERS[name])


def with_micro_batches(strategy, seed: int):
    """``strategy`` over 2 to 4 micro-batches of random sizes, under 1F1B (even ``seed``) or GPipe."""
    rng = np.random.default_rng(1000 + seed)
    B = strategy.batch_size
    k = int(rng.integers(2, min(4, B) + 1))
    cuts = np.sort(rng.choice(np.arange(1, B), size=k - 1, replace=False))
    sizes = tuple(int(x) for x in np.diff(np.concatenate([[0], cuts, [B]])))
    return dataclasses.replace(strategy, micro_batches=sizes, schedule=("1f1b", "gpipe")[seed % 2])


def with_recompute(strategy, graph, cluster, seed: int):
    """``strategy`` with its groups merged into layers (``op_layers``; each layer takes the config of its
    first op's group) and a random non-empty half of the layers that have something to recompute
    (``recomputed_ops``) recomputed."""
    layers, _ = op_layers(graph)
    first = [int(np.nonzero(layers == k)[0][0]) for k in range(int(layers.max()) + 1)]
    by_layer = dataclasses.replace(strategy, group_of=layers,
                                   configs=[strategy.configs[strategy.group_of[o]] for o in first])
    ops = recomputed_ops(Evaluator(graph, cluster).compiler.context, layers, tuple(range(len(first))))
    assert ops is not None, f"{graph.name}: no layer has anything to recompute"
    inner = np.unique(layers[ops])
    rng = np.random.default_rng(2000 + seed)
    chosen = rng.random(len(inner)) < 0.5
    chosen[rng.integers(len(inner))] = True
    return by_layer.with_recompute(inner[chosen])


def plan(m, cluster, method: str, seed: int = 0):
    """``method``'s plan; ``method+micro``: that plan over random micro-batches (``with_micro_batches``);
    ``method+recompute``: that plan by layers, some of them recomputed (``with_recompute``)."""
    if method.endswith("+recompute"):
        return with_recompute(plan(m, cluster, method[:-len("+recompute")], seed), m.graph, cluster, seed)
    if method.endswith("+micro"):
        return with_micro_batches(plan(m, cluster, method[:-len("+micro")], seed), seed)
    if method == "agent":
        from heterog.runtime.api import resolve_strategy

        return resolve_strategy(m, cluster, method="agent", episodes=1, seed=seed)
    ev = Evaluator(m.graph, cluster)
    opts = dict(PLANNER_OPTS.get(method, {}))
    if method in ("random", "mcmc"):
        opts["seed"] = seed
    return baselines.run(method, m.graph, cluster, evaluator=ev, **opts)


def assert_trains_like_one_process(name: str, m, single_process, cluster_name: str, method: str, seed: int,
                                   request) -> None:
    """``STEPS`` steps of model ``m`` under ``method``'s plan on ``cluster_name`` give the losses and values of
    ``single_process`` (``train_single_process``'s result for the same steps)."""
    cluster = cluster_of(cluster_name)
    strategy = plan(m, cluster, method, seed)
    if method.endswith("+recompute"):              # the plan recomputes something
        compiled = Evaluator(m.graph, cluster).compile(strategy)
        assert np.any(compiled.task_kind == TaskKind.RECOMPUTE), f"{name} {method}: nothing is recomputed"
    result = run_prepared(prepare(m, cluster, strategy), [m.example_inputs], STEPS,
                          pool=request.getfixturevalue(POOLS[cluster_name]))
    ref_losses, ref_values = single_process
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{name} {method} seed {seed} on {cluster_name}: {bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)


def check_trains_like_one_process(name: str, cluster_name: str, method: str, seed: int, request) -> None:
    assert_trains_like_one_process(name, captured(name), reference(name), cluster_name, method, seed, request)


# ---------------------------------------------------------------------------- regression tests of the causes
def test_a_value_re_laid_out_keeps_the_memory_order_the_captured_views_expect() -> None:
    """SDPA's output is traced as (B, H, T, D) stored (B, T, H, D); transpose(1, 2).view(B, T, C) needs
    that. A re-laid-out (concatenated) copy is row-major until put back in the captured order."""
    m = captured("sdpa_classifier")
    orders = {info.node: info.dim_order for info in m.prog.leaves.values() if info.dim_order is not None}
    assert any(o == (0, 2, 1, 3) for o in orders.values()), orders
    B, H, T, D = 3, 2, 4, 5
    traced = torch.randn(B, T, H, D).transpose(1, 2)                       # (B, H, T, D) stored (B, T, H, D)
    joined = torch.cat([traced[:1], traced[1:]])                            # what a re-layout assembles
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        joined.transpose(1, 2).view(B, T, H * D)
    fixed = in_memory_order(joined, (0, 2, 1, 3))
    assert fixed.stride() == traced.stride()
    torch.testing.assert_close(fixed.transpose(1, 2).view(B, T, H * D), traced.transpose(1, 2).reshape(B, T, H * D))
    assert in_memory_order(traced, (0, 2, 1, 3)) is traced                  # already in order: no copy


@pytest.mark.parametrize("method", ["ev-ar", "random", "random+micro"])
def test_ops_along_the_batch_train_like_one_process(method, pool3) -> None:
    """Ranks over the batch divided by the batch size, a running sum and a softmax over the samples, the batch
    flipped (``heterog.graph.coupling``: each runs once over the whole batch); replicas of their own would
    compute them over their own samples."""
    from tests.graph.test_coupling import AlongTheBatch, along_inputs

    torch.manual_seed(0)
    m = capture_model_for_runtime(AlongTheBatch(route=False), along_inputs(12), lr=LR, name="along_the_batch")
    ref_losses, ref_values = train_single_process(m, [m.example_inputs], STEPS)
    cluster = cluster_of("local-cpu-3")
    result = run_prepared(prepare(m, cluster, plan(m, cluster, method, 0)), [m.example_inputs], STEPS, pool=pool3)
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{method}: {bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)


def test_sample_minor_rows_are_sliced_and_joined_within_their_blocks() -> None:
    """nn.MultiheadAttention / TransformerEncoderLayer project (T*B, C) rows: samples are interleaved, so
    the probe marks them sample-minor and a re-layout slices within each of the T blocks."""
    m = captured("tied_decoder")
    assert m.exponents().sample_minor and not m.exponents().coupled
    T, B, C = 4, 5, 3
    rows = torch.arange(T * B * C, dtype=torch.float32).view(T, B, C)
    flat = rows.reshape(T * B, C)
    part = narrow_batch(flat, (0, 1, 3, T))                                # samples 1, 2 of every time step
    torch.testing.assert_close(part, rows[:, 1:3].reshape(T * 2, C))
    pieces = [narrow_batch(flat, (0, lo, hi, T)) for lo, hi in ((0, 1), (1, 3), (3, 5))]
    torch.testing.assert_close(cat_batch(pieces, 0, T), flat)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_re_layout_helpers_keep_values_and_reach_the_requested_layout(shape, data) -> None:
    """in_memory_order keeps the values and yields a tensor dense in the requested order; slicing samples
    (sample-major or within blocks) and joining the pieces gives the tensor back."""
    t = torch.randn(*shape)
    order = tuple(data.draw(st.permutations(range(len(shape)))))
    stored = data.draw(st.permutations(range(len(shape))))                 # t's values, stored in this order
    src = t.permute(stored).contiguous().permute(*np.argsort(stored).tolist())
    assert torch.equal(src, t)
    out = in_memory_order(src, order)
    assert torch.equal(out, t)
    assert out.permute(order).is_contiguous()
    block = data.draw(st.sampled_from([0] + [d for d in range(1, shape[0] + 1) if shape[0] % d == 0]))
    samples = shape[0] // block if block else shape[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, samples), max_size=3)) + [0, samples]))
    pieces = [narrow_batch(t, (0, lo, hi, block))
              for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    assert torch.equal(cat_batch(pieces, 0, block), t)


def test_in_place_ops_on_intermediates_run_out_of_place() -> None:
    """binary_cross_entropy_with_logits' backward divides ``mul`` in place; the probe then read ``mul``
    divided (exponent -1 instead of 0) and every re-laid-out gradient was scaled by a ratio of shares."""
    m = captured("wide_embeddings")
    targets = {c.target for c in m.prog.calls.values()}
    assert "op:aten::div.Scalar" in targets and "op:aten::div_.Scalar" not in targets
    mul = next(leaf for leaf, info in m.prog.leaves.items() if info.node == "mul")
    assert m.exponents()[mul] == 0


def test_storage_addressing_ops_run_on_a_storage_of_their_own() -> None:
    """``as_strided_scatter`` addresses the storage: on a replica's piece sliced out of a larger storage
    (offset 16) it must write where it writes on the traced tensor (offset 0)."""
    from heterog.runtime.kernel import as_strided_own, as_strided_scatter_own

    whole = torch.zeros(48)
    piece = whole[16:32]
    src = torch.arange(16.0).view(4, 4)
    got = as_strided_scatter_own(piece, src, [4, 4], [4, 1], 0)
    assert torch.equal(got, src.flatten()) and piece.storage_offset() == 16 and not whole.any()
    assert torch.equal(as_strided_own(torch.arange(48.0)[16:32], [2, 2], [1, 2], 0), torch.tensor([[16., 18.],
                                                                                                    [17., 19.]]))
    targets = {c.target for c in captured("view_chains").prog.calls.values()}
    assert "op:aten::reshape.default" in targets and "op:aten::view.default" not in targets


def test_positional_values_shift_to_the_consumers_first_sample() -> None:
    """EmbeddingBag's offsets (arange(0, B*L, L)) and offset2bag count positions in the batch."""
    assert positional_step(torch.tensor([0, 5]), torch.tensor([0, 5, 10, 15]), 0, 2) == 5
    assert positional_step(torch.tensor([0, 5]), torch.tensor([0, 5, 0, 5]), 0, 2) is None
    assert set(captured("embedding_bag").exponents().positional.values()) >= {1, 3}


# ---------------------------------------------------------------------------- every run equals one process
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", list(cm.EQUIVALENCE_MODELS))
def test_random_plans_train_like_one_process(name, cluster_name, seed, request) -> None:
    check_trains_like_one_process(name, cluster_name, "random", seed, request)


# every planner's plan of every model with `make conformance`; `make test`: half of them, in turn, so each model
# meets half the planners and each planner half the models
PLANNER_CASES = [(n, p) for i, n in enumerate(cm.EQUIVALENCE_MODELS) for j, p in enumerate(PLANNERS)
                 if len(SEEDS) > 2 or (i + j) % 2 == 0]


@pytest.mark.parametrize("name,method", PLANNER_CASES)
def test_planner_plans_train_like_one_process(name, method, request) -> None:
    check_trains_like_one_process(name, "local-cpu-3", method, 0, request)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", list(cm.EQUIVALENCE_MODELS))
def test_micro_batched_random_plans_train_like_one_process(name, cluster_name, seed, request) -> None:
    """Random plans over 2-4 micro-batches of uneven sizes, 1F1B (seed 0) and GPipe (seed 1): gradients
    accumulate over the micro-batches of each device, and the step is single-process training's."""
    check_trains_like_one_process(name, cluster_name, "random+micro", seed, request)


@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", list(cm.EQUIVALENCE_MODELS))
def test_recomputed_random_plans_train_like_one_process(name, cluster_name, request) -> None:
    """Random plans by layers with random layers recomputed: over 2-4 micro-batches under 1F1B on
    local-cpu-2, one micro-batch on local-cpu-3. The recomputed instances run the ops again (random ops
    draw the same values) and the backward reads them: the step is single-process training's."""
    method = "random+micro+recompute" if cluster_name == "local-cpu-2" else "random+recompute"
    check_trains_like_one_process(name, cluster_name, method, 0, request)


@pytest.mark.parametrize("method", ["random", "random+micro"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ignored_labels_train_like_one_process(method, seed, request) -> None:
    """Labels equal to ``ignore_index`` on uneven numbers of positions per sample: the mean loss divides by
    the whole batch's count of real labels (computed from the targets, ``heterog.graph.normalisers``), and
    the parameters are single-process training's under any plan. The reported loss weights each replica's
    mean by its share of the samples, so with ignored labels it is not the global mean: only the
    parameters are compared."""
    m = captured("padded_tagger")
    cluster = cluster_of("local-cpu-3")
    result = run_prepared(prepare(m, cluster, plan(m, cluster, method, seed)), [m.example_inputs], STEPS,
                          pool=request.getfixturevalue("pool3"))
    ok, diff, bad = compare_values(m, result.values, reference("padded_tagger")[1], rtol=RTOL, atol=ATOL)
    assert ok, f"padded_tagger {method} seed {seed}: {bad[:4]} differ (max |diff| {diff:.3g})"


# ---------------------------------------------------------------------------- batch norm: per replica
def ddp_reference(module: torch.nn.Module, inputs, shares, steps: int) -> dict[str, torch.Tensor]:
    """Eager data-parallel training: each replica's batch statistics over its own samples, gradients
    weighted by share / batch, one SGD update. ``inputs``: positional, or a dict of keyword arguments."""
    module = copy.deepcopy(module)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    B = sum(shares)
    for _ in range(steps):
        opt.zero_grad()
        lo = 0
        for s in shares:
            if isinstance(inputs, dict):
                out = module(**{k: v[lo:lo + s] for k, v in inputs.items()})
            else:
                out = module(*[x[lo:lo + s] for x in inputs])
            (select_loss(out)[0] * (s / B)).backward()
            lo += s
        opt.step()
    return {n: p.detach() for n, p in module.named_parameters()}


def assert_data_parallel_equals_per_replica(m, built, cluster_name: str, method: str, request) -> None:
    """``method``'s plan (one data-parallel layout) for model ``m`` trains like ``ddp_reference`` of
    ``built`` (the same model's ``(module, inputs)``)."""
    cluster = cluster_of(cluster_name)
    strategy = plan(m, cluster, method)
    shares = {c.shares for c in strategy.configs}
    assert len(shares) == 1
    result = run_prepared(prepare(m, cluster, strategy), [m.example_inputs], STEPS,
                          pool=request.getfixturevalue(POOLS[cluster_name]))
    # one instance per (replica, micro-batch), in sample order: statistics of each instance's samples
    entries = [s for row in micro_batch_shares(next(iter(shares)), strategy.micro) for s in row if s > 0]
    want = ddp_reference(*built, entries, STEPS)
    for name, got in result.params(m).items():
        torch.testing.assert_close(got, want[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("method", ["ev-ar", "cp-ps", "ev-ar+micro", "cp-ps+micro"])
@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
def test_batch_norm_data_parallel_equals_per_replica_training(cluster_name, method, request) -> None:
    assert_data_parallel_equals_per_replica(captured("batchnorm_cnn"), cm.build_batchnorm_cnn(BATCH), cluster_name,
                                            method, request)


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_norm_under_random_plans_smoke(seed, request) -> None:
    """Mixed plans with batch norm run to the end with finite parameters (statistics are per replica, so
    there is no single-process value to compare with)."""
    m = captured("batchnorm_cnn")
    cluster = cluster_of("local-cpu-3")
    result = run_prepared(prepare(m, cluster, plan(m, cluster, "random", seed)), [m.example_inputs], STEPS,
                          pool=request.getfixturevalue("pool3"))
    assert all(bool(torch.isfinite(v).all()) for v in result.params(m).values())
    assert len(result.losses) == STEPS and all(np.isfinite(result.losses))


# ---------------------------------------------------------------------------- NCCL programs, without GPUs
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("name", list(cm.EQUIVALENCE_MODELS))
def test_programs_of_both_backends_compute_one_step_like_one_process(name, backend) -> None:
    """The per-rank programs lowered for NCCL (no emulation) and for gloo, both posting each receive at its
    send's key (its buffer is held from there, as the simulator counts a transfer's), run in one process
    (``heterog.runtime.check``) under a random plan on local-cpu-3, give one training step of single-process
    training."""
    from heterog.runtime.check import check_prepared

    m = captured(name)
    cluster = cluster_of("local-cpu-3")
    prepared = prepare(m, cluster, plan(m, cluster, "random", 1), backend=backend, check=False)
    assert any(isinstance(ins, Post) for rp in prepared.lowered.ranks for ins in rp.instrs)
    dry = check_prepared(prepared)
    losses, want = train_single_process(m, [m.example_inputs], 1)
    ok, diff, bad = compare_values(m, dry.values, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{name} ({backend}): {bad[:4]} differ (max |diff| {diff:.3g})"
    assert dry.loss == pytest.approx(losses[0], rel=RTOL)
