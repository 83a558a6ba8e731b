"""Scaling exponents around the ops that couple samples (``heterog.graph.coupling``).

A coupled op runs once over the whole batch (``heterog.compiler.coupled``), so what it makes is the value of
single-device training. The replicas that read it work at their own share, in the convention of
``heterog.runtime.scaling``: a forward value as is (exponent 0), a backward value as the gradient of a mean
over the replica's own samples (exponent -1: ``B / b`` times the global rows). A coupled op's batch outputs
therefore get exponent 0 in forward and -1 in backward, and the re-layout that cuts them back to the
replicas scales them by ``(b / B) ** e``; its other outputs (a loss, the gradient of a temperature) are
global values (exponent 0).

The exponents of everything downstream are then measured as usual (run on ``k`` samples and on those
samples twice over), with one change: in the doubled run each coupled op does not compute on the doubled
batch (every sample would meet its copy) but gives the single run's values doubled along every dimension
that holds the batch, times ``2 ** e``, as the convention above says its readers see them. Rows that hold
several entries per sample (``2 B`` rows of two views) are doubled as the values the coupled ops read hold
them: within their blocks where those are sample-minor (``coupled_minor_blocks``), and the coupled ops'
outputs of that many entries per sample are then sample-minor too.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from heterog.runtime.stepprog import StepProgram


def duplicated(v: torch.Tensor, batch_dim: int | None, minor_per: int = 0) -> torch.Tensor:
    """``v`` of a run on k samples as the same run on those samples twice over computes it: repeated along
    the batch dim (sample-major), or, when the batch dim holds ``(minor_per, k)`` (sample-minor), repeated
    within each of its ``minor_per`` blocks."""
    if batch_dim is None:
        return v
    if not minor_per:
        return torch.cat([v, v], dim=batch_dim)
    folded = v.unflatten(batch_dim, (minor_per, -1))
    return torch.cat([folded, folded], dim=batch_dim + 1).flatten(batch_dim, batch_dim + 1)


def coupled_exponent(prog: StepProgram, op: int) -> int:
    """The exponent of coupled op ``op``'s batch outputs: 0 in forward, -1 in backward."""
    return -1 if prog.op_phase[op] == "backward" else 0


def tiled(v: Any, dims: Sequence[tuple[int, ...]], scale: float, blocks: int = 0, k: int = 0) -> Any:
    """A node's value of a run on ``k`` samples as the doubled run's readers see it: doubled along ``dims`` (one
    tuple per tensor of the value; a dim of ``blocks * k`` entries within each of its ``blocks`` blocks), a
    floating-point value with batch dims times ``scale``."""
    if isinstance(v, (tuple, list)):
        return type(v)(tiled(x, [d], scale, blocks, k) for x, d in zip(v, dims))
    if not isinstance(v, torch.Tensor) or not dims or not dims[0]:
        return v
    for d in dims[0]:
        if blocks > 1 and v.shape[d] == blocks * k:
            folded = v.unflatten(d, (blocks, k))
            v = torch.cat([folded, folded], dim=d + 1).flatten(d, d + 1)
        else:
            v = torch.cat([v, v], dim=d)
    return v * scale if v.is_floating_point() and scale != 1.0 else v


def minor_reads(prog: StepProgram, op: int, single: dict[str, Any], doubled: dict[str, Any]) -> set[int]:
    """The entries per sample of the values coupled op ``op`` reads from other ops that the doubled run
    repeats within blocks (sample-minor rows; ``single``, ``doubled``: the values of the runs on ``k``
    samples and on them twice over, as far as they have run)."""
    found: set[int] = set()
    for r in prog.reads[op]:
        info = prog.leaves[r.leaf]
        if prog.op_coupled[r.leaf[0]] or info.batch_dim is None or info.per_sample < 2 or info.node is None:
            continue
        v1, v2 = single.get(info.node), doubled.get(info.node)
        if isinstance(v1, torch.Tensor) and isinstance(v2, torch.Tensor):
            u = duplicated(v1, info.batch_dim, info.per_sample)
            if u.shape == v2.shape and torch.allclose(u.double(), v2.double(), rtol=1e-4, atol=1e-6) and \
                    not torch.allclose(duplicated(v1, info.batch_dim).double(), v2.double(), rtol=1e-4, atol=1e-6):
                found.add(info.per_sample)
    return found


def minor_blocks(prog: StepProgram, pers: set[int]) -> dict[int, int]:
    """Coupled op -> the entries per sample of its outputs that are sample-minor, given ``pers``: those found
    sample-minor in what any coupled op reads (``minor_reads``)."""
    return {op: per for op, coupled in enumerate(prog.op_coupled) if coupled
            for per in {prog.leaves[leaf].per_sample for leaf in prog.leaves if leaf[0] == op} & pers}


def tile_coupled(prog: StepProgram, op: int, single: dict[str, Any], doubled: dict[str, Any], k: int,
                 minor: dict[int, int]) -> None:
    """Coupled op ``op``'s values in the doubled run: the single run's, doubled as its readers see them
    (module docstring; ``minor``: coupled op -> entries per sample of its sample-minor rows)."""
    scale = 2.0 ** coupled_exponent(prog, op)
    for n in prog.op_nodes[op]:
        if n in single:
            doubled[n] = tiled(single[n], prog.coupled_dims.get(n, ()), scale, minor.get(op, 0), k)
