"""Capture of training graphs: structure, phases, optimizer state, FLOPs, bytes, batch dims, module paths,
and that the traced step reproduces eager training at other batch sizes."""
from __future__ import annotations

import copy
import logging

import graph_models
import numpy as np
import pytest
import torch
from graph_models import (
    MLP,
    AttributeLoss,
    BNNet,
    BranchOnValues,
    ConvNet,
    DepthwiseNet,
    DictLoss,
    DictNoLoss,
    FixedBatch,
    FoldNet,
    MatmulNet,
    NonScalar,
    TinyEncoder,
    TupleLoss,
    TuplePerSample,
    mlp_inputs,
)

from heterog.errors import DataDependentControlFlowError, HeterogError, ModelError
from heterog.graph.capture import capture, capture_fx, graph_from_step, select_loss
from heterog.graph.opgraph import PHASES, OpGraph

B = 4


@pytest.fixture(scope="module")
def mlp_graph() -> OpGraph:
    torch.manual_seed(0)
    return capture(MLP(), mlp_inputs(B), fuse=False)


def _compute(g: OpGraph, target: str | None = None, phase: str | None = None) -> list:
    return [op for op in g.ops if op.kind == "compute" and (target is None or op.target == target)
            and (phase is None or op.phase == phase)]


def _assert_topological(g: OpGraph) -> None:
    g.validate()
    assert all(e.src < e.dst for e in g.edges)
    assert len({(e.src, e.src_output, e.dst) for e in g.edges}) == len(g.edges)


# ---------------------------------------------------------------------------- structure and phases
@pytest.mark.parametrize("fuse", [False, True])
def test_mlp_graph_is_topological_dag_with_phases_in_order(fuse: bool) -> None:
    g = capture(MLP(), mlp_inputs(B), fuse=fuse)
    _assert_topological(g)
    phases = [PHASES.index(op.phase) for op in g.ops if op.kind == "compute"]
    assert phases == sorted(phases) and set(phases) == {0, 1, 2}
    # every edge from a compute op goes forward -> forward/backward/update, never back in phase
    for e in g.edges:
        if g.ops[e.src].kind == "compute":
            assert g.phase_index[e.src] <= g.phase_index[e.dst]


def test_mlp_placeholders_params_grads_and_updates(mlp_graph: OpGraph) -> None:
    g = mlp_graph
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    params = [op for op in g.ops if op.kind == "param"]
    assert [op.param for op in params] == names
    assert [op.output_shapes for op in params] == [[[16, 8]], [[16]], [[2, 16]], [[2]]]
    assert [op.param_bytes for op in params] == [512, 64, 128, 8]
    assert all(op.grad_bytes == op.param_bytes and op.state_bytes == 0 for op in params)
    assert all(op.module_path == n.rpartition(".")[0] for op, n in zip(params, names))
    inputs = [op for op in g.ops if op.kind == "input"]
    assert [op.output_shapes for op in inputs] == [[[B, 8]], [[B, 2]]]
    assert all(op.phase == "forward" for op in params + inputs)
    # one gradient producer per parameter, in the backward phase, with the gradient's shape
    grads = {op.param: op for op in g.ops if op.is_grad}
    assert set(grads) == set(names)
    assert all(op.phase == "backward" for op in grads.values())
    assert grads["fc1.weight"].output_shapes == [[16, 8]] and grads["fc2.bias"].output_shapes == [[2]]
    # SGD: exactly one update op (p - lr*g) per parameter, tagged with it
    updates = _compute(g, phase="update")
    assert sorted(op.param for op in updates) == sorted(names)
    assert all(op.target == "aten.add.Tensor" for op in updates)
    assert g.summary()["ops_by_phase"] == {"forward": 9, "backward": 22, "update": 4}
    assert g.meta["model"] == "MLP" and g.meta["torch_version"] == torch.__version__
    assert g.meta["ops_before_fusion"] == g.meta["ops_after_fusion"] == g.n_ops
    assert g.meta["capture_time_s"] > 0


