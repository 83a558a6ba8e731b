"""Share arithmetic: integer batch shares, split shares and micro-batch shares in even sizes or in
proportion to weights (device speeds), by the largest remainder method."""
from __future__ import annotations

from typing import Sequence, TypeAlias

import numpy as np

from heterog.errors import StrategyError

Floats: TypeAlias = Sequence[float] | np.ndarray  # per-device values, as a list or a 1-D array


def even_shares(batch_size: int, n: int) -> list[int]:
    """Split ``batch_size`` samples over ``n`` replicas as evenly as possible (first ones take the rest)."""
    base, rest = divmod(int(batch_size), int(n))
    return [base + (1 if i < rest else 0) for i in range(n)]


def proportional_shares(batch_size: int, weights: Floats) -> list[int]:
    """Integer shares proportional to ``weights`` summing to ``batch_size`` (largest remainder method)."""
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w <= 0) or not np.all(np.isfinite(w)):
        raise StrategyError(f"proportional shares need positive finite weights, got {w.tolist()}")
    exact = batch_size * w / w.sum()
    shares = np.floor(exact).astype(np.int64)
    rest = int(batch_size - shares.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - shares)))  # largest remainder, ties by index
    shares[order[:rest]] += 1
    return shares.tolist()


SPLIT_WEIGHT_TOTAL = 1000
"""The sum ``split_weights`` divides (thousandths): no split weight it gives exceeds it."""


def split_weights(speeds: Floats) -> list[int]:
    """Integer split shares (``ParallelConfig.split_shares``) in proportion to ``speeds``, in thousandths,
    each at least 1."""
    return [max(1, w) for w in proportional_shares(SPLIT_WEIGHT_TOTAL, speeds)]


def split_shares_of(extent: int, weights: Sequence[int]) -> list[int]:
    """Integer shares of a split dimension of ``extent`` units in proportion to ``weights`` (largest
    remainder), every device at least one unit where the extent allows (taken from the largest share);
    a device gets none only when the extent is smaller than the devices (the compiler does not divide
    such a dimension among them)."""
    shares = proportional_shares(int(extent), weights)
    if extent >= len(shares):
        for i in [i for i, s in enumerate(shares) if s == 0]:
            shares[int(np.argmax(shares))] -= 1
            shares[i] = 1
    return shares


def micro_batch_shares(config_shares: Sequence[int], micro: Sequence[int]) -> list[list[int]]:
    """Each replica's share of each micro-batch, ``[m][r]``: micro-batch m's ``micro[m]`` samples split
    over the replicas in proportion to ``config_shares`` (largest remainder; a replica may get none)."""
    if int(sum(micro)) != int(sum(config_shares)):
        raise StrategyError(f"micro-batch sizes {list(micro)} do not sum to the batch {int(sum(config_shares))}")
    if len(micro) == 1:
        return [list(int(s) for s in config_shares)]
    return [proportional_shares(int(b), config_shares) for b in micro]


def grid_micro_shares(group_shares: Sequence[int], micro: Sequence[int]) -> list[list[int]]:
    """Each group's share of each micro-batch of a grid (``ParallelConfig.split_grid``), ``[m][r]``: in
    proportion to the groups' batch shares, every group at least one sample (``split_shares_of``); a
    micro-batch smaller than the groups is refused."""
    if min(micro) < len(group_shares):
        raise StrategyError(f"a grid of {len(group_shares)} groups needs at least one sample of every micro-batch "
                            f"for each group; micro-batches {list(micro)} are too small")
    if len(micro) == 1:
        return [list(int(s) for s in group_shares)]
    return [split_shares_of(int(b), group_shares) for b in micro]
