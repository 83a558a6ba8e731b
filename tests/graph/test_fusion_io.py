"""Trivial-op fusion (on hand-built graphs and on captured ones) and graph file round trips."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
from graph_models import MLP, TinyEncoder, mlp_inputs

from heterog.errors import GraphError
from heterog.graph.capture import capture
from heterog.graph.fusion import VIEW_OPS, fuse_trivial
from heterog.graph.opgraph import Edge, Op, OpGraph, load_graph


def _op(name: str, target: str, shapes: list[list[int]], bdims: list, kind: str = "compute", **kw) -> Op:
    return Op(name=name, target=target, kind=kind, output_shapes=shapes, output_dtypes=["float32"] * len(shapes),
              batch_dims=bdims, fx_nodes=[name], **kw)


def test_view_ops_are_recognised_by_packet() -> None:
    assert "aten.view.default" in VIEW_OPS and "aten.transpose.int" in VIEW_OPS and "getitem" in VIEW_OPS
    assert "aten.clone.default" not in VIEW_OPS and "aten._to_copy.default" not in VIEW_OPS
    assert "aten.mm.default" not in VIEW_OPS and "placeholder" not in VIEW_OPS


def test_fuse_trivial_on_a_hand_built_graph() -> None:
    # x (4,3,5) -> ln (multi-output: out (4,3,5), mean (4,3,1)) -> getitem(0) -> view (12,5) -> mm
    #                                                            -> getitem(1) -> sum
    ops = [
        _op("x", "placeholder", [[4, 3, 5]], [0], kind="input"),
        _op("ln", "aten.native_layer_norm.default", [[4, 3, 5], [4, 3, 1]], [0, 0], flops=60.0,
            bytes_read=240, bytes_written=288),
        _op("g0", "getitem", [[4, 3, 5]], [0]),
        _op("g1", "getitem", [[4, 3, 1]], [0]),
        _op("v", "aten.view.default", [[12, 5]], [0]),
        _op("w", "placeholder", [[5, 2]], [None], kind="param", param="w"),
        _op("mm", "aten.mm.default", [[12, 2]], [0], flops=240.0),
        _op("s", "aten.sum.default", [[]], [None], flops=12.0),
    ]
    edges = [Edge(0, 1, 240, 0), Edge(1, 2, 240, 0, 0), Edge(1, 3, 48, 0, 1), Edge(2, 4, 240, 0),
             Edge(4, 6, 240, 0), Edge(5, 6, 40, None), Edge(3, 7, 48, 0)]
    g = OpGraph("hand", 4, ops, edges)
    f = fuse_trivial(g)
    assert [op.name for op in f.ops] == ["x", "ln", "w", "mm", "s"]
    assert f.ops[1].fx_nodes == ["ln", "g0", "g1", "v"]
    assert f.ops[1].output_shapes == [[4, 3, 5], [4, 3, 1]] and f.ops[1].flops == 60.0
    assert [(e.src, e.dst, e.bytes, e.batch_dim, e.src_output) for e in f.edges] == [
        (0, 1, 240, 0, 0), (1, 3, 240, 0, 0), (2, 3, 40, None, 0), (1, 4, 48, 0, 1)]
    assert f.meta == {"ops_before_fusion": 8, "ops_after_fusion": 5}
    assert sum(op.flops for op in f.ops) == sum(op.flops for op in g.ops)


def test_a_consumer_of_several_views_of_one_output_reads_their_bytes_summed_at_most_the_whole() -> None:
    # proj (4,6) -> unbind-like views q, k, v (4,2) each -> attn reads all three; scale reads q and q's alias
    # (an overlap: at most the whole output); an expanded view read alone keeps its own (larger) bytes
    ops = [
        _op("x", "placeholder", [[4, 6]], [0], kind="input"),
        _op("proj", "aten.relu.default", [[4, 6]], [0]),
        _op("q", "aten.slice.Tensor", [[4, 2]], [0]),
        _op("k", "aten.slice.Tensor", [[4, 2]], [0]),
        _op("v", "aten.slice.Tensor", [[4, 2]], [0]),
        _op("attn", "aten.add.Tensor", [[4, 2]], [0]),
        _op("all", "aten.alias.default", [[4, 6]], [0]),
        _op("both", "aten.mul.Tensor", [[4, 6]], [0]),
        _op("e", "aten.expand.default", [[4, 6, 6]], [0]),
        _op("big", "aten.neg.default", [[4, 6, 6]], [0]),
    ]
    edges = [Edge(0, 1, 96, 0), Edge(1, 2, 96, 0), Edge(1, 3, 96, 0), Edge(1, 4, 96, 0), Edge(2, 5, 32, 0),
             Edge(3, 5, 32, 0), Edge(4, 5, 32, 0), Edge(1, 6, 96, 0), Edge(2, 7, 32, 0), Edge(6, 7, 96, 0),
             Edge(1, 8, 96, 0), Edge(8, 9, 576, 0)]
    f = fuse_trivial(OpGraph("views", 4, ops, edges))
    assert [op.name for op in f.ops] == ["x", "proj", "attn", "both", "big"]
    assert [(f.ops[e.src].name, f.ops[e.dst].name, e.bytes) for e in f.edges] == [
        ("x", "proj", 96), ("proj", "attn", 96), ("proj", "both", 96), ("proj", "big", 576)]


def test_fusion_keeps_one_parameter_gradient_per_op() -> None:
    # bwd -> (grad_w, grad_b) via two getitems: the second gradient stays its own op
    ops = [_op("go", "placeholder", [[4, 3]], [0], kind="input"),
           _op("bwd", "aten.native_layer_norm_backward.default", [[3], [3]], [None, None], flops=12.0),
           _op("gw", "getitem", [[3]], [None], is_grad=True, param="w"),
           _op("gb", "getitem", [[3]], [None], is_grad=True, param="b"),
           _op("vb", "aten.view.default", [[3, 1]], [None])]
    edges = [Edge(0, 1, 48, 0), Edge(1, 2, 12, None, 0), Edge(1, 3, 12, None, 1), Edge(3, 4, 12, None)]
    f = fuse_trivial(OpGraph("g", 4, ops, edges))
    assert [(op.name, op.fx_nodes, op.is_grad, op.param) for op in f.ops] == [
        ("go", ["go"], False, None), ("bwd", ["bwd", "gw"], True, "w"), ("gb", ["gb", "vb"], True, "b")]
    assert [(e.src, e.dst, e.src_output) for e in f.edges] == [(0, 1, 0), (1, 2, 1)]


def test_fusion_keeps_a_view_with_batch_dim_of_the_consumed_tensor() -> None:
    # p (B,S,H) -> transpose (S,B,H) consumed by c: the fused edge carries batch dim 1
    ops = [_op("p", "aten.relu.default", [[4, 3, 2]], [0]), _op("t", "aten.transpose.int", [[3, 4, 2]], [1]),
           _op("c", "aten.clone.default", [[3, 4, 2]], [1]), _op("d", "aten.neg.default", [[4, 3, 2]], [0])]
    g = OpGraph("t", 4, ops, [Edge(0, 1, 96, 0), Edge(1, 2, 96, 1), Edge(0, 3, 96, 0)])
    f = fuse_trivial(g)
    assert [(e.src, e.dst, e.batch_dim) for e in f.edges] == [(0, 1, 1), (0, 2, 0)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fusion_of_a_captured_graph_preserves_flops_grads_and_dag(optimizer: str) -> None:
    model, inputs = TinyEncoder(), (torch.randint(0, 11, (3, 5)),) * 2
    raw = capture(model, inputs, optimizer=optimizer, fuse=False)
    fused = capture(model, inputs, optimizer=optimizer)
    fused.validate()
    assert all(e.src < e.dst for e in fused.edges)
    assert fused.n_ops < raw.n_ops
    assert fused.meta["ops_before_fusion"] == raw.n_ops and fused.meta["ops_after_fusion"] == fused.n_ops
    assert fused.flops.sum() == pytest.approx(raw.flops.sum(), rel=0, abs=0)
    assert sorted(n for op in fused.ops for n in op.fx_nodes) == sorted(n for op in raw.ops for n in op.fx_nodes)
    assert len({op.name for op in fused.ops}) == fused.n_ops
    # the only views left pick a second parameter's gradient (layer-norm backward gives weight and bias)
    remaining = [op for op in fused.ops if op.kind == "compute" and op.target in VIEW_OPS]
    assert [(op.target, op.is_grad, op.param) for op in remaining] == [("getitem", True, "norm.bias")]
    (ln_bwd,) = [op for op in fused.ops if op.target == "aten.native_layer_norm_backward.default"]
    assert ln_bwd.is_grad and ln_bwd.param == "norm.weight"
    params = {op.param for op in raw.ops if op.kind == "param"}
    assert {op.param for op in fused.ops if op.is_grad} == params
    assert {op.param for op in fused.ops if op.phase == "update" and op.kind == "compute"} == params
    assert fused.summary()["param_bytes"] == raw.summary()["param_bytes"]
    assert fused.summary()["state_bytes"] == raw.summary()["state_bytes"]
    for op in fused.ops:                          # each merged op starts with its own node
        assert op.fx_nodes[0] == op.name


# ---------------------------------------------------------------------------- files
@pytest.fixture(scope="module")
def adam_graph() -> OpGraph:
    return capture(MLP(), mlp_inputs(4), optimizer="adam")


@pytest.mark.parametrize("filename", ["g.json", "g.json.gz"])
def test_graph_save_load_round_trip(adam_graph: OpGraph, tmp_path: Path, filename: str) -> None:
    path = adam_graph.save(tmp_path / filename)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == filename.endswith(".gz")
    loaded = load_graph(path)
    assert loaded.to_dict() == adam_graph.to_dict()
    assert loaded.fingerprint == adam_graph.fingerprint
    assert loaded.ops == adam_graph.ops and loaded.edges == adam_graph.edges


@pytest.mark.parametrize("filename", ["g.json", "g.json.gz"])
def test_truncated_graph_file_is_a_graph_error(adam_graph: OpGraph, tmp_path: Path, filename: str) -> None:
    path = adam_graph.save(tmp_path / filename)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GraphError, match="truncated or not JSON"):
        load_graph(path)


def test_missing_or_foreign_graph_file_is_a_graph_error(tmp_path: Path) -> None:
    with pytest.raises(GraphError, match="does not exist"):
        load_graph(tmp_path / "nope.json")
    (tmp_path / "other.json.gz").write_bytes(gzip.compress(b'{"format": "something-else"}'))
    with pytest.raises(GraphError, match="not a heterog graph file"):
        load_graph(tmp_path / "other.json.gz")
