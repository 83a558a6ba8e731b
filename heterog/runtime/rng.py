"""Random ops under any plan: dropout (and every op that draws from a generator) gives each sample the
values single-device training draws for it, whichever replica computes that sample.

The scheme. A random op (an ATen op tagged ``nondeterministic_seeded``: ``native_dropout``, ``bernoulli``,
``rand``, ``randn_like``, ...) does not draw from the process's running generator. Each call draws from a
generator seeded by ``(run seed, step, fx node)`` (``draw_key``), at the shape the whole batch has, with its
tensor arguments made dense and row-major; an instance that holds samples ``lo .. hi`` of the batch places
its rows of each batch argument into a zero tensor of the whole batch's shape, draws, and keeps its rows
of each batch output. Single-device training makes the same call on the whole batch, so every replica
and every shard of a plan draws, for each of its samples, exactly what single-device training draws. The
rows of other samples are wasted work: a random op costs its whole-batch time on every replica
(``heterog.cost.model`` prices it so).

Exactness needs the draw to depend on the shape of the arguments, not on their values: true of
dropout, Bernoulli with a probability tensor, uniform and normal draws (values are drawn, then shifted
or compared). A sampler that draws a value-dependent number of times (``poisson``, ``binomial``,
``multinomial`` without replacement) gets other values on a replica, since the rows of other samples
are zeros there; ``inexact_reason`` names such ops, and the equivalence check reports them.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from heterog.runtime.layout import in_memory_order

# samplers whose number of draws depends on the values they are given (see the module docstring)
VALUE_DEPENDENT = frozenset({"poisson", "binomial", "_standard_gamma", "_sample_dirichlet", "multinomial",
                             "randperm", "_dirichlet_grad"})


def is_random(target: Any) -> bool:
    """True for an ATen op that may draw from a random generator."""
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def draws(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """True when a call of ``target`` draws random values: a random op, unless its dropout probability is
    the constant 0 (``p``, ``dropout_p``) or it is told it is not training (``train=False``), as attention
    kernels and dropout are when dropout is off."""
    if not is_random(target):
        return False
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    for i, arg in enumerate(schema.arguments):
        default = arg.default_value if arg.has_default_value() else None
        value = args[i] if i < len(args) else kwargs.get(arg.name, default)
        if arg.name in ("p", "dropout_p") and isinstance(value, (int, float)) and value == 0:
            return False
        if arg.name == "train" and value is False:
            return False
    return True


def inexact_reason(target_name: str) -> str | None:
    """Why a random op cannot give every replica single-device training's values, or None."""
    packet = target_name.split("::")[-1].split(".")[0].rstrip("_")
    if packet in VALUE_DEPENDENT:
        return (f"{packet} draws a number of values that depends on its inputs, so a replica (whose other "
                "samples' rows are zeros) draws other values than single-device training")
    return None


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

    ``samples`` are the positions, in the draw of ``batch`` samples, of the instance's samples in the order
    its rows hold them (a replica: ``range(lo, hi)``; the scaling probe's doubled run: the same samples
    twice). ``sizes`` are the size nodes' values at ``batch`` (the whole batch's shapes)."""

    seed: int
    step: int
    batch: int
    samples: Sequence[int]
    sizes: dict[str, Any]

    @property
    def whole(self) -> bool:
        """The instance holds every sample of the draw, in order (single-device training)."""
        return len(self.samples) == self.batch and all(i == s for i, s in enumerate(self.samples))


def _rows(samples: Sequence[int], per_sample: int, device: torch.device) -> torch.Tensor:
    idx = torch.as_tensor(list(samples), dtype=torch.int64, device=device)
    if per_sample == 1:
        return idx
    return (idx[:, None] * per_sample + torch.arange(per_sample, device=device)).reshape(-1)


def _generator_of(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def call_random(fn: Callable[..., Any], node: RandomNode, args: Sequence[Any], kwargs: dict[str, Any],
                draw: Draw) -> Any:
    """``fn(*args, **kwargs)`` (arguments at the instance's local batch, sizes at the draw's batch) with the
    values single-device training draws for the instance's samples (see the module docstring)."""
    args, kwargs = list(args), dict(kwargs)
    device = next((a.device for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), torch.device("cpu"))
    rows: dict[int, torch.Tensor] = {}

    def rows_of(per_sample: int) -> torch.Tensor:
        r = rows.get(per_sample)
        if r is None:
            r = rows[per_sample] = _rows(draw.samples, per_sample, device)
        return r

    for a in node.batch_args:
        where = kwargs if isinstance(a.index, str) else args
        x = where[a.index]
        if not draw.whole:
            shape = list(x.shape)
            shape[a.dim] = draw.batch * a.per_sample
            where[a.index] = x.new_zeros(shape).index_copy_(a.dim, rows_of(a.per_sample), x.contiguous())
    for where, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
        for k in keys:
            if isinstance(where[k], torch.Tensor) and not where[k].is_contiguous():
                where[k] = where[k].contiguous()
    gen = _generator_of(device)
    saved = gen.get_state()
    gen.manual_seed(draw_key(draw.seed, draw.step, node.name))
    try:
        out = fn(*args, **kwargs)
    finally:
        gen.set_state(saved)
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out)
    for b in node.batch_outputs:
        if not draw.whole:
            outs[b.index] = outs[b.index].index_select(b.dim, rows_of(b.per_sample))
    outs = [in_memory_order(o, order) if isinstance(o, torch.Tensor) else o
            for o, order in zip(outs, node.output_orders)]
    return outs[0] if single else type(out)(outs) if isinstance(out, tuple) else outs
