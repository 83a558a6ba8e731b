"""Shared pieces of the zoo: the model spec record, seeded example-input factory,
the image-classifier base class and small helpers every builder uses."""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heterog.errors import HeterogError

Inputs = tuple[torch.Tensor, ...]
# A builder makes the module (under the caller's device/RNG context) and its example inputs.
Builder = Callable[..., tuple[nn.Module, Any]]


@dataclass(frozen=True)
class ModelSpec:
    """What the registry knows about one zoo model."""

    name: str
    """Registry name, e.g. "resnet50"."""
    description: str
    """One line: architecture and reference."""
    builder: Builder
    """builder(batch_size, factory, **knobs) -> (module, inputs): a tuple, or a dict of keyword inputs."""
    default_batch_size: int
    """Samples per iteration (images, or sequences for NLP models)."""
    batch_size_source: str
    """Where the default batch size comes from ("HeteroG paper" or the reason for the choice)."""
    params: int
    """Exact parameter count of this implementation in its default configuration."""
    published_params: int | None
    """Published parameter count of the reference configuration (None where none is published)."""
    published_source: str
    """Where the published count comes from, and how it relates to `params`."""
    inputs: tuple[tuple[str, str], ...]
    """(name, shape) of each example input, in call order; B is the batch."""
    small_overrides: dict = field(default_factory=dict)
    """Overrides that shrink the model for fast real forward passes in tests (same code paths)."""
    notes: str = ""
    """Deviations from the reference, loss definition, tracing remarks."""

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "default_batch_size": self.default_batch_size,
            "batch_size_source": self.batch_size_source,
            "params": self.params,
            "published_params": self.published_params,
            "published_source": self.published_source,
            "inputs": [{"name": n, "shape": s} for n, s in self.inputs],
            "small_overrides": dict(self.small_overrides),
            "notes": self.notes,
        }


class InputFactory:
    """Makes deterministic random example inputs, or shape-only ones on the meta device.

    Real inputs are drawn on the CPU from a generator seeded with `seed`, so two builds with
    the same seed get identical inputs; `build` moves them to the requested device afterwards.
    """

    def __init__(self, *, meta: bool, seed: int) -> None:
        self.meta = meta
        self.device = torch.device("meta") if meta else torch.device("cpu")
        self.generator = None if meta else torch.Generator().manual_seed(seed)

    def normal(self, *shape: int) -> torch.Tensor:
        """Standard-normal float32 tensor (images, features)."""
        if self.meta:
            return torch.empty(shape, device=self.device)
        return torch.randn(shape, generator=self.generator)

    def uniform(self, *shape: int) -> torch.Tensor:
        """Uniform [0, 1) float32 tensor (random permutations are argsorts of these)."""
        if self.meta:
            return torch.empty(shape, device=self.device)
        return torch.rand(shape, generator=self.generator)

    def integers(self, high: int, *shape: int) -> torch.Tensor:
        """int64 tensor with values in [0, high) (labels, token ids)."""
        if self.meta:
            return torch.empty(shape, dtype=torch.long, device=self.device)
        return torch.randint(0, high, shape, generator=self.generator)


def check_positive(model: str, **values: int) -> None:
    """Reject a non-positive size knob early, naming the model and the knob."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HeterogError(f"zoo model '{model}': {key} must be a positive integer, got {value!r}")


def dropout(p: float) -> nn.Module:
    """nn.Dropout(p), or Identity for p == 0 so the captured graph has no random ops."""
    if not 0.0 <= p < 1.0:
        raise HeterogError(f"dropout probability must be in [0, 1), got {p}")
    return nn.Dropout(p) if p > 0.0 else nn.Identity()


def count_parameters(module: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in module.parameters())


class ImageClassifier(nn.Module, abc.ABC):
    """Base of the CNNs: `logits(images)` is the network, `forward` the training loss.

    Shapes:
        images `(B, 3, H, W)`, labels `(B,)` int64 in [0, num_classes) -> scalar mean loss.
    """

    @abc.abstractmethod
    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores `(B, num_classes)` of images `(B, 3, H, W)`."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(images), labels)


def image_inputs(factory: InputFactory, batch_size: int, image_size: int, num_classes: int) -> Inputs:
    """(images (B, 3, S, S), labels (B,)) for an image classifier."""
    return factory.normal(batch_size, 3, image_size, image_size), factory.integers(num_classes, batch_size)


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial size after a convolution or pooling (floor mode)."""
    return (size + 2 * padding - kernel) // stride + 1


def check_spatial(model: str, size: int, image_size: int) -> None:
    """Reject an image too small for the network's downsampling."""
    if size < 1:
        raise HeterogError(f"zoo model '{model}': image_size {image_size} is too small for this network")
