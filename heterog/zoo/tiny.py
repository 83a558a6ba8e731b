"""Tiny models without batch-statistics layers (a few thousand parameters) for the tests of the
capture, compiler and runtime: an MLP, a small CNN and a 2-layer causal Transformer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heterog.zoo.common import (
    ImageClassifier,
    InputFactory,
    Inputs,
    check_positive,
    check_spatial,
    conv_out,
    image_inputs,
)
from heterog.zoo.gpt2 import make_causal_lm_builder


class TinyMLP(nn.Module):
    """Linear-ReLU-Linear-ReLU-Linear classifier.

    Shapes: features `(B, in_features)`, labels `(B,)` -> scalar mean CE.
    """

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc2(F.relu(self.fc1(features))))
        return F.cross_entropy(self.fc3(x), labels)


class TinyCNN(ImageClassifier):
    """conv3x3-ReLU -> conv3x3/2-ReLU -> max-pool 2 -> global average -> FC; no batch norm.

    Shapes: images `(B, 3, S, S)` -> logits `(B, num_classes)`.
    """

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.fc = nn.Linear(2 * channels, num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(images))))
        return self.fc(F.max_pool2d(x, 2).mean(dim=(2, 3)))


def build_tiny_mlp(
    batch_size: int, factory: InputFactory, *, in_features: int = 32, hidden: int = 64, num_classes: int = 10
) -> tuple[nn.Module, Inputs]:
    check_positive("tiny_mlp", in_features=in_features, hidden=hidden, num_classes=num_classes)
    model = TinyMLP(in_features, hidden, num_classes)
    return model, (factory.normal(batch_size, in_features), factory.integers(num_classes, batch_size))


def build_tiny_cnn(
    batch_size: int, factory: InputFactory, *, channels: int = 8, image_size: int = 16, num_classes: int = 10
) -> tuple[nn.Module, Inputs]:
    check_positive("tiny_cnn", channels=channels, image_size=image_size, num_classes=num_classes)
    check_spatial("tiny_cnn", conv_out(conv_out(image_size, 3, 2, 1), 2, 2), image_size)
    return TinyCNN(channels, num_classes), image_inputs(factory, batch_size, image_size, num_classes)


build_tiny_transformer = make_causal_lm_builder(
    "tiny_transformer", layers=2, hidden=16, heads=2, vocab=64, seq_len=8, max_positions=8
)
