"""VGG-19 (Simonyan & Zisserman 2015, configuration E): 16 3x3 convolutions with biases and ReLU,
five max-pools, and three fully connected layers; no batch normalisation."""
from __future__ import annotations

import torch
from torch import nn

from heterog.zoo.common import (
    ImageClassifier,
    InputFactory,
    Inputs,
    check_positive,
    check_spatial,
    dropout,
    image_inputs,
)

# Channels of each 3x3 convolution; "M" is a 2x2 max-pool with stride 2.
VGG19_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
                512, 512, 512, 512, "M")


class VGG(ImageClassifier):
    """VGG with a flattening classifier (no adaptive pooling: the 7x7 map of a 224 image is
    flattened directly, as in the paper).

    Args:
        width: multiplier on every convolution's channels (1.0 = the paper).
        hidden: width of the two hidden fully connected layers (4096).
        image_size: input height = width; num_classes: classifier outputs.
        dropout_p: dropout before the hidden FC layers (paper 0.5; default 0 keeps steps deterministic).

    Shapes:
        images `(B, 3, S, S)` -> logits `(B, num_classes)`.
    """

    def __init__(
        self,
        *,
        width: float = 1.0,
        hidden: int = 4096,
        image_size: int = 224,
        num_classes: int = 1000,
        dropout_p: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels, size = 3, image_size
        for item in VGG19_LAYOUT:
            if isinstance(item, str):      # "M"
                layers.append(nn.MaxPool2d(2, 2))
                size //= 2
            else:
                out = max(1, round(item * width))
                layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
                channels = out
        check_spatial("vgg19", size, image_size)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(channels * size * size, hidden), nn.ReLU(), dropout(dropout_p),
            nn.Linear(hidden, hidden), nn.ReLU(), dropout(dropout_p),
            nn.Linear(hidden, num_classes),
        )

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def build_vgg19(
    batch_size: int,
    factory: InputFactory,
    *,
    width: float = 1.0,
    hidden: int = 4096,
    image_size: int = 224,
    num_classes: int = 1000,
    dropout: float = 0.0,
) -> tuple[nn.Module, Inputs]:
    check_positive("vgg19", hidden=hidden, image_size=image_size, num_classes=num_classes)
    model = VGG(width=width, hidden=hidden, image_size=image_size, num_classes=num_classes, dropout_p=dropout)
    return model, image_inputs(factory, batch_size, image_size, num_classes)
