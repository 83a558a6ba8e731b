"""Split rules through zero-cost views (view, reshape, permute, transpose, expand, ...): where a placement of
a view's input lands on its output, written here for uneven shards (DTensor's view rule refuses to flatten an
unevenly split dimension). Used by ``heterog.graph.sharding`` to compose the rules of a fused op."""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from heterog.graph.split_rules import TensorInfo
from heterog.placement import Placement, Shard


# ---------------------------------------------------------------------------- views
@dataclass(frozen=True)
class ViewStep:
    """A placement carried through one view: the view's placement (a tuple for views returning several
    tensors), the extent after it (views may group units: (B*S) split -> (B, S) split over B) and the
    size arguments to pass as local sizes."""

    placement: Placement | tuple[Placement, ...]
    extent: int | None
    size_args: tuple[tuple[int, int | None], ...] = ()


IDENTITY_VIEWS = frozenset({"aten.alias", "aten.detach", "aten.lift_fresh"})
RESHAPE_VIEWS = frozenset({"aten.view", "aten._unsafe_view", "aten.reshape", "aten.unflatten", "aten.flatten",
                           "aten.squeeze", "aten.unsqueeze"})
PERMUTE_VIEWS = frozenset({"aten.t", "aten.transpose", "aten.permute", "aten.movedim", "aten.swapaxes",
                           "aten.swapdims", "aten.numpy_T", "aten.mT", "aten.adjoint"})
SPLIT_VIEWS = frozenset({"aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.tensor_split"})


def packet(target: Any) -> str:
    """"aten.view" for aten.view.default; "getitem" for operator.getitem."""
    if target is operator.getitem:
        return "getitem"
    name = str(target)
    return name.rpartition(".")[0] if name.count(".") >= 2 else name


def propagate_view(target: Any, args: Sequence[Any], kwargs: dict[str, Any], src: TensorInfo,
                   out: TensorInfo | tuple[TensorInfo, ...], placement: Placement, extent: int | None
                   ) -> ViewStep | None:
    """The placement of a view's result when its input has ``placement`` (None: a device cannot take its
    view of a shard; the op would need the whole tensor). Replicate and partial sums pass every view."""
    if not isinstance(placement, Shard):
        n = len(out) if isinstance(out, tuple) else 0
        return ViewStep(tuple([placement] * n) if n else placement, extent)
    assert extent is not None
    kind = packet(target)
    d = placement.dim
    if kind in IDENTITY_VIEWS:
        return ViewStep(placement, extent)
    if isinstance(out, tuple):
        if kind not in SPLIT_VIEWS:
            return None
        dim = int(args[1] if kind == "aten.unbind" and len(args) > 1 else
                  (args[2] if len(args) > 2 else kwargs.get("dim", 0))) % src.ndim
        if dim == d:
            return None
        shifted = Shard(d - 1 if kind == "aten.unbind" and d > dim else d, placement.sf)
        return ViewStep(tuple([shifted] * len(out)), extent)
    if kind in PERMUTE_VIEWS:
        perm = _permutation(kind, args, src.ndim)
        return None if perm is None else ViewStep(Shard(perm.index(d), placement.sf), extent)
    if kind in RESHAPE_VIEWS:
        moved = _reshape(src.shape, out.shape, placement, extent)
        if moved is None:
            return None
        shard, new_extent = moved
        size_args: tuple[tuple[int, int | None], ...] = ()
        if kind in ("aten.view", "aten._unsafe_view", "aten.reshape"):
            size_args = ((1, shard.dim),)
        elif kind == "aten.unflatten":
            first = int(args[1]) % src.ndim
            if first <= shard.dim < first + len(args[2]):
                size_args = ((2, shard.dim - first),)
        return ViewStep(shard, new_extent, size_args)
    if kind == "aten.expand":
        d_out = d + out.ndim - src.ndim
        return ViewStep(Shard(d_out, placement.sf), extent, ((1, d_out),))
    if kind in ("aten.slice", "aten.narrow"):
        dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % src.ndim
        return ViewStep(placement, extent) if dim != d or out.shape == src.shape else None
    if kind == "aten.select":
        dim = int(args[1]) % src.ndim
        return None if dim == d else ViewStep(Shard(d - 1 if d > dim else d, placement.sf), extent)
    return None


def _permutation(kind: str, args: Sequence[Any], ndim: int) -> list[int] | None:
    """perm[out_dim] = in_dim of a permuting view."""
    perm = list(range(ndim))
    if kind in ("aten.t", "aten.numpy_T"):
        return perm[::-1]
    if kind in ("aten.mT", "aten.adjoint"):
        perm[-2], perm[-1] = perm[-1], perm[-2]
        return perm
    if kind in ("aten.transpose", "aten.swapaxes", "aten.swapdims"):
        a, b = int(args[1]) % ndim, int(args[2]) % ndim
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if kind == "aten.permute":
        return [int(x) % ndim for x in args[1]]
    if kind == "aten.movedim":
        src = [args[1]] if isinstance(args[1], int) else list(args[1])
        dst = [args[2]] if isinstance(args[2], int) else list(args[2])
        src, dst = [s % ndim for s in src], [t % ndim for t in dst]
        rest = iter(i for i in range(ndim) if i not in src)
        out = [-1] * ndim
        for s, t in zip(src, dst):
            out[t] = s
        return [x if x >= 0 else next(rest) for x in out]
    return None


def _reshape(src: Sequence[int], dst: Sequence[int], shard: Shard, extent: int) -> tuple[Shard, int] | None:
    """A shard carried through a row-major reshape. The source, flattened, is ``outer x extent x inner``
    with the ``extent`` axis divided (``outer`` = sizes before the dim times the split factor). The
    result holds the same layout if one of its dimensions starts exactly where the divided axis starts
    and ends where a whole unit ends; units may be grouped by ``c`` (extent / c shared out) to get
    there: ``(B*S, H)`` divided over B*S becomes ``(B, S, H)`` divided over B (c = S)."""
    size = src[shard.dim]
    if size % (shard.sf * extent):
        return None
    unit = size // (shard.sf * extent)
    outer = math.prod(src[:shard.dim]) * shard.sf
    inner = unit * math.prod(src[shard.dim + 1:])
    best: tuple[int, int, int] | None = None
    for j, size_j in enumerate(dst):
        before, after = math.prod(dst[:j]), math.prod(dst[j + 1:])
        if size_j < 2 or outer % before or size_j % (outer // before):
            continue
        a = outer // before
        if (size_j // a) * after != extent * inner:
            continue
        c = after // math.gcd(inner, after)
        if extent % c or extent // c < 2:
            continue
        if best is None or c < best[0]:
            best = (c, j, a)
    if best is None:
        return None
    c, j, a = best
    return Shard(j, a), extent // c