def test_mlp_module_paths_forward_and_backward(mlp_graph: OpGraph) -> None:
    g = mlp_graph
    fwd = _compute(g, "aten.addmm.default", "forward")
    assert [op.module_path for op in fwd] == ["fc1", "fc2"]
    # backward matmuls differentiate the Linear they belong to
    bwd_mm = _compute(g, "aten.mm.default", "backward")
    assert [op.module_path for op in bwd_mm] == ["fc2", "fc2", "fc1"]
    assert [op.module_path for op in _compute(g, "aten.relu.default")] == [""]
    assert {op.module_path for op in _compute(g, phase="update")} == {"fc1", "fc2"}


@pytest.mark.parametrize("optimizer, slots, per_param", [
    ("sgd", 0, lambda pb: 0), ("momentum", 1, lambda pb: pb), ("adam", 3, lambda pb: 2 * pb + 4)])
def test_optimizer_state_is_recorded_on_param_ops(optimizer: str, slots: int, per_param) -> None:
    g = capture(MLP(), mlp_inputs(B), optimizer=optimizer)
    _assert_topological(g)
    assert g.optimizer == optimizer
    params = [op for op in g.ops if op.kind == "param"]
    assert [op.state_bytes for op in params] == [per_param(op.param_bytes) for op in params]
    states = [op for op in g.ops if op.kind == "state"]
    assert len(states) == slots * len(params)
    assert all(op.state_bytes == 0 and op.param_bytes == 0 and op.phase == "update" for op in states)
    assert sorted(op.param for op in states) == sorted(p.param for p in params for _ in range(slots))
    assert {op.param for op in _compute(g, phase="update")} == {op.param for op in params}
    assert g.summary()["state_bytes"] == sum(per_param(op.param_bytes) for op in params)


def test_adam_state_bytes_are_twice_params_plus_step() -> None:
    g = capture(MLP(), mlp_inputs(B), optimizer="adam")
    param_bytes = sum(op.param_bytes for op in g.ops if op.kind == "param")
    assert param_bytes == 4 * (16 * 8 + 16 + 2 * 16 + 2)
    assert g.summary()["state_bytes"] == 2 * param_bytes + 4 * 4


# ---------------------------------------------------------------------------- FLOPs and bytes
def test_linear_flops_match_hand_count(mlp_graph: OpGraph) -> None:
    g = mlp_graph
    fwd = [op.flops for op in _compute(g, "aten.addmm.default")]
    assert fwd == [2 * B * 8 * 16, 2 * B * 16 * 2]
    bwd = [op.flops for op in _compute(g, "aten.mm.default")]
    # fc2: grad input (B x 2 @ 2 x 16) and grad weight (2 x B @ B x 16); fc1: grad weight only (x needs no grad)
    assert bwd == [2 * B * 16 * 2, 2 * B * 16 * 2, 2 * B * 8 * 16]
    assert not any(op.flops_estimated for op in _compute(g, "aten.addmm.default") + _compute(g, "aten.mm.default"))


def test_conv_flops_match_hand_count() -> None:
    b, cin, cout, hw, k = 2, 3, 4, 6, 3
    g = capture(ConvNet(), (torch.randn(b, cin, hw, hw),), fuse=False)
    per_pass = 2 * b * cout * hw * hw * cin * k * k
    (conv,) = _compute(g, "aten.convolution.default")
    (conv_bwd,) = _compute(g, "aten.convolution_backward.default")
    assert conv.flops == per_pass and conv.phase == "forward" and conv.module_path == "conv"
    assert conv_bwd.flops == per_pass and conv_bwd.phase == "backward"   # weight gradient only
    # (grad_input, grad_weight, grad_bias) = (None, tensor, None): outputs list the tensors only.
    # Unfused, the gradient is the getitem picking it; fused, the convolution_backward op holds it
    (grad,) = [i for i, op in enumerate(g.ops) if op.is_grad]
    assert g.ops[grad].target == "getitem" and g.ops[grad].param == "conv.weight"
    assert [(g.ops[e.src].name, e.src_output) for e in g.edges if e.dst == grad] == [(conv_bwd.name, 0)]
    assert conv_bwd.output_shapes == [[cout, cin, k, k]]
    fused = capture(ConvNet(), (torch.randn(b, cin, hw, hw),))
    (conv_bwd,) = _compute(fused, "aten.convolution_backward.default")
    assert conv_bwd.is_grad and conv_bwd.param == "conv.weight" and conv_bwd.flops == per_pass


