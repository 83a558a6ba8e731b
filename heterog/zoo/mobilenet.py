"""MobileNetV2 (Sandler et al. 2018) in the torchvision layout: inverted residual blocks with
linear bottlenecks, depthwise 3x3 convolutions and ReLU6, width multiplier 1.0 by default."""
from __future__ import annotations

import torch
from torch import nn

from heterog.zoo.common import (
    ImageClassifier,
    InputFactory,
    Inputs,
    check_positive,
    check_spatial,
    conv_out,
    dropout,
    image_inputs,
)

# (expansion t, output channels c, repeats n, first stride s) of each stage, Table 2 of the paper.
MOBILENET_V2_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1))


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of `divisor`, never more than 10% down (torchvision)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """1x1 expand (if t > 1) -> 3x3 depthwise(stride) -> 1x1 linear projection; residual add when
    the stride is 1 and the channels match.

    Shapes: `(B, cin, H, W)` -> `(B, cout, H/stride, W/stride)`.
    """

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = round(cin * expansion)
        layers: list[nn.Module] = [conv_bn_relu6(cin, hidden, 1)] if expansion != 1 else []
        layers += [
            conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.block = nn.Sequential(*layers)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.use_residual else out

    def extra_repr(self) -> str:
        return f"residual={self.use_residual}"


class MobileNetV2(ImageClassifier):
    """MobileNetV2.

    Args:
        width: the paper's width multiplier (1.0).
        image_size, num_classes: input size and classifier outputs.
        dropout_p: before the classifier (published 0.2; default 0 keeps steps deterministic).

    Shapes:
        images `(B, 3, S, S)` -> logits `(B, num_classes)`.
    """

    def __init__(
        self, *, width: float = 1.0, image_size: int = 224, num_classes: int = 1000, dropout_p: float = 0.0
    ) -> None:
        super().__init__()
        cin = make_divisible(32 * width)
        last = make_divisible(1280 * max(1.0, width))
        layers: list[nn.Module] = [conv_bn_relu6(3, cin, 3, 2)]
        size = conv_out(image_size, 3, 2, 1)
        for t, c, n, s in MOBILENET_V2_STAGES:
            cout = make_divisible(c * width)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
            size = conv_out(size, 3, s, 1)
        check_spatial("mobilenet_v2", size, image_size)
        layers.append(conv_bn_relu6(cin, last, 1))
        self.features = nn.Sequential(*layers)
        self.drop = dropout(dropout_p)
        self.classifier = nn.Linear(last, num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.drop(self.features(images).mean(dim=(2, 3))))


def build_mobilenet_v2(
    batch_size: int,
    factory: InputFactory,
    *,
    width: float = 1.0,
    image_size: int = 224,
    num_classes: int = 1000,
    dropout: float = 0.0,
) -> tuple[nn.Module, Inputs]:
    check_positive("mobilenet_v2", image_size=image_size, num_classes=num_classes)
    model = MobileNetV2(width=width, image_size=image_size, num_classes=num_classes, dropout_p=dropout)
    return model, image_inputs(factory, batch_size, image_size, num_classes)
