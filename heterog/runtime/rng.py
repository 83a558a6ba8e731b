"""Random ops under any plan: dropout (and every op that draws from a generator) gives each sample the
values single-device training draws for it, whichever replica computes that sample.

The scheme. A random op (an ATen op tagged ``nondeterministic_seeded``: ``native_dropout``, ``bernoulli``,
``rand``, ``randn_like``, ...; dropout with p = 0 is not one) does not draw from the process's running
generator. The batch is cut into blocks of ``BLOCK_SAMPLES`` consecutive samples, and the values of block
``j`` are drawn by one call on that block's samples, from a generator seeded by ``(run seed, step, fx
node, j)`` (``draw_key``), with the tensor arguments dense and row-major. An instance that holds samples
``lo .. hi`` draws the blocks that overlap them: a block it holds in part gets zero rows for the samples
it does not hold (the draws depend on shapes, not values), and it keeps the rows of its own samples.
Single-device training draws every block the same way, so every replica and every shard of a plan
draws, for each of its samples, exactly what single-device training draws. The cost: at most two blocks
held in part per instance, drawn whole (``blocks_drawn``; ``heterog.cost.model`` prices the extra rows and
the per-block launches), and one block's arguments and outputs as a transient while the op runs.

Exactness needs the draw to depend on the shape of the arguments, not on their values: true of
dropout, Bernoulli with a probability tensor, uniform and normal draws (values are drawn, then shifted
or compared). A sampler that draws a value-dependent number of times (``poisson``, ``binomial``,
``multinomial`` without replacement) gets other values on a replica, since the rows of other samples
are zeros there; ``heterog.graph.random_ops.inexact_reason`` names such ops, and the equivalence check
reports them.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from heterog.graph.opgraph import DRAW_BLOCK_SAMPLES as BLOCK_SAMPLES
from heterog.runtime.layout import in_memory_order


def draw_key(seed: int, step: int, node: str) -> int:
    """The generator seed of fx node ``node`` at training step ``step`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(step)}:{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class BatchArg:
    """A tensor (argument or output) that carries the batch: where it sits and how it is laid out."""

    index: int | str                 # position among the call's arguments (or keyword), or among its outputs
    dim: int                         # the batch dim
    per_sample: int                  # entries per sample along it (sample-major: B*T rows -> T)


@dataclass(frozen=True)
class RandomNode:
    """What drawing an fx node's values needs beyond its call (built with the StepProgram)."""

    name: str
    batch_args: tuple[BatchArg, ...]                  # positional arguments that carry the batch
    batch_outputs: tuple[BatchArg, ...]               # outputs (index in the node's value) that do
    output_orders: tuple[tuple[int, ...] | None, ...]  # captured memory order per output (None: row-major)


@dataclass(frozen=True)
class Draw:
    """The samples an op instance holds and the draw they come from.

    ``samples`` are the positions, in the batch of ``batch`` samples, of the instance's samples in the order
    its rows hold them (a replica: ``range(lo, hi)``; the scaling probe's doubled run: the same samples
    twice). ``sizes[n]`` are the size nodes' values at a batch of ``n`` samples, for every block size
    (``block_batches``)."""

    seed: int
    step: int
    batch: int
    samples: Sequence[int]
    sizes: dict[int, dict[str, Any]]


def block_batches(batch: int) -> set[int]:
    """The sample counts of the blocks a batch of ``batch`` samples is drawn in."""
    out = {min(BLOCK_SAMPLES, batch)}
    if batch > BLOCK_SAMPLES and batch % BLOCK_SAMPLES:
        out.add(batch % BLOCK_SAMPLES)
    return out


def blocks_drawn(first: int, samples: int) -> int:
    """How many blocks an instance holding samples ``first .. first + samples`` draws."""
    if samples <= 0:
        return 0
    return (first + samples - 1) // BLOCK_SAMPLES - first // BLOCK_SAMPLES + 1


def _rows(positions: Sequence[int], per_sample: int, device: torch.device) -> torch.Tensor:
    idx = torch.as_tensor(list(positions), dtype=torch.int64, device=device)
    if per_sample == 1:
        return idx
    return (idx[:, None] * per_sample + torch.arange(per_sample, device=device)).reshape(-1)


def _generator_of(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def call_random(fn: Callable[..., Any], node: RandomNode,
                arguments: Callable[[dict[str, Any]], tuple[Sequence[Any], dict[str, Any]]], draw: Draw) -> Any:
    """``fn`` called on ``arguments(sizes)`` (tensors at the instance's local batch, size nodes at the given
    values) with the values single-device training draws for the instance's samples (module docstring)."""
    ids = list(draw.samples)
    if not node.batch_args and not node.batch_outputs:          # no batch: one draw, the same everywhere
        args, kwargs = arguments(draw.sizes[min(BLOCK_SAMPLES, draw.batch)])
        return _seeded(fn, list(args), dict(kwargs), draw_key(draw.seed, draw.step, node.name), None)
    pieces: list[list[Any]] = []        # per block drawn: its outputs
    position: dict[int, int] = {}       # sample -> its place among the blocks' samples, joined in order
    device = None
    for j in sorted({s // BLOCK_SAMPLES for s in ids}):
        lo = j * BLOCK_SAMPLES
        n = min(BLOCK_SAMPLES, draw.batch - lo)
        held = [i for i, s in enumerate(ids) if lo <= s < lo + n]       # local rows of this block's samples
        at = [ids[i] - lo for i in held]                                 # their places in the block
        args, kwargs = arguments(draw.sizes[n])
        args, kwargs = list(args), dict(kwargs)
        for a in node.batch_args:
            x = kwargs[a.index] if isinstance(a.index, str) else args[a.index]
            device = x.device
            if at == list(range(n)) and held == list(range(held[0], held[0] + n)):
                block = x.narrow(a.dim, held[0] * a.per_sample, n * a.per_sample)
            else:                           # a block held in part: the other samples' rows are zeros
                shape = list(x.shape)
                shape[a.dim] = n * a.per_sample
                mine = x.index_select(a.dim, _rows(held, a.per_sample, x.device))
                block = x.new_zeros(shape).index_copy_(a.dim, _rows(at, a.per_sample, x.device), mine)
            if isinstance(a.index, str):
                kwargs[a.index] = block
            else:
                args[a.index] = block
        for s in range(lo, lo + n):
            position[s] = len(position)
        out = _seeded(fn, args, kwargs, draw_key(draw.seed, draw.step, f"{node.name}#{j}"), device)
        pieces.append([out] if isinstance(out, torch.Tensor) else list(out))
    outs = list(pieces[0])
    take = [position[s] for s in ids]
    for b in node.batch_outputs:
        k = b.index
        assert isinstance(k, int)           # outputs are numbered, never named
        joined = torch.cat([p[k] for p in pieces], dim=b.dim) if len(pieces) > 1 else pieces[0][k]
        if take != list(range(len(position))):
            joined = joined.index_select(b.dim, _rows(take, b.per_sample, joined.device))
        outs[k] = joined
    outs = [in_memory_order(o, order) if isinstance(o, torch.Tensor) else o
            for o, order in zip(outs, node.output_orders)]
    if isinstance(out, torch.Tensor):
        return outs[0]
    return tuple(outs) if isinstance(out, tuple) else outs


def _seeded(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], key: int,
            device: torch.device | None) -> Any:
    """``fn(*args, **kwargs)`` with dense row-major tensor arguments, drawing from a generator seeded ``key``
    (the device's default generator, put back as it was)."""
    def dense(x: torch.Tensor) -> torch.Tensor:
        nonlocal device
        device = device or x.device
        return x if x.is_contiguous() else x.contiguous()

    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            args[i] = dense(a)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            kwargs[k] = dense(v)
    gen = _generator_of(device or torch.device("cpu"))
    saved = gen.get_state()
    gen.manual_seed(key)
    try:
        return fn(*args, **kwargs)
    finally:
        gen.set_state(saved)
