"""Bottleneck ResNets: post-activation v1.5 (He et al. 2015, torchvision layout, stride on the 3x3)
for resnet50/101 and pre-activation v2 (He et al. 2016, "Identity Mappings") for resnet200."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heterog.errors import HeterogError
from heterog.zoo.common import (
    Builder,
    ImageClassifier,
    InputFactory,
    Inputs,
    check_positive,
    check_spatial,
    conv_out,
    image_inputs,
)

EXPANSION = 4


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)
    )


class Bottleneck(nn.Module):
    """Post-activation bottleneck (v1.5): 1x1 -> 3x3(stride) -> 1x1, BN after each, ReLU after the add.

    Shapes: `(B, cin, H, W)` -> `(B, 4*mid, H/stride, W/stride)`.
    """

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * EXPANSION
        self.conv1 = conv_bn(cin, mid, 1)
        self.conv2 = conv_bn(mid, mid, 3, stride)
        self.conv3 = conv_bn(mid, cout, 1)
        self.shortcut = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x))
        out = F.relu(self.conv2(out))
        return F.relu(self.conv3(out) + self.shortcut(x))


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck (v2): BN-ReLU before each convolution; a projection shortcut
    (1x1 conv, no BN) takes the pre-activated input, an identity shortcut the raw input.

    Shapes: `(B, cin, H, W)` -> `(B, 4*mid, H/stride, W/stride)`.
    """

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * EXPANSION
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.projection = (
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if stride != 1 or cin != cout else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(x))
        shortcut = x if self.projection is None else self.projection(pre)
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return out + shortcut


class ResNet(ImageClassifier):
    """ImageNet ResNet with bottleneck blocks.

    Args:
        layers: blocks per stage, e.g. (3, 4, 6, 3) for ResNet-50.
        preact: v2 pre-activation blocks (stem conv without BN; final BN-ReLU) instead of v1.5.
        width: channels of the stem and of the first stage's bottleneck (64).
        image_size, num_classes: input size and classifier outputs.

    Shapes:
        images `(B, 3, S, S)` -> logits `(B, num_classes)`.
    """

    def __init__(
        self,
        layers: tuple[int, ...],
        *,
        preact: bool = False,
        width: int = 64,
        image_size: int = 224,
        num_classes: int = 1000,
        name: str = "resnet",
    ) -> None:
        super().__init__()
        self.preact = preact
        self.stem: nn.Module
        if preact:
            self.stem = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        else:
            self.stem = nn.Sequential(conv_bn(3, width, 7, 2), nn.ReLU())
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        size = conv_out(conv_out(image_size, 7, 2, 3), 3, 2, 1)
        block = PreActBottleneck if preact else Bottleneck
        stages: list[nn.Module] = []
        cin = width
        for index, count in enumerate(layers):
            mid = width * 2**index
            stride = 1 if index == 0 else 2
            blocks = []
            for b in range(count):
                blocks.append(block(cin, mid, stride if b == 0 else 1))
                cin = mid * EXPANSION
            stages.append(nn.Sequential(*blocks))
            size = conv_out(size, 3, stride, 1)
        check_spatial(name, size, image_size)
        self.stages = nn.Sequential(*stages)
        self.final_norm = nn.BatchNorm2d(cin) if preact else None
        self.fc = nn.Linear(cin, num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.pool(self.stem(images)))
        if self.final_norm is not None:
            x = F.relu(self.final_norm(x))
        return self.fc(x.mean(dim=(2, 3)))

    def extra_repr(self) -> str:
        return f"preact={self.preact}"


def make_resnet_builder(name: str, default_layers: tuple[int, ...], default_preact: bool) -> Builder:
    """Builder for one depth; the knobs are shared by all three ResNets."""

    def build(
        batch_size: int,
        factory: InputFactory,
        *,
        layers: tuple[int, ...] = default_layers,
        preact: bool = default_preact,
        width: int = 64,
        image_size: int = 224,
        num_classes: int = 1000,
    ) -> tuple[nn.Module, Inputs]:
        layers = tuple(layers)
        if not layers or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in layers):
            raise HeterogError(f"zoo model '{name}': layers must be positive block counts, got {layers!r}")
        check_positive(name, width=width, image_size=image_size, num_classes=num_classes)
        model = ResNet(
            layers, preact=preact, width=width, image_size=image_size, num_classes=num_classes, name=name
        )
        return model, image_inputs(factory, batch_size, image_size, num_classes)

    build.__name__ = f"build_{name}"
    return build


build_resnet50 = make_resnet_builder("resnet50", (3, 4, 6, 3), False)
build_resnet101 = make_resnet_builder("resnet101", (3, 4, 23, 3), False)
build_resnet200 = make_resnet_builder("resnet200", (3, 24, 36, 3), True)
