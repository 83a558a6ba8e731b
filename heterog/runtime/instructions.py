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
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from heterog.runtime.resharding import Sharding


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
END = (math.inf, math.inf)                 # an instruction key after every task of the step


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


@dataclass(frozen=True, slots=True)
class Part:
    """A device's part of a value divided beyond the batch (``heterog.graph.sharding`` placements):
    ``"S<d>[:<f>]"`` its ``shares[rank]`` of ``extent`` units of dim d, ``"P"`` a partial sum, ``"R"`` the
    whole value."""

    placement: str
    extent: int | None
    shares: tuple[int, ...]
    rank: int


@dataclass(frozen=True, slots=True)
class Local:
    """How a device runs the fx nodes of an op divided beyond the batch: the size arguments
    ``(node, arg, element or None)`` that take ``value * share // extent``, and the node that runs
    ``transform`` (``heterog.graph.shard_exec.local_transform``) holding units ``offset ..``."""

    size_args: tuple[tuple[str, int, int | None], ...]
    transform: str | None
    transform_node: str | None
    share: int
    offset: int
    extent: int | None


# ---------------------------------------------------------------------------- instructions
@dataclass(frozen=True, slots=True)
class Compute:
    """Op ``op``'s fx nodes at ``local_batch`` samples (``first_sample`` .. of the batch) of micro-batch
    ``micro``; ``exports``: the node values kept for later instructions; ``local``: this device's way of
    running an op divided beyond the batch (None: the whole op); ``stats``: the whole batch's sums of a synced
    batch norm (``heterog.runtime.sync_stats``; its batch-norm node reads them, at the instance's gradient
    convention ``stats_scale``); ``host``: run on the host CPU on values in host memory (an update of
    offloaded state, ``heterog.runtime.state_lowering``)."""

    op: int
    local_batch: int
    inputs: tuple[Input, ...]
    exports: tuple[str, ...]
    first_sample: int
    micro: int = 0             # the micro-batch: exports are kept as ``env_name(node, micro, recompute)``
    recompute: bool = False    # the op's forward run again before its backward (its recomputed copy)
    local: Local | None = None
    stats: Stash | None = None
    stats_scale: float = 1.0
    host: bool = False

    kind = "compute"


@dataclass(frozen=True, slots=True)
class BatchStats:
    """Stash ``key`` = the count and per-channel sums of batch-norm node ``node`` over the instances ``parts``
    (their inputs fetched as they fetch them), each instance's sums times its ``weights`` entry
    (``heterog.runtime.sync_stats.local_sums``)."""

    key: tuple
    node: str
    parts: tuple[Compute, ...]
    weights: tuple[float, ...]

    kind = "batchstats"


@dataclass(frozen=True, slots=True)
class Combine:
    """Stash ``key`` = the whole value from every device's part under ``placement`` (in device order:
    shards concatenated, partial sums added, a replica's copy), in memory ``order``."""

    key: tuple
    parts: tuple[Source, ...]
    placement: str
    order: tuple[int, ...] | None

    kind = "combine"


@dataclass(frozen=True, slots=True)
class Derive:
    """Stash ``key`` = ``source`` x ``scale`` (the value of leaf node ``leaf``, element ``index`` of a tuple
    value; ``pad``: a device's shard of it, put in zeros of the whole shape, one of its partial sums), view
    ``chain`` run on it at
    ``local_batch`` (on a device's shard: with ``local``'s sizes), then this device's ``part`` of the result
    (None: all of it): a view of the result where the part is dense in it (the simulator counts the whole
    value to the last reader of its parts), in a tensor of its own where ``own`` (the rest is let go)."""

    key: tuple
    source: Source
    scale: float
    leaf: str
    chain: tuple[str, ...]
    local_batch: int
    local: Local | None
    part: Part | None
    pad: Part | None = None
    index: int | None = None
    own: bool = False

    kind = "derive"


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
class AllGather:
    """Stash ``key`` = the whole value from the shards that the members of subgroup ``group`` hold of it
    (``source`` on each), joined under ``placement`` (``"S<d>[:<f>]"``) in part order: ``parts`` lists the
    members in that order with the shape of each one's shard (uneven shards are padded to the largest for
    NCCL's all-gather and trimmed). Asynchronous: waited for where first read; ``emulated_s``: the nominal
    ring time the emulation enforces. ``into``: an env value the whole value lands in, in place, where no
    later instruction reads it (a parameter's next value gathered into the old one's buffer), else None."""

    key: tuple
    group: int
    source: Source
    placement: str
    parts: tuple[tuple[int, tuple[int, ...]], ...]
    emulated_s: float
    order: tuple[int, ...] | None
    into: str | None = None

    kind = "allgather"


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """Stash ``key`` = this member's shard under ``need`` of the sum over the members of subgroup ``group`` of
    ``source`` x ``scale`` (each member's partial sum of the whole value): ``need`` divides the value in
    shards of uneven sizes (``"S<d>[:<f>]"``, ``extent`` units shared in part order), ``members`` lists the
    members in that order. On CPU each member sends every other one its part and sums the parts it gets in
    member order; on GPUs NCCL's reduce-scatter of the shards padded to the largest, trimmed.
    Asynchronous: waited for where first read; ``emulated_s``: the nominal ring time the emulation
    enforces. The result is laid out in memory ``order`` (the whole value's, as a shard cut from it is)."""

    key: tuple
    group: int
    source: Source
    scale: float
    members: tuple[int, ...]
    need: Sharding
    emulated_s: float
    order: tuple[int, ...] | None

    kind = "reducescatter"


