"""Which ATen calls draw random values, and which of them a replica can draw exactly as single-device
training does (``heterog.runtime.rng`` says how it draws them)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

# samplers whose number of draws depends on the values they are given
VALUE_DEPENDENT = frozenset({"poisson", "binomial", "_standard_gamma", "_sample_dirichlet", "multinomial",
                             "randperm", "_dirichlet_grad"})


def is_random(target: Any) -> bool:
    """True for an ATen op that may draw from a random generator."""
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def draws(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """True when a call of ``target`` draws random values: a random op, unless its dropout probability is
    the constant 0 (``p``, ``dropout_p``) or it is told it is not training (``train=False``), as attention
    kernels and dropout are when dropout is off."""
    if not is_random(target):
        return False
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    for i, arg in enumerate(schema.arguments):
        default = arg.default_value if arg.has_default_value() else None
        value = args[i] if i < len(args) else kwargs.get(arg.name, default)
        if arg.name in ("p", "dropout_p") and isinstance(value, (int, float)) and value == 0:
            return False
        if arg.name == "train" and value is False:
            return False
    return True


def inexact_reason(target_name: str) -> str | None:
    """Why a random op cannot give every replica single-device training's values, or None."""
    packet = target_name.split("::")[-1].split(".")[0].rstrip("_")
    if packet in VALUE_DEPENDENT:
        return (f"{packet} draws a number of values that depends on its inputs, so a replica (whose other "
                "samples' rows are zeros) draws other values than single-device training")
    return None


@contextlib.contextmanager
def dropout_as_eager() -> Iterator[None]:
    """Dropout that is off (``p = 0``, or not training) is its input while the trace runs, as eager PyTorch
    computes it (ATen's ``dropout`` returns the tensor it was given). Symbolic tracing otherwise takes
    torch's Python decomposition, which returns a copy: a graph with one more tensor per attention layer
    than the model keeps (the softmax output, copied for the product with the values), whose simulated
    memory and time a real step does not have."""
    op = torch.ops.aten.dropout.default
    saved = dict(op.py_kernels)

    def dropout(input: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
        if train and p != 0:
            return torch.ops.aten.native_dropout(input, p, train)[0]
        return input

    for key in (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd):
        if key in saved:
            op.py_kernels[key] = dropout
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.clear()
        op.py_kernels.update(saved)
        op._dispatch_cache.clear()
