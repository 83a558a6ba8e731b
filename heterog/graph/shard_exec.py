"""Running one op of a captured step on one device's shard of a split option (``heterog.graph.sharding``):
the shard of a tensor a placement gives a device, the op's fx nodes run on shards with local size
arguments and local transforms, and the whole tensor put back together from the devices' results."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.fx import Node

from heterog.graph.sharding import OpSplits, SplitOption
from heterog.graph.tracing import CapturedStep, Sizes
from heterog.placement import P, Placement, R, Shard, as_placement

Key = tuple[str, int | None]


def shard_of(value: torch.Tensor, placement: Placement | str, extent: int | None, shares: Sequence[int], rank: int
             ) -> torch.Tensor:
    """Device ``rank``'s part of ``value`` under ``placement`` with integer ``shares`` of ``extent`` units
    ("R": the whole tensor; "P": not defined here, the caller chooses the summands).

    Shapes: a dimension of size D divided as ``S<d>:<f>`` is read as ``(f, D // f)`` and the device keeps
    ``D // f * share // extent`` of the second part from offset ``D // f * sum(shares[:rank]) // extent``.
    """
    p = as_placement(placement)
    if p == R:
        return value
    if not isinstance(p, Shard) or extent is None:
        raise ValueError(f"shard_of needs a shard placement, got {placement!r}")
    size = value.shape[p.dim] // p.sf
    unit = size // extent
    blocks = value.unflatten(p.dim, (p.sf, size))
    part = blocks.narrow(p.dim + 1, sum(shares[:rank]) * unit, shares[rank] * unit)
    return part.flatten(p.dim, p.dim + 1)


def dense_like(part: torch.Tensor, whole: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A dense copy of ``part`` whose dimensions are laid out in memory in the order of ``whole``'s (a
    transposed tensor stays transposed): the fx graph's views assume the traced strides, so a device's
    shard must keep their order, as a tensor received whole would. ``copy=False``: ``part`` itself where it
    is dense in that order already (rows of a row-major tensor: a view that holds no bytes of its own)."""
    strides = whole.stride()
    order = sorted(range(whole.dim()), key=lambda d: (-strides[d], -d))
    inverse = [order.index(d) for d in range(whole.dim())]
    laid = part.permute(order)
    if not copy and laid.is_contiguous():
        return part
    return laid.clone(memory_format=torch.contiguous_format).permute(inverse)


def part_of(value: torch.Tensor, placement: Placement | str, extent: int | None, shares: Sequence[int], rank: int,
            copy: bool = True) -> torch.Tensor:
    """Device ``rank``'s part of the whole ``value`` as a consumer needing ``placement`` reads it: its shard
    (a dense copy in ``value``'s memory order, ``dense_like``; ``copy=False``: a view where that is dense
    already), the whole value ("R"), or as partial sums the whole value on rank 0 and zeros elsewhere ("P")."""
    p = as_placement(placement)
    if p == R:
        return value
    if p == P:
        return value if rank == 0 else torch.zeros_like(value)
    return dense_like(shard_of(value, placement, extent, shares, rank), value, copy)


def padded(part: torch.Tensor, placement: Placement | str, extent: int | None, shares: Sequence[int], rank: int
           ) -> torch.Tensor:
    """Device ``rank``'s shard ``part`` under ``placement`` put in a whole tensor of zeros (a shard is one of
    the partial sums of the whole value)."""
    p = as_placement(placement)
    if not isinstance(p, Shard) or extent is None:
        raise ValueError(f"padded needs a shard placement, got {placement!r}")
    shape = list(part.shape)
    shape[p.dim] = part.shape[p.dim] * extent // shares[rank]
    whole = part.new_zeros(shape)
    unit = shape[p.dim] // p.sf // extent
    blocks = whole.unflatten(p.dim, (p.sf, shape[p.dim] // p.sf))          # a view: written through
    blocks.narrow(p.dim + 1, sum(shares[:rank]) * unit, shares[rank] * unit).copy_(part.unflatten(p.dim, (p.sf, -1)))
    return whole


def combine(values: Sequence[torch.Tensor], placement: Placement | str) -> torch.Tensor:
    """The whole tensor from the devices' parts: concatenation along the split dimension (within each
    outer block for a split factor), the sum of partial sums, or the (equal) replicas' first."""
    p = as_placement(placement)
    if p == R:
        return values[0]
    if p == P:
        return torch.stack(list(values)).sum(0)
    assert isinstance(p, Shard)
    blocks = [v.unflatten(p.dim, (p.sf, v.shape[p.dim] // p.sf)) for v in values]
    return torch.cat(blocks, dim=p.dim + 1).flatten(p.dim, p.dim + 1)


class ShardRunner:
    """Runs ops of one captured step on shards (``run``); non-tensor arguments take their values at the
    captured batch size (kept across calls: evaluating a symbolic size is the slow part)."""

    def __init__(self, captured: CapturedStep) -> None:
        self.captured = captured
        self.sizes = Sizes(captured.batch_symbols, captured.batch_size)

    def run(self, fx_nodes: Sequence[str], splits: OpSplits, option: SplitOption, shares: Sequence[int], rank: int,
            inputs: Mapping[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        """Run an op's fx nodes (``Op.fx_nodes``) on device ``rank``'s shards ``inputs`` (keyed like
        ``splits.inputs``: (fx node, element or None); a graph-input op gives its own node's value) under
        ``option`` with ``shares`` of ``option.extent``; returns the device's value of each of
        ``splits.exits``. Size arguments take their local values. For a "partial" option ``shares`` only
        counts the devices."""
        share, offset = (shares[rank], sum(shares[:rank])) if option.extent is not None else (1, 0)
        local_sizes: dict[str, list[tuple[int, int | None]]] = {}
        for a in option.size_args:
            local_sizes.setdefault(a.node, []).append((a.arg, a.index))
        env: dict[str, Any] = {}
        for (name, index), t in inputs.items():
            if index is None:
                env[name] = t
            else:
                env.setdefault(name, {})[index] = t

        def value(n: Node) -> Any:
            if n.name in env:
                return env[n.name]
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) or val is None:
                raise KeyError(f"fx node {n.name!r}: no value given for it")
            return self.sizes.value(val)

        for name in fx_nodes:
            node = self.captured.node(name)
            if node.op in ("placeholder", "get_attr"):
                if name not in env:
                    raise KeyError(f"graph input {name!r}: no value given for it")
                continue
            args = list(torch.fx.node.map_arg(node.args, value))
            kwargs = dict(torch.fx.node.map_arg(node.kwargs, value))
            for arg, index in local_sizes.get(name, ()):
                args[arg] = local_size(args[arg], index, share, option.extent, name)
            assert callable(node.target)
            if option.transform is not None and name == option.transform_node:
                env[name] = local_transform(option.transform, node.target, share, offset, option.extent,
                                            *args, **kwargs)
            else:
                env[name] = node.target(*args, **kwargs)
        out = {}
        for ref in splits.exits:
            v = env[ref.node]
            out[(ref.node, ref.index)] = v[ref.index] if ref.index is not None else v
        return out


def local_size(value: Any, index: int | None, share: int, extent: int | None, node: str) -> Any:
    """A size argument of fx node ``node`` as a device with ``share`` of ``extent`` units passes it (element
    ``index`` of a list argument, None for a scalar): ``value * share // extent``; -1 stays -1."""
    if index is not None:
        items = list(value)
        items[index] = local_size(items[index], None, share, extent, node)
        return items
    if value == -1 or extent is None:
        return value
    if (value * share) % extent:
        raise ValueError(f"fx node {node}: size {value} does not divide into {extent} units")
    return value * share // extent


def local_transform(kind: str, target: Any, share: int, offset: int, extent: int | None, *args: Any,
                    **kwargs: Any) -> Any:
    """Call ``target`` as a device holding ``share`` units from unit ``offset`` of ``extent`` does under a
    split option's ``transform`` (``heterog.graph.sharding``)."""
    if kind == "embedding_rows":
        return _embedding_rows(target, list(args), kwargs, share, offset)
    if kind == "partial_mean":
        assert extent is not None
        return target(*args, **kwargs) * (share / extent)
    raise ValueError(f"unknown split transform {kind!r}")


def _embedding_rows(target: Any, args: list[Any], kwargs: dict[str, Any], share: int, offset: int) -> torch.Tensor:
    """The embedding (or its weight gradient) of a device holding rows ``[first, first + rows)`` of the
    table: indices outside them give zeros (forward) or no gradient (backward)."""
    aten = torch.ops.aten
    if target is aten.embedding.default:
        weight, indices = args[0], args[1]
        rows = weight.shape[0]
        first = offset * (rows // share)
        local = indices - first
        inside = (local >= 0) & (local < rows)
        out = aten.embedding.default(weight, local.clamp(0, rows - 1), *args[2:], **kwargs)
        return out * inside.unsqueeze(-1).to(out.dtype)
    if target is aten.embedding_dense_backward.default:
        grad, indices, rows = args[0], args[1], int(args[2])
        first = offset * (rows // share)
        local = indices - first
        inside = (local >= 0) & (local < rows)
        padding = int(args[3]) - first if int(args[3]) >= 0 else -1
        padding = padding if 0 <= padding < rows else -1
        return aten.embedding_dense_backward.default(grad * inside.unsqueeze(-1).to(grad.dtype),
                                                     local.clamp(0, rows - 1), rows, padding, *args[4:], **kwargs)
    raise ValueError(f"no embedding_rows transform for {target}")
