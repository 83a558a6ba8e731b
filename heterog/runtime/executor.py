"""Worker side of the runtime: one process per device runs its RankProgram step after step with
torch.distributed (gloo on CPU, NCCL on GPUs), emulating device slowdown and link speed on local-cpu.

Instructions (built by ``heterog.runtime.lowering``; sources are ``("env", node)`` this rank's values,
``("stash", key)`` derived values, ``("recv", tag)`` a received message, ``("const", node)``,
``("zeros", shape, dtype, order)``; a slice is ``(dim, start, end, block)`` (``batch_slice`` in the lowering)
or None; ``order`` is the memory order of the value's dims, outermost first, that the captured program
expects (``in_memory_order``); ``shift`` is added to positional values (``heterog.runtime.scaling``))::

    ("compute", op, local_batch, inputs, exports, first sample)
                                          inputs: (node, source, leaf node, view chain, scale, tuple index)
    ("send", source, slice, scale, dst, tag, (latency_s, s_per_byte))
    ("assemble", stash key, (batch dim, block) | None, [(source, slice, scale, shift), ...], order)
    ("aggregate", stash key, [(source, slice, scale, 0), ...], order)
    ("allreduce", stash key, group index, source, scale, emulated_s, order)
    ("post", tag)                                    NCCL: post a receive in global message order

Emulation (local-cpu clusters): after each op the worker owes ``(slowdown - 1) x`` its measured time and
sleeps it off before anything leaves the device (sends, collectives) or when it exceeds a small quantum;
a message carries the time at which it may be consumed, ``max(now, link free) + latency + bytes /
bandwidth`` of its link (one transfer at a time per link), and the receiver sleeps until then; an
AllReduce's messages carry each member's entry time and it completes no earlier than the last entry (and
the end of the group's previous collective: a group's collectives share its ring) plus the nominal ring time.

AllReduce on CPU is a direct exchange of point-to-point messages (``Transport.allreduce`` says why), on GPUs
NCCL's collective. On CPU every direction between two ranks has a gloo process group of its own
(``p2p_channels`` says why).
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from heterog.runtime.layout import cat_batch, in_memory_order, narrow_batch
from heterog.runtime.lowering import RankProgram
from heterog.runtime.rng import Draw, block_batches
from heterog.runtime.stepprog import Kernel, StepProgram

SLEEP_QUANTUM_S = 50e-6
# CPU AllReduce messages: tag = base + subgroup index x span + sequence number in the subgroup (mod span);
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


def _unframe(buf: torch.Tensor, shape, dtype: torch.dtype) -> tuple[float, torch.Tensor]:
    """The stamp and the payload (a view of ``buf`` as ``shape`` and ``dtype``) of an emulated message."""
    stamp = float(buf[:8].numpy().view(np.float64)[0])
    n = buf.numel() - _HEADER_BYTES
    payload = buf[_HEADER_BYTES:].view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype,
                                                                                    device=buf.device)
    return stamp, payload


@dataclass
class Job:
    """What one rank receives: the step, its program, the subgroups to create and the data."""

    prog: StepProgram
    rank: RankProgram
    groups: list[tuple[int, ...]]
    sizes: dict[int, dict[str, Any]]
    steps: int
    inputs: list[tuple[torch.Tensor, ...]]          # global batches; step s uses inputs[s % len]
    emulate: bool
    name: str = ""
    return_state: bool = True
    trace: bool = False              # record (kind, start, end, waited) of each instruction, each step
    memory_steps: int = 1            # steps whose held bytes are metered (LiveBytes; the first is warm-up)


@dataclass
class PingPongJob:
    """Link profiling: ``pairs`` of ranks bounce messages of each size ``repeats`` times; with ``stream``
    >= 2 they also send bursts of ``stream`` messages one way (see ``pingpong``)."""

    pairs: list[tuple[int, int]]
    sizes: list[int]
    repeats: int
    emulate: bool
    links: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)   # (lat, s/byte)
    name: str = "pingpong"
    stream: int = 0


@dataclass
class CollectiveJob:
    """Collective profiling: bursts of ``burst`` AllReduces of each size (bytes of float32) over each of
    ``groups``, ``repeats`` times; ``emulated_s[k][j]`` is the nominal time the emulation enforces for
    group k, size j.

    One AllReduce at a time (``burst`` 1) is the default: a plan's AllReduces start as their gradients
    become ready, apart from each other, so each pays a lone collective's latency, which back-to-back
    ones overlap. On local-cpu-2 (tiny_cnn, 8 plans, 12 rounds) the ev-ar plan was simulated 15-23%
    short with bursts of four, 6-16% with lone AllReduces; fidelity MAPE 9.7-12.9% -> 6.9-7.4%."""

    groups: list[tuple[int, ...]]
    sizes: list[int]
    repeats: int
    emulate: bool
    emulated_s: list[list[float]] = field(default_factory=list)
    burst: int = 1
    name: str = "collectives"


# ---------------------------------------------------------------------------- status shared with the parent
class Status:
    """Per-rank progress in shared memory: step, instruction index, peer waited for (-1 none (computing),
    -2 a collective, -3 the barrier between steps)."""

    def __init__(self, array, rank: int) -> None:
        self.a, self.base = array, 3 * rank
        self.peer = -1

    def at(self, step: int, index: int) -> None:
        self.a[self.base] = step
        self.a[self.base + 1] = index

    def waiting(self, peer: int) -> None:
        self.a[self.base + 2] = peer
        self.peer = peer


class _NullStatus:
    peer = -1

    def at(self, step: int, index: int) -> None:
        pass

    def waiting(self, peer: int) -> None:
        self.peer = peer


def _waited_for(peer: int) -> str:
    return {-2: "a collective", -3: "the barrier between steps"}.get(peer, f"rank {peer}")


def describe_failure(exc: BaseException, rank: int) -> dict:
    """What a worker reports when ``exc`` ends its job: the exception with its notes (which fx node, which
    step and instruction), whether it struck while waiting for another rank (a *secondary* failure, e.g.
    gloo's ``Connection closed by peer`` after the peer crashed) and when (wall clock)."""
    import traceback

    where = getattr(exc, "heterog_where", None)
    waited = getattr(exc, "heterog_waiting", -1)
    notes = [n for n in getattr(exc, "__notes__", ()) if n != where]
    return {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "where": where,
            "step": getattr(exc, "heterog_step", None), "notes": notes,
            "secondary": waited != -1, "waited_for": _waited_for(waited) if waited != -1 else None,
            "time": time.time(), "traceback": traceback.format_exc(limit=8)}


# ---------------------------------------------------------------------------- transport
_CHANNELS: dict[int, dict[tuple[int, int], Any]] = {}     # per default process group: (src, dst) -> group


def p2p_channels(device: torch.device) -> dict[tuple[int, int], Any]:
    """CPU (gloo): one process group per ordered pair of ranks, ``(src, dst) -> group``, that carries only
    the messages from ``src`` to ``dst``; GPUs (NCCL): empty (the default group is used).

    On the default group two ranks share one gloo pair (one socket and its lock) for both directions.
    When both send at the same moment, as plans with transfers both ways do at every layout change, the
    caller's write and the device thread's read contend for that pair and a send of a few bytes now and
    then blocks for a scheduler time slice (``python -m experiments.channels_bench`` measures it; the
    figures are in docs/journal.md). Created once per
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
    """Point-to-point messages and AllReduce with optional link emulation (see the module docstring).
    ``rank``: this process's rank; messages travel on ``p2p_channels``."""

    def __init__(self, device: torch.device, emulate: bool, status, rank: int) -> None:
        self.device, self.emulate, self.status, self.rank = device, emulate, status, rank
        self.channels = p2p_channels(device)
        self.link_free: dict[int, float] = {}
        self.idle_s = 0.0          # time spent waiting (messages, collectives, emulated delays)
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.recvs: dict[int, tuple] = {}
        self.in_flight: dict[tuple[int, ...], list[_Pending]] = {}    # started collectives, per group
        self.group_ready: dict[tuple[int, ...], float] = {}            # emulation: when each group is free
        self.ar_seq: dict[tuple[int, ...], int] = {}                   # CPU AllReduces started, per group

    def post(self, tag: int, src: int, shape: tuple, dtype: torch.dtype) -> None:
        n = math.prod(shape) * dtype.itemsize
        if self.emulate:
            buf = torch.empty(n + _HEADER_BYTES, dtype=torch.uint8, device=self.device)
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.recvs[tag] = (dist.irecv(buf, src=src, tag=tag, group=self.channels.get((src, self.rank))), buf, shape,
                           dtype, n, src)

    def send(self, t: torch.Tensor, dst: int, tag: int, latency_s: float, s_per_byte: float) -> None:
        t = t.contiguous()
        if self.emulate:                              # CPU only: [ready time (float64) | payload bytes]
            n = t.numel() * t.element_size()
            now = time.perf_counter()
            ready = max(now, self.link_free.get(dst, 0.0)) + latency_s + n * s_per_byte
            self.link_free[dst] = ready
            t = _frame(ready, t)
        self.sends.append((dist.isend(t, dst=dst, tag=tag, group=self.channels.get((self.rank, dst))), t))

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

    def allreduce(self, t: torch.Tensor, gid: int, group, members: Sequence[int], me: int,
                  emulated_s: float) -> _Pending:
        """Start summing ``t`` (a fresh tensor) over the members of subgroup ``gid`` (``group``: its
        process group); ``finish`` waits for the sum.

        On GPUs this is NCCL's AllReduce. On CPU it is a direct exchange of point-to-point messages: each
        member sends ``t`` to every other member and adds all of them in member order, so every member
        gets the same bits. gloo hands each collective to a worker thread, which on a few busy cores costs
        several times a message exchange on a few busy cores (measured in docs/journal.md).
        """
        key = tuple(members)
        if self.device.type == "cuda":
            p = _Pending(dist.all_reduce(t, group=group, async_op=True), t, t.shape, t.dtype, None, members, me,
                         key)
        else:
            if not 0 <= gid < _AR_MAX_GROUPS:
                raise ValueError(f"subgroup index {gid} out of range for AllReduce message tags")
            seq = self.ar_seq.get(key, 0)
            self.ar_seq[key] = seq + 1
            tag = _AR_TAG_BASE + gid * _AR_SEQ_SPAN + seq % _AR_SEQ_SPAN
            t = t.contiguous()
            stamp = time.perf_counter()
            if self.emulate:                # [entry time (float64) | payload bytes], as ``send`` frames it
                msg = _frame(stamp, t)
            else:
                msg = t
            recvs = {}
            for m in members:
                if m != me:
                    buf = torch.empty_like(msg)
                    recvs[m] = (dist.irecv(buf, src=m, tag=tag, group=self.channels.get((m, me))), buf)
            for m in members:
                if m != me:
                    self.sends.append((dist.isend(msg, dst=m, tag=tag, group=self.channels.get((me, m))), msg))
            p = _Pending(recvs, t, t.shape, t.dtype, emulated_s if self.emulate else None, members, me, key,
                         stamp=stamp)
        self.in_flight.setdefault(key, []).append(p)
        return p

    def finish(self, p: _Pending) -> torch.Tensor:
        """The sum of ``p``. A group runs its collectives in the order they were started, so the earlier
        ones of ``p``'s group are finished first (which also lets the emulation serialize them)."""
        queue = self.in_flight.get(p.key, [])
        while p.result is None and queue:
            q = queue.pop(0)
            q.result = self._complete(q)
        return p.result

    def _complete(self, p: _Pending) -> torch.Tensor:
        t0 = time.perf_counter()
        self.status.waiting(-2)
        if not isinstance(p.work, dict):             # NCCL
            p.work.wait()
            self.status.waiting(-1)
            self.idle_s += time.perf_counter() - t0
            return p.buf
        parts, entered = {p.me: p.buf}, [p.stamp]
        for m, (work, buf) in p.work.items():
            work.wait()
            if self.emulate:
                stamp, buf = _unframe(buf, p.shape, p.dtype)
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
        acc = parts[p.members[0]]
        for m in p.members[1:]:
            acc = acc + parts[m]
        return acc

    def flush(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


@dataclass
class _Pending:
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
    order: tuple[int, ...] | None = None   # memory order of the sum's dims for the reader (executor)


# ---------------------------------------------------------------------------- memory held by a rank
def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class _NoMeter:
    def put(self, entry: tuple, value: Any) -> None:
        pass

    def drop(self, entry: tuple) -> None:
        pass

    def reset(self) -> None:
        pass


class LiveBytes:
    """Bytes of the tensors a rank holds in its value tables, counted once per storage, and their
    high-water mark (``peak``: ``RankExecutor.run()`` reports it as ``peak_memory_bytes``).

    The tables are the rank's parameters, buffers and optimizer state (``persist``), the values of its ops
    (``env``: inputs, activations, gradients, new parameters) and derived values (``stash``: assembled
    pieces, PS sums, AllReduce results); a value enters when it is stored (after the instruction that
    makes it) and leaves when the program frees it after its last consumer; a received message counts
    from when it is taken to the end of the instruction that takes it. This is the simulator's
    memory model (DESIGN section 3: resident parameters, gradients and state plus activations from
    production until their last consumer) applied to what the runtime actually holds, so the two are
    comparable on any backend; allocator caches, kernels' temporaries, receive buffers posted but not
    yet taken and the Python process are not counted (the process RSS of a CPU worker is hundreds of MB
    of libraries, and CPU tensors have no allocator statistics). Views count their storage once, whole
    (its bytes are held), except views of ``sliced`` storages (the global input batches a job carries),
    which count the bytes they span: a rank's input is its batch share.

    A rank meters its first ``Job.memory_steps`` steps (default 1: the first step, which the median
    iteration time leaves out as warm-up): every step runs the same program on tensors of the same
    sizes, so they hold the same bytes, and metering costs about 1.5 us per value, which would otherwise
    add to the measured time of every step.
    """

    def __init__(self, sliced: Sequence[torch.Tensor] = ()) -> None:
        self.sliced = {t.untyped_storage().data_ptr() for t in sliced if t.numel()}
        self.held: dict[tuple, list[int]] = {}            # table entry -> storage keys it holds
        self.storages: dict[int, list[int]] = {}          # storage key -> [references, low byte, high byte]
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        self.held.clear()
        self.storages.clear()
        self.live = 0

    def put(self, entry: tuple, value: Any) -> None:
        """``value`` stored in table entry ``entry`` (replacing what it held)."""
        if entry in self.held:
            self.drop(entry)
        keys = []
        for t in _tensors(value):
            st = t.untyped_storage()
            key = st.data_ptr()
            if not st.nbytes() or not key:
                continue
            if key in self.sliced:
                size = t.element_size()
                lo = t.storage_offset() * size
                hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * size if t.numel() else lo
            else:
                lo, hi = 0, st.nbytes()
            rec = self.storages.get(key)
            if rec is None:
                self.storages[key] = [1, lo, hi]
                self.live += hi - lo
            else:
                before = rec[2] - rec[1]
                rec[0] += 1
                rec[1], rec[2] = min(rec[1], lo), max(rec[2], hi)
                self.live += rec[2] - rec[1] - before
            keys.append(key)
        self.held[entry] = keys
        if self.live > self.peak:
            self.peak = self.live

    def drop(self, entry: tuple) -> None:
        """Table entry ``entry`` freed (no-op if it holds nothing counted)."""
        for key in self.held.pop(entry, ()):
            rec = self.storages[key]
            rec[0] -= 1
            if rec[0] == 0:
                self.live -= rec[2] - rec[1]
                del self.storages[key]


# ---------------------------------------------------------------------------- executing a rank program
class RankExecutor:
    """Runs one rank's program; ``run()`` returns per-step times and loss terms and the final values."""

    def __init__(self, job: Job, rank: int, device: torch.device, status=None, transport=None) -> None:
        """``transport``: where messages and collectives go (default: torch.distributed through
        ``Transport``; ``heterog.runtime.check`` passes an in-process one for its dry run)."""
        self.job, self.rank, self.device = job, rank, device
        self.rp: RankProgram = job.rank
        self.status = status or _NullStatus()
        prog = job.prog
        ops = {ins[1] for ins in self.rp.instrs if ins[0] == "compute"}
        self.kernels = {op: prog.kernel(op, device) for op in ops}
        self.chains: dict[tuple[str, ...], Kernel] = {}
        for ins in self.rp.instrs:
            if ins[0] == "compute":
                for *_, chain, _, _ in ins[3]:
                    if chain and chain not in self.chains:
                        self.chains[chain] = Kernel([prog.view_calls[c] for c in chain], device)
        # every rank creates every subgroup, in the same order
        if transport is None:
            self.groups = [dist.new_group(list(g)) for g in job.groups] if job.groups else []
            self.transport = Transport(device, job.emulate, self.status, rank)
        else:
            self.groups, self.transport = [None] * len(job.groups), transport
        self.members = [list(g) for g in job.groups]
        self.consts = {k: v.to(device) for k, v in prog.consts.items()}
        self.persist = {k: v.to(device) for k, v in self.rp.persist.items()}
        self.debt_s = 0.0
        self.slow = self.rp.slowdown if job.emulate else 1.0
        self.post_in_order = any(ins[0] == "post" for ins in self.rp.instrs)
        self.recv_spec = {tag: (src, shape, dtype) for tag, src, shape, dtype, _ in self.rp.recvs}
        self.world = dist.get_world_size() if dist.is_initialized() and transport is None else 1
        self._at = -1                  # the instruction running (error messages)
        self._step = 0                 # the training step running (random draws)
        self.traces: list[list] = []   # per step, per instruction: [kind, start s, end s, s waiting] (job.trace)
        self.memory = LiveBytes([t for batch in job.inputs for t in batch])
        self._taken: list[tuple] = []      # messages taken by the current instruction
        self._mem: LiveBytes | _NoMeter = _NoMeter()     # the meter of the current step

    # ------------------------------------------------------------------ helpers
    def _fetch(self, src: tuple, env: dict, stash: dict) -> Any:
        kind = src[0]
        if kind == "env":
            return env[src[1]]
        if kind == "stash":
            v = stash[src[1]]
            if type(v) is _Pending:
                v = stash[src[1]] = in_memory_order(self.transport.finish(v), v.order)
                self._mem.put(src, v)
            return v
        if kind == "recv":
            self._pay()
            v = self.transport.take(src[1])
            self._mem.put(src, v)           # held until the end of the instruction that takes it
            self._taken.append(src)
            return v
        if kind == "const":
            return self.consts[src[1]]
        return in_memory_order(torch.zeros(src[1], dtype=src[2], device=self.device), src[3])

    def _piece(self, src: tuple, sl: tuple | None, scale: float, env: dict, stash: dict, shift: int = 0
               ) -> torch.Tensor:
        v = self._fetch(src, env, stash)
        if sl is not None:
            v = narrow_batch(v, sl)
        if scale != 1.0:
            v = v * scale
        if shift:
            v = v + shift
        return v

    def _owe(self, t_start: float, idle_before: float) -> None:
        """Charge (slowdown - 1) x the busy time since ``t_start`` (waiting excluded)."""
        if self.slow != 1.0:
            busy = time.perf_counter() - t_start - (self.transport.idle_s - idle_before)
            self.debt_s += (self.slow - 1.0) * max(busy, 0.0)
            if self.debt_s > SLEEP_QUANTUM_S:
                self._pay()

    def _pay(self) -> None:
        if self.debt_s > 0:
            t0 = time.perf_counter()
            time.sleep(self.debt_s)
            slept = time.perf_counter() - t0
            self.debt_s -= slept
            self.transport.idle_s += slept

    # ------------------------------------------------------------------ one step
    def step(self, index: int, inputs: Sequence[torch.Tensor]) -> tuple[float, float]:
        """Run step ``index``: (seconds, this rank's loss terms). A failure carries where it happened
        (``heterog_where``: rank, step, instruction) and whether this rank was waiting for another one."""
        rp, tr = self.rp, self.transport
        env: dict[str, Any] = dict(self.persist)
        self._step = index
        mem = self._mem = self.memory if index < self.job.memory_steps else _NoMeter()
        mem.reset()
        for ph, v in self.persist.items():
            mem.put(("persist", ph), v)
        for name, i, lo, hi in rp.inputs:
            env[name] = inputs[i][lo:hi].to(self.device)
            mem.put(("env", name), env[name])
        stash: dict[Any, Any] = {}
        self._at = -1
        try:
            if not self.post_in_order:
                # gloo matches by tag: post every receive of the step up front (all of the previous step's
                # messages to this rank have arrived, so none can be mistaken for this step's)
                for tag, src, shape, dtype, _ in rp.recvs:
                    tr.post(tag, src, shape, dtype)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.world > 1:
                self.status.waiting(-3)
                dist.barrier()
                self.status.waiting(-1)
            t0 = time.perf_counter()
            trace = [] if self.job.trace else None
            self._instructions(index, env, stash, t0, trace)
            self._at = len(rp.instrs)
            elapsed, loss = self._step_end(env, stash, t0)
        except Exception as exc:
            self._annotate(exc, index, self._at)
            raise
        self.status.at(index + 1, 0)
        if trace is not None:
            self.traces.append(trace)
        return elapsed, loss

    def describe(self, i: int) -> str:
        """Instruction ``i`` in words (for error messages)."""
        if i < 0:
            return "the start of the step (posting receives, the barrier)"
        if i >= len(self.rp.instrs):
            return "the end of the step (finishing collectives, sends and updates)"
        ins = self.rp.instrs[i]
        kind = ins[0]
        if kind == "compute":
            prog = self.job.prog
            return (f"instruction {i}: compute op {ins[1]} ({prog.op_target[ins[1]]}, fx nodes "
                    f"{', '.join(prog.op_nodes[ins[1]][:4])}) at local batch {ins[2]}")
        if kind == "send":
            return f"instruction {i}: send message {ins[5]} to rank {ins[4]}"
        if kind in ("assemble", "aggregate", "allreduce"):
            return f"instruction {i}: {kind} {ins[1]}"
        return f"instruction {i}: {kind}"

    def _annotate(self, exc: BaseException, step: int, i: int) -> None:
        where = f"rank {self.rank}, step {step}, {self.describe(i)}"
        if getattr(exc, "heterog_where", None) is None:
            exc.heterog_where, exc.heterog_step, exc.heterog_waiting = where, step, self.status.peer
            exc.add_note(where)

    def _instructions(self, index: int, env: dict, stash: dict, t0: float, trace: list | None) -> None:
        tr = self.transport
        for i, ins in enumerate(self.rp.instrs):
            self._at = i
            self.status.at(index, i)
            if trace is not None:
                trace.append([ins[0], time.perf_counter() - t0])
                idle_at = tr.idle_s
            self.execute(i, env, stash)
            if trace is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)     # traced GPU ops: their time, not their launch
                trace[-1] += [time.perf_counter() - t0, tr.idle_s - idle_at]

    def execute(self, i: int, env: dict, stash: dict) -> None:
        """Run instruction ``i`` on this rank's values ``env`` and ``stash``, then free what it last used."""
        rp, tr, sizes, mem = self.rp, self.transport, self.job.sizes, self._mem
        ins = rp.instrs[i]
        kind = ins[0]
        if kind == "compute":
            t_op, idle0 = time.perf_counter(), tr.idle_s
            local: dict[str, Any] = {}
            for node, src, leaf, chain, scale, tidx in ins[3]:
                v = self._fetch(src, env, stash)
                if scale != 1.0:
                    v = v * scale
                if chain:
                    local[leaf] = v
                    self.chains[chain](local, sizes[ins[2]])
                else:
                    local[node] = v
                if tidx is not None and not isinstance(local[node], (tuple, list)):
                    local[node] = [None] * tidx + [local[node]]
            kernel = self.kernels[ins[1]]
            draw = None
            if kernel.random:
                prog = self.job.prog
                draw = Draw(prog.rng_seed, self._step, prog.batch_size, range(ins[5], ins[5] + ins[2]),
                            {n: sizes[n] for n in block_batches(prog.batch_size)})
            kernel(local, sizes[ins[2]], draw)
            for name in ins[4]:
                env[name] = local[name]
            self._owe(t_op, idle0)
            for name in ins[4]:
                mem.put(("env", name), env[name])
        elif kind == "send":
            self._pay()
            v = self._piece(ins[1], ins[2], ins[3], env, stash)
            tr.send(v, ins[4], ins[5], *ins[6])
        elif kind == "assemble":
            t_op, idle0 = time.perf_counter(), tr.idle_s
            pieces = [self._piece(src, sl, sc, env, stash, shift) for src, sl, sc, shift in ins[3]]
            v = pieces[0] if len(pieces) == 1 else cat_batch(pieces, *ins[2])
            stash[ins[1]] = in_memory_order(v, ins[4])
            self._owe(t_op, idle0)
            mem.put(("stash", ins[1]), stash[ins[1]])
        elif kind == "aggregate":
            t_op, idle0 = time.perf_counter(), tr.idle_s
            parts = [self._piece(src, sl, sc, env, stash) for src, sl, sc, _ in ins[2]]
            acc = parts[0] + parts[1]
            for p in parts[2:]:
                acc = acc + p
            stash[ins[1]] = in_memory_order(acc, ins[3])
            self._owe(t_op, idle0)
            mem.put(("stash", ins[1]), stash[ins[1]])
        elif kind == "allreduce":
            self._pay()
            v = self._fetch(ins[3], env, stash) * ins[4]
            g = ins[2]
            stash[ins[1]] = p = tr.allreduce(v, g, self.groups[g], self.members[g], self.rank, ins[5])
            p.order = ins[6]
        elif kind == "post":
            src, shape, dtype = self.recv_spec[ins[1]]
            tr.post(ins[1], src, shape, dtype)
        for src in rp.frees[i]:
            (env if src[0] == "env" else stash).pop(src[1], None)
            mem.drop(src)
        for src in self._taken:
            mem.drop(src)
        self._taken.clear()

    def _step_end(self, env: dict, stash: dict, t0: float) -> tuple[float, float]:
        rp, tr = self.rp, self.transport
        for key, v in list(stash.items()):
            if type(v) is _Pending:
                stash[key] = in_memory_order(tr.finish(v), v.order)
                self._mem.put(("stash", key), stash[key])
        self._pay()
        tr.flush()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        loss = 0.0
        for src, scale in rp.loss_terms:
            loss += float(self._fetch(src, env, stash)) * scale
        for ph, src in rp.updates:
            self.persist[ph] = self._fetch(src, env, stash)
        return elapsed, loss

    def run(self) -> dict:
        times, losses = [], []
        for s in range(self.job.steps):
            batch = self.job.inputs[s % len(self.job.inputs)]
            elapsed, loss = self.step(s, batch)
            times.append(elapsed)
            losses.append(loss)
        out: dict[str, Any] = {"rank": self.rank, "times_s": times, "loss_terms": losses,
                               "has_loss": bool(self.rp.loss_terms), "values": {},
                               "peak_memory_bytes": int(self.memory.peak)}
        if self.job.trace:
            out["traces"] = self.traces
        if self.job.return_state:
            out["values"] = {ph: (kind, self.persist[ph].detach().to("cpu").clone()) for kind, ph in self.rp.report}
        return out


def pingpong(job: PingPongJob, rank: int, device: torch.device) -> dict:
    """One-way times (half round trips) per (pair, size) through the runtime's transport, under the key
    ``"a->b"``. Sizes are interleaved within each repeat, so that a change of machine load affects all
    sizes alike.

    With ``job.stream = K >= 2``, also the time a message holds the link when messages follow each other
    (key ``"stream:a->b"``): a sends a burst of K messages, then a single one, each burst answered by a
    1-byte acknowledgement once all of it has arrived; ``(T_K - T_1) / (K - 1)`` is the time each further
    message adds, paired within the repeat so that the acknowledgement and the wake-up cancel out."""
    tr = Transport(device, job.emulate, _NullStatus(), rank)
    out: dict[str, list] = {}
    tag = 0
    bursts = (job.stream, 1) if job.stream >= 2 else ()
    ack = torch.zeros(1, dtype=torch.uint8, device=device)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        tr.flush()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for a, b in job.pairs:
        dist.barrier()
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        lat, spb = job.links.get((rank, peer), (0.0, 0.0))
        payload = {size: torch.zeros(size, dtype=torch.uint8, device=device) for size in job.sizes}
        samples: dict[int, list[float]] = {size: [] for size in job.sizes}
        gaps: dict[int, list[float]] = {size: [] for size in job.sizes}
        for rep in range(job.repeats + 1):            # the first round warms up
            for size, x in payload.items():
                if rank == a:
                    def bounce(x=x, tag=tag) -> None:
                        tr.post(tag + 1, peer, (size,), torch.uint8)
                        tr.send(x, peer, tag, lat, spb)
                        tr.take(tag + 1)
                    t = timed(bounce)
                    if rep:
                        samples[size].append(t / 2)
                else:
                    tr.post(tag, peer, (size,), torch.uint8)
                    tr.take(tag)
                    tr.send(x, peer, tag + 1, lat, spb)
                    tr.flush()
                tag += 2
                took = {}
                for k in bursts:
                    if rank == a:
                        def burst(x=x, tag=tag, k=k) -> None:
                            tr.post(tag + k, peer, (1,), torch.uint8)
                            for i in range(k):
                                tr.send(x, peer, tag + i, lat, spb)
                            tr.take(tag + k)
                        took[k] = timed(burst)
                    else:
                        for i in range(k):
                            tr.post(tag + i, peer, (size,), torch.uint8)
                        for i in range(k):
                            tr.take(tag + i)
                        tr.send(ack, peer, tag + k, lat, spb)
                        tr.flush()
                    tag += k + 1
                if rep and bursts and rank == a:
                    gaps[size].append((took[job.stream] - took[1]) / (job.stream - 1))
        if rank == a:
            out[f"{a}->{b}"] = [(size, samples[size]) for size in job.sizes]
            if bursts:
                out[f"stream:{a}->{b}"] = [(size, gaps[size]) for size in job.sizes]
    return out


def collectives(job: CollectiveJob, rank: int, device: torch.device) -> dict:
    """Times of AllReduce through the runtime's transport per (group, size), as a plan's step uses it: a
    burst of ``job.burst`` (default one) started back to back, then waited for; a sample is the burst's
    time over its length, i.e. how long each holds the group. Each burst starts
    after a barrier of the group and is timed by the slowest member. Sizes are interleaved."""
    tr = Transport(device, job.emulate, _NullStatus(), rank)
    handles = [dist.new_group(list(g)) for g in job.groups]
    out: dict[str, list] = {}
    try:
        for k, (members, group) in enumerate(zip(job.groups, handles)):
            dist.barrier()
            if rank not in members:
                continue
            members = list(members)
            payload = {size: torch.zeros(max(1, size // 4), dtype=torch.float32, device=device) for size in job.sizes}
            samples: dict[int, list[float]] = {size: [] for size in job.sizes}
            emulated = job.emulated_s[k] if job.emulated_s else [0.0] * len(job.sizes)
            for rep in range(job.repeats + 1):           # the first round warms up
                for j, (size, x) in enumerate(payload.items()):
                    dist.barrier(group=group)
                    xs = [x.clone() for _ in range(job.burst)]
                    t0 = time.perf_counter()
                    for p in [tr.allreduce(y, k, group, members, rank, emulated[j]) for y in xs]:
                        tr.finish(p)
                    tr.flush()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    took = torch.tensor([(time.perf_counter() - t0) / job.burst], dtype=_F64, device=device)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
                    if rep:
                        samples[size].append(float(took.item()))
            if rank == members[0]:
                out[",".join(str(m) for m in members)] = [(size, samples[size]) for size in job.sizes]
    finally:
        for g in handles:
            dist.destroy_process_group(g)
    return out


# ---------------------------------------------------------------------------- process entry
def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this worker when its parent disappears (no orphans after a crash of the launcher)."""
    def loop() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(3)
    threading.Thread(target=loop, daemon=True, name="heterog-parent-watch").start()