def test_grouped_conv_flops_count_each_group_once() -> None:
    b, c, hw, k = 2, 4, 5, 3
    g = capture(DepthwiseNet(), (torch.randn(b, 1, hw, hw),))
    first = 2 * b * c * 1 * k * k * hw * hw       # Conv2d(1 -> 4)
    depthwise = 2 * b * c * 1 * k * k * hw * hw   # groups=4: each output channel sees one input channel
    assert [op.flops for op in _compute(g, "aten.convolution.default")] == [first, depthwise]
    # backward of dw: grad input + grad weight (torch's own formula counts the latter 4x); of conv: grad weight
    assert [op.flops for op in _compute(g, "aten.convolution_backward.default")] == [2 * depthwise, first]


def test_matmul_flops_match_hand_count() -> None:
    b, s, d_in, d_out = 2, 3, 8, 5
    g = capture(MatmulNet(), (torch.randn(b, s, d_in),))
    mms = _compute(g, "aten.mm.default")
    assert [(op.phase, op.flops) for op in mms] == [("forward", 2 * b * s * d_in * d_out),
                                                   ("backward", 2 * b * s * d_in * d_out)]
    assert mms[1].is_grad and mms[1].param == "w"


def test_sdpa_on_cpu_has_flop_formula() -> None:
    b, s, h, heads = 2, 5, 8, 2
    g = capture(TinyEncoder(hidden=h, heads=heads), (torch.randint(0, 11, (b, s)),) * 2)
    fwd = [op for op in g.ops if "scaled_dot_product" in op.target and op.phase == "forward"]
    bwd = [op for op in g.ops if "scaled_dot_product" in op.target and op.phase == "backward"]
    assert len(fwd) == len(bwd) == 1
    d = h // heads
    assert fwd[0].flops == 2 * (2 * b * heads * s * s * d) and not fwd[0].flops_estimated
    assert bwd[0].flops == 5 * (2 * b * heads * s * s * d) and not bwd[0].flops_estimated


def test_ops_without_formula_get_documented_estimate(mlp_graph: OpGraph, caplog) -> None:
    g = mlp_graph
    (relu,) = _compute(g, "aten.relu.default")
    assert relu.flops_estimated and relu.flops == B * 16                # one per output element
    (mean,) = _compute(g, "aten.mean.default")
    assert mean.flops_estimated and mean.flops == B * 2                 # reduction: one per input element
    bias_sums = _compute(g, "aten.sum.dim_IntList")
    assert [op.flops for op in bias_sums] == [B * 2, B * 16]
    assert all(op.flops > 0 for op in _compute(g) if op.target not in
               ("aten.t.default", "aten.view.default", "aten.detach.default", "aten.expand.default"))
    assert "aten.relu.default" in g.summary()["estimated_flop_ops"]
    with caplog.at_level(logging.WARNING, logger="heterog.graph.capture"):
        capture(MLP(), mlp_inputs(B))
    warnings = [r for r in caplog.records if "FLOPs estimated" in r.getMessage()]
    assert len(warnings) == 1 and "aten.relu.default" in warnings[0].getMessage()


def test_bytes_read_written_and_batch_bytes(mlp_graph: OpGraph) -> None:
    g = mlp_graph
    addmm = _compute(g, "aten.addmm.default")[0]          # addmm(bias (16,), x (B, 8), W^T (8, 16))
    assert addmm.bytes_read == 4 * (16 + B * 8 + 8 * 16)
    assert addmm.bytes_written == 4 * B * 16
    assert addmm.batch_bytes == 4 * (B * 8 + B * 16)
    views = _compute(g, "aten.t.default")
    assert all(op.flops == op.bytes_read == op.bytes_written == 0 for op in views)
    for e in g.edges:
        src = g.ops[e.src]
        shape = src.output_shapes[e.src_output]
        assert e.bytes == 4 * int(np.prod(shape)) and e.batch_dim == src.batch_dims[e.src_output]


