"""Inception-v3 (Szegedy et al. 2016) in the torchvision layout: factorised 5x5 / 7x7 / 3x3
Inception-A..E modules, BN-ReLU convolutions and the auxiliary classifier on the 17x17 map."""
from __future__ import annotations

from typing import TypeAlias, TypedDict

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
    dropout,
    image_inputs,
)

AUX_WEIGHT = 0.4  # weight of the auxiliary classifier's loss (Szegedy et al.; torchvision's recipe)

_Size: TypeAlias = int | tuple[int, int]


class _Factorised(TypedDict):
    """Kernel and padding of one half of a factorised n x n convolution (1 x n or n x 1)."""

    kernel: tuple[int, int]
    padding: tuple[int, int]


class ConvBN(nn.Module):
    """Conv (no bias) -> BatchNorm(eps=1e-3) -> ReLU. Shapes: `(B, cin, H, W)` -> `(B, cout, H', W')`."""

    def __init__(self, cin: int, cout: int, kernel: _Size, stride: int = 1, padding: _Size = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class Scaled:
    """Channel widths scaled by one multiplier (1.0 = the published network)."""

    def __init__(self, width: float) -> None:
        self.width = width

    def __call__(self, channels: int) -> int:
        return max(1, round(channels * self.width))


def chain(*convs: nn.Module) -> nn.Sequential:
    return nn.Sequential(*convs)


class InceptionA(nn.Module):
    """35x35 module: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, cin: int, pool_features: int, c: Scaled) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c(64), 1)
        self.b5 = chain(ConvBN(cin, c(48), 1), ConvBN(c(48), c(64), 5, padding=2))
        self.b3 = chain(
            ConvBN(cin, c(64), 1), ConvBN(c(64), c(96), 3, padding=1), ConvBN(c(96), c(96), 3, padding=1)
        )
        self.pool = ConvBN(cin, c(pool_features), 1)
        self.out_channels = c(64) + c(64) + c(96) + c(pool_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), pooled], dim=1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 reduction: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c: Scaled) -> None:
        super().__init__()
        self.b3 = ConvBN(cin, c(384), 3, stride=2)
        self.b3dbl = chain(
            ConvBN(cin, c(64), 1), ConvBN(c(64), c(96), 3, padding=1), ConvBN(c(96), c(96), 3, stride=2)
        )
        self.out_channels = c(384) + c(96) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b3dbl(x), F.max_pool2d(x, 3, stride=2)], dim=1)


class InceptionC(nn.Module):
    """17x17 module with factorised 7x7: 1x1 | 1x1-1x7-7x1 | 1x1-7x1-1x7-7x1-1x7 | avgpool-1x1."""

    def __init__(self, cin: int, c7: int, c: Scaled) -> None:
        super().__init__()
        c7 = c(c7)
        row: _Factorised = {"kernel": (1, 7), "padding": (0, 3)}
        col: _Factorised = {"kernel": (7, 1), "padding": (3, 0)}
        self.b1 = ConvBN(cin, c(192), 1)
        self.b7 = chain(ConvBN(cin, c7, 1), ConvBN(c7, c7, **row), ConvBN(c7, c(192), **col))
        self.b7dbl = chain(
            ConvBN(cin, c7, 1), ConvBN(c7, c7, **col), ConvBN(c7, c7, **row), ConvBN(c7, c7, **col),
            ConvBN(c7, c(192), **row),
        )
        self.pool = ConvBN(cin, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b7(x), self.b7dbl(x), pooled], dim=1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 reduction: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c: Scaled) -> None:
        super().__init__()
        self.b3 = chain(ConvBN(cin, c(192), 1), ConvBN(c(192), c(320), 3, stride=2))
        self.b7 = chain(
            ConvBN(cin, c(192), 1), ConvBN(c(192), c(192), (1, 7), padding=(0, 3)),
            ConvBN(c(192), c(192), (7, 1), padding=(3, 0)), ConvBN(c(192), c(192), 3, stride=2),
        )
        self.out_channels = c(320) + c(192) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, stride=2)], dim=1)


class InceptionE(nn.Module):
    """8x8 module with expanded filter banks: 1x1 | 1x1-(1x3,3x1) | 1x1-3x3-(1x3,3x1) | avgpool-1x1."""

    def __init__(self, cin: int, c: Scaled) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c(320), 1)
        self.b3_in = ConvBN(cin, c(384), 1)
        self.b3_a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.b3_b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.b3dbl_in = chain(ConvBN(cin, c(448), 1), ConvBN(c(448), c(384), 3, padding=1))
        self.b3dbl_a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.b3dbl_b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.pool = ConvBN(cin, c(192), 1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.b3_in(x)
        b3dbl = self.b3dbl_in(x)
        pooled = self.pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        parts = [self.b1(x), self.b3_a(b3), self.b3_b(b3), self.b3dbl_a(b3dbl), self.b3dbl_b(b3dbl), pooled]
        return torch.cat(parts, dim=1)


class InceptionAux(nn.Module):
    """Auxiliary classifier on the 17x17 map: avgpool 5/3 -> 1x1 -> 5x5 -> global pool -> FC.

    Shapes: `(B, cin, 17, 17)` -> `(B, num_classes)`.
    """

    def __init__(self, cin: int, num_classes: int, c: Scaled) -> None:
        super().__init__()
        self.conv0 = ConvBN(cin, c(128), 1)
        self.conv1 = ConvBN(c(128), c(768), 5)
        self.fc = nn.Linear(c(768), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(self.conv0(F.avg_pool2d(x, 5, stride=3)))
        return self.fc(x.mean(dim=(2, 3)))


class InceptionV3(ImageClassifier):
    """Inception-v3 whose training loss is CE(main) + 0.4 * CE(aux) when aux_logits is on.

    Args:
        width: multiplier on every convolution's channels (1.0 = the published network).
        aux_logits: include the auxiliary classifier (torchvision's default for training).
        image_size: input size (299; at least 75, and about 299 for the auxiliary head's 5x5 conv).
        num_classes: classifier outputs; dropout_p: before the final FC (paper 0.5, default 0).

    Shapes:
        images `(B, 3, S, S)`, labels `(B,)` -> scalar loss.
    """

    def __init__(
        self,
        *,
        width: float = 1.0,
        aux_logits: bool = True,
        image_size: int = 299,
        num_classes: int = 1000,
        dropout_p: float = 0.0,
    ) -> None:
        super().__init__()
        c = Scaled(width)
        self.stem = chain(
            ConvBN(3, c(32), 3, stride=2), ConvBN(c(32), c(32), 3), ConvBN(c(32), c(64), 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(c(64), c(80), 1), ConvBN(c(80), c(192), 3),
            nn.MaxPool2d(3, stride=2),
        )
        size = conv_out(conv_out(conv_out(conv_out(image_size, 3, 2), 3), 3, 2), 3)
        size = conv_out(size, 3, 2)  # 35 for a 299 image
        blocks_35 = []
        cin = c(192)
        for pool_features in (32, 64, 64):
            blocks_35.append(InceptionA(cin, pool_features, c))
            cin = blocks_35[-1].out_channels
        reduce_17 = InceptionB(cin, c)
        cin = reduce_17.out_channels
        size = conv_out(size, 3, 2)  # 17
        blocks_17 = []
        for c7 in (128, 160, 160, 192):
            blocks_17.append(InceptionC(cin, c7, c))
            cin = blocks_17[-1].out_channels
        self.mixed_35 = nn.Sequential(*blocks_35)
        self.mixed_17 = nn.Sequential(reduce_17, *blocks_17)
        aux_size = conv_out(conv_out(size, 5, 3), 5)
        if aux_logits:
            check_spatial("inception_v3 (auxiliary head; pass aux_logits=False)", aux_size, image_size)
        self.aux = InceptionAux(cin, num_classes, c) if aux_logits else None
        reduce_8 = InceptionD(cin, c)
        cin = reduce_8.out_channels
        size = conv_out(size, 3, 2)  # 8
        check_spatial("inception_v3", size, image_size)
        mixed_8a = InceptionE(cin, c)
        mixed_8b = InceptionE(mixed_8a.out_channels, c)
        self.mixed_8 = nn.Sequential(reduce_8, mixed_8a, mixed_8b)
        self.drop = dropout(dropout_p)
        self.fc = nn.Linear(mixed_8b.out_channels, num_classes)

    def features_17(self, images: torch.Tensor) -> torch.Tensor:
        return self.mixed_17(self.mixed_35(self.stem(images)))

    def head(self, x17: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.mixed_8(x17).mean(dim=(2, 3))))

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features_17(images))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x17 = self.features_17(images)
        loss = F.cross_entropy(self.head(x17), labels)
        if self.aux is not None:
            loss = loss + AUX_WEIGHT * F.cross_entropy(self.aux(x17), labels)
        return loss


def build_inception_v3(
    batch_size: int,
    factory: InputFactory,
    *,
    width: float = 1.0,
    aux_logits: bool = True,
    image_size: int = 299,
    num_classes: int = 1000,
    dropout: float = 0.0,
) -> tuple[nn.Module, Inputs]:
    check_positive("inception_v3", image_size=image_size, num_classes=num_classes)
    model = InceptionV3(
        width=width, aux_logits=aux_logits, image_size=image_size, num_classes=num_classes, dropout_p=dropout
    )
    return model, image_inputs(factory, batch_size, image_size, num_classes)
