"""NASNet-A (Zoph et al. 2018) with its normal and reduction cells (separable-conv, pooling and
identity branches) in the Keras/TF-slim layout; Large (6 @ 4032, 331 px) by default, or Mobile."""
from __future__ import annotations

from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from heterog.errors import HeterogError
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

BN_EPS = 1e-3
BN_MOMENTUM = 0.0003  # Keras momentum 0.9997 in torch's convention

# The two published variants: N cells per stack @ penultimate filters, stem filters,
# whether the cell after a reduction keeps the pre-reduction "previous" input, image size.
class Variant(TypedDict):
    """The defaults of one NASNet-A variant (the knobs of the same names)."""

    num_blocks: int
    penultimate_filters: int
    stem_filters: int
    skip_reduction: bool
    image_size: int


VARIANTS: dict[str, Variant] = {
    "large": {"num_blocks": 6, "penultimate_filters": 4032, "stem_filters": 96, "skip_reduction": True,
              "image_size": 331},
    "mobile": {"num_blocks": 4, "penultimate_filters": 1056, "stem_filters": 32, "skip_reduction": False,
               "image_size": 224},
}


def batch_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


def same_pad(size: int, kernel: int, stride: int) -> tuple[int, int, int, int]:
    """F.pad amounts (left, right, top, bottom) of Keras "same" for a square map.

    Stride 1: symmetric kernel // 2. Stride 2: Keras' correct_pad, one less on the top/left for
    an even size, so the output is ceil(size / 2).
    """
    if stride == 1:
        return (kernel // 2,) * 4
    before = kernel // 2 - 1 + size % 2
    return (before, kernel // 2, before, kernel // 2)


class SeparableConv(nn.Module):
    """Depthwise k x k (stride) followed by pointwise 1x1, no biases (Keras SeparableConv2D).

    Shapes: `(B, cin, S, S)` -> `(B, cout, S', S')`.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, size: int) -> None:
        super().__init__()
        self.pad = same_pad(size, kernel, stride)
        self.depthwise = nn.Conv2d(cin, cin, kernel, stride=stride, groups=cin, bias=False)
        self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(F.pad(x, self.pad)))

    def extra_repr(self) -> str:
        return f"pad={self.pad}"


class SeparableBlock(nn.Module):
    """ReLU -> SepConv(stride) -> BN -> ReLU -> SepConv -> BN, the NASNet "sep k x k" operation.

    Shapes: `(B, cin, S, S)` -> `(B, cout, S / stride, S / stride)` (ceil).
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, size: int) -> None:
        super().__init__()
        self.sep1 = SeparableConv(cin, cout, kernel, stride, size)
        self.bn1 = batch_norm(cout)
        self.sep2 = SeparableConv(cout, cout, kernel, 1, -(-size // stride))
        self.bn2 = batch_norm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn1(self.sep1(F.relu(x)))
        return self.bn2(self.sep2(F.relu(x)))


class FactorizedReduction(nn.Module):
    """Halve the previous input's map to match the current one: ReLU, then two 1x1 stride-2 paths
    (the second shifted by one pixel), concatenated and batch-normalised (Keras _adjust_block).

    Shapes: `(B, cin, S, S)` -> `(B, 2 * (cout // 2), ceil(S/2), ceil(S/2))`.
    """

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.path1 = nn.Conv2d(cin, cout // 2, 1, bias=False)
        self.path2 = nn.Conv2d(cin, cout // 2, 1, bias=False)
        self.bn = batch_norm(2 * (cout // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        p1 = self.path1(F.avg_pool2d(x, 1, stride=2))
        p2 = self.path2(F.avg_pool2d(shifted, 1, stride=2))
        return self.bn(torch.cat([p1, p2], dim=1))


def relu_conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, 1, bias=False), batch_norm(cout))


def adjust_previous(
    prev: tuple[int, int] | None, cin: int, size: int, filters: int
) -> tuple[nn.Module, int]:
    """The module that brings the previous cell's output (channels, size) to `filters` channels at
    the current map size, and the channels it yields. `prev` None (the first stem cell) means the
    cell's own input of `cin` channels serves as its previous input, unchanged (as in Keras)."""
    if prev is None:
        return nn.Identity(), cin
    channels, prev_size = prev
    if prev_size != size:
        return FactorizedReduction(channels, filters), 2 * (filters // 2)
    if channels != filters:
        return relu_conv_bn(channels, filters), filters
    return nn.Identity(), channels


def avg_pool_same(x: torch.Tensor) -> torch.Tensor:
    """3x3 stride-1 average pool, "same" padding not counted (Keras AveragePooling2D)."""
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class NormalCell(nn.Module):
    """NASNet-A normal cell (Fig. 4 left): five pairwise-combined branches over the current input h
    (after a 1x1) and the previous input p; output concat[p, x1..x5] = 6 * filters channels.

    Shapes: x `(B, cx, S, S)`, p `(B, cp, S_p, S_p)` -> `(B, 6 * filters, S, S)`.
    """

    def __init__(self, cin: int, size: int, prev: tuple[int, int] | None, filters: int) -> None:
        super().__init__()
        self.adjust, cp = adjust_previous(prev, cin, size, filters)
        self.squeeze = relu_conv_bn(cin, filters)
        self.left1 = SeparableBlock(filters, filters, 5, 1, size)
        self.right1 = SeparableBlock(cp, filters, 3, 1, size)
        self.left2 = SeparableBlock(cp, filters, 5, 1, size)
        self.right2 = SeparableBlock(cp, filters, 3, 1, size)
        self.left5 = SeparableBlock(filters, filters, 3, 1, size)
        self.out_channels = cp + 5 * filters
        self.out_size = size

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        p = self.adjust(prev)
        h = self.squeeze(x)
        x1 = self.left1(h) + self.right1(p)
        x2 = self.left2(p) + self.right2(p)
        x3 = avg_pool_same(h) + p
        x4 = avg_pool_same(p) + avg_pool_same(p)
        x5 = self.left5(h) + h
        return torch.cat([p, x1, x2, x3, x4, x5], dim=1)


class ReductionCell(nn.Module):
    """NASNet-A reduction cell (Fig. 4 right): stride-2 separable 5x5/7x7 and max/avg pools,
    output concat[x2, x3, x4, x5] = 4 * filters channels at half the map size.

    Shapes: x `(B, cx, S, S)`, p `(B, cp, S_p, S_p)` -> `(B, 4 * filters, ceil(S/2), ceil(S/2))`.
    """

    def __init__(self, cin: int, size: int, prev: tuple[int, int] | None, filters: int) -> None:
        super().__init__()
        self.adjust, cp = adjust_previous(prev, cin, size, filters)
        half = -(-size // 2)
        self.squeeze = relu_conv_bn(cin, filters)
        self.pool_pad = same_pad(size, 3, 2)
        self.left1 = SeparableBlock(filters, filters, 5, 2, size)
        self.right1 = SeparableBlock(cp, filters, 7, 2, size)
        self.right2 = SeparableBlock(cp, filters, 7, 2, size)
        self.right3 = SeparableBlock(cp, filters, 5, 2, size)
        self.left5 = SeparableBlock(filters, filters, 3, 1, half)
        self.out_channels = 4 * filters
        self.out_size = half

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        p = self.adjust(prev)
        h = self.squeeze(x)
        h3 = F.pad(h, self.pool_pad)
        x1 = self.left1(h) + self.right1(p)
        x2 = F.max_pool2d(h3, 3, stride=2) + self.right2(p)
        x3 = F.avg_pool2d(h3, 3, stride=2) + self.right3(p)
        x4 = avg_pool_same(x1) + x2
        x5 = self.left5(x1) + F.max_pool2d(h3, 3, stride=2)
        return torch.cat([x2, x3, x4, x5], dim=1)


class NASNetA(ImageClassifier):
    """NASNet-A (N @ P): stem conv, two stem reduction cells, then three stacks of N normal cells
    separated by reduction cells; ReLU, global average pool and FC.

    Args:
        num_blocks: N normal cells per stack; penultimate_filters: P (channels before the pool).
        stem_filters: channels of the stem convolution.
        skip_reduction: the first cell after a reduction takes the pre-reduction cell input as its
            "previous" input (Large) instead of the reduction cell's input (Mobile).
        filter_multiplier: channel growth per reduction (2).
        image_size, num_classes: input size and classifier outputs; dropout_p: before the FC.

    Shapes:
        images `(B, 3, S, S)` -> logits `(B, num_classes)`.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        penultimate_filters: int,
        stem_filters: int,
        skip_reduction: bool,
        filter_multiplier: int = 2,
        image_size: int = 331,
        num_classes: int = 1000,
        dropout_p: float = 0.0,
    ) -> None:
        super().__init__()
        m = filter_multiplier
        if penultimate_filters % (24 * m * m):
            raise HeterogError(
                f"zoo model 'nasnet': penultimate_filters {penultimate_filters} must be a multiple of "
                f"24 * filter_multiplier**2 = {24 * m * m}"
            )
        filters = penultimate_filters // 24
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem_filters, 3, stride=2, bias=False), batch_norm(stem_filters)
        )
        x_shape = (stem_filters, conv_out(image_size, 3, 2))
        check_spatial("nasnet", x_shape[1], image_size)
        prev_shape: tuple[int, int] | None = None
        cells: list[nn.Module] = []
        keep_prev: list[bool] = []

        def add(cell_type: type[NormalCell | ReductionCell], cell_filters: int, keep: bool) -> None:
            nonlocal x_shape, prev_shape
            cell = cell_type(x_shape[0], x_shape[1], prev_shape, cell_filters)
            cells.append(cell)
            keep_prev.append(keep)
            prev_shape = prev_shape if keep else x_shape
            x_shape = (cell.out_channels, cell.out_size)

        add(ReductionCell, filters // (m * m), False)
        add(ReductionCell, filters // m, False)
        for stack in range(3):
            if stack > 0:
                add(ReductionCell, filters * m**stack, skip_reduction)
            for _ in range(num_blocks):
                add(NormalCell, filters * m**stack, False)
        check_spatial("nasnet", x_shape[1], image_size)
        self.cells = nn.ModuleList(cells)
        self.keep_prev = tuple(keep_prev)
        self.drop = dropout(dropout_p)
        self.fc = nn.Linear(x_shape[0], num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        prev = x
        for cell, keep in zip(self.cells, self.keep_prev):
            x, prev = cell(x, prev), (prev if keep else x)
        return self.fc(self.drop(F.relu(x).mean(dim=(2, 3))))


def build_nasnet(
    batch_size: int,
    factory: InputFactory,
    *,
    variant: str = "large",
    num_blocks: int | None = None,
    penultimate_filters: int | None = None,
    stem_filters: int | None = None,
    skip_reduction: bool | None = None,
    image_size: int | None = None,
    num_classes: int = 1000,
    dropout: float = 0.0,
) -> tuple[nn.Module, Inputs]:
    if variant not in VARIANTS:
        raise HeterogError(f"zoo model 'nasnet': unknown variant '{variant}'; known: {', '.join(VARIANTS)}")
    defaults = VARIANTS[variant]           # a knob left at None takes the variant's value
    num_blocks = defaults["num_blocks"] if num_blocks is None else num_blocks
    penultimate_filters = defaults["penultimate_filters"] if penultimate_filters is None else penultimate_filters
    stem_filters = defaults["stem_filters"] if stem_filters is None else stem_filters
    skip_reduction = defaults["skip_reduction"] if skip_reduction is None else skip_reduction
    image_size = defaults["image_size"] if image_size is None else image_size
    check_positive("nasnet", num_blocks=num_blocks, penultimate_filters=penultimate_filters,
                   stem_filters=stem_filters, image_size=image_size, num_classes=num_classes)
    model = NASNetA(num_blocks=num_blocks, penultimate_filters=penultimate_filters, stem_filters=stem_filters,
                    skip_reduction=skip_reduction, image_size=image_size, num_classes=num_classes,
                    dropout_p=dropout)
    return model, image_inputs(factory, batch_size, image_size, num_classes)