@dataclass(frozen=True, slots=True)
class AllToAll:
    """Stash ``key`` = this member's shard under ``need`` of a value of ``shape`` that the members of subgroup
    ``group`` hold as shards under ``have`` (``source`` on each; both in the part order of ``members``):
    a shard along another dimension, or of other units. Each member sends every other one the entries of
    its shard that the other's new shard holds (uneven pieces; only copies, exact on every backend).
    Asynchronous: waited for where first read; ``emulated_s``: the nominal time the emulation enforces.
    The result is laid out in memory ``order``."""

    key: tuple
    group: int
    source: Source
    members: tuple[int, ...]
    shape: tuple[int, ...]
    have: Sharding
    need: Sharding
    emulated_s: float
    order: tuple[int, ...] | None

    kind = "alltoall"


@dataclass(frozen=True, slots=True)
class Copy:
    """Stash ``key`` = a copy of ``source`` in host memory (``to_host``) or in the device's (offloaded state,
    ``heterog.runtime.state_lowering``). On GPUs through pinned host memory, asynchronous (a copy to the host is
    waited for where first read); on CPU workers, whose host and device memory are one, a copy all the same
    (the two sides are held, metered and freed apart). ``into``: an env value a copy to the device lands in,
    in place (its rows ``part``; None: the whole), where no later instruction reads it (a parameter's next
    value copied up into the old one's buffer), else None."""

    key: tuple
    source: Source
    to_host: bool
    into: str | None = None
    part: Part | None = None

    kind = "copy"


@dataclass(frozen=True, slots=True)
class Post:
    """Post the receive of message ``tag`` (NCCL: receives are posted in global message order)."""

    tag: int

    kind = "post"


@dataclass(frozen=True, slots=True)
class Sent:
    """The simulated end of message ``tag``'s transfer: the sender lets go of what it sent
    (``heterog.runtime.transfers``)."""

    tag: int

    kind = "sent"


@dataclass(frozen=True, slots=True)
class Finish:
    """The simulated end of the collective whose result is stash ``key``: waited for, its contribution let go of
    (``heterog.runtime.transfers``)."""

    key: tuple

    kind = "finish"


Instruction = (Compute | Send | Assemble | Aggregate | AllReduce | AllGather | ReduceScatter | AllToAll | Post | Combine
               | Derive | BatchStats | Copy | Sent | Finish)


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
        return [i.source for i in ins.inputs] + ([ins.stats] if ins.stats is not None else [])
    if isinstance(ins, BatchStats):
        return [i.source for part in ins.parts for i in part.inputs]
    if isinstance(ins, (Send, AllReduce, AllGather, ReduceScatter, AllToAll, Derive, Copy)):
        return [ins.source]
    if isinstance(ins, Combine):
        return list(ins.parts)
    if isinstance(ins, Assemble):
        return [p.source for p in ins.pieces]
    if isinstance(ins, Aggregate):
        return [p.source for p in ins.parts]
    if isinstance(ins, Finish):
        return [Stash(ins.key)]
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
    persist_parts: dict[str, Part] = field(default_factory=dict)       # placeholders held as a part of the value
    host: dict[str, str] = field(default_factory=dict)    # persist values in host memory -> the placeholder whose
                                                          # initial value they start from (offloaded state)
    batches: set[int] = field(default_factory=set)


@dataclass
class Lowered:
    """The per-rank programs of one plan, the process subgroups to create (in order) and statistics."""

    ranks: list[RankProgram]
    groups: list[tuple[int, ...]]
    messages: list[Message]
    n_allreduce: int
    n_aggregate: int
    # placeholders held divided beyond the batch: (placement, devices in part order) to put them back together
    parts: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)


def with_tags(instr: Instruction, tag_of: list[int]) -> Instruction:
    """``instr`` with its messages named by tag instead of by index in the message list."""
    def piece(p: Piece) -> Piece:
        return p._replace(source=Recv(tag_of[p.source.tag])) if isinstance(p.source, Recv) else p

    if isinstance(instr, Send):
        return replace(instr, tag=tag_of[instr.tag])
    if isinstance(instr, Assemble):
        return replace(instr, pieces=tuple(piece(p) for p in instr.pieces))
    if isinstance(instr, Aggregate):
        return replace(instr, parts=tuple(piece(p) for p in instr.parts))
    if isinstance(instr, Combine):
        return replace(instr, parts=tuple(Recv(tag_of[p.tag]) if isinstance(p, Recv) else p for p in instr.parts))
    return instr


def last_uses(rp: RankProgram) -> list[tuple[Env | Stash, ...]]:
    """Per instruction, the env names and stash keys whose last use it is (values needed at the step
    end, by updates and the loss, are kept). A parameter, buffer or state value that the step replaces is
    freed after its last reader too where an op of this rank makes the new value: the step updates it in
    place (``RankExecutor`` writes the new value into the old one's storage where the writer is its last
    reader), so the old and the new value are not both held to the step's end. One the step keeps, and one
    whose new value arrives (all-gathered from its shards, copied up from the host), is held throughout (the
    new value lands in its buffer: ``AllGather.into``, ``Copy.into``)."""
    keep = {src for _, src in rp.updates} | {src for src, _ in rp.loss_terms}
    replaced = {ph for ph, src in rp.updates if isinstance(src, Env) and src != Env(ph)}
    last: dict[Env | Stash, int] = {}
    for i, instr in enumerate(rp.instrs):
        for src in sources(instr):
            if isinstance(src, (Env, Stash)):
                last[src] = i
    frees: list[list[Env | Stash]] = [[] for _ in rp.instrs]
    for src, i in last.items():
        if src not in keep and not (isinstance(src, Env) and src.node in rp.persist and src.node not in replaced):
            frees[i].append(src)
    return [tuple(f) for f in frees]
