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


def mark_batch_made_values(ops: list[Op], edges: list[Edge]) -> None:
    """Mark coupled the batch ops made from the batch size alone (no model input upstream: ``arange(B)``,
    ``eye(B)`` and what is computed from them) whose every reader is coupled (ops in topological order)."""
    succ: list[list[int]] = [[] for _ in ops]
    from_inputs = [op.kind == "input" for op in ops]
    for e in edges:
        succ[e.src].append(e.dst)
    for e in sorted(edges, key=lambda e: e.dst):
        from_inputs[e.dst] = from_inputs[e.dst] or from_inputs[e.src]
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.kind != "compute" or op.coupled or from_inputs[i] or not succ[i]:
            continue
        if any(d is not None for d in op.batch_dims) and all(ops[j].coupled for j in succ[i]):
            op.coupled = True
