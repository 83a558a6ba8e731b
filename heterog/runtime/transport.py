"""How ranks exchange values: point-to-point messages (framed with their emulated arrival time on
local-cpu clusters), AllReduce, and the all-gather, reduce-scatter and all-to-all of uneven shards (a direct
exchange of messages on CPU, NCCL's collectives on GPUs), one gloo process group per direction between two
ranks, and the progress each rank reports to its parent."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from heterog.graph.shard_exec import combine
from heterog.runtime.resharding import (
    Sharding,
    a2a_assemble,
    a2a_piece,
    a2a_piece_shape,
    memory_order,
    pack_padded,
    pack_split,
    rs_pieces,
    sum_in_order,
    unpack_padded,
    unpack_split,
)

# CPU collectives' messages: tag = base + subgroup index x span + sequence number in the subgroup (mod span);
# above every plan message tag, and below 2**32 (gloo's slot)
_AR_TAG_BASE, _AR_SEQ_SPAN, _AR_MAX_GROUPS = 1 << 30, 1 << 16, 1 << 14
_F64 = torch.float64
# emulated messages: [time stamp (float64) | zero padding | payload]; 64 bytes keep the payload as aligned as
# a fresh allocation (an 8-byte header left it misaligned, and the first ops reading a received tensor took
# up to 2x their profiled time)
_HEADER_BYTES = 64


def _frame(stamp: float, t: torch.Tensor) -> torch.Tensor:
    """An emulated message: ``stamp`` in the header, then ``t``'s bytes."""
    header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
    header[:8] = torch.from_numpy(np.array([stamp], dtype=np.float64).view(np.uint8))
    if not t.numel():
        return header
    flat = t.reshape(-1)
    if flat.stride(0) != 1:                 # one element kept with stride 0 (an expanded value): copy it
        flat = flat.clone(memory_format=torch.contiguous_format)
    return torch.cat((header, flat.view(torch.uint8)))


