"""Check a lowered plan before any process starts: every rank's program runs once, in this process, on
CPU tensors (small models) or fake tensors (shapes, dtypes and strides only, the kernels the capture
traced with), in the global order of the instruction keys.

What fails here would fail in a worker: an op that cannot run at a replica's local batch (a size written
into the model, a view the delivered strides do not allow), a message whose shape is not what its
receiver expects, an AllReduce whose members contribute different shapes (an all-gather: not the shards it
expects), a value read before the rank that sends it has produced it (the order would deadlock), or a new
parameter of the wrong shape. The plan is then refused with a ``StrategyError`` naming the rank, the
instruction and the reason.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from heterog.errors import StrategyError
from heterog.graph.shard_exec import combine
from heterog.runtime.executor import Job, RankExecutor
from heterog.runtime.layout import in_memory_order
from heterog.runtime.resharding import Sharding, a2a_assemble, a2a_piece, memory_order, rs_pieces, sum_in_order
from heterog.runtime.split_lowering import whole_values
from heterog.runtime.stepprog import StepProgram
from heterog.runtime.transport import Pending

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.runtime.instructions import Lowered
    from heterog.strategy import Strategy

# steps of at most this many FLOPs are checked on real CPU tensors (cheap for small models, where fake tensors'
# per-op overhead dominates), larger ones on fake tensors (shapes and strides, as the capture traced them)
REAL_FLOPS_LIMIT = 2e8
_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
                NotImplementedError)


# heterog.runtime.api imports this module, so its PreparedRun is described by what the check reads of it
class CheckedModel(Protocol):
    """The captured model of a prepared run (``heterog.runtime.api.Model``)."""

    @property
    def prog(self) -> StepProgram: ...

    @property
    def graph(self) -> OpGraph: ...

    @property
    def example_inputs(self) -> Sequence[torch.Tensor]: ...


class CheckedRun(Protocol):
    """A plan lowered for a model and cluster (``heterog.runtime.api.PreparedRun``)."""

    @property
    def model(self) -> CheckedModel: ...

    @property
    def cluster(self) -> Cluster: ...

    @property
    def strategy(self) -> Strategy: ...

    @property
    def lowered(self) -> Lowered: ...

    def jobs(self, batches: Sequence[Sequence[torch.Tensor]], steps: int, *, return_state: bool = True
             ) -> list[Job]: ...


@dataclass
class _Mail:
    """Messages and collectives' contributions in flight between the ranks of the dry run."""

    messages: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    contributions: dict[tuple, dict[int, torch.Tensor]] = field(default_factory=dict)