# ---------------------------------------------------------------------------- batch dimensions
def test_batch_dims_follow_transpose_and_folded_reshape() -> None:
    b, s, h = 4, 5, 6
    g = capture(FoldNet(hidden=h), (torch.randn(b, s, h), torch.randint(0, 3, (b, s))), fuse=False)
    fwd = {op.name: op for op in g.ops if op.phase == "forward"}
    by_target: dict[str, list] = {}
    for op in fwd.values():
        by_target.setdefault(op.target, []).append((op.output_shapes[0], op.batch_dims[0]))
    assert [(op.output_shapes, op.batch_dims) for op in g.ops if op.kind == "input"] == [
        ([[b, s, h]], [0]), ([[b, s]], [0])]
    assert by_target["aten.transpose.int"] == [([s, b, h], 1), ([b, s, h], 0)]
    assert by_target["aten.mm.default"] == [([s * b, h], 0)]           # (S, B, H) folded to (S*B, H)
    assert by_target["aten.addmm.default"] == [([b * s, 3], 0)]        # (B, S, H) folded to (B*S, H)
    assert by_target["aten.view.default"] == [([b * s], 0)]            # labels.reshape(B*S)
    assert by_target["aten.t.default"] == [([h, h], None), ([h, 3], None)]
    assert all(op.batch_dims == [None, None] for op in fwd.values() if op.target == "aten.nll_loss_forward.default")
    # weight gradients and updates carry no batch; the ops producing them read batch tensors
    for op in g.ops:
        if op.is_grad or op.phase == "update" or op.kind in ("param", "state"):
            assert op.batch_dims == [None] * len(op.batch_dims)
    assert all(g.has_batch[i] for i, op in enumerate(g.ops) if op.is_grad and op.target == "aten.mm.default")


def test_fused_edges_carry_the_batch_dim_of_the_consumed_view() -> None:
    b, s, h = 4, 5, 6
    g = capture(FoldNet(hidden=h), (torch.randn(b, s, h), torch.randint(0, 3, (b, s))))
    _assert_topological(g)
    (x,) = [i for i, op in enumerate(g.ops) if op.kind == "input" and len(op.output_shapes[0]) == 3]
    # the input op absorbed x.transpose(0, 1); its consumer (clone in proj) reads the (S, B, H) view
    assert g.ops[x].fx_nodes[1:] == ["transpose"]
    (e,) = [e for e in g.edges if e.src == x]
    assert e.batch_dim == 1 and e.bytes == 4 * b * s * h and e.src_output == 0
    assert g.ops[e.dst].target == "aten.clone.default"


# ---------------------------------------------------------------------------- model errors
def test_non_scalar_output_is_a_model_error() -> None:
    with pytest.raises(ModelError, match=r"model output has shape \(4\); it must be a scalar mean loss"):
        capture(NonScalar(), (torch.randn(4, 4),))


@pytest.mark.parametrize(("model_cls", "where"), [(TupleLoss, "output[0]"), (DictLoss, 'output["loss"]'),
                                                 (AttributeLoss, "output.loss")])
def test_loss_is_taken_from_tuple_dict_or_attribute_outputs(model_cls, where, caplog) -> None:
    torch.manual_seed(0)
    plain = MLP()
    model = model_cls()
    model.load_state_dict(plain.state_dict())
    x = mlp_inputs(B)
    with caplog.at_level(logging.WARNING, logger="heterog.graph.tracing"):     # the logger that notes it
        step = capture_fx(model, x)
        capture_fx(model, x)                        # said once per process, not per capture
    notes = [r.getMessage() for r in caplog.records if "training on its loss" in r.getMessage()]
    assert len(notes) == 1 and notes[0].endswith(f"training on its loss, {where}")
    assert notes[0].startswith(f"model {model_cls.__name__} returned a ")
    assert select_loss(model(*x), model_cls.__name__)[1] == where
    ref = capture_fx(plain, x)
    params = [p.detach() for p in plain.parameters()]
    loss, new_params, _ = step(params, [], [], x)
    ref_loss, ref_params, _ = ref(params, [], [], x)
    torch.testing.assert_close(loss, select_loss(model(*x))[0].detach())
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(new_params, ref_params):
        torch.testing.assert_close(a, b)
    assert [op.target for op in capture(model, x).ops] == [op.target for op in capture(plain, x).ops]


