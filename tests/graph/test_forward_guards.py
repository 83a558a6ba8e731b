"""Guards around a model's forward while it is traced (heterog.graph.forward_guards) and hand-written
backwards: what a captured step cannot follow is refused in one line naming the model's line, what it can
follow traces and trains as eager PyTorch does."""
from __future__ import annotations

import functools
import logging
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import heterog
from heterog.errors import ModelError
from heterog.runtime import capture_model_for_runtime, train_single_process

LR = 0.1


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)


def _xy(batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 4, generator=g), torch.randint(0, 3, (batch,), generator=g)


class Net(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.2)
        self.mode = mode

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.mode == "numpy":
            x = x * float(np.random.rand())
        elif self.mode == "random":
            x = x * random.random()
        elif self.mode == "cast-same":
            self.fc = self.fc.to(torch.float32)
        elif self.mode == "cast-other":
            self.fc = self.fc.to(torch.float64)
        elif self.mode in ("seed", "seed-no-dropout"):
            torch.manual_seed(3)
        logits = self.fc(self.drop(x) if self.mode != "seed-no-dropout" else x)
        if self.mode == "len":
            logits = logits + torch.arange(len(logits)).unsqueeze(1) * 0.0
        if self.mode == "literal":
            logits = logits.view(6, 3)
        return F.cross_entropy(logits, y)


@pytest.mark.parametrize("mode, what", [("numpy", "numpy.random.rand"), ("random", "random.random")])
def test_draws_outside_torch_are_refused_naming_the_line(mode, what) -> None:
    with pytest.raises(ModelError) as info:
        heterog.capture(Net(mode), _xy())
    msg = str(info.value)
    assert f"draws random values with {what} at " in msg and "test_forward_guards.py:" in msg and "\n" not in msg


def test_a_module_casting_itself_to_what_it_is_does_nothing() -> None:
    g = heterog.capture(Net("cast-same"), _xy())
    plain = heterog.capture(Net("plain"), _xy())
    assert [op.target for op in g.ops] == [op.target for op in plain.ops]


def test_a_module_casting_itself_to_another_dtype_is_refused_naming_it() -> None:
    with pytest.raises(ModelError, match=r"module 'fc' \(Linear\) casts itself to float64 inside forward at "
                                         r".*test_forward_guards.py:\d+.*its parameters being float32"):
        heterog.capture(Net("cast-other"), _xy())


def test_reseeding_torch_is_refused_when_the_step_draws_random_values() -> None:
    with pytest.raises(ModelError, match=r"re-seeds torch's random generator inside forward at "
                                         r".*test_forward_guards.py:\d+ in forward\(\) \(torch.manual_seed\(3\)\)"):
        heterog.capture(Net("seed"), _xy())
    heterog.capture(Net("seed-no-dropout"), _xy())          # nothing random: the seed changes nothing


def test_len_of_a_tensor_is_the_batch_symbol_and_a_literal_batch_is_still_refused() -> None:
    m = capture_model_for_runtime(Net("len"), _xy(), lr=LR)
    x, y = _xy(3)
    loss, _, _ = m.prog.step(m.params, list(m.buffers), m.state, (x, y))       # another batch size runs
    assert torch.isfinite(loss)
    with pytest.raises(ModelError, match="fixes the batch size to 6"):
        heterog.capture(Net("literal"), _xy())


def test_an_op_whose_output_shape_depends_on_values_is_named() -> None:
    class Ctc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logp = self.fc(x).log_softmax(-1).transpose(0, 1)                     # (T, B, C)
            n = x.shape[0]
            return F.ctc_loss(logp, targets, torch.full((n,), 7), torch.full((n,), 2))

    g = torch.Generator().manual_seed(2)
    with pytest.raises(ModelError) as info:
        heterog.capture(Ctc(), (torch.randn(3, 7, 4, generator=g), torch.randint(1, 5, (3, 2), generator=g)))
    msg = str(info.value)
    assert "aten._ctc_loss" in msg and "depends on tensor values at" in msg and "test_forward_guards.py:" in msg