class _LocalTransport:
    """The executor's transport interface (post, send, release, take, allreduce, allgather, reduce_scatter,
    all_to_all, finish, flush) within one process."""

    def __init__(self, rank: int, mail: _Mail) -> None:
        self.rank, self.mail, self.idle_s = rank, mail, 0.0
        self.expected: dict[int, tuple[int, tuple, torch.dtype]] = {}
        self.out: dict[int, torch.Tensor] = {}
        self.ar_seq: dict[tuple[int, ...], int] = {}

    def post(self, tag: int, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.expected[tag] = (src, tuple(shape), dtype)
        return torch.empty(shape, dtype=dtype)        # what a worker's receive buffer holds

    def send(self, t: torch.Tensor, dst: int, tag: int, latency_s: float, s_per_byte: float) -> torch.Tensor:
        """A copy to the receiver, as a message is (the sender may overwrite its value afterwards); the sender
        holds what it sends until ``release``, as a worker does."""
        held = self.out[tag] = t.contiguous()
        self.mail.messages[tag] = (self.rank, held.clone())
        return held

    def release(self, tag: int) -> None:
        self.out.pop(tag, None)

    def take(self, tag: int) -> torch.Tensor:
        src, shape, dtype = self.expected.pop(tag)
        if tag not in self.mail.messages:
            raise StrategyError(f"message {tag} from rank {src} is read before rank {src} sends it (the ranks "
                                "would wait for each other)")
        _, t = self.mail.messages.pop(tag)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise StrategyError(f"message {tag} from rank {src} carries {tuple(t.shape)} {t.dtype}, the receiver "
                                f"expects {shape} {dtype}")
        return t

    def allreduce(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                  emulated_s: float) -> Pending:
        key = tuple(members)
        seq = self.ar_seq.get(key, 0)
        self.ar_seq[key] = seq + 1
        self.mail.contributions.setdefault((key, seq), {})[me] = t.clone()
        return Pending(None, t, t.shape, t.dtype, None, members, me, key, stamp=float(seq))

    def allgather(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                  parts: Sequence[tuple[int, tuple[int, ...]]], placement: str, emulated_s: float) -> Pending:
        p = self.allreduce(t, gid, group, members, me, emulated_s)
        p.parts, p.placement = tuple(parts), placement
        return p

    def reduce_scatter(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                       order: Sequence[int], need: Sharding, emulated_s: float) -> Pending:
        p = self.allreduce(t, gid, group, members, me, emulated_s)
        shape, i = tuple(t.shape), list(order).index(me)

        def join(got: dict[int, torch.Tensor]) -> torch.Tensor:
            if {tuple(v.shape) for v in got.values()} != {shape}:
                raise StrategyError(f"a reduce-scatter over ranks {list(members)} sums different shapes "
                                    f"{ {m: tuple(v.shape) for m, v in got.items()} }")
            return in_memory_order(sum_in_order([rs_pieces(got[m], need)[i] for m in members]), memory_order(t))

        p.join, p.order = join, memory_order(t)
        return p

    def all_to_all(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                   order: Sequence[int], shape: tuple[int, ...], have: Sharding, need: Sharding,
                   emulated_s: float) -> Pending:
        p = self.allreduce(t, gid, group, members, me, emulated_s)
        i = list(order).index(me)

        def join(got: dict[int, torch.Tensor]) -> torch.Tensor:
            want = {m: have.shape(shape, j) for j, m in enumerate(order)}
            if {m: tuple(v.shape) for m, v in got.items()} != want:
                raise StrategyError(f"an all-to-all over ranks {list(members)} expects shards {want}, gets "
                                    f"{ {m: tuple(v.shape) for m, v in got.items()} }")
            pieces = [a2a_piece(got[m], shape, have, need, j, i) for j, m in enumerate(order)]
            return a2a_assemble(pieces, shape, have, need, i, memory_order(t))

        p.join, p.order = join, memory_order(t)
        return p

    def finish(self, p: Pending) -> torch.Tensor:
        parts = self.mail.contributions[(p.key, int(p.stamp))]
        what = "an AllReduce" if p.placement is None else "an all-gather"
        missing = sorted(set(p.members) - set(parts))
        if missing:
            raise StrategyError(f"{what} over ranks {list(p.members)} is read before ranks {missing} join it")
        if p.join is not None:
            return p.join(parts)
        shapes = {m: tuple(parts[m].shape) for m in p.members}
        if p.placement is not None:
            want = dict(p.parts)
            if shapes != {m: tuple(want[m]) for m in p.members}:
                raise StrategyError(f"an all-gather over ranks {list(p.members)} expects shards {want}, gets {shapes}")
            return combine([parts[m] for m, _ in p.parts], p.placement)
        if len(set(shapes.values())) != 1:
            raise StrategyError(f"an AllReduce over ranks {list(p.members)} sums different shapes {shapes}")
        acc = parts[p.members[0]]
        for m in p.members[1:]:
            acc = acc + parts[m]
        return acc

    def flush(self) -> None:
        self.out.clear()


def check_prepared(prepared: CheckedRun) -> DryRun | None:
    """Raise ``StrategyError`` when ``prepared`` (a PreparedRun) cannot run (see the module docstring).
    Returns one step's values when the dry run used CPU tensors (None on fake tensors): the per-rank
    programs of any backend (NCCL's included) compute the training step without a process group."""
    model = prepared.model
    jobs = prepared.jobs([model.example_inputs], 1, return_state=False)
    mail = _Mail()
    real = float(model.graph.flops.sum()) <= REAL_FLOPS_LIMIT
    fake_mode = None if real else FakeTensorMode()
    mode = contextlib.nullcontext() if fake_mode is None else fake_mode
    # a tensor shared by several ranks gets one fake; each entry keeps its tensor alive, so that a rank's own
    # copy, dropped once faked, cannot hand its id to another rank's tensor of another shape
    fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def value(t: torch.Tensor) -> torch.Tensor:
        if fake_mode is None:
            return t
        if id(t) not in fakes:
            fakes[id(t)] = (t, fake_mode.from_tensor(t))
        return fakes[id(t)][1]

    cpu = torch.device("cpu")
    ranks: list[RankExecutor] = []
    envs: list[dict[str, Any]] = []
    stashes: list[dict[Any, Any]] = []
    inputs = [value(x) for x in model.example_inputs]
    for r, job in enumerate(jobs):
        ex = RankExecutor(job, r, cpu, transport=_LocalTransport(r, mail))
        ex.slow = 1.0                                   # no emulated slowdown in the dry run
        ex.consts = {k: value(v) for k, v in model.prog.consts.items()}
        ex.persist = {k: value(v) for k, v in ex.persist.items()}
        env = dict(ex.persist)
        with mode:
            for name, i, lo, hi in job.rank.inputs:
                env[name] = inputs[i][lo:hi]
        for rcv in job.rank.recvs:
            ex.transport.post(rcv.tag, rcv.src, rcv.shape, rcv.dtype)
        ranks.append(ex)
        envs.append(env)
        stashes.append({})
    order = sorted((key, r, i) for r, ex in enumerate(ranks) for i, key in enumerate(ex.rp.keys))
    shapes_before = [{ph: tuple(v.shape) for ph, v in ex.persist.items()} for ex in ranks]
    names = prepared.cluster.device_names
    with torch.no_grad(), mode:
        for _, r, i in order:
            ex = ranks[r]
            try:
                ex.execute(i, envs[r], stashes[r])
            except Exception as exc:
                if not real and isinstance(exc, _FAKE_LIMITS):
                    # an op fake tensors cannot run (data-dependent sizes): the check cannot say more
                    logging.getLogger(__name__).info("plan not checked before launch: %s", _reason(exc))
                    return None
                raise StrategyError(f"plan {prepared.strategy.method or 'strategy'} cannot run: rank {r} "
                                    f"({names[r]}), {ex.describe(i)}: {_reason(exc)}") from exc
    reported: list[dict[str, torch.Tensor]] = []
    loss = 0.0
    with torch.no_grad(), mode:
        for r, ex in enumerate(ranks):
            shapes = shapes_before[r]
            try:
                if not real:
                    for ph, src in ex.rp.updates:
                        ex.persist[ph] = ex._fetch(src, envs[r], stashes[r])
                    for src, _ in ex.rp.loss_terms:
                        ex._fetch(src, envs[r], stashes[r])
                else:
                    loss += ex._step_end(envs[r], stashes[r], 0.0)[1]
                wrong = {ph: tuple(v.shape) for ph, v in ex.persist.items() if tuple(v.shape) != shapes[ph]}
                if wrong:
                    raise StrategyError(f"new values of the wrong shape {wrong} (want {[shapes[p] for p in wrong]})")
            except Exception as exc:
                raise StrategyError(f"plan {prepared.strategy.method or 'strategy'} cannot run: rank {r} "
                                    f"({names[r]}), {ex.describe(len(ex.rp.instrs))}: {_reason(exc)}") from exc
            reported.append({ph: ex.persist[ph] for _, ph in ex.rp.report})
    return DryRun(whole_values(prepared.lowered, reported), loss) if real else None


@dataclass
class DryRun:
    """What the dry run on CPU tensors computed: one step's final placeholder values and the loss."""

    values: dict[str, torch.Tensor]
    loss: float


def _reason(exc: BaseException) -> str:
    notes = "; ".join(getattr(exc, "__notes__", ()))
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" + (f" ({notes})" if notes else "")


def metered_dry_run(prepared: CheckedRun) -> list[tuple[int, int]]:
    """One step of every rank's program in this process on CPU tensors, each rank metered as its worker meters
    its first step (``heterog.runtime.memory.LiveBytes``): per rank, (device peak bytes, host peak bytes). What
    a rank holds depends only on its own program's order, not on timing, so this is what its worker measures
    but for the 64-byte header of each emulated message it holds (``tests/runtime/test_memory.py`` holds the two
    equal under single-device and data-parallel plans, and within those headers under a parameter server)."""
    return [(ex.memory.peak, ex.host_memory.peak) for ex in metered_ranks(prepared)]


def metered_ranks(prepared: CheckedRun) -> list[RankExecutor]:
    """Every rank's executor after ``metered_dry_run``'s step (its meters, ``memory`` and ``host_memory``, hold
    what it held at the step's end and its peaks)."""
    model = prepared.model
    jobs = prepared.jobs([model.example_inputs], 1, return_state=False)
    mail = _Mail()
    ranks: list[RankExecutor] = []
    envs: list[dict[str, Any]] = []
    for r, job in enumerate(jobs):
        ex = RankExecutor(job, r, torch.device("cpu"), transport=_LocalTransport(r, mail))
        ex.slow = 1.0
        ex._mem, ex._host_mem = ex.memory, ex.host_memory
        envs.append(ex.begin_step(job.inputs[0]))
        for rcv in job.rank.recvs:
            ex.transport.post(rcv.tag, rcv.src, rcv.shape, rcv.dtype)
        ranks.append(ex)
    stashes: list[dict[Any, Any]] = [{} for _ in ranks]
    order = sorted((key, r, i) for r, ex in enumerate(ranks) for i, key in enumerate(ex.rp.keys))
    with torch.no_grad():
        for _, r, i in order:
            ranks[r].execute(i, envs[r], stashes[r])
        for r, ex in enumerate(ranks):
            ex._step_end(envs[r], stashes[r], 0.0)
    return ranks
