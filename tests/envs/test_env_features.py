"""Observation features: scales, shapes, the op-type vocabulary and the DP-share columns."""
from __future__ import annotations

import numpy as np
import pytest

from envs.features import (
    DEVICE_FEATURE_DIM,
    DEVICE_FEATURES,
    OP_TYPES,
    PER_DEVICE_OP_FEATURES,
    SCALAR_OP_FEATURES,
    device_features,
    graph_features,
    log_scale,
    op_feature_dim,
    op_type_index,
    pad_observation,
)
from heterog.evaluate import Evaluator


def test_log_scale_maps_units_to_tenths_and_thousands_to_one():
    assert log_scale(np.array([0.0, 1e-6 * 999, 1e-3 - 1e-6]), 1e-6) == pytest.approx([0.0, 1.0, 1.0])
    assert log_scale(np.array([9.0]), 1.0)[0] == pytest.approx(1 / 3)


@pytest.mark.parametrize("target, category", [
    ("aten.mm.default", "matmul"), ("aten.addmm.default", "matmul"), ("aten.convolution.default", "conv"),
    ("aten.convolution_backward.default", "conv_backward"), ("aten.native_layer_norm.default", "norm"),
    ("aten.threshold_backward.default", "activation_backward"), ("aten.add_.Tensor", "elementwise"),
    ("getitem", "copy"), ("aten.frobnicate.default", "other"), ("placeholder", "other")])
def test_op_type_vocabulary(target, category):
    assert OP_TYPES[op_type_index(target)] == category


def test_op_features_columns(tiny_mlp, paper8):
    ev = Evaluator(tiny_mlp, paper8)
    f = graph_features(tiny_mlp, paper8, ev.cost, ev.group_of)
    m = paper8.n_devices
    assert f.op_x.shape == (tiny_mlp.n_ops, op_feature_dim(m)) and f.op_x.dtype == np.float32
    assert f.dev_x.shape == (m, DEVICE_FEATURE_DIM) and f.edge_index.shape == (2, len(tiny_mlp.edges))
    assert np.isfinite(f.op_x).all() and np.abs(f.op_x).max() <= 10
    full, even = f.op_x[:, :m], f.op_x[:, m:2 * m]
    batch = tiny_mlp.has_batch & tiny_mlp.is_compute
    # a batch share of 1/8 is never slower than the full batch, and a non-batch op costs the same
    assert (even[batch] <= full[batch] + 1e-6).all()
    assert np.allclose(even[~tiny_mlp.has_batch], full[~tiny_mlp.has_batch])
    assert (full[~tiny_mlp.is_compute] == 0).all()
    expected = np.log10(1 + ev.cost.full_batch_times(tiny_mlp) / 1e-6) / 3
    assert np.allclose(full, expected, atol=1e-6)
    # one-hots: exactly one phase, kind and (for compute ops) op type
    start = len(PER_DEVICE_OP_FEATURES) * m + len(SCALAR_OP_FEATURES)
    one_hots = f.op_x[:, start:]
    assert np.allclose(one_hots[:, :3].sum(1), 1) and np.allclose(one_hots[:, 3:8].sum(1), 1)
    assert np.allclose(one_hots[tiny_mlp.is_compute, 8:].sum(1), 1)


def test_device_features_describe_the_paper_cluster(paper8, tiny_mlp):
    x = device_features(paper8, tiny_mlp)
    power_share = x[:, DEVICE_FEATURES.index("power_share")]
    assert power_share.sum() == pytest.approx(paper8.n_devices)
    assert power_share[0] > power_share[2] > power_share[6]          # V100 > 1080Ti > P100
    assert (x[:, DEVICE_FEATURES.index("server_share")] == pytest.approx(2 / 8))
    assert x[:, DEVICE_FEATURES.index("memory_pressure")] == pytest.approx(
        tiny_mlp.resident_bytes.sum() / paper8.memory_bytes)


def test_pad_observation_refuses_a_graph_that_does_not_fit(tiny_mlp, paper8):
    ev = Evaluator(tiny_mlp, paper8)
    f = graph_features(tiny_mlp, paper8, ev.cost, ev.group_of)
    with pytest.raises(ValueError, match=f"graph has {f.n_groups} groups, more than the observation's max_groups=3"):
        pad_observation(f, f.n_ops, f.n_edges, 3)
