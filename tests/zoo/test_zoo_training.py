"""Tests of the zoo models as training programs: real forward/backward on the small configurations,
the loss as a per-sample mean (data-parallel splits), determinism, dtype, input semantics, tracing."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from heterog import zoo

ALL = zoo.names()
# Models without batch statistics: the loss of a batch is the share-weighted mean of its parts' losses.
NO_BATCH_STATISTICS = ["vgg19", "transformer", "bert_large", "xlnet_large", "gpt2", "gpt2_xl", "big_embedding",
                       "tiny_mlp", "tiny_cnn", "tiny_transformer"]


@pytest.fixture(autouse=True)
def without_onednn():
    """Tiny convolutions run faster on the native kernels than through oneDNN's per-shape setup."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with torch.backends.mkldnn.flags(enabled=False):
            yield


def small(name: str, batch_size: int = 4, **kwargs):
    return zoo.build(name, batch_size, **zoo.small_overrides(name), **kwargs)


@pytest.mark.parametrize("name", ALL)
def test_forward_gives_a_finite_scalar_and_backward_reaches_every_parameter(name):
    module, inputs = small(name, 2 if name == "inception_v3" else 4)
    loss = module(**inputs).loss if isinstance(inputs, dict) else module(*inputs)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    for param_name, param in module.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
    assert any(p.grad.abs().sum() > 0 for p in module.parameters())


@pytest.mark.parametrize("name", NO_BATCH_STATISTICS)
def test_loss_is_the_share_weighted_mean_of_a_split_batch(name):
    module, inputs = small(name, 4, dtype=torch.float64)
    with torch.no_grad():
        whole = module(*inputs)
        first = module(*(x[:1] for x in inputs))
        rest = module(*(x[1:] for x in inputs))
    torch.testing.assert_close(whole, (1 * first + 3 * rest) / 4, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["tiny_transformer", "xlnet_large", "resnet50"])
def test_each_sample_changes_the_loss(name):
    module, inputs = small(name, 3)
    with torch.no_grad():
        base = module(*inputs)
        first = inputs[0].clone()
        first[2] = torch.flip(first[2], dims=[0]) if first.is_floating_point() else (first[2] + 1) % 64
        changed = module(first, *inputs[1:])
    assert not torch.equal(base, changed)


def test_builds_are_deterministic_per_seed():
    module_a, inputs_a = small("bert_large", seed=3)
    module_b, inputs_b = small("bert_large", seed=3)
    _, inputs_c = small("bert_large", seed=4)
    for (name, a), b in zip(module_a.state_dict().items(), module_b.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(torch.equal(a, b) for a, b in zip(inputs_a, inputs_b))
    assert not torch.equal(inputs_a[0], inputs_c[0])


def test_dtype_applies_to_parameters_and_float_inputs_only():
    module, (features, labels) = zoo.build("tiny_mlp", 4, dtype=torch.float64)
    assert {p.dtype for p in module.parameters()} == {torch.float64}
    assert features.dtype == torch.float64 and labels.dtype == torch.int64
    assert module.training


def test_xlnet_permutation_inputs_describe_one_factorisation_order_per_sequence():
    _, (ids, segments, perm_mask, target_mapping, labels) = small("xlnet_large", 3)
    length = ids.shape[1]
    predictions = length // 6
    assert target_mapping.shape == (3, predictions, length) and labels.shape == (3, predictions)
    visible = (perm_mask == 0).sum(dim=2)  # position i sees exactly the positions earlier in the order
    assert torch.equal(visible.sort(dim=1).values, torch.arange(length).expand(3, -1))
    assert torch.equal(perm_mask.diagonal(dim1=1, dim2=2), torch.ones(3, length))
    assert torch.equal(target_mapping.sum(dim=2), torch.ones(3, predictions))
    targets = target_mapping.argmax(dim=2)
    assert torch.equal(labels, torch.gather(ids, 1, targets))
    assert (visible.gather(1, targets) >= length - predictions).all()  # targets come last in the order
    assert torch.equal(segments[0], (torch.arange(length) >= length // 2).long())


def test_bert_masks_distinct_positions_in_every_sequence():
    _, (_, _, positions, masked_ids, next_sentence) = small("bert_large", 3)
    assert positions.shape == masked_ids.shape == (3, 3)  # ceil(15% of 16)
    assert all(len(set(row.tolist())) == positions.shape[1] for row in positions)
    assert set(next_sentence.tolist()) <= {0, 1}


def trace(name: str, mode: str):
    module, inputs = small(name, 2)
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())

    def train_step(params, buffers, *inputs):
        loss = functional_call(module, {**params, **buffers}, inputs)
        return loss, torch.autograd.grad(loss, list(params.values()))

    return make_fx(train_step, tracing_mode=mode)(params, buffers, *inputs)


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_cnn", "tiny_transformer", "xlnet_large", "nasnet"])
def test_training_step_traces_on_fake_tensors(name):
    graph = trace(name, "fake")
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert "aten.mm.default" in targets or "aten.convolution.default" in targets


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_cnn"])
def test_training_step_traces_with_symbolic_shapes(name):
    graph = trace(name, "symbolic")
    assert any(node.op == "call_function" for node in graph.graph.nodes)
