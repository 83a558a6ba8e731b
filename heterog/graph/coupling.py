"""Ops that couple the samples of the batch: a B x B similarity of every sample with every other one, a loss
over all pairs (CLIP's and SigLIP's contrastive losses, SimCLR's NT-Xent, in-batch negatives).

The capture traces the batch size as one symbol B, so such ops show in their shapes: a value whose sizes
hold B to a total degree of 2 or more (``(B, B)``, ``(B * B,)``) pairs samples with samples. An op that
reads or makes such a value is *coupled*: it must see the whole batch, so it runs once on one device over
all samples (``heterog.compiler.coupled``), whatever its group's replicas. So does a value made from the
batch size alone (``arange(B)`` as labels, ``eye(B)`` as a mask) that only coupled ops read. A literal batch
size (``x.view(8, -1)``) is another thing: it fixes B to a number, which the capture refuses.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from heterog.graph.opgraph import Edge, Op


class BatchDegree:
    """The total degree of the batch symbols in a tensor's sizes (cached per size expression)."""

    def __init__(self, symbols: Iterable[Any]) -> None:
        self.symbols = frozenset(symbols)
        self._cache: dict[Any, int] = {}

    def of_size(self, size: Any) -> int:
        if not isinstance(size, torch.SymInt):
            return 0
        expr = size.node.expr
        hit = self._cache.get(expr)
        if hit is None:
            import sympy

            free = expr.free_symbols & self.symbols
            if not free:
                hit = 0
            else:
                try:
                    hit = int(sympy.Poly(expr, *sorted(free, key=str)).total_degree())
                except sympy.PolynomialError:
                    hit = 1                    # B // 2 and the like: the batch, once
            self._cache[expr] = hit
        return hit

    def of_tensors(self, tensors: Sequence[torch.Tensor]) -> int:
        """The largest total degree over ``tensors``."""
        return max((sum(self.of_size(s) for s in t.shape) for t in tensors), default=0)


# ops that work along the dimensions named by their ``dim`` or ``dims`` argument (the packet's name)
ALONG_DIM = frozenset({"sort", "argsort", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax",
                       "log_softmax", "_softmax", "_log_softmax", "_softmax_backward_data",
                       "_log_softmax_backward_data", "flip", "roll", "diff"})


def mixes_samples(node: Any, batch_symbols: Iterable[Any]) -> bool:
    """Whether fx ``node`` is an op of ``ALONG_DIM`` working along a dimension of its first tensor argument
    whose size is exactly a batch symbol (module docstring)."""
    target: Any = getattr(node, "target", None)
    schema = getattr(target, "_schema", None)
    packet = getattr(target, "overloadpacket", None)
    if schema is None or packet is None or packet.__name__ not in ALONG_DIM or not node.args:
        return False
    val = getattr(node.args[0], "meta", {}).get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return False
    symbols = frozenset(batch_symbols)
    for i, arg in enumerate(schema.arguments):
        if arg.name not in ("dim", "dims"):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
        dims = value if isinstance(value, (list, tuple)) else [value]
        for d in dims:
            if isinstance(d, int):
                size = val.shape[d % val.dim()]
                if isinstance(size, torch.SymInt) and size.node.expr in symbols:
                    return True
    return False


def sizes_coupled(node: Any, op_of: dict[str, int], ops: Sequence[Op], degree: BatchDegree) -> bool:
    """Whether fx ``node`` reads the output of a coupled op (``op_of``: fx name -> index into ``ops``) and a
    size that holds the batch as a scalar argument (a shape node's ``SymInt``, not a tensor's sizes), or reads
    only coupled ops' outputs and makes a value with the batch (``ranks.float()`` on the way to ``/ B``)."""
    data = [ops[op_of[i.name]].coupled for i in node.all_input_nodes if i.name in op_of]
    takes_batch = any(degree.of_size(i.meta.get("val")) >= 1 for i in node.all_input_nodes if i.name not in op_of)
    val = node.meta.get("val")
    made = [v for v in (val if isinstance(val, (list, tuple)) else [val]) if isinstance(v, torch.Tensor)]
    return any(data) and (takes_batch or (all(data) and degree.of_tensors(made) >= 1))


def mark_batch_made_values(ops: list[Op], edges: list[Edge]) -> None:
    """Mark coupled the batch ops made from the batch size alone (no model input upstream: ``arange(B)``,
    ``eye(B)``, what is computed from them, a loss's count of the labels so made) connected to a coupled op
    through such ops: computed once over the whole batch, they are exact wherever they are read."""
    n = len(ops)
    from_inputs = [op.kind == "input" for op in ops]
    batch = [any(d is not None for d in op.batch_dims) for op in ops]
    for e in sorted(edges, key=lambda e: e.dst):
        from_inputs[e.dst] = from_inputs[e.dst] or from_inputs[e.src]
        batch[e.dst] = batch[e.dst] or e.batch_dim is not None
    made = [ops[i].kind == "compute" and batch[i] and not from_inputs[i] for i in range(n)]
    near: list[list[int]] = [[] for _ in ops]
    for e in edges:
        if made[e.src] or made[e.dst]:
            near[e.src].append(e.dst)
            near[e.dst].append(e.src)
    todo = [i for i in range(n) if ops[i].coupled]
    while todo:
        i = todo.pop()
        for j in near[i]:
            if made[j] and not ops[j].coupled:
                ops[j].coupled = True
                todo.append(j)