def test_output_without_a_scalar_loss_is_named() -> None:
    with pytest.raises(ModelError, match=r"returned a dict with keys \['prediction'\]; it must return the "
                                         r"scalar mean loss"):
        capture(DictNoLoss(), mlp_inputs(B))
    with pytest.raises(ModelError, match=r"model output\[0\] has shape \(4\); it must be a scalar mean loss"):
        capture(TuplePerSample(), mlp_inputs(4))
    with pytest.raises(ModelError, match=r"returned a tuple of 0 \(\)"):
        select_loss((), "Empty")


def test_data_dependent_control_flow_names_the_line_and_the_fix() -> None:
    with pytest.raises(DataDependentControlFlowError) as info:
        capture(BranchOnValues(), mlp_inputs(B))
    msg = str(info.value)
    assert "\n" not in msg and isinstance(info.value, ModelError)
    line = next(i for i, text in enumerate(open(graph_models.__file__), 1) if "if pred.sum() > 0:" in text)
    assert f"graph_models.py:{line} in forward() (if pred.sum() > 0:)" in msg
    assert "control flow depends on tensor values" in msg and "torch.where (or torch.cond)" in msg


def test_literal_batch_size_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="fixes the batch size to 4"):
        capture(FixedBatch(), (torch.randn(4, 6),))


def test_bad_inputs_and_options_are_named() -> None:
    with pytest.raises(ModelError, match=r"disagree on the batch size.*\[4, 3\]"):
        capture(MLP(), (torch.randn(4, 8), torch.randn(3, 2)))
    with pytest.raises(ModelError, match="example input 1 is a int"):
        capture(MLP(), (torch.randn(4, 8), 3))
    with pytest.raises(HeterogError, match="unknown optimizer 'rmsprop'"):
        capture(MLP(), mlp_inputs(4), optimizer="rmsprop")
    with pytest.raises(ModelError, match="forward pass failed.*RuntimeError"):
        capture(MLP(), (torch.randn(4, 7), torch.randn(4, 2)))


# ---------------------------------------------------------------------------- meta device, determinism
def test_meta_module_captures_the_same_graph_as_a_real_one() -> None:
    real = capture(TinyEncoder(), (torch.randint(0, 11, (3, 5)),) * 2)
    with torch.device("meta"):
        model = TinyEncoder()
        ids = torch.randint(0, 11, (3, 5))
    meta = capture(model, (ids, ids))
    assert meta.fingerprint == real.fingerprint
    assert meta.summary()["gflops_by_phase"] == real.summary()["gflops_by_phase"]


def test_batch_one_is_captured_at_batch_one() -> None:
    g = capture(MLP(), mlp_inputs(1), fuse=False)
    assert g.batch_size == 1
    assert [op.flops for op in _compute(g, "aten.addmm.default")] == [2 * 8 * 16, 2 * 16 * 2]
    assert [op.batch_dims for op in g.ops if op.kind == "input"] == [[0], [0]]


# ---------------------------------------------------------------------------- the traced step runs
def _eager_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
@pytest.mark.parametrize("model_cls, make_inputs", [
    (MLP, mlp_inputs), (BNNet, lambda b: (torch.randn(b, 2, 5, 5),))])
def test_symbolic_step_equals_eager_training_at_other_batch_sizes(optimizer, model_cls, make_inputs) -> None:
    torch.manual_seed(0)
    model = model_cls()
    step = capture_fx(model, make_inputs(4), optimizer=optimizer, lr=0.1, tracing_mode="symbolic")
    ref = copy.deepcopy(model)
    opt = _eager_optimizer(optimizer, ref.parameters(), 0.1)
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    state = step.init_state(params)
    for batch in (3, 7, 2):
        x = make_inputs(batch)
        loss, params, state = step(params, buffers, state, x)
        opt.zero_grad()
        ref_loss = ref(*x)
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach())
        for mine, theirs in zip(params, ref.parameters()):
            torch.testing.assert_close(mine, theirs.detach())
    for mine, theirs in zip(buffers, ref.buffers()):   # batch-norm running statistics, updated in place
        torch.testing.assert_close(mine, theirs)


