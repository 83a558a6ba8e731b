"""Batch-scaling exponents: how every tensor of the training step depends on the local batch size, which
is what lets replicas with unequal shares reproduce single-device training exactly.

The scheme. A replica that holds ``b`` of the ``B`` samples runs the step graph at batch ``b``, so it
computes what single-device training on its own samples would: the mean loss over ``b`` samples, and
backward tensors that carry ``1/b`` where the global step has ``1/B``. Every value ``v`` of the step has
an integer *scaling exponent* ``e(v)`` such that, for models whose samples do not interact (no batch
statistics), the copy a replica of share ``b`` holds is

    batch tensors:        v_b = (b / B) ** e * (the rows of the global v for its samples)
    non-batch results     P_b = (b / B) ** (e - 1) * sum over its samples of per-sample terms
    of batch ops (partial):

Forward activations have e = 0, backward activations e = -1 (the ``1/b`` of the mean), the loss and
weight gradients e = 0 (means), the token count of a mean cross-entropy e = 1 (a sum). Three rules then
keep every op instance consistent with the global step:

  1. aggregation: the global value of a partial is ``sum over replicas of (b/B) ** (1 - e) * P_b``
     (e = 0: the share-weighted mean of docs/design.md section 3; e = 1: a plain sum);
  2. re-layout: a piece of a batch tensor moving from a replica of share ``b`` to one of share ``b'`` is
     multiplied by ``(b' / b) ** e`` (backward tensors: ``b / b'``);
  3. a non-batch value ``G`` read by a batch op instance of share ``b`` is fed as ``(b / B) ** e * G``
     (the global token count becomes the count a replica of ``b`` samples would see).

Rule 3 makes a replica reading the aggregated token count compute exactly ``(B/b)`` times the global
gradient rows, so weight gradients aggregated by rule 1 equal the global ones even when some labels are
ignored. Values that are exact global quantities (parameters, their updates) have e = 0 and are never
rescaled; ops without a batch tensor always run on the whole batch.

Batch statistics: a mean-like (e = 0) non-batch result of a batch op that a batch op reads (batch-norm
mean and inverse std) is a statistic of the samples. A reader on the same replicas uses its own replica's
value, so batch statistics are per replica, as in ordinary data parallelism (a reader laid out
differently gets the share-weighted mean). Models with such layers train like data parallelism, not
exactly like one device; ``Exponents.statistics`` lists them.

Rows that fold the samples inside another dim: a batch dim of ``per * B`` entries usually holds the
samples one after the other (sample-major: ``(B, T)`` flattened to ``B*T``), but a model that moves the
batch inward before flattening (``nn.MultiheadAttention`` with ``batch_first=True`` works on ``(T, B, C)``
and projects ``(T*B, C)`` rows) holds them interleaved (sample-minor): a contiguous range of rows is then
some time steps of every sample, not some samples. The probe tells the two apart (a doubled run repeats
whole blocks of rows, or repeats rows within every block) and ``Exponents.sample_minor`` lists the
sample-minor leaves: re-layouts slice and concatenate them within the blocks (``batch_slice``).

Positional values: integer batch tensors whose entries count positions in the batch (the bag offsets
``arange(0, B*L, L)`` and ``offset2bag`` of ``nn.EmbeddingBag``, ``arange(B)`` used as row indices) are
``(position of the sample) x s + (a per-sample part)``; a replica computes them from its own first sample.
The doubled run shows them as the single run followed by the single run plus ``k x s``;
``Exponents.positional`` holds ``s``, and a re-layout adds ``(producer's first sample - consumer's) x s``.

The exponents are measured, not declared: the step runs once on ``k`` samples and once on the same
samples twice over (``2k``); a value whose doubled run equals ``2 ** e`` times the (duplicated) single run
has exponent ``e``. Such duplication leaves per-sample computation unchanged and exposes exactly the
batch-size normalisations. A value that is not a power-of-two multiple depends on how samples interact
(batch-norm statistics, running variance): it gets e = 0 and is reported; replicas then
compute such statistics over their own samples, as in ordinary data parallelism.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from heterog.runtime.coupled_scaling import coupled_exponent, duplicated, minor_blocks, minor_reads, tile_coupled
from heterog.runtime.stepprog import LeafInfo, StepProgram

MAX_EXPONENT = 3
RTOL = 2e-3


@dataclass
class Exponents:
    """Scaling exponent of every leaf; the leaves whose samples interact (exponent 0 assumed) and the
    batch statistics (mean-like results of batch ops read by batch ops: kept per replica)."""

    of: dict[tuple[int, int], int] = field(default_factory=dict)
    coupled: list[str] = field(default_factory=list)
    statistics: set[tuple[int, int]] = field(default_factory=set)
    sample_minor: set[tuple[int, int]] = field(default_factory=set)   # batch dim holds (per, B), samples inside
    positional: dict[tuple[int, int], int] = field(default_factory=dict)   # leaf -> value step per sample

    def __getitem__(self, leaf: tuple[int, int]) -> int:
        return self.of.get(leaf, 0)


def _duplicate(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([x[:k], x[:k]], dim=0)


def measured_exponent(v1: torch.Tensor, v2: torch.Tensor, batch_dim: int | None, zero_below: float = 0.0,
                      minor_per: int = 0) -> int | None:
    """e with v2 = 2**e * dup(v1) (dup: see ``duplicated``), or None if there is none.
    Values whose entries all lie within ``zero_below`` of 0 in both runs are rounding noise (e = 0)."""
    e, largest = exponent_parts(v1, v2, batch_dim, minor_per)
    return 0 if largest is not None and largest <= zero_below else e


def exponent_parts(v1: torch.Tensor, v2: torch.Tensor, batch_dim: int | None, minor_per: int = 0
                   ) -> tuple[int | None, float | None]:
    """``measured_exponent`` in two parts, for a ``zero_below`` known only later: (the exponent if the values
    are not rounding noise, the largest magnitude the noise rule compares; None where it does not apply)."""
    u = duplicated(v1, batch_dim, minor_per)
    if u.shape != v2.shape:
        return None, None
    if not (u.dtype.is_floating_point or u.dtype.is_complex) and torch.equal(u, v2):
        return 0, None                    # integers (a count of targets doubles: e = 1, measured below)
    u64, v64 = u.detach().double().flatten(), v2.detach().double().flatten()
    if u64.numel() == 0:
        return 0, None
    largest = max(float(u64.abs().max()), float(v64.abs().max()))
    uu = float(torch.dot(u64, u64))
    if uu == 0.0 or not math.isfinite(uu):
        return None, largest
    r = float(torch.dot(u64, v64)) / uu
    if not r > 0:                         # also NaN: entries that are not numbers in one run
        return None, largest
    e = round(math.log2(r))
    if abs(e) > MAX_EXPONENT or abs(r - 2.0 ** e) > RTOL * 2.0 ** e:
        return None, largest
    resid = float(torch.linalg.vector_norm(v64 - (2.0 ** e) * u64))
    return (e if resid <= RTOL * math.sqrt(uu) * 2.0 ** e else None), largest


def positional_step(v1: torch.Tensor, v2: torch.Tensor, batch_dim: int, k: int) -> int | None:
    """s when the run on k samples twice over gives ``v1`` then ``v1 + k * s`` along the batch dim (integer
    values that count positions in the batch), else None."""
    if v2.shape[batch_dim] != 2 * v1.shape[batch_dim] or v1.dtype != v2.dtype or v1.dtype.is_complex:
        return None
    first, second = v2.split(v1.shape[batch_dim], dim=batch_dim)
    if not torch.equal(first, v1):
        return None
    diff = (second - v1).unique()
    if diff.numel() != 1 or int(diff) % k:
        return None
    step = int(diff) // k
    return step if step else None


@dataclass
class _Measured:
    """What the probe keeps of one leaf's two values: the parts of its exponent (sample-major, and
    sample-minor where its rows hold several entries per sample), its positional step, and its largest
    entry (for the typical magnitude: None where it is not a finite floating value)."""

    magnitude: float | None
    major: tuple[int | None, float | None] = (None, None)
    minor: tuple[int | None, float | None] | None = None
    positional: int | None = None


def _measure(info: LeafInfo, v1: torch.Tensor, v2: torch.Tensor, k: int, coupled: bool) -> _Measured:
    """A coupled op's leaf (``heterog.runtime.coupled_scaling``) only counts towards the magnitude."""
    finite = v1.is_floating_point() and v1.numel() and bool(torch.isfinite(v1).all())
    out = _Measured(float(v1.detach().abs().max()) if finite else None)
    if coupled:
        return out
    bd = info.batch_dim
    out.major = exponent_parts(v1, v2, bd)
    if bd is not None and info.per_sample > 1:
        out.minor = exponent_parts(v1, v2, bd, info.per_sample)
    if bd is not None and not info.dtype.is_floating_point and out.major[0] is None and \
            (out.minor is None or out.minor[0] is None):
        out.positional = positional_step(v1, v2, bd, k)
    return out


