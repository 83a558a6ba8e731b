"""Worker side of the runtime: one process per device runs its RankProgram step after step with
torch.distributed (gloo on CPU, NCCL on GPUs), emulating device slowdown and link speed on local-cpu.

The instructions (``heterog.runtime.instructions``: compute, send, assemble, aggregate, allreduce, allgather,
reducescatter, alltoall, post, combine, derive, copy, batchstats)
are built by ``heterog.runtime.lowering`` and matched here by type; messages and collectives go through
``heterog.runtime.transport``, held bytes are metered by ``heterog.runtime.memory``.

Emulation (local-cpu clusters): after each op the worker owes ``(slowdown - 1) x`` its measured time and
sleeps it off before anything leaves the device (sends, collectives) or when it exceeds a small quantum;
a message carries the time at which it may be consumed, ``max(now, link free) + latency + bytes /
bandwidth`` of its link (one transfer at a time per link), and the receiver sleeps until then; a
collective's messages carry each member's entry time and it completes no earlier than the last entry (and
the end of the group's previous collective: a group's collectives share its ring) plus the nominal ring time.

AllReduce, AllGather, ReduceScatter and AllToAll on CPU are a direct exchange of point-to-point messages
(``Transport.allreduce`` says why), on GPUs NCCL's collectives. On CPU every direction between two ranks has a
gloo process group of its own (``heterog.runtime.transport.p2p_channels`` says why).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from heterog.errors import HeterogError
from heterog.graph.shard_exec import combine, padded, part_of, shard_of
from heterog.runtime.host_copy import Landing, to_device, to_host
from heterog.runtime.in_place import cut, in_place_writers, owned, scaled, stats_scale, write_targets
from heterog.runtime.instructions import (
    Aggregate,
    AllGather,
    AllReduce,
    AllToAll,
    Assemble,
    BatchStats,
    Combine,
    Compute,
    Const,
    Copy,
    Derive,
    Env,
    Finish,
    Part,
    Post,
    RankProgram,
    Recv,
    ReduceScatter,
    Send,
    Sent,
    Slice,
    Source,
    Stash,
    env_name,
)
from heterog.runtime.kernel import Kernel, call_arguments
from heterog.runtime.layout import cat_batch, in_memory_order, shape_only
from heterog.runtime.memory import LiveBytes, Meter, NoMeter, exclusive
from heterog.runtime.rng import Draw, block_batches
from heterog.runtime.stepprog import StepProgram
from heterog.runtime.transport import NullStatus, Pending, StatusLike, Transport, TransportLike, waited_for

if TYPE_CHECKING:  # pragma: no cover
    from heterog.runtime.checkpoint import RankCheckpoint

SLEEP_QUANTUM_S = 50e-6


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
    first_step: int = 0              # the training step the job starts at (a resumed run: its checkpoint's)
    checkpoint: RankCheckpoint | None = None    # writes this rank's parts when a checkpoint is due


def initial_values(rp: RankProgram) -> dict[str, torch.Tensor]:
    """The initial parameters, buffers and optimizer state of rank program ``rp`` by placeholder (lowering
    leaves them None; ``PreparedRun.jobs`` fills them in)."""
    missing = [k for k, v in rp.persist.items() if v is None]
    if missing:
        raise HeterogError(f"rank {rp.rank}: no initial value for {', '.join(missing[:4])}"
                           f"{' ...' if len(missing) > 4 else ''} (PreparedRun.jobs fills them in)")
    return {k: v for k, v in rp.persist.items() if v is not None}


def describe_failure(exc: BaseException, rank: int) -> dict[str, Any]:
    """What a worker reports when ``exc`` ends its job: the exception with its notes (which fx node, which
    step and instruction), whether it struck while waiting for another rank (a *secondary* failure, e.g.
    gloo's ``Connection closed by peer`` after the peer crashed) and when (wall clock)."""
    import traceback

    where = getattr(exc, "heterog_where", None)
    waited = getattr(exc, "heterog_waiting", -1)
    notes = [n for n in getattr(exc, "__notes__", ()) if n != where]
    return {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "where": where,
            "step": getattr(exc, "heterog_step", None), "notes": notes,
            "secondary": waited != -1, "waited_for": waited_for(waited) if waited != -1 else None,
            "time": time.time(), "traceback": traceback.format_exc(limit=8)}


# ---------------------------------------------------------------------------- executing a rank program
class RankExecutor:
    """Runs one rank's program; ``run()`` returns per-step times and loss terms and the final values."""

    def __init__(self, job: Job, rank: int, device: torch.device, status: StatusLike | None = None,
                 transport: TransportLike | None = None) -> None:
        """``transport``: where messages and collectives go (default: torch.distributed through
        ``Transport``; ``heterog.runtime.check`` passes an in-process one for its dry run)."""
        self.job, self.rank, self.device = job, rank, device
        self.rp: RankProgram = job.rank
        self.status: StatusLike = status or NullStatus()
        prog = job.prog
        computes = [ins for ins in self.rp.instrs if isinstance(ins, Compute)]
        self.host = torch.device("cpu")          # where offloaded state lives and its update runs
        self.kernels = {(op, local, scale, host): prog.kernel(op, self.host if host else device, local, scale)
                        for op, local, scale, host in {(ins.op, ins.local, stats_scale(ins), ins.host)
                                                       for ins in computes}}
        self.chains: dict[tuple, Kernel] = {}
        for ins in self.rp.instrs:
            chains = [(inp.chain, None) for inp in ins.inputs] if isinstance(ins, Compute) else \
                [(ins.chain, ins.local)] if isinstance(ins, Derive) else \
                [(inp.chain, None) for part in ins.parts for inp in part.inputs] if isinstance(ins, BatchStats) else []
            for chain, local in chains:
                if chain and (chain, local) not in self.chains:
                    self.chains[(chain, local)] = Kernel([prog.view_calls[c] for c in chain], device, local=local)
        # every rank creates every subgroup, in the same order
        self.groups: list[Any]                  # the subgroups' process groups (None in process)
        self.transport: TransportLike
        if transport is None:
            self.groups = [dist.new_group(list(g)) for g in job.groups] if job.groups else []
            self.transport = Transport(device, job.emulate, self.status, rank)
        else:
            self.groups, self.transport = [None] * len(job.groups), transport
        self.members = [list(g) for g in job.groups]
        self.in_place = in_place_writers(self.rp, prog, self.kernels)
        self.write_into = write_targets(self.rp)
        self._claimed: set[str] = set()     # targets written in place this step (``_target``)
        self.consts = {k: v.to(device) for k, v in prog.consts.items()}
        # the rank's own copies: the step updates them in place
        self.persist = {k: to_host(v) if k in self.rp.host else owned(v, device)
                        for k, v in initial_values(self.rp).items()}
        self.debt_s = 0.0
        self.slow = self.rp.slowdown if job.emulate else 1.0
        self.post_in_order = any(isinstance(ins, Post) for ins in self.rp.instrs)
        self.recv_spec = {r.tag: r for r in self.rp.recvs}
        self.world = dist.get_world_size() if dist.is_initialized() and transport is None else 1
        self._at, self._step = -1, 0   # the instruction running (error messages), the step (random draws)
        # per step, per instruction: [kind, start s, end s, s waiting] (job.trace)
        self.traces: list[list[list[Any]]] = []
        self.memory = LiveBytes([t for batch in job.inputs for t in batch])
        self.host_memory = LiveBytes()     # the bytes of offloaded state and its update, in host memory
        self._taken: list[Recv] = []       # messages taken by the current instruction
        self._mem: Meter = NoMeter()     # the meter of the current step
        self._host_mem: Meter = NoMeter()

    # ------------------------------------------------------------------ helpers
    def _fetch(self, src: Source, env: dict[str, Any], stash: dict[Any, Any]) -> Any:
        if isinstance(src, Env):
            return env[src.node]
        if isinstance(src, Stash):
            v = stash[src.key]
            if type(v) is Pending:
                v = stash[src.key] = self._landed(src.key, v, env)
                self._mem.put(src, v)
            elif type(v) is Landing:
                v.event.synchronize()
                v = stash[src.key] = v.tensor
            return v
        if isinstance(src, Recv):
            self._pay()
            v = self.transport.take(src.tag)
            self._mem.put(src, v)           # held until the end of the instruction that takes it
            self._taken.append(src)
            return v
        if isinstance(src, Const):
            return self.consts[src.node]
        return shape_only(src.shape, src.dtype, src.order, self.device)

    def _landed(self, key: tuple, p: Pending, env: dict[str, Any]) -> torch.Tensor:
        """The result of collective ``p`` (stash ``key``) in its memory order, an all-gather's written into its
        target (``write_targets``) where there is one."""
        v = in_memory_order(self.transport.finish(p), p.order)
        into = self._target(key, v, env)
        return v if into is None else into.copy_(v)

    def _target(self, key: tuple, v: torch.Tensor, env: dict[str, Any], part: Part | None = None
                ) -> torch.Tensor | None:
        """Where the value ``v`` of stash ``key`` lands in place (``write_targets``; its rows ``part``): the
        target where ``v`` fits it and this rank alone holds it, or held it when a value landed in it before
        this step (a copy up into a parameter's rows, then gathered from them: no other instruction reads the
        target after, so the views of it are the landings'; None: in a tensor of its own)."""
        node = self.write_into.get(key, "")
        old = env.get(node)
        if old is None or not (node in self._claimed or exclusive(old)):
            return None
        if part is not None:
            old = shard_of(old, part.placement, part.extent, part.shares, part.rank)
        if old.shape != v.shape or old.dtype != v.dtype:
            return None
        self._claimed.add(node)
        return old

    def _piece(self, src: Source, sl: Slice | None, scale: float, env: dict[str, Any], stash: dict[Any, Any],
               shift: int = 0) -> torch.Tensor:
        return cut(self._fetch(src, env, stash), sl, scale, shift)

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
            self.debt_s, self.transport.idle_s = self.debt_s - slept, self.transport.idle_s + slept

    # ------------------------------------------------------------------ one step
    def step(self, index: int, inputs: Sequence[torch.Tensor]) -> tuple[float, float]:
        """Run step ``index``: (seconds, this rank's loss terms). A failure carries where it happened
        (``heterog_where``: rank, step, instruction) and whether this rank was waiting for another one."""
        rp, tr = self.rp, self.transport
        self._step = index
        metered = index < self.job.memory_steps
        self._mem = self.memory if metered else NoMeter()
        self._host_mem = self.host_memory if metered else NoMeter()
        env = self.begin_step(inputs)
        stash: dict[Any, Any] = {}
        self._at = -1
        try:
            if not self.post_in_order:
                # gloo matches by tag: post every receive of the step up front (all of the previous step's
                # messages to this rank have arrived, so none can be mistaken for this step's)
                for r in rp.recvs:
                    self._mem.put(Recv(r.tag), tr.post(r.tag, r.src, r.shape, r.dtype))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.world > 1:
                self.status.waiting(-3)
                dist.barrier()
                self.status.waiting(-1)
            t0 = time.perf_counter()
            trace: list[list[Any]] | None = [] if self.job.trace else None
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

    def begin_step(self, inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
        """A step's environment: the held values and this rank's slices of ``inputs``, metered from the start."""
        env: dict[str, Any] = dict(self.persist)
        self._claimed.clear()
        self._mem.reset()
        self._host_mem.reset()
        for ph, v in self.persist.items():
            (self._host_mem if ph in self.rp.host else self._mem).put(("persist", ph), v)
        for name, i, lo, hi in self.rp.inputs:
            env[name] = inputs[i][lo:hi].to(self.device)
            self._mem.put(Env(name), env[name])
        return env

    def describe(self, i: int) -> str:
        """Instruction ``i`` in words (for error messages)."""
        if i < 0:
            return "the start of the step (posting receives, the barrier)"
        if i >= len(self.rp.instrs):
            return "the end of the step (finishing collectives, sends and updates)"
        ins = self.rp.instrs[i]
        if isinstance(ins, Compute):
            prog = self.job.prog
            return (f"instruction {i}: compute op {ins.op} ({prog.op_target[ins.op]}, fx nodes "
                    f"{', '.join(prog.op_nodes[ins.op][:4])}) at local batch {ins.local_batch}")
        if isinstance(ins, Send):
            return f"instruction {i}: send message {ins.tag} to rank {ins.dst}"
        key = getattr(ins, "key", None)           # what it makes (a stash entry), or none
        return f"instruction {i}: {ins.kind}" + ("" if key is None else f" {key}")

    def _annotate(self, exc: BaseException, step: int, i: int) -> None:
        where = f"rank {self.rank}, step {step}, {self.describe(i)}"
        if getattr(exc, "heterog_where", None) is None:
            # read back by describe_failure (and by anyone holding the exception)
            for name, v in (("heterog_where", where), ("heterog_step", step), ("heterog_waiting", self.status.peer)):
                setattr(exc, name, v)
            exc.add_note(where)

    def _instructions(self, index: int, env: dict[str, Any], stash: dict[Any, Any], t0: float,
                      trace: list[list[Any]] | None) -> None:
        tr = self.transport
        for i, ins in enumerate(self.rp.instrs):
            self._at = i
            self.status.at(index, i)
            if trace is not None:
                trace.append([ins.kind, time.perf_counter() - t0])
                idle_at = tr.idle_s
            self.execute(i, env, stash)
            if trace is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)     # traced GPU ops: their time, not their launch
                trace[-1] += [time.perf_counter() - t0, tr.idle_s - idle_at]

    def execute(self, i: int, env: dict[str, Any], stash: dict[Any, Any]) -> None:
        """Run instruction ``i`` on this rank's values ``env`` and ``stash``, then free what it last used."""
        rp, tr, mem = self.rp, self.transport, self._mem
        ins = rp.instrs[i]
        if isinstance(ins, Compute):
            t_op, idle0 = time.perf_counter(), tr.idle_s
            self._compute(ins, env, stash, self.in_place.get(i))
            if not ins.host:               # the host CPU runs at its own speed, not the device's slowdown
                self._owe(t_op, idle0)
            where = self._host_mem if ins.host else mem
            for name in ins.exports:
                key = env_name(name, ins.micro, ins.recompute)
                where.put(Env(key), env[key])
        elif isinstance(ins, Send):
            self._pay()
            v = self._contribution(i, ins.source, ins.scale, env, stash, copy=False) if ins.slice is None \
                else self._piece(ins.source, ins.slice, ins.scale, env, stash)    # scaled in place where it can be
            mem.put(("sent", ins.tag), tr.send(v, ins.dst, ins.tag, *ins.link))   # held to its transfer's end: Sent
        elif isinstance(ins, Assemble):
            t_op, idle0 = time.perf_counter(), tr.idle_s
            pieces = [self._piece(p.source, p.slice, p.scale, env, stash, p.shift) for p in ins.pieces]
            v = pieces[0] if ins.batch is None or len(pieces) == 1 else cat_batch(pieces, *ins.batch)
            stash[ins.key] = in_memory_order(v, ins.order)
            self._owe(t_op, idle0)
            mem.put(Stash(ins.key), stash[ins.key])
        elif isinstance(ins, Aggregate):
            t_op, idle0 = time.perf_counter(), tr.idle_s
            stash[ins.key] = in_memory_order(self._sum(i, ins, env, stash), ins.order)
            self._owe(t_op, idle0)
            mem.put(Stash(ins.key), stash[ins.key])
        elif isinstance(ins, AllReduce):
            self._pay()
            v = self._contribution(i, ins.source, ins.scale, env, stash, copy=True)
            g = ins.group
            stash[ins.key] = pending = tr.allreduce(v, g, self.groups[g], self.members[g], self.rank,
                                                    ins.emulated_s)
            pending.order = ins.order
            mem.put(Stash(ins.key), v)
        elif isinstance(ins, AllGather):
            self._pay()
            g = ins.group
            v = self._fetch(ins.source, env, stash)
            stash[ins.key] = pending = tr.allgather(v, g, self.groups[g], self.members[g], self.rank, ins.parts,
                                                    ins.placement, ins.emulated_s)
            pending.order = ins.order
            mem.put(Stash(ins.key), v)
        elif isinstance(ins, ReduceScatter):
            self._pay()
            g = ins.group
            v = self._contribution(i, ins.source, ins.scale, env, stash, copy=False)
            stash[ins.key] = pending = tr.reduce_scatter(v, g, self.groups[g], self.members[g], self.rank,
                                                         ins.members, ins.need, ins.emulated_s)
            pending.order = ins.order
            mem.put(Stash(ins.key), v)
        elif isinstance(ins, AllToAll):
            self._pay()
            g = ins.group
            v = self._fetch(ins.source, env, stash)
            stash[ins.key] = pending = tr.all_to_all(v, g, self.groups[g], self.members[g], self.rank, ins.members,
                                                     ins.shape, ins.have, ins.need, ins.emulated_s)
            pending.order = ins.order
            mem.put(Stash(ins.key), v)
        elif isinstance(ins, Combine):
            t_op, idle0 = time.perf_counter(), tr.idle_s
            stash[ins.key] = in_memory_order(combine([self._fetch(p, env, stash) for p in ins.parts], ins.placement),
                                             ins.order)
            self._owe(t_op, idle0)
            mem.put(Stash(ins.key), stash[ins.key])
        elif isinstance(ins, Derive):
            t_op, idle0 = time.perf_counter(), tr.idle_s
            stash[ins.key] = self._derive(i, ins, env, stash)
            self._owe(t_op, idle0)
            mem.put(Stash(ins.key), stash[ins.key])
        elif isinstance(ins, Copy):
            t_op, idle0 = time.perf_counter(), tr.idle_s
            v = self._fetch(ins.source, env, stash)
            stash[ins.key] = to_host(v, wait=False) if ins.to_host else \
                to_device(v, self.device, self._target(ins.key, v, env, ins.part))
            self._owe(t_op, idle0)
            got = stash[ins.key]
            (self._host_mem if ins.to_host else mem).put(Stash(ins.key), got.tensor if type(got) is Landing else got)
        elif isinstance(ins, Post):
            r = self.recv_spec[ins.tag]
            mem.put(Recv(r.tag), tr.post(r.tag, r.src, r.shape, r.dtype))
        elif isinstance(ins, Sent):
            tr.release(ins.tag)
            mem.drop(("sent", ins.tag))
        elif isinstance(ins, Finish):
            self._fetch(Stash(ins.key), env, stash)
        elif isinstance(ins, BatchStats):
            t_op, idle0 = time.perf_counter(), tr.idle_s
            stash[ins.key] = self._batch_stats(ins, env, stash)
            self._owe(t_op, idle0)
            mem.put(Stash(ins.key), stash[ins.key])
        for src in rp.frees[i]:
            if isinstance(src, Env):
                env.pop(src.node, None)
                if self.persist.pop(src.node, None) is not None:       # replaced by the step (``last_uses``)
                    mem.drop(("persist", src.node))
                    self._host_mem.drop(("persist", src.node))
            else:
                stash.pop(src.key, None)
            mem.drop(src)
            self._host_mem.drop(src)
        for taken in self._taken:
            mem.drop(taken)
        self._taken.clear()

    def _batch_stats(self, ins: BatchStats, env: dict[str, Any], stash: dict[Any, Any]) -> torch.Tensor:
        """A synced batch norm's count and sums over this device's instances (``heterog.runtime.sync_stats``)."""
        from heterog.runtime.batch_stats import local_sums

        prog = self.job.prog
        call = prog.calls[ins.node]
        total = None
        for part, weight in zip(ins.parts, ins.weights):
            local = self._inputs(part, env, stash)
            args, _ = call_arguments(call, local, self.job.sizes[part.local_batch])
            sums = local_sums(prog.op_target[part.op], args, weight)
            total = sums if total is None else total + sums
        assert total is not None
        return total

    def _compute(self, ins: Compute, env: dict[str, Any], stash: dict[Any, Any],
                 in_place: tuple[str, tuple[str, ...]] | None = None) -> None:
        """An op instance: its inputs fetched (scaled, their view chains run at the local batch), its
        kernel run (random nodes drawing for its samples; ``in_place``: a node and the inputs it may write
        its output into, ``in_place_writers``), its exports kept in ``env``."""
        sizes = self.job.sizes
        local = self._inputs(ins, env, stash)
        if ins.stats is not None:
            from heterog.runtime.batch_stats import STATS_NODE

            local[STATS_NODE] = self._fetch(ins.stats, env, stash)
        kernel = self.kernels[(ins.op, ins.local, stats_scale(ins), ins.host)]
        draw = None
        if kernel.random:
            prog = self.job.prog
            draw = Draw(prog.rng_seed, self._step, prog.batch_size,
                        range(ins.first_sample, ins.first_sample + ins.local_batch),
                        {n: sizes[n] for n in block_batches(prog.batch_size)})
        kernel(local, sizes[ins.local_batch], draw, in_place)
        for name in ins.exports:
            env[env_name(name, ins.micro, ins.recompute)] = local[name]

    def _inputs(self, ins: Compute, env: dict[str, Any], stash: dict[Any, Any]) -> dict[str, Any]:
        """What an op instance reads: each input fetched, scaled, its view chain run at the local batch."""
        sizes = self.job.sizes
        local: dict[str, Any] = {}
        for inp in ins.inputs:
            v = self._fetch(inp.source, env, stash)
            if inp.scale != 1.0:
                v = scaled(v, inp.scale)
            if inp.chain:
                assert inp.leaf is not None   # a view chain starts at a leaf's node
                local[inp.leaf] = v
                self.chains[(inp.chain, None)](local, sizes[ins.local_batch])
            else:
                local[inp.node] = v
            if inp.tuple_index is not None and not isinstance(local[inp.node], (tuple, list)):
                local[inp.node] = [None] * inp.tuple_index + [local[inp.node]]
        return local

    def _sum(self, i: int, ins: Aggregate, env: dict[str, Any], stash: dict[Any, Any]) -> torch.Tensor:
        """The sum of an aggregate's parts, added into the first one where this is its last reader and this rank
        alone holds it (gradient accumulation over micro-batches, a PS's sum): the same bits as a new sum."""
        first = ins.parts[0]
        v = self._fetch(first.source, env, stash)
        parts = [self._piece(p.source, p.slice, p.scale, env, stash) for p in ins.parts[1:]]
        if first.slice is None and not first.shift and self._dying(i, first.source) and exclusive(v) \
                and v.is_floating_point() and all(p.shape == v.shape and p.dtype == v.dtype for p in parts):
            acc = v if first.scale == 1.0 else v.mul_(first.scale)
            for p in parts:
                acc.add_(p)
            return acc
        acc = cut(v, first.slice, first.scale, first.shift) + parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc

    def _contribution(self, i: int, src: Source, scale: float, env: dict[str, Any], stash: dict[Any, Any],
                      copy: bool) -> torch.Tensor:
        """What this rank gives a collective: ``src`` x ``scale``, scaled in place where this is its last reader
        and this rank alone holds it (a collective works in its contribution's buffer, as NCCL's AllReduce does);
        else a new tensor when scaled or when ``copy`` (the collective writes into it)."""
        v = self._fetch(src, env, stash)
        if self._dying(i, src) and exclusive(v) and v.is_floating_point():
            return v if scale == 1.0 else v.mul_(scale)
        return scaled(v, scale) if copy or scale != 1.0 else v

    def _dying(self, i: int, src: Source) -> bool:
        """Whether instruction ``i`` is the last reader of ``src`` on this rank (a message: always)."""
        return isinstance(src, Recv) or src in self.rp.frees[i]

    def _derive(self, i: int, ins: Derive, env: dict[str, Any], stash: dict[Any, Any]) -> torch.Tensor:
        """A value's view chain run on it (on a device's part: with its local sizes), then the part of it
        this device reads (a view where it is dense, unless ``Derive.own``); scaled in place where instruction
        ``i`` is the value's last reader and this rank alone holds it (a gradient on its way to a
        reduce-scatter: the collective works in its buffer)."""
        v = self._fetch(ins.source, env, stash)
        if isinstance(v, (tuple, list)):
            assert ins.index is not None
            v = v[ins.index]
        if ins.scale != 1.0:
            whole = isinstance(v, torch.Tensor) and ins.index is None and v.is_floating_point()
            v = v.mul_(ins.scale) if whole and self._dying(i, ins.source) and exclusive(v) else scaled(v, ins.scale)
        if ins.pad is not None:
            p = ins.pad
            v = padded(v, p.placement, p.extent, p.shares, p.rank)
        if ins.chain:
            local = {ins.leaf: v}
            self.chains[(ins.chain, ins.local)](local, self.job.sizes[ins.local_batch])
            v = local[ins.chain[-1]]
        if ins.part is not None:
            p = ins.part
            v = part_of(v, p.placement, p.extent, p.shares, p.rank, copy=ins.own)
        return v

    def _step_end(self, env: dict[str, Any], stash: dict[Any, Any], t0: float) -> tuple[float, float]:
        rp, tr = self.rp, self.transport
        for key, v in list(stash.items()):
            if type(v) is Pending:
                stash[key] = self._landed(key, v, env)
                self._mem.put(Stash(key), stash[key])
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

    def run(self) -> dict[str, Any]:
        """Steps ``first_step ..`` of the job (step s reads batch ``s % len(inputs)`` and draws step s's
        random values), writing checkpoints when they are due."""
        times, losses, written = [], [], []
        ck = self.job.checkpoint
        if ck is not None:
            ck.ready()
        for s in range(self.job.first_step, self.job.first_step + self.job.steps):
            batch = self.job.inputs[s % len(self.job.inputs)]
            elapsed, loss = self.step(s, batch)
            times.append(elapsed)
            losses.append(loss)
            if ck is not None:
                self.status.waiting(-4)
                took = ck.after_step(s + 1, self.persist, loss if self.rp.loss_terms else 0.0, self.rank,
                                     self.world, self.device)
                self.status.waiting(-1)
                if took is not None:
                    written.append((s + 1, took))
        out: dict[str, Any] = {"rank": self.rank, "times_s": times, "loss_terms": losses,
                               "has_loss": bool(self.rp.loss_terms), "values": {},
                               "peak_memory_bytes": int(self.memory.peak), "checkpoints": written,
                               "host_peak_memory_bytes": int(self.host_memory.peak)}
        if self.job.trace:
            out["traces"] = self.traces
        if self.job.return_state:
            out["values"] = {ph: (kind, self.persist[ph].detach().to("cpu").clone()) for kind, ph in self.rp.report}
        return out
