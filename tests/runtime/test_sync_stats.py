"""Synchronized batch statistics in the runtime (heterog.runtime.sync_stats, heterog.runtime.batch_stats): the
arithmetic equals torch's batch norm over the whole batch whatever the cut into instances, and plans of a
batch-norm CNN train exactly like one process, buffers included."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from heterog.runtime import compare_values, prepare, run_prepared
from heterog.runtime.batch_stats import local_sums, synced_backward, synced_forward
from heterog.runtime.instructions import BatchStats
from tests.runtime.test_conformance import ATOL, POOLS, RTOL, STEPS, captured, cluster_of, plan, reference

FUNCTIONAL = "aten._native_batch_norm_legit_functional.default"
BACKWARD = "aten.native_batch_norm_backward.default"


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, 4), min_size=2, max_size=4), channels=st.integers(1, 3),
       spatial=st.integers(1, 3), seed=st.integers(0, 1000))
def test_batch_norm_from_summed_instances_equals_torch_over_the_whole_batch(cuts, channels, spatial, seed) -> None:
    """Instances of ``cuts`` samples (two or more): their sums (gradients in each instance's convention, ``B / b``
    times the global rows) summed give the forward, running statistics and backward of F.batch_norm on the
    batch."""
    g = torch.Generator().manual_seed(seed)
    B = sum(cuts)
    x = torch.randn(B, channels, spatial, spatial, generator=g, dtype=torch.float64) * 3 + 1
    w = torch.randn(channels, generator=g, dtype=torch.float64)
    b = torch.randn(channels, generator=g, dtype=torch.float64)
    rm, rv = torch.randn(channels, dtype=torch.float64), torch.rand(channels, dtype=torch.float64) + 0.5
    dy = torch.randn_like(x)
    xr = x.clone().requires_grad_(True)
    wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    rm_want, rv_want = rm.clone(), rv.clone()
    out_want = F.batch_norm(xr, rm_want, rv_want, wr, br, training=True, momentum=0.1, eps=1e-5)
    out_want.backward(dy)
    pieces = list(zip(x.split(cuts), dy.split(cuts)))
    stats = sum(local_sums(FUNCTIONAL, (xi,), 1.0) for xi, _ in pieces)
    outs = [synced_forward(stats, FUNCTIONAL, xi, w, b, rm, rv, True, 0.1, 1e-5) for xi, _ in pieces]
    torch.testing.assert_close(torch.cat([o[0] for o in outs]), out_want.detach())
    for o in outs:                                          # every instance updates the running statistics alike
        torch.testing.assert_close(o[3], rm_want)
        torch.testing.assert_close(o[4], rv_want)
    mean, invstd = outs[0][1], outs[0][2]
    scales = [c / B for c in cuts]                          # instance rows are B / b times the global ones
    back = sum(local_sums(BACKWARD, (dyi / s, xi, w, rm, rv, mean), s) for (xi, dyi), s in zip(pieces, scales))
    grads = [synced_backward(back, 1 / s, dyi / s, xi, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True])
             for (xi, dyi), s in zip(pieces, scales)]
    torch.testing.assert_close(torch.cat([gi[0] * s for gi, s in zip(grads, scales)]), xr.grad)
    torch.testing.assert_close(sum(gi[1] * s for gi, s in zip(grads, scales)), wr.grad)
    torch.testing.assert_close(sum(gi[2] * s for gi, s in zip(grads, scales)), br.grad)


@pytest.mark.parametrize("cluster_name, method", [("local-cpu-2", "ev-ar"), ("local-cpu-3", "random+micro"),
                                                  ("local-cpu-2", "cp-ps+micro")])
def test_batch_norm_plans_with_synchronized_statistics_train_like_one_process(cluster_name, method, request) -> None:
    m, cluster = captured("batchnorm_cnn"), cluster_of(cluster_name)
    strategy = dataclasses.replace(plan(m, cluster, method, 1), sync_batch_stats=True)
    prepared = prepare(m, cluster, strategy)
    assert any(isinstance(i, BatchStats) for rp in prepared.lowered.ranks for i in rp.instrs)
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=request.getfixturevalue(POOLS[cluster_name]))
    ref_losses, ref_values = reference("batchnorm_cnn")
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{method} on {cluster_name}: {bad} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)
    n_p = len(m.params)
    for ph in m.prog.placeholders[n_p:n_p + len(m.buffers)]:          # running statistics, batch count
        torch.testing.assert_close(result.values[ph].double(), ref_values[ph].double(), rtol=RTOL, atol=ATOL)
    assert not any("batch statistics" in c for c in m.inexact_causes(strategy))