class Recompute(torch.autograd.Function):
    """A reversible layer's pattern: the forward keeps no graph; the backward runs the layer again and
    accumulates its parameters' gradients into ``.grad`` (as Reformer's ``_ReversibleFunction``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:       # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.layer = layer
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):                                      # type: ignore[override]
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            out = ctx.layer(x)
            torch.autograd.backward(out, grad)
        return x.grad, None


class Reversible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(Recompute.apply(self.embed(x), self.inner)), y)


def _one_step_equals_eager(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One captured step of ``module`` updates every parameter as one eager step of SGD does."""
    m = capture_model_for_runtime(module, (x, y), lr=LR)
    _, values = train_single_process(m, [(x, y)], 1)
    module.zero_grad()
    module(x, y).backward()
    for name, ph in zip(m.prog.param_names, m.prog.placeholders):
        p = dict(module.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(values[ph], p.detach() - LR * p.grad, rtol=1e-5, atol=1e-6)


def test_a_hand_written_backward_trains_as_in_eager_pytorch() -> None:
    torch.manual_seed(0)
    _one_step_equals_eager(Reversible(), *_xy())


_SCALE = torch.tensor([0.5, 1.0, 2.0])                # a module-level constant the model reads


@functools.lru_cache(maxsize=4)
def _offsets(n: int) -> torch.Tensor:
    """A tensor a cache keeps, as transformers keeps BEiT's relative position index."""
    return torch.arange(n, dtype=torch.float32) * 0.1


class Held(nn.Module):
    """Reads tensors other than its parameters, buffers and inputs (a plain attribute, a module-level constant,
    a cached value) and keeps its last logits as an attribute; ``through_list``: its weight through a list."""

    def __init__(self, through_list: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.shift = torch.tensor([0.1, -0.2, 0.3])      # a plain attribute, not a buffer
        self.weights = [self.fc.weight]
        self.through_list = through_list

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = x @ self.weights[0].t() if self.through_list else self.fc(x)
        logits = logits * _SCALE + self.shift + _offsets(3)
        self.last = logits.detach()
        return F.cross_entropy(logits, y)


def test_tensors_read_outside_the_parameters_are_constants_of_the_step() -> None:
    torch.manual_seed(0)
    x, y = _xy()
    _offsets.cache_clear()
    module = Held()
    eager = module(x, y).detach()                       # the cache now holds a real tensor, read as a constant
    last = module.last
    _one_step_equals_eager(module, x, y)
    torch.testing.assert_close(module.last, last)
    # traced first: the cache the trace filled is emptied, and the attribute set in forward put back, so that
    # the next eager call reads no fake tensor
    _offsets.cache_clear()
    torch.manual_seed(0)
    fresh = Held()
    capture_model_for_runtime(fresh, (x, y), lr=LR)
    assert _offsets.cache_info().currsize == 0 and not hasattr(fresh, "last")
    torch.testing.assert_close(fresh(x, y).detach(), eager)


def test_a_parameter_read_through_a_kept_reference_is_refused_naming_it() -> None:
    with pytest.raises(ModelError) as info:
        heterog.capture(Held(through_list=True), _xy())
    msg = str(info.value)
    assert "parameter 'fc.weight'" in msg and "constant" in msg and "\n" not in msg, msg


class GrowingTable(nn.Module):
    """Registers a table for the sequence length it meets, as rotary embeddings that grow their cache do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.made_for = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n > self.made_for:
            self.register_buffer("table", torch.arange(n, dtype=torch.float32).unsqueeze(1).expand(n, 4) * 0.01,
                                 persistent=False)
            self.made_for = n
        return ((self.fc(x) + self.table - y) ** 2).mean()


def test_a_buffer_registered_in_forward_is_put_back_after_the_trace() -> None:
    torch.manual_seed(0)
    module = GrowingTable()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 5, 4, generator=g), torch.randn(6, 5, 4, generator=g)
    heterog.capture(module, (x, y))
    assert module.made_for == 0 and "table" not in module._buffers
    torch.manual_seed(0)
    torch.testing.assert_close(module(x, y), GrowingTable()(x, y))


class Renormed(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalises, in place inside forward, the rows its samples read."""

    def __init__(self, max_norm: float | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4, max_norm=max_norm)
        self.fc = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(self.embed(tokens)), y)


def test_a_write_into_a_parameter_inside_forward_is_named_as_inexact() -> None:
    g = torch.Generator().manual_seed(4)
    inputs = (torch.randint(0, 10, (6,), generator=g), torch.randint(0, 3, (6,), generator=g))
    torch.manual_seed(0)
    causes = capture_model_for_runtime(Renormed(1.0), inputs, lr=LR).inexact_causes()
    assert len(causes) == 1 and "embedding_renorm_" in causes[0] and "'embed.weight'" in causes[0], causes
    assert not capture_model_for_runtime(Renormed(None), inputs, lr=LR).inexact_causes()
