"""A model's example inputs as users write them (a tensor, a tuple of tensors, or a dict of keyword arguments
as Hugging Face models are called) and as the capture and the runtime take them: a flat tuple of tensors.

Positional inputs all carry the batch on dimension 0. Among keyword inputs, the batch size is dimension 0
of the first tensor; a tensor with that many entries on dimension 0 carries the batch, any other tensor
(a position-id row shared by all samples, a scalar) is passed whole to every replica and named in the
capture's report, and a value that is not a tensor (``use_cache=False``) is a constant of the trace.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from heterog.errors import ModelError

# a tensor, a sequence of tensors (positional arguments) or a dict of keyword arguments
ExampleInputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any]


@dataclass(frozen=True)
class InputSpec:
    """How a model is called on its inputs: the keyword of each tensor in flat order (None: positional),
    whether it carries the batch on dim 0, and the keyword constants."""

    keywords: tuple[str | None, ...]
    batched: tuple[bool, ...]
    shapes: tuple[tuple[int, ...], ...]
    constants: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(s[0] for s, b in zip(self.shapes, self.batched) if b)

    @property
    def unbatched(self) -> list[str]:
        """The inputs without the batch, as ``name (shape)`` (the capture's report)."""
        return [f"{self.name(i)} {tuple(s)}" for i, (s, b) in enumerate(zip(self.shapes, self.batched)) if not b]

    def name(self, i: int) -> str:
        keyword = self.keywords[i]
        return keyword if keyword is not None else f"input {i}"

    def call_args(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(positional arguments, keyword arguments) of the model call on ``tensors`` (flat order)."""
        args = tuple(t for k, t in zip(self.keywords, tensors) if k is None)
        kwargs = {k: t for k, t in zip(self.keywords, tensors) if k is not None}
        return args, {**kwargs, **self.constants}

    def flatten(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """The tensors of ``inputs`` (of the same form as the example's) in flat order."""
        if isinstance(inputs, Mapping):
            missing = [k for k in self.keywords if k is not None and k not in inputs]
            if missing or any(k is None for k in self.keywords):
                raise ModelError(f"inputs are keyword arguments {sorted(inputs)}, the model was captured with "
                                 f"{[self.name(i) for i in range(len(self.keywords))]}")
            return tuple(inputs[k] for k in self.keywords)
        tensors = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        if len(tensors) != len(self.keywords) or any(k is not None for k in self.keywords):
            raise ModelError(f"inputs are {len(tensors)} positional tensors, the model was captured with "
                             f"{[self.name(i) for i in range(len(self.keywords))]}")
        return tensors

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """``tensors`` (flat order) in the form of the example inputs (a tuple, or a dict with the constants)."""
        if all(k is None for k in self.keywords):
            return tuple(tensors)
        return {**{k: t for k, t in zip(self.keywords, tensors)}, **self.constants}

    def first_samples(self, tensors: Sequence[torch.Tensor], n: int) -> tuple[torch.Tensor, ...]:
        """The first ``n`` samples: batch inputs cut to ``n`` rows, the others whole."""
        return tuple(t[:n] if b else t for t, b in zip(tensors, self.batched))


def input_spec(example_inputs: Any) -> InputSpec:
    """The InputSpec of a model's example inputs (a tensor, a tuple or list of tensors, or a dict of keyword
    arguments); a ModelError names what breaks the model contract."""
    if isinstance(example_inputs, Mapping):
        return _keyword_spec(example_inputs)
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not inputs:
        raise ModelError("model has no example inputs; build() must return (module, inputs) with the batch "
                         "on dimension 0 of every input")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise ModelError(f"example input {i} is a {type(x).__name__}, not a tensor")
        if x.dim() == 0:
            raise ModelError(f"example input {i} is a scalar; every input must have the batch on dimension 0")
    sizes = [int(x.shape[0]) for x in inputs]
    if len(set(sizes)) != 1:
        raise ModelError(f"example inputs disagree on the batch size (dimension 0): {sizes}")
    if sizes[0] <= 0:
        raise ModelError(f"example inputs have batch size {sizes[0]}")
    return InputSpec((None,) * len(inputs), (True,) * len(inputs), tuple(tuple(x.shape) for x in inputs))


def _keyword_spec(example_inputs: Mapping[str, Any]) -> InputSpec:
    bad = [k for k in example_inputs if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ModelError(f"keyword inputs must be named by identifiers, got {bad}")
    tensors = {k: v for k, v in example_inputs.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in example_inputs.items() if not isinstance(v, torch.Tensor)}
    first = next((t for t in tensors.values() if t.dim() > 0), None)
    if first is None:
        raise ModelError(f"keyword inputs {sorted(example_inputs)} hold no tensor with a batch dimension")
    batch = int(first.shape[0])
    if batch <= 0:
        raise ModelError(f"example inputs have batch size {batch}")
    batched = tuple(t.dim() > 0 and int(t.shape[0]) == batch for t in tensors.values())
    return InputSpec(tuple(tensors), batched, tuple(tuple(t.shape) for t in tensors.values()), constants)
