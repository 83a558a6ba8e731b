"""Models as model libraries write them: tensors made inside from the batch size carry the batch, writes
into intermediates become edges, random ops are marked, and inputs may be keyword arguments."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from graph_models import MLP
from torch import nn

from heterog.errors import ModelError
from heterog.graph.capture import capture, capture_fx
from heterog.graph.fusion import fuse_trivial
from heterog.graph.inputs import input_spec
from heterog.graph.mutations import intermediate_mutations
from heterog.graph.opgraph import Edge, Op, OpGraph
from tests.runtime import conformance_models as cm

B = 6                      # conformance_models: T = 8, C = 16, VOCAB = 32; no other size is 6 or 48


def test_tensors_made_from_the_batch_size_carry_the_batch() -> None:
    """A buffer expanded to the batch, new_ones / zeros / full / ones factories, arange(T) expanded, a
    causal mask from the input's shape and new_zeros of the labels: every tensor of the forward pass
    with the batch (B rows, or B*T) carries it on dim 0, and the expand of the buffer is an op of its own."""
    module, inputs = cm.build_made_inside(B)
    g = capture(module, inputs)
    checked = 0
    for op in g.ops:
        if op.kind != "compute" or op.phase != "forward":
            continue
        for shape, bd in zip(op.output_shapes, op.batch_dims):
            if shape and shape[0] in (B, B * cm.T):
                assert bd == 0, (op.name, op.target, shape, bd)
                checked += 1
    assert checked > 20
    factories = {op.target for op in g.ops if op.phase == "forward" and op.batch_dims[:1] == [0]}
    assert {"aten.new_ones.default", "aten.zeros.default", "aten.full.default", "aten.ones.default",
            "aten.expand.default", "aten.new_zeros.default"} <= factories


def test_a_write_into_an_intermediate_that_is_read_again_becomes_an_edge() -> None:
    """T5's shift right (``shifted[:, 1:] = y[:, :-1]`` into ``new_zeros``, then read whole) is traced
    functionalised: no write into an intermediate is read again, and the scatters feed the embedding."""
    module, inputs = cm.build_made_inside(B)
    step = capture_fx(module, inputs)
    assert not any(intermediate_mutations(step.gm).values())
    scatters = [n for n in step.gm.graph.nodes if "scatter" in str(n.target)]
    assert {str(n.target) for n in scatters} >= {"aten.slice_scatter.default", "aten.select_scatter.default"}
    assert all(step.node_phase[n.name] == "forward" for n in scatters)
    plain = capture_fx(*cm.build_tied_decoder(B))
    assert not any("scatter" in str(n.target) for n in plain.gm.graph.nodes)      # others are traced as before


def test_a_view_that_brings_in_the_batch_is_not_fused_into_its_producer() -> None:
    ops = [Op("buf", "placeholder", kind="buffer", output_shapes=[[1, 8]], batch_dims=[None], fx_nodes=["buf"]),
           Op("ex", "aten.expand.default", output_shapes=[[6, 8]], batch_dims=[0], fx_nodes=["ex"]),
           Op("v", "aten.view.default", output_shapes=[[8]], batch_dims=[None], fx_nodes=["v"]),
           Op("use", "aten.add.Tensor", output_shapes=[[6, 8]], batch_dims=[0], fx_nodes=["use"])]
    edges = [Edge(0, 1, 32, None), Edge(0, 2, 32, None), Edge(1, 3, 192, 0), Edge(2, 3, 32, None)]
    fused = fuse_trivial(OpGraph("g", 6, ops, edges))
    assert [op.name for op in fused.ops] == ["buf", "ex", "use"]
    assert fused.ops[0].fx_nodes == ["buf", "v"] and fused.has_batch.tolist() == [False, True, True]


def test_random_ops_are_marked() -> None:
    g = capture(*cm.build_dropout_net(B))
    assert sorted(op.target for op in g.ops if op.draws) == ["aten.native_dropout.default"] * 3 + [
        "aten.randn_like.default"]
    assert g.meta["random_ops"] == 4 and g.draws_batch.sum() == 4
    assert not any(op.draws for op in capture(*cm.build_tied_decoder(B)).ops)      # dropout 0: no draw


class Attention(nn.Module):
    """Attention as Hugging Face's eager kernels write it: softmax, dropout at ``p`` (0: off), product with
    the values."""

    def __init__(self, p: float | None) -> None:
        super().__init__()
        self.qkv, self.p = nn.Linear(16, 48), p

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(1, 2), dim=-1)
        if self.p is not None:
            w = F.dropout(w, p=self.p, training=self.training)
        return F.mse_loss(w @ v, y)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_dropout_that_is_off_is_its_input_as_in_eager_pytorch(p) -> None:
    """Eager PyTorch returns the tensor itself from dropout at p = 0; the graph has no copy of the
    attention weights either (symbolic tracing's own decomposition makes one), so the simulated memory
    is that of the model without the dropout line. At p > 0 dropout draws and keeps its mask."""
    inputs = (torch.randn(B, 8, 16), torch.randn(B, 8, 16))
    kernels = dict(torch.ops.aten.dropout.default.py_kernels)
    g, plain = capture(Attention(p), inputs), capture(Attention(None), inputs)
    assert torch.ops.aten.dropout.default.py_kernels == kernels          # torch as the trace found it
    assert not any(op.target == "aten.clone.default" for op in g.ops)
    if p == 0:
        assert len(g.ops) == len(plain.ops) and not any(op.draws for op in g.ops)
    else:
        assert sum(op.draws for op in g.ops) == 1


class Keywords(nn.Module):
    """Called with keyword arguments: a batch input, a row shared by all samples and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, *, x: torch.Tensor, shift: torch.Tensor, labels: torch.Tensor, scale: float = 1.0):
        return {"loss": F.cross_entropy(self.fc(x + shift) * scale, labels)}