def _unframe(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[float, torch.Tensor]:
    """The stamp and the payload of an emulated message: a tensor of ``shape`` and ``dtype`` on ``buf``'s
    storage that is not a view of ``buf``, so that once ``buf`` is dropped the receiver holds it alone and
    may write into it, as into a message received unframed (a PS adds its workers' gradients into the
    first one it holds: ``RankExecutor._sum``, ``heterog.runtime.memory.exclusive``)."""
    stamp = float(buf[:8].numpy().view(np.float64)[0])
    n = buf.numel() - _HEADER_BYTES
    if not n:
        return stamp, torch.empty(shape, dtype=dtype, device=buf.device)
    view = buf[_HEADER_BYTES:].view(dtype).reshape(shape)
    payload = torch.empty(0, dtype=dtype, device=buf.device).set_(view.untyped_storage(), view.storage_offset(),
                                                                  view.shape, view.stride())
    return stamp, payload


# ---------------------------------------------------------------------------- status shared with the parent
class SharedInts(Protocol):
    """Integers a rank writes for its parent to read (a ``multiprocessing.Array`` of ``"q"``)."""

    def __getitem__(self, index: int) -> int: ...

    def __setitem__(self, index: int, value: int) -> None: ...


class StatusLike(Protocol):
    """Where a rank reports its progress: ``Status`` (shared with the parent) or ``NullStatus``."""

    @property
    def peer(self) -> int: ...

    def at(self, step: int, index: int) -> None: ...

    def waiting(self, peer: int) -> None: ...


class Status:
    """Per-rank progress in shared memory: step, instruction index, peer waited for (-1 none (computing),
    -2 a collective, -3 the barrier between steps, -4 a checkpoint being written)."""

    def __init__(self, array: SharedInts, rank: int) -> None:
        self.a, self.base = array, 3 * rank
        self.peer = -1

    def at(self, step: int, index: int) -> None:
        self.a[self.base] = step
        self.a[self.base + 1] = index

    def waiting(self, peer: int) -> None:
        self.a[self.base + 2] = peer
        self.peer = peer


class NullStatus:
    peer = -1

    def at(self, step: int, index: int) -> None:
        pass

    def waiting(self, peer: int) -> None:
        self.peer = peer


def waited_for(peer: int) -> str:
    return {-2: "a collective", -3: "the barrier between steps", -4: "a checkpoint being written"}.get(
        peer, f"rank {peer}")


# ---------------------------------------------------------------------------- transport
class TransportLike(Protocol):
    """What the executor sends, receives and reduces through: ``Transport`` (torch.distributed) or the
    in-process one of ``heterog.runtime.check``. ``idle_s``: seconds spent waiting so far."""

    idle_s: float

    def post(self, tag: int, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def send(self, t: torch.Tensor, dst: int, tag: int, latency_s: float, s_per_byte: float) -> torch.Tensor: ...

    def release(self, tag: int) -> None: ...

    def take(self, tag: int) -> torch.Tensor: ...

    def allreduce(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                  emulated_s: float) -> Pending: ...

    def allgather(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                  parts: Sequence[tuple[int, tuple[int, ...]]], placement: str, emulated_s: float) -> Pending: ...

    def reduce_scatter(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                       order: Sequence[int], need: Sharding, emulated_s: float) -> Pending: ...

    def all_to_all(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                   order: Sequence[int], shape: tuple[int, ...], have: Sharding, need: Sharding,
                   emulated_s: float) -> Pending: ...

    def finish(self, p: Pending) -> torch.Tensor: ...

    def flush(self) -> None: ...


_CHANNELS: dict[int, dict[tuple[int, int], Any]] = {}     # per default process group: (src, dst) -> group


def p2p_channels(device: torch.device) -> dict[tuple[int, int], Any]:
    """CPU (gloo): one process group per ordered pair of ranks, ``(src, dst) -> group``, that carries only
    the messages from ``src`` to ``dst``; GPUs (NCCL): empty (the default group is used).

    On the default group two ranks share one gloo pair (one socket and its lock) for both directions.
    When both send at the same moment, as plans with transfers both ways do at every layout change, the
    caller's write and the device thread's read contend for that pair and a send of a few bytes now and
    then blocks for a scheduler time slice (measured with crossing sends on one pair against one
    group per direction; the figures are in docs/journal.md). Created once per
    process and default group, collectively: every rank must call this at the same point (every job's
    ``Transport`` does, on every rank)."""
    if device.type != "cpu" or not dist.is_initialized() or dist.get_world_size() < 2:
        return {}
    key = id(dist.group.WORLD)
    if key not in _CHANNELS:
        world = dist.get_world_size()
        _CHANNELS.clear()             # a former default group's channels are gone with it
        _CHANNELS[key] = {(a, b): dist.new_group([a, b]) for a in range(world) for b in range(world) if a != b}
    return _CHANNELS[key]


class Transport:
    """Point-to-point messages, AllReduce, all-gather, reduce-scatter and all-to-all with optional link emulation
    (see the module docstring).
    ``rank``: this process's rank; messages travel on ``p2p_channels``."""

    def __init__(self, device: torch.device, emulate: bool, status: StatusLike, rank: int) -> None:
        self.device, self.emulate, self.status, self.rank = device, emulate, status, rank
        self.channels = p2p_channels(device)
        self.link_free: dict[int, float] = {}
        self.idle_s = 0.0          # time spent waiting (messages, collectives, emulated delays)
        self.sends: list[tuple[Any, torch.Tensor]] = []                   # collectives' messages
        self.messages_out: dict[int, list[tuple[Any, torch.Tensor, torch.Tensor, int]]] = {}   # p2p, by tag
        self.recvs: dict[int, tuple] = {}
        self.in_flight: dict[tuple[int, ...], list[Pending]] = {}    # started collectives, per group
        self.group_ready: dict[tuple[int, ...], float] = {}            # emulation: when each group is free
        self.ar_seq: dict[tuple[int, ...], int] = {}                   # CPU AllReduces started, per group

    def post(self, tag: int, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Post the receive of message ``tag``; returns the buffer it lands in."""
        n = math.prod(shape) * dtype.itemsize
        if self.emulate:
            buf = torch.empty(n + _HEADER_BYTES, dtype=torch.uint8, device=self.device)
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.recvs[tag] = (dist.irecv(buf, src=src, tag=tag, group=self.channels.get((src, self.rank))), buf, shape,
                           dtype, n, src)
        return buf

    def send(self, t: torch.Tensor, dst: int, tag: int, latency_s: float, s_per_byte: float) -> torch.Tensor:
        """Start sending ``t`` as message ``tag``; returns what is sent, held until it is delivered (emulated: the
        value, not its framed copy, as a GPU holds the value it sends)."""
        t = value = t.contiguous()
        if self.emulate:                              # CPU only: [ready time (float64) | payload bytes]
            n = t.numel() * t.element_size()
            now = time.perf_counter()
            ready = max(now, self.link_free.get(dst, 0.0)) + latency_s + n * s_per_byte
            self.link_free[dst] = ready
            t = _frame(ready, t)
        self.messages_out.setdefault(tag, []).append(
            (dist.isend(t, dst=dst, tag=tag, group=self.channels.get((self.rank, dst))), t, value, dst))
        return value

    def release(self, tag: int) -> None:
        """Let go of message ``tag``'s tensor at its transfer's simulated end (``Sent``), once delivered: the
        receiver posts it at the transfer's start, which comes before in every rank's order (no deadlock). The
        rank waits for the receiver meanwhile (its status names it: a receiver that hangs is the one blamed)."""
        t0 = time.perf_counter()
        for work, _, _, dst in self.messages_out.pop(tag, ()):
            self.status.waiting(dst)
            work.wait()
            self.status.waiting(-1)
        self.idle_s += time.perf_counter() - t0

    def take(self, tag: int) -> torch.Tensor:
        work, buf, shape, dtype, n, src = self.recvs.pop(tag)
        t0 = time.perf_counter()
        self.status.waiting(src)
        work.wait()
        self.status.waiting(-1)
        if self.emulate:
            ready, buf = _unframe(buf, shape, dtype)
            wait = ready - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        self.idle_s += time.perf_counter() - t0
        return buf

    def allreduce(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                  emulated_s: float) -> Pending:
        """Start summing ``t`` (a fresh tensor) over the members of subgroup ``gid`` (``group``: its
        process group); ``finish`` waits for the sum.

        On GPUs this is NCCL's AllReduce. On CPU it is a direct exchange of point-to-point messages: each
        member sends ``t`` to every other member and adds all of them in member order, so every member
        gets the same bits. gloo hands each collective to a worker thread, which on a few busy cores costs
        several times a message exchange on a few busy cores (measured in docs/journal.md).
        """
        if self.device.type == "cuda":
            t = t.contiguous()
            p = Pending(dist.all_reduce(t, group=group, async_op=True), t, t.shape, t.dtype, None, members, me,
                        tuple(members))
        else:
            p = self._exchange(t, {m: t for m in members}, gid, members, me, {m: tuple(t.shape) for m in members},
                               emulated_s)
        self.in_flight.setdefault(p.key, []).append(p)
        return p

    def allgather(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                  parts: Sequence[tuple[int, tuple[int, ...]]], placement: str, emulated_s: float) -> Pending:
        """Start putting a value together on every member of subgroup ``gid`` from the members' shards of it
        (``t``: this member's; ``parts``: (member, shard shape) in part order, joined under ``placement`` by
        ``heterog.graph.shard_exec.combine``); ``finish`` waits for the whole value.

        On GPUs this is NCCL's all-gather of the shards flattened and padded to the largest
        (``start_uneven_gather``), trimmed when it is done. On CPU it is a direct exchange of point-to-point
        messages as ``allreduce``'s (in the same sequence of the subgroup's collectives). Every member
        joins the same shards in the same order: the same bits everywhere.
        """
        shapes = dict(parts)
        if self.device.type == "cuda":
            ranks = tuple(dist.get_process_group_ranks(group))         # the order of the gathered list
            work, out = start_uneven_gather(t, [shapes[m] for m in ranks], group)
            p = Pending(work, t, t.shape, t.dtype, None, members, me, tuple(members), gathered=(ranks, out))
        else:
            p = self._exchange(t, {m: t for m in members}, gid, members, me, shapes, emulated_s)
        p.parts, p.placement = tuple(parts), placement
        self.in_flight.setdefault(p.key, []).append(p)
        return p

    def reduce_scatter(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                       order: Sequence[int], need: Sharding, emulated_s: float) -> Pending:
        """Start this member's shard under ``need`` of the sum over the members of subgroup ``gid`` of their
        partial sums ``t`` of the whole value (``order``: the members in part order, the shards of
        ``need``'s shares); ``finish`` waits for it (``Pending.order``: ``t``'s memory order).

        On GPUs this is NCCL's reduce-scatter of the shards flattened and padded to the largest
        (``heterog.runtime.resharding.pack_padded``), trimmed when it is done. On CPU it is a direct
        exchange of point-to-point messages as ``allreduce``'s: each member sends every other member its
        part of ``t`` and adds the parts it receives in member order (the same bits as the sum of the whole
        values in member order, cut).
        """
        pieces = dict(zip(order, rs_pieces(t, need)))
        shape = need.shape(tuple(t.shape), list(order).index(me))
        keep = memory_order(t)
        if self.device.type == "cuda":
            ranks = tuple(dist.get_process_group_ranks(group))
            out = torch.empty(max(p.numel() for p in pieces.values()), dtype=t.dtype, device=t.device)
            work = dist.reduce_scatter_single(out, pack_padded([pieces[r] for r in ranks]), group=group,
                                              async_op=True)
            p = Pending(work, out, t.shape, t.dtype, None, members, me, tuple(members),
                        join=lambda _: unpack_padded(out, [shape])[0])
        else:
            p = self._exchange(pieces[me], pieces, gid, members, me, {m: shape for m in members}, emulated_s)
            p.parts = tuple((m, shape) for m in members)
            p.join = lambda got: sum_in_order([got[m] for m in members])
        p.order = keep                  # how the reader gets it (``RankExecutor``: the instruction's order)
        self.in_flight.setdefault(p.key, []).append(p)
        return p

    def all_to_all(self, t: torch.Tensor, gid: int, group: Any, members: Sequence[int], me: int,
                   order: Sequence[int], shape: tuple[int, ...], have: Sharding, need: Sharding,
                   emulated_s: float) -> Pending:
        """Start this member's shard under ``need`` of a value of ``shape`` that the members of subgroup
        ``gid`` hold in shards under ``have`` (``t``: this member's; ``order``: the members in part order,
        of both); ``finish`` waits for it (``Pending.order``: ``t``'s memory order). Each member sends every other one
        the entries it holds of the other's new shard (``heterog.runtime.resharding.a2a_piece``): NCCL's
        all-to-all of uneven pieces on GPUs, a direct exchange of messages on CPU. Only copies: exact.
        """
        i = list(order).index(me)
        pieces = {m: a2a_piece(t, shape, have, need, i, j) for j, m in enumerate(order)}
        shapes = {m: a2a_piece_shape(shape, have, need, j, i) for j, m in enumerate(order)}
        keep = memory_order(t)

        def join(got: dict[int, torch.Tensor]) -> torch.Tensor:
            return a2a_assemble([got[m] for m in order], shape, have, need, i, None)

        if self.device.type == "cuda":
            ranks = tuple(dist.get_process_group_ranks(group))
            flat, sizes = pack_split([pieces[r] for r in ranks])
            out = torch.empty(sum(math.prod(shapes[r]) for r in ranks), dtype=t.dtype, device=t.device)
            work = dist.all_to_all_single(out, flat, [math.prod(shapes[r]) for r in ranks], sizes, group=group,
                                          async_op=True)
            p = Pending(work, out, t.shape, t.dtype, None, members, me, tuple(members),
                        join=lambda _: join(dict(zip(ranks, unpack_split(out, [shapes[r] for r in ranks])))))
        else:
            p = self._exchange(pieces[me], pieces, gid, members, me, shapes, emulated_s)
            p.parts = tuple(shapes.items())
            p.join = join
        p.order = keep                  # as ``reduce_scatter``'s
        self.in_flight.setdefault(p.key, []).append(p)
        return p

    def _exchange(self, own: torch.Tensor, msgs: dict[int, torch.Tensor], gid: int, members: Sequence[int], me: int,
                  shapes: dict[int, tuple[int, ...]], emulated_s: float) -> Pending:
        """A CPU collective started: ``msgs[m]`` sent to every other member ``m`` of subgroup ``gid`` and a
        receive posted for each other member's message to this one (of shape ``shapes[member]``); ``own``:
        this member's own input to the result."""
        key = tuple(members)
        if not 0 <= gid < _AR_MAX_GROUPS:
            raise ValueError(f"subgroup index {gid} out of range for collective message tags")
        seq = self.ar_seq.get(key, 0)
        self.ar_seq[key] = seq + 1
        tag = _AR_TAG_BASE + gid * _AR_SEQ_SPAN + seq % _AR_SEQ_SPAN
        own = own.contiguous()
        stamp = time.perf_counter()
        recvs = {}
        for m in members:
            if m != me:
                n = math.prod(shapes[m]) * own.element_size()
                buf = torch.empty(n + _HEADER_BYTES, dtype=torch.uint8) if self.emulate else \
                    torch.empty(shapes[m], dtype=own.dtype)
                recvs[m] = (dist.irecv(buf, src=m, tag=tag, group=self.channels.get((m, me))), buf)
        framed: dict[int, torch.Tensor] = {}      # one message per distinct tensor (an AllReduce's: one in all)
        for m in members:
            if m != me:
                if id(msgs[m]) not in framed:     # [entry time (float64) | payload bytes], as ``send``
                    t = msgs[m].contiguous()
                    framed[id(msgs[m])] = _frame(stamp, t) if self.emulate else t
                msg = framed[id(msgs[m])]
                self.sends.append((dist.isend(msg, dst=m, tag=tag, group=self.channels.get((me, m))), msg))
        return Pending(recvs, own, own.shape, own.dtype, emulated_s if self.emulate else None, members, me, key,
                       stamp=stamp)

    def finish(self, p: Pending) -> torch.Tensor:
        """The result of ``p`` (a sum or a value put together). A group runs its collectives in the order
        they were started, so the earlier ones of ``p``'s group are finished first (which also lets the
        emulation serialize them)."""
        queue = self.in_flight.get(p.key, [])
        while p.result is None and queue:
            q = queue.pop(0)
            q.result = self._complete(q)
        if p.result is None:
            raise RuntimeError(f"a collective over ranks {list(p.members)} was not started by this rank's transport")
        return p.result

    def _complete(self, p: Pending) -> torch.Tensor:
        t0 = time.perf_counter()
        self.status.waiting(-2)
        if not isinstance(p.work, dict):             # NCCL
            p.work.wait()
            self.status.waiting(-1)
            self.idle_s += time.perf_counter() - t0
            if p.join is not None:
                return p.join({})
            if p.gathered is None or p.placement is None:
                return p.buf
            ranks, out = p.gathered
            got = dict(zip(ranks, unpack_padded(out, [dict(p.parts)[r] for r in ranks])))
            return combine([got[m] for m, _ in p.parts], p.placement)
        shapes = dict(p.parts)
        parts, entered = {p.me: p.buf}, [p.stamp]
        for m, (work, buf) in p.work.items():
            work.wait()
            if self.emulate:
                stamp, buf = _unframe(buf, shapes.get(m, tuple(p.shape)), p.dtype)
                entered.append(stamp)
            parts[m] = buf
        self.status.waiting(-1)
        if p.emulated_s is not None:
            # emulated: the exchange starts when the last member has entered and the group's previous
            # collective is done (the same numbers on every member), and takes the nominal time
            ready = max(max(entered), self.group_ready.get(p.key, 0.0)) + p.emulated_s
            self.group_ready[p.key] = ready
            nxt = p.members[(p.members.index(p.me) + 1) % len(p.members)]
            self.link_free[nxt] = max(self.link_free.get(nxt, 0.0), ready)
            wait = ready - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        self.idle_s += time.perf_counter() - t0
        if p.join is not None:
            return p.join(parts)
        if p.placement is not None:
            return combine([parts[m] for m, _ in p.parts], p.placement)
        return sum_in_order([parts[m] for m in p.members])

    def flush(self) -> None:
        for work, *_ in self.sends + [m for out in self.messages_out.values() for m in out]:
            work.wait()
        self.sends.clear()
        self.messages_out.clear()


@dataclass
class Pending:
    work: Any                          # NCCL: the collective's work; CPU: {peer: (receive work, buffer)}
    buf: torch.Tensor                  # this member's contribution (NCCL: reduced in place)
    shape: torch.Size
    dtype: torch.dtype
    emulated_s: float | None
    members: Sequence[int]
    me: int
    key: tuple[int, ...]
    stamp: float = 0.0                 # when this member entered (emulation)
    result: torch.Tensor | None = None
    order: tuple[int, ...] | None = None   # memory order of the result's dims for the reader (executor)
    # an all-gather: (member, shard shape) in part order and the placement joining them; NCCL: the ranks of
    # the subgroup in its rank order and the buffer of padded slots gathered in that order; a reduce-scatter or
    # all-to-all on CPU: (member, shape of its message to this one)
    parts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    placement: str | None = None
    gathered: tuple[tuple[int, ...], torch.Tensor] | None = None
    # a reduce-scatter or all-to-all: the result from the parts received per member (NCCL: from nothing,
    # the output buffer it captures)
    join: Callable[[dict[int, torch.Tensor]], torch.Tensor] | None = None


def start_uneven_gather(t: torch.Tensor, shapes: Sequence[tuple[int, ...]], group: Any
                        ) -> tuple[Any, torch.Tensor]:
    """Start ``dist.all_gather`` over ``group`` (any backend) of shards of uneven shapes: this member's
    shard ``t`` flattened and padded with zeros to the largest shard's number of elements. ``shapes``:
    every member's shard shape, in the group's rank order. Returns the work and the buffer it fills, one
    padded slot per member in rank order (``resharding.pack_padded``'s layout: ``unpack_padded`` trims it).

    Shapes:
        t: this member's entry of ``shapes``; buffer: ``(len(shapes) * max numel,)``.
    """
    n = max((math.prod(s) for s in shapes), default=0)
    flat = torch.zeros(n, dtype=t.dtype, device=t.device)
    flat[:t.numel()] = t.reshape(-1)
    out = torch.empty(len(shapes) * n, dtype=t.dtype, device=t.device)
    return dist.all_gather(list(out.view(len(shapes), n)), flat, group=group, async_op=True), out


# ---------------------------------------------------------------------------- memory held by a rank
