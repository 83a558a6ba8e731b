"""The runtime's instructions: what one rank does in a step, one small frozen dataclass per kind, built by
``heterog.runtime.lowering`` and run by ``heterog.runtime.executor`` (matched by type).

Values come from *sources*: ``Env`` (a value this rank computed or holds: an fx node's name), ``Stash``
(a value derived on this rank: re-laid out, aggregated, received whole), ``Recv`` (a message, by tag),
``Const`` (a constant of the captured step) or ``Zeros`` (a zero tensor standing in for a value that
only its shape matters for). A ``Slice`` names samples of a batch tensor (``layout.narrow_batch``);
``order`` is the memory order of a value's dims, outermost first, that the captured program expects
(``layout.in_memory_order``). A ``RankProgram`` is one rank's instructions, ``Lowered`` every rank's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


# ---------------------------------------------------------------------------- sources
@dataclass(frozen=True, slots=True)
class Env:
    """A value of this rank's environment: fx node ``node``'s output, a placeholder or an input slice."""

    node: str


@dataclass(frozen=True, slots=True)
class Stash:
    """A value derived on this rank (``key``: ``("r", node, layout)`` re-laid out, ``("g", node)``
    aggregated, ``("x", node)`` received whole)."""

    key: tuple


@dataclass(frozen=True, slots=True)
class Recv:
    """The payload of message ``tag`` (taken when first read)."""

    tag: int


@dataclass(frozen=True, slots=True)
class Const:
    """A constant of the captured step (``StepProgram.consts``)."""

    node: str


@dataclass(frozen=True, slots=True)
class Zeros:
    """Zeros of a value's shape, for readers that use only its shape (``VALUE_FREE_TARGETS``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...] | None


Source = Env | Stash | Recv | Const | Zeros


def env_name(node: str, micro: int, recomputed: bool = False) -> str:
    """The environment name of fx node ``node``'s value for micro-batch ``micro`` (the node's own name
    for micro-batch 0 and for values of the whole step), or of its recomputed copy (``recomputed``)."""
    name = node if micro == 0 else f"{node}@{micro}"
    return name + "~r" if recomputed else name
Slice = tuple[int, int, int, int]          # (dim, start, end, block): see layout.narrow_batch


class Piece(NamedTuple):
    """One part of an assembled or aggregated value: ``source`` (sliced, times ``scale``, plus ``shift``)."""

    source: Source
    slice: Slice | None
    scale: float
    shift: int


class Input(NamedTuple):
    """What a compute instruction reads for fx node ``node``: ``source`` (times ``scale``) is the value of
    leaf node ``leaf``, then view ``chain`` runs on it at the local batch; ``tuple_index`` picks an
    element of a tuple-valued producer."""

    node: str
    source: Source
    leaf: str | None
    chain: tuple[str, ...]
    scale: float
    tuple_index: int | None


# ---------------------------------------------------------------------------- instructions
@dataclass(frozen=True, slots=True)
class Compute:
    """Op ``op``'s fx nodes at ``local_batch`` samples (``first_sample`` .. of the batch) of micro-batch
    ``micro``; ``exports``: the node values kept for later instructions."""

    op: int
    local_batch: int
    inputs: tuple[Input, ...]
    exports: tuple[str, ...]
    first_sample: int
    micro: int = 0             # the micro-batch: exports are kept as ``env_name(node, micro, recompute)``
    recompute: bool = False    # the op's forward run again before its backward (its recomputed copy)

    kind = "compute"


@dataclass(frozen=True, slots=True)
class Send:
    """``source`` (sliced, scaled) to rank ``dst`` as message ``tag``; ``link``: the emulated (latency s,
    seconds per byte) of the link (zeros: no emulation)."""

    source: Source
    slice: Slice | None
    scale: float
    dst: int
    tag: int
    link: tuple[float, float]

    kind = "send"


@dataclass(frozen=True, slots=True)
class Assemble:
    """Stash ``key`` = the pieces joined along the batch (``batch``: (dim, block); None: one whole
    piece), in memory ``order``."""

    key: tuple
    batch: tuple[int, int] | None
    pieces: tuple[Piece, ...]
    order: tuple[int, ...] | None

    kind = "assemble"


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Stash ``key`` = the sum of the parts (a parameter server's aggregation), in memory ``order``."""

    key: tuple
    parts: tuple[Piece, ...]
    order: tuple[int, ...] | None

    kind = "aggregate"


@dataclass(frozen=True, slots=True)
class AllReduce:
    """Stash ``key`` = the sum over subgroup ``group`` of ``source`` x ``scale`` (asynchronous: waited for
    where first read); ``emulated_s``: the nominal ring time the emulation enforces."""

    key: tuple
    group: int
    source: Source
    scale: float
    emulated_s: float
    order: tuple[int, ...] | None

    kind = "allreduce"


@dataclass(frozen=True, slots=True)
class Post:
    """Post the receive of message ``tag`` (NCCL: receives are posted in global message order)."""

    tag: int

    kind = "post"


Instruction = Compute | Send | Assemble | Aggregate | AllReduce | Post


class Receive(NamedTuple):
    """A message this rank receives each step."""

    tag: int
    src: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: tuple


class InputSlice(NamedTuple):
    """Rows ``lo:hi`` of model input ``input_index`` (``hi`` None: the whole input) as placeholder ``name``."""

    name: str
    input_index: int
    lo: int
    hi: int | None


def sources(ins: Instruction) -> list[Source]:
    """The sources ``ins`` reads."""
    if isinstance(ins, Compute):
        return [i.source for i in ins.inputs]
    if isinstance(ins, (Send, AllReduce)):
        return [ins.source]
    if isinstance(ins, Assemble):
        return [p.source for p in ins.pieces]
    if isinstance(ins, Aggregate):
        return [p.source for p in ins.parts]
    return []


# ---------------------------------------------------------------------------- programs
@dataclass
class Message:
    """One point-to-point transfer of a step."""

    src: int
    dst: int
    key: tuple
    shape: tuple[int, ...]
    dtype: torch.dtype
    tag: int = -1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class RankProgram:
    """What one rank does each step (``heterog.runtime.instructions``; run by ``heterog.runtime.executor``)."""

    rank: int
    device_name: str
    slowdown: float
    # placeholder -> initial value (None until ``PreparedRun.jobs`` fills it in)
    persist: dict[str, torch.Tensor | None] = field(default_factory=dict)
    inputs: list[InputSlice] = field(default_factory=list)
    recvs: list[Receive] = field(default_factory=list)
    instrs: list[Instruction] = field(default_factory=list)
    keys: list[tuple] = field(default_factory=list)
    frees: list[tuple[Env | Stash, ...]] = field(default_factory=list)  # per instruction: values last read there
    updates: list[tuple[str, Source]] = field(default_factory=list)   # (placeholder, source) at the step end
    loss_terms: list[tuple[Source, float]] = field(default_factory=list)
    report: list[tuple[str, str]] = field(default_factory=list)        # (kind param|state|buffer, placeholder)
    batches: set[int] = field(default_factory=set)


@dataclass
class Lowered:
    """The per-rank programs of one plan, the process subgroups to create (in order) and statistics."""

    ranks: list[RankProgram]
    groups: list[tuple[int, ...]]
    messages: list[Message]
    n_allreduce: int
    n_aggregate: int