def test_adam_step_equals_torch_adam_step() -> None:
    torch.manual_seed(0)
    model = TinyEncoder()

    def make(b):
        return torch.randint(0, 11, (b, 5)), torch.randint(0, 11, (b, 5))

    step = capture_fx(model, make(4), optimizer="adam", lr=0.01)
    assert [s for _, s in step.state_names[:3]] == ["exp_avg", "exp_avg_sq", "step"]
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for batch in (3, 6):   # one step at a time from torch's own state: equal to float tolerance
        params = [p.detach().clone() for p in model.parameters()]
        state = []
        for p in model.parameters():
            s = opt.state.get(p)
            state += ([s["exp_avg"].clone(), s["exp_avg_sq"].clone(), s["step"].clone()] if s
                      else step.init_state([p.detach()]))
        x = make(batch)
        _, new_params, new_state = step(params, [], state, x)
        opt.zero_grad()
        model(*x).backward()
        opt.step()
        for mine, theirs in zip(new_params, model.parameters()):
            torch.testing.assert_close(mine, theirs.detach(), rtol=1e-5, atol=1e-5)
        assert float(new_state[2]) == float(opt.state[next(iter(model.parameters()))]["step"])


def test_run_nodes_executes_ops_one_at_a_time_like_the_graph_module() -> None:
    torch.manual_seed(0)
    model = TinyEncoder()

    def make(b):
        return torch.randint(0, 11, (b, 5)), torch.randint(0, 11, (b, 5))

    step = capture_fx(model, make(4), optimizer="adam")
    graph = graph_from_step(step)
    assert graph.fingerprint == capture(model, make(4), optimizer="adam").fingerprint
    params = [p.detach() for p in model.parameters()]
    state = step.init_state(params)
    x = make(6)
    env = dict(zip(step.placeholders, [*params, *state, *x]))
    covered = []
    for op in graph.ops:   # placeholder ops too: they may hold fused views (the transposed weight)
        step.run_nodes(op.fx_nodes, env)
        covered += op.fx_nodes
    tensor_nodes = [n.name for n in step.gm.graph.nodes if n.op in ("placeholder", "call_function")
                    and n.name not in step.shape_nodes]
    assert sorted(covered) == sorted(tensor_nodes)
    expected = step.gm(*params, *state, *x)
    for name, value in zip(step.outputs, expected):
        torch.testing.assert_close(env[name], value)
    assert step.node_phase[graph.ops[-1].fx_nodes[0]] == "update"
    with pytest.raises(HeterogError, match="has not been computed yet"):
        step.run_nodes(graph.ops[-1].fx_nodes, dict(zip(step.placeholders, [*params, *state, *x])))
    assert set(step.grad_nodes) == set(step.param_names) and all(step.grad_nodes.values())


def test_fake_mode_step_runs_at_the_traced_batch() -> None:
    torch.manual_seed(0)
    model = MLP()
    step = capture_fx(model, mlp_inputs(B), tracing_mode="fake")
    assert step.shape_nodes == []
    params = [p.detach() for p in model.parameters()]
    loss, new_params, new_state = step(params, [], [], mlp_inputs(B))
    torch.testing.assert_close(loss, model(*mlp_inputs(B)).detach())
    assert len(new_params) == 4 and new_state == []
    with pytest.raises(HeterogError, match="needs a step traced with tracing_mode='symbolic'"):
        graph_from_step(step)
    with pytest.raises(HeterogError, match="takes 4 params"):
        step(params[:3], [], [], mlp_inputs(B))


def test_cli_reports_data_dependent_control_flow_in_one_line_with_exit_2(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import heterog

    root = str(Path(heterog.__file__).resolve().parents[1])     # this checkout's heterog in the child too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    model = tmp_path / "branchy.py"
    model.write_text("import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n"
                     "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 1)\n\n"
                     "    def forward(self, x):\n        y = self.fc(x)\n        if y.mean() > 0:\n"
                     "            y = -y\n        return y.mean()\n\n\n"
                     "def build(batch_size=4):\n    return Net(), (torch.randn(batch_size, 4),)\n")
    proc = subprocess.run([sys.executable, "-m", "heterog", "capture", f"{model}:build", "--no-cache",
                           "-o", str(tmp_path / "g.json")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("heterog capture: error: model Net: Python control flow depends on tensor values")
    assert "branchy.py:12 in forward() (if y.mean() > 0:)" in lines[0] and "torch.where" in lines[0]
    assert not (tmp_path / "g.json").exists()
