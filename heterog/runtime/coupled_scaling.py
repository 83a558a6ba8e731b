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
that holds the batch, times ``2 ** e``, as the convention above says its readers see them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from heterog.runtime.kernel import Kernel
from heterog.runtime.stepprog import StepProgram


def coupled_exponent(prog: StepProgram, op: int) -> int:
    """The exponent of coupled op ``op``'s batch outputs: 0 in forward, -1 in backward."""
    return -1 if prog.op_phase[op] == "backward" else 0


def tiled(v: Any, dims: Sequence[tuple[int, ...]], scale: float) -> Any:
    """A node's value of a run on k samples as the doubled run's readers see it: doubled along ``dims`` (one
    tuple per tensor of the value), a floating-point value with batch dims times ``scale``."""
    if isinstance(v, (tuple, list)):
        return type(v)(tiled(x, [d], scale) for x, d in zip(v, dims))
    if not isinstance(v, torch.Tensor) or not dims or not dims[0]:
        return v
    for d in dims[0]:
        v = torch.cat([v, v], dim=d)
    return v * scale if v.is_floating_point() and scale != 1.0 else v


def run_doubled(prog: StepProgram, single: dict[str, Any], params: Sequence[torch.Tensor],
                buffers: Sequence[torch.Tensor], state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                samples: Sequence[int]) -> dict[str, Any]:
    """``prog.run_all`` on ``inputs`` (the samples of the run ``single`` twice over), coupled ops giving the
    single run's values doubled (module docstring)."""
    if not any(prog.op_coupled):
        return prog.run_all(params, buffers, state, inputs, samples=samples)
    batch = prog.batch_of(inputs)
    env: dict[str, Any] = dict(zip(prog.placeholders, [*params, *buffers, *state, *inputs]))
    env.update(prog.consts)
    sym = prog.sizes_at(batch)
    draw = prog.draw(0, max(samples) + 1, samples) if prog.random else None
    for op, nodes in enumerate(prog.op_nodes):
        if not nodes:
            continue
        if prog.op_coupled[op]:
            scale = 2.0 ** coupled_exponent(prog, op)
            for n in nodes:
                if n in single:
                    env[n] = tiled(single[n], prog.coupled_dims.get(n, ()), scale)
        else:
            Kernel([prog.calls[n] for n in nodes], random=prog.random)(env, sym, draw)
    return env
