"""Where the pieces of a tensor live among the devices of a split: the placement vocabulary that the graph's
split rules, the compiler's costs and the runtime's lowering share, and the one table of conversions.

Words. A *split* divides an op's work beyond the batch among the devices of a split config
(``ParallelConfig.split``, docs/design.md "Splits beyond the batch"); each of an op's *split options*
(``OpGraph.splits``) says, per tensor it reads or gives, its *placement*:

  ``Shard(dim, sf)``  dimension ``dim`` divided: each device holds a *shard*, its integer share of the
                      option's ``extent`` units (shares from the plan, ``heterog.strategy.split_shares_of``);
                      with ``sf`` > 1 the dimension is read as ``sf`` outer blocks, each divided alike
                      (heads inside a ``(batch * heads)`` dimension: ``Shard(0, sf=batch)``);
  ``Replicate()``     every device holds the whole tensor;
  ``Partial()``       the tensor is the sum of the devices' tensors (partial sums).

"Shard" names only the piece a placement gives a device; the division of an op is a "split". Re-laying out
a value along the batch between data-parallel layouts is a *relayout* (``TaskKind.RELAYOUT``), not a split.

Text form, as graphs store it (``SplitOption``; the format on disk): ``"S1"``, ``"S0:4"`` (dim 0 in 4 outer
blocks), ``"R"``, ``"P"`` and ``"-"`` for no tensor (``str`` and ``parse``).

Conversions (``conversion``): what a consumer needing ``need`` of a tensor does with a producer's ``have``
over the same devices; ``same_units``: both divide it into the same units (``same_units``):

  have \\ need   Replicate     Shard (same dim and units)  Shard (other)   Partial
  Replicate     LOCAL         SLICE                       SLICE           SLICE (whole on the first device)
  Shard         ALL_GATHER    LOCAL                       ALL_TO_ALL      PAD (a shard in zeros)
  Partial       ALL_REDUCE    REDUCE_SCATTER              REDUCE_SCATTER  LOCAL

and LOCAL where either side holds no tensor (``None``, "-": a shape read). The compiler prices the four
collectives (``heterog.compiler.shards``, ``heterog.compiler.reshard``); the runtime lowers LOCAL, SLICE and
PAD on the consumer's device, REDUCE_SCATTER and ALL_TO_ALL as those collectives
(``heterog.runtime.split_collectives``), and ALL_GATHER and ALL_REDUCE by making the value whole and taking
the consumer's slice of it (``heterog.runtime.split_lowering``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import TypeGuard, Union

from heterog.errors import HeterogError


@dataclass(frozen=True, order=True)
class Shard:
    """Dimension ``dim`` divided among the devices; with ``sf`` > 1 read as ``sf`` outer blocks, each divided
    the same way (DTensor's ``_StridedShard``)."""

    dim: int
    sf: int = 1

    def __str__(self) -> str:
        return f"S{self.dim}" if self.sf == 1 else f"S{self.dim}:{self.sf}"


@dataclass(frozen=True)
class Replicate:
    """Every device holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """The tensor is the sum of the devices' tensors."""

    def __str__(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]
R = Replicate()
P = Partial()


class PlacementError(HeterogError, ValueError):
    """A placement's text is not one of "R", "P", "S<dim>", "S<dim>:<split factor>" or "-"."""


@lru_cache(maxsize=4096)
def parse(text: str) -> Placement | None:
    """The placement of its text form (None for "-", no tensor; placements are immutable, so one object stands
    for each text)."""
    if text == "-":
        return None
    if text == "R":
        return R
    if text == "P":
        return P
    dim, colon, sf = text[1:].partition(":")
    if not text.startswith("S") or not dim.isdigit() or not (sf.isdigit() or not colon):
        raise PlacementError(f"not a placement: {text!r} (R, P, S<dim>, S<dim>:<split factor> or -)")
    return Shard(int(dim), int(sf) if sf else 1)


def text(p: Placement | None) -> str:
    """The text form of ``p`` ("-" for None)."""
    return "-" if p is None else str(p)


def as_placement(p: Placement | str) -> Placement | None:
    """``p`` itself, or parsed from its text form."""
    return parse(p) if isinstance(p, str) else p


def is_shard(p: Placement | None) -> TypeGuard[Shard]:
    return isinstance(p, Shard)


def same_units(extent_a: int | None, extent_b: int | None, shares_a: Sequence[int] = (),
               shares_b: Sequence[int] = ()) -> bool:
    """Two splits over the same devices give each device the same piece of a tensor: equal extents and equal
    integer shares of them (shares may be left out where one config's split weights give both: the extent
    fixes them), or units that nest, each of the coarser split's ``m`` times as large as the finer's, with
    every share of the finer ``m`` times the coarser's (1024 columns in shares of 256 are 16 heads of 64
    columns in shares of 4)."""
    if extent_a == extent_b:
        return tuple(shares_a) == tuple(shares_b)
    if extent_a is None or extent_b is None or not shares_a or not shares_b:
        return False
    (coarse, coarse_shares), (fine, fine_shares) = sorted(((extent_a, tuple(shares_a)),
                                                           (extent_b, tuple(shares_b))))
    return fine % coarse == 0 and fine_shares == tuple(fine // coarse * s for s in coarse_shares)


class Conversion(IntEnum):
    """How a consumer gets the placement it needs from the producer's (module docstring's table)."""

    LOCAL = 0             # it holds what it needs
    ALL_GATHER = 1        # shards made whole
    REDUCE_SCATTER = 2    # partial sums summed into shards
    ALL_REDUCE = 3        # partial sums summed whole
    ALL_TO_ALL = 4        # shards of one layout re-divided into another's
    SLICE = 5             # its part of a whole copy it holds (its shard; as partial sums: all on the first device)
    PAD = 6               # its shard read as partial sums: the shard in zeros of the whole shape

    @property
    def collective(self) -> bool:
        """Bytes move among the devices (one of the four collectives, numbered 1 to 4)."""
        return 1 <= self <= 4

    @property
    def label(self) -> str:
        """"all-gather", "slice", ..."""
        return self.name.lower().replace("_", "-")


def conversion(have: Placement | None, need: Placement | None, same_units: bool) -> Conversion:
    """THE conversion from a producer's placement ``have`` of one tensor to a consumer's ``need`` over the
    same devices (module docstring); ``same_units``: both divide it into the same units."""
    if have is None or need is None:
        return Conversion.LOCAL
    if isinstance(have, Replicate):
        return Conversion.LOCAL if isinstance(need, Replicate) else Conversion.SLICE
    if isinstance(have, Shard):
        if isinstance(need, Replicate):
            return Conversion.ALL_GATHER
        if isinstance(need, Partial):
            return Conversion.PAD
        return Conversion.LOCAL if need == have and same_units else Conversion.ALL_TO_ALL
    if isinstance(need, Replicate):
        return Conversion.ALL_REDUCE
    return Conversion.LOCAL if isinstance(need, Partial) else Conversion.REDUCE_SCATTER


__all__ = ["P", "R", "Conversion", "Partial", "Placement", "PlacementError", "Replicate", "Shard", "as_placement",
           "conversion", "is_shard", "parse", "same_units", "text"]