def probe_exponents(prog: StepProgram, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                    state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], samples: int = 2) -> Exponents:
    """Measure the scaling exponent of every leaf (see the module docstring) on the first ``samples``
    samples of ``inputs``. Buffers are copied (batch norm updates them in place).

    The two runs go op by op side by side (``lockstep``): each leaf is measured as soon as both runs have
    made it, and every value goes once its last reader has run, so the probe holds what one training step
    holds at ``3 * samples`` samples, not every value of two steps."""
    k = max(1, min(int(samples), prog.batch_of(inputs)))
    small = [x[:k] if prog.input_batched(i) else x for i, x in enumerate(inputs)]
    doubled = [_duplicate(x, k) if prog.input_batched(i) else x for i, x in enumerate(inputs)]
    # leaves whose exponent matters: outputs of batch ops, and non-batch values that batch ops read
    read_by_batch = {r.leaf for i, rs in enumerate(prog.reads) if prog.op_has_batch[i] for r in rs}
    probed: dict[int, list[tuple[tuple[int, int], LeafInfo]]] = {}
    for leaf, info in prog.leaves.items():
        if info.node is not None and prog.op_kind[info.op] == "compute" and \
                (prog.op_has_batch[info.op] or leaf in read_by_batch):
            probed.setdefault(info.op, []).append((leaf, info))
    coupled = any(prog.op_coupled)
    with torch.no_grad():
        measured: dict[tuple[int, int], _Measured] = {}
        pers: set[int] = set()

        def visit(op: int, env1: dict[str, Any], env2: dict[str, Any]) -> None:
            for leaf, info in probed.get(op, ()):
                v1, v2 = env1.get(info.read_node), env2.get(info.read_node)
                if isinstance(v1, torch.Tensor) and isinstance(v2, torch.Tensor):
                    measured[leaf] = _measure(info, v1, v2, k, prog.op_coupled[op])

        def before_coupled(op: int, env1: dict[str, Any], env2: dict[str, Any]) -> None:
            pers.update(minor_reads(prog, op, env1, env2))

        lockstep(prog, params, buffers, state, small, doubled, {}, visit, before_coupled)
        minor = minor_blocks(prog, pers) if coupled else {}
        if minor:                      # rows of several entries per sample, sample-minor: doubled within blocks
            measured.clear()
            lockstep(prog, params, buffers, state, small, doubled, minor, visit, None)
    # typical magnitude (median of the leaves' largest entries; masks filled with -inf or -1e9 stay out)
    mags = sorted(m.magnitude for m in measured.values() if m.magnitude is not None)
    zero_below = 1e-6 * (mags[len(mags) // 2] if mags else 0.0)

    def settled(parts: tuple[int | None, float | None]) -> int | None:
        e, largest = parts
        return 0 if largest is not None and largest <= zero_below else e

    out = Exponents()
    for leaf, info in prog.leaves.items():
        m = measured.get(leaf)
        if m is None:                  # not probed, or not a tensor in both runs
            continue
        if prog.op_coupled[info.op]:                           # heterog.runtime.coupled_scaling
            c = coupled_exponent(prog, info.op) if info.batch_dim is not None else 0
            if c:
                out.of[leaf] = c
            if info.batch_dim is not None and minor.get(info.op) == info.per_sample:
                out.sample_minor.add(leaf)
            continue
        e = settled(m.major)
        if e is None and m.minor is not None:
            e = settled(m.minor)
            if e is not None:
                out.sample_minor.add(leaf)
        if e is None and m.positional is not None:
            out.positional[leaf] = m.positional
            continue
        if e is None:
            out.coupled.append(info.read_node)
            e = 0
        if e:
            out.of[leaf] = e
        elif info.batch_dim is None and prog.op_has_batch[info.op] and leaf in read_by_batch:
            out.statistics.add(leaf)
    return out


def lockstep(prog: StepProgram, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
             state: Sequence[torch.Tensor], small: Sequence[torch.Tensor], doubled: Sequence[torch.Tensor],
             minor: dict[int, int], visit: Callable[[int, dict, dict], None],
             before_coupled: Callable[[int, dict, dict], None] | None) -> None:
    """The step on ``small`` (k samples) and on ``doubled`` (those samples twice over) op by op, side by side,
    each with its own copy of the buffers and step 0's random draws for its samples; a coupled op gives the
    doubled run the single run's values doubled (``tile_coupled``; ``before_coupled`` sees both runs just
    before). ``visit(op, single, doubled)`` after each op; then the values no later op reads are dropped."""
    k = prog.batch_of(small)
    runs = []
    for inputs, samples in ((small, range(k)), (doubled, [*range(k), *range(k)])):
        env: dict[str, Any] = dict(zip(prog.placeholders, [*params, *[b.clone() for b in buffers], *state,
                                                           *inputs]))
        env.update(prog.consts)
        runs.append((env, prog.sizes_at(prog.batch_of(inputs)),
                     prog.draw(0, max(samples) + 1, samples) if prog.random else None))
    (env1, sym1, draw1), (env2, sym2, draw2) = runs
    for op, dying in enumerate(prog.last_readers()):
        if prog.op_nodes[op]:
            kernel = prog.op_kernel(op)
            kernel(env1, sym1, draw1)
            if prog.op_coupled[op]:
                if before_coupled is not None:
                    before_coupled(op, env1, env2)
                tile_coupled(prog, op, env1, env2, k, minor)
            else:
                kernel(env2, sym2, draw2)
            visit(op, env1, env2)
        for n in dying:
            env1.pop(n, None)
            env2.pop(n, None)
