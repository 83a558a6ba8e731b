"""Batch tensors in pieces: slicing the samples of a replica out of a batch tensor, joining the pieces of
several replicas, and bringing a value to the memory order the captured program expects."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def batch_slice(dim: int, lo: int, hi: int, per_sample: int, block: int) -> tuple[int, int, int, int]:
    """The executor's slice of samples ``lo:hi`` of a batch tensor: ``(dim, start, end, 0)`` narrows entries
    ``start:end`` of ``dim`` (samples one after the other, ``per_sample`` entries each); ``(dim, lo, hi,
    block)`` narrows samples ``lo:hi`` within each of the ``block`` blocks that ``dim`` holds (sample-minor
    rows, see ``heterog.runtime.scaling``)."""
    if block:
        return (dim, lo, hi, block)
    return (dim, lo * per_sample, hi * per_sample, 0)


def narrow_batch(t: torch.Tensor, sl: tuple[int, int, int, int]) -> torch.Tensor:
    """The part of ``t`` that slice ``(dim, start, end, block)`` names: entries ``start:end`` of ``dim``
    (block 0), or entries ``start:end`` within each of the ``block`` blocks of ``dim`` (sample-minor rows)."""
    dim, start, end, block = sl
    if not block:
        return t.narrow(dim, start, end - start)
    return t.unflatten(dim, (block, -1)).narrow(dim + 1, start, end - start).flatten(dim, dim + 1)


def cat_batch(pieces: list[torch.Tensor], dim: int, block: int) -> torch.Tensor:
    """Pieces of a batch tensor, in sample order, joined along ``dim`` (within each of its ``block`` blocks
    when the rows are sample-minor); the inverse of ``narrow_batch``."""
    if not block:
        return torch.cat(pieces, dim=dim)
    return torch.cat([p.unflatten(dim, (block, -1)) for p in pieces], dim=dim + 1).flatten(dim, dim + 1)


def in_memory_order(t: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """``t`` itself when it is dense with its dims laid out in ``order`` (outermost first; None: row-major),
    else a copy that is.

    The captured program runs on values with the strides it was traced with; a value assembled by ``cat``,
    received, or summed is row-major (or, narrowed, not dense at all) instead. ``aten.view`` then fails on
    e.g. an attention output traced as (B, H, T, D) stored (B, T, H, D) and viewed (B*T, C) after a
    transpose, and elementwise ops pass the wrong strides on to the views after them."""
    n = t.dim()
    order = tuple(range(n)) if order is None else tuple(order)
    expected = 1
    for d in reversed(order):
        size = t.shape[d]
        if size != 1 and t.stride(d) != expected:
            break
        expected *= size
    else:
        return t
    if order == tuple(range(n)):
        return t.contiguous()
    inverse = [0] * n
    for i, d in enumerate(order):
        inverse[d] = i
    return t.permute(order).contiguous().permute(inverse)


def shape_only(shape: Sequence[int], dtype: torch.dtype, order: Sequence[int] | None, device: torch.device
               ) -> torch.Tensor:
    """Zeros of ``shape`` for readers of its shape only (``VALUE_FREE_TARGETS``: ones_like, new_zeros, ...):
    one element expanded, which holds no bytes, where the value is laid out row-major (such a reader then
    makes a row-major value, as traced); zeros laid out in ``order`` otherwise."""
    n = len(shape)
    if order is None or tuple(order) == tuple(range(n)):
        return torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))
    return in_memory_order(torch.zeros(tuple(shape), dtype=dtype, device=device), order)