def keyword_inputs(batch: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(batch, 4, generator=g), "shift": torch.randn(1, 4, generator=g),
            "labels": torch.randint(0, 3, (batch,), generator=g), "scale": 2.0}


def test_keyword_inputs_name_the_inputs_without_the_batch(caplog) -> None:
    # the logger that notes the inputs: another test in this process may have silenced "heterog.graph"
    with caplog.at_level(logging.WARNING, logger="heterog.graph.tracing"):
        g = capture(Keywords(), keyword_inputs(B))
    assert g.meta["inputs_without_batch"] == ["shift (1, 4)"]
    assert "shift (1, 4)" in caplog.text
    inputs = [op for op in g.ops if op.kind == "input"]
    assert [op.batch_dims for op in inputs] == [[0], [None], [0]]
    spec = input_spec(keyword_inputs(B))
    assert spec.keywords == ("x", "shift", "labels") and spec.batched == (True, False, True)
    assert spec.constants == {"scale": 2.0} and spec.batch_size == B
    tensors = spec.flatten(keyword_inputs(B))
    assert [t.shape[0] for t in spec.first_samples(tensors, 2)] == [2, 1, 2]
    rebuilt = spec.rebuild(tensors)
    assert rebuilt["scale"] == 2.0 and torch.equal(rebuilt["shift"], tensors[1])


def test_bad_keyword_inputs_are_named() -> None:
    with pytest.raises(ModelError, match="hold no tensor with a batch dimension"):
        input_spec({"x": torch.tensor(1.0), "flag": True})
    with pytest.raises(ModelError, match="must be named by identifiers"):
        input_spec({"not a name": torch.ones(2, 2)})
    spec = input_spec(keyword_inputs(B))
    with pytest.raises(ModelError, match="positional tensors, the model was captured with"):
        spec.flatten((torch.ones(B, 4),))
    with pytest.raises(ModelError, match=r"keyword arguments \['x'\]"):
        spec.flatten({"x": torch.ones(B, 4)})
    with pytest.raises(ModelError, match="disagree on the batch size"):
        input_spec((torch.randn(4, 8), torch.randn(3, 2)))
    assert input_spec(torch.ones(3, 2)).keywords == (None,)
    assert capture(MLP(), {"x": torch.randn(4, 8), "y": torch.randn(4, 2)}).batch_size == 4


def test_activation_checkpointing_of_the_model_trains_as_in_eager_pytorch() -> None:
    """Hugging Face's ``gradient_checkpointing_enable`` (``torch.utils.checkpoint`` around each block, its
    forward run again in backward): the captured step's update equals eager PyTorch's."""
    import transformers as tf

    from heterog.runtime import capture_model_for_runtime, train_single_process

    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(3, 32, (B, 8), generator=torch.Generator().manual_seed(1))
    m = capture_model_for_runtime(model, {"input_ids": ids, "labels": ids}, lr=0.1)
    _, values = train_single_process(m, [m.example_inputs], 1)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    params = dict(model.named_parameters())
    for name, ph in zip(m.prog.param_names, m.prog.placeholders):
        p = params[name]
        assert p.grad is not None, name
        torch.testing.assert_close(values[ph], p.detach() - 0.1 * p.grad, rtol=1e-5, atol=1e-6)
