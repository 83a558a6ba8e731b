"""The one conversion engine: the tasks that give each reader of a value what it needs where it is made
(collectives, landings, transfers, re-layouts, host copies, batch statistics), priced, with deps and order keys.

Semantics: docs/design.md, "Placements" (the table of conversions, ``heterog.placement.conversion``), "Splits
beyond the batch", "Sharded state" and "Offloading". Who needs what is decided by the modules that know the
placement (``emit``: data-parallel layouts; ``reshard``: values divided beyond the batch and grids;
``sharded_state``: state rows of a group's replicas; ``offload``: values in host memory; ``sync_stats``: the
statistics of synced batch norms); every task that converts a value between placements is produced here, by
these routes:

  route          have (where it is made)              need (where it is read)            tasks
  collective     shards / partial sums / whole over   the table's need over the same     COLLECTIVE (+ landings:
                 a device group                       group (all-gather, reduce-scatter,  zero-time CONCAT tasks
                                                      all-reduce, all-to-all)             allocating the result)
  allreduce      partial sums over data-parallel      whole on each replica              ALLREDUCE (the
                 replicas                                                                 algorithm's links)
  transfers      whole (or a piece) on a device       the same on another device         TRANSFER (PUSH to a PS)
  copies         whole on some devices                whole on a device lacking it       TRANSFER from the
                                                                                          best-connected holder
  partitioned    whole outside a split group          whole on every device of it        TRANSFER of pieces +
                                                                                          all-gather, if faster
  relayout       batch rows over a layout             batch rows over another layout     RELAYOUT + TRANSFER +
                                                                                          CONCAT
  host_copies    on a GPU (or on its host)            on its host (or on the GPU)        TRANSFER on a PCIe link
  statistics     a synced batch norm's per-channel    their sum on every replica         STATISTICS (the
                 sums on each replica                                                     AllReduce's links)
  trigger        -                                    a conversion waits for given ops   SYNC (no work)

Prices: transfers ``latency + bytes / bandwidth`` of the path (``CostModel.transfer_times``); all-gather and
reduce-scatter of uneven shards hop by hop (``CostModel.sharded_ring_times``), all-to-all as that ring passing
1/n of each shard, all-reduce as ``CostModel.allreduce_times`` (summed partial results of a step as gradients,
``gradient_allreduce_times``; the data-parallel AllReduce from ``CompileContext.allreduce``, a synced batch
norm's statistics as a value on the links of its first algorithm); re-layout cuts and
joins as memory copies (``CostModel.copy_times``); host copies ``heterog.cost.host.pcie_time_s``. A collective of
a value made in a layer whose measured time includes it (``CostModel.profiled_layers``) takes 0. A collective
holds a ring's links (the data-parallel AllReduce its algorithm's), the NCCL stream where collectives are
serialised, and the members that drive their own communication.

Order keys (``heterog.compiler.tasks``): each caller names its tasks' place (``prio_op``, stage, class, tensor,
``sub``) and owner; ``sub=None`` numbers a tensor's tasks as they are made. An ``Engine`` gathers the tasks of one
emission phase and adds them to the batch in the order they were made (task ids are final when made); call
``flush`` before anything else adds tasks to the batch or reads it (a few tasks added at once wait as rows, like
tasks made one at a time).
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from heterog.caches import DerivedCache
from heterog.compiler.context import CompileContext
from heterog.compiler.memory import input_ops
from heterog.compiler.registries import LayoutTable
from heterog.compiler.tasks import STAGE, TaskBatch, TaskCategory, TaskKind, ragged
from heterog.cost.host import pcie_time_s
from heterog.placement import Conversion


# ----------------------------------------------------------------------------------- prices and resources
class CollectiveKey(NamedTuple):
    """A collective as priced: its kind, devices, bytes, each device's shard of them (None for an all-reduce) and
    whether it sums a step's partial results (priced as gradients)."""

    kind: Conversion
    devices: tuple[int, ...]
    nbytes: float
    shards: tuple[float, ...] | None
    gradient: bool


_COLLECTIVE_S: DerivedCache[CompileContext, dict[CollectiveKey, float]] = DerivedCache(
    "seconds of each collective priced one at a time, per compile context")
_RINGS: DerivedCache[CompileContext, dict[tuple[int, ...], tuple[int, ...]]] = DerivedCache(
    "resources a ring collective over each device set holds, per compile context")
_COVERED: DerivedCache[CompileContext, np.ndarray] = DerivedCache(
    "ops whose collectives a layer profile's measured time covers, per compile context")


def ring_resources(ctx: CompileContext, devices: tuple[int, ...]) -> tuple[int, ...]:
    """The resources a ring collective over ``devices`` holds: its links, the NCCL stream (serialised
    collectives) and the members that drive their own communication."""
    rings = _RINGS.get(ctx, dict)
    hit = rings.get(devices)
    if hit is None:
        links = tuple(ctx.n_devices + x for x in ctx.cost.allreduce_links(devices, "ring"))
        nccl = (ctx.nccl_resource,) if ctx.nccl_resource >= 0 else ()
        hit = rings[devices] = links + nccl + tuple(d for d in devices if ctx.paths.host[d])
    return hit


def collective_seconds(ctx: CompileContext, kind: Conversion, devices: tuple[int, ...], nbytes: np.ndarray,
                       have: np.ndarray | None = None, need: np.ndarray | None = None,
                       gradient: bool = False) -> np.ndarray:
    """(K,) seconds of a collective ``kind`` of tensors of ``nbytes`` (K,) (whole) over ``devices``: all-gather and
    all-to-all of the producer's shards ``have`` (n,) (each device's part), reduce-scatter into the shards
    ``need`` (n,), all-reduce as a value or, ``gradient``, as a step's partial results."""
    x = np.asarray(nbytes, dtype=np.float64)
    if kind == Conversion.ALL_REDUCE:
        cost_ar = ctx.cost.gradient_allreduce_times if gradient else ctx.cost.allreduce_times
        return cost_ar(devices, x)[0]
    shards = have if kind in (Conversion.ALL_GATHER, Conversion.ALL_TO_ALL) else need
    if kind not in (Conversion.ALL_GATHER, Conversion.ALL_TO_ALL, Conversion.REDUCE_SCATTER) or shards is None:
        raise ValueError(f"no price for a {kind.label} with shards {shards}")
    cost_s = ctx.cost.alltoall_times if kind == Conversion.ALL_TO_ALL else ctx.cost.sharded_ring_times
    return cost_s(devices, x[:, None] * np.asarray(shards, dtype=np.float64)[None, :])


def _collective_s(ctx: CompileContext, kind: Conversion, devices: tuple[int, ...], nbytes: float,
                  have: np.ndarray | None, need: np.ndarray | None, gradient: bool) -> float:
    """``collective_seconds`` of one tensor, kept per context."""
    shards = have if kind in (Conversion.ALL_GATHER, Conversion.ALL_TO_ALL) else \
        need if kind == Conversion.REDUCE_SCATTER else None
    key = CollectiveKey(kind, devices, nbytes, None if shards is None else tuple(np.asarray(shards).tolist()),
                        gradient)
    times = _COLLECTIVE_S.get(ctx, dict)
    hit = times.get(key)
    if hit is None:
        hit = times[key] = float(collective_seconds(ctx, kind, devices, np.array([nbytes]), have, need, gradient)[0])
    return hit


def covered(ctx: CompileContext) -> np.ndarray:
    """(n_ops, M) ``CostModel.profiled_layers`` of the context's graph: an op's collectives on a device are in
    its layer's measured time."""
    return _COVERED.get(ctx, lambda: ctx.cost.profiled_layers(ctx.graph))


# ----------------------------------------------------------------------------------- the engine
_FEW_TASKS = 16          # tasks added at once that the engine keeps as rows until ``flush``
# the columns of a row (``Engine._task``), by ``TaskBatch.add``'s names
_ROW_COLS = ("dur", "kind", "op", "dev", "alloc", "cat", "prio_op", "stage", "cls", "tensor", "sub", "owner", "lag")


def _each(value: Any, k: int) -> list:
    """``value`` (a scalar or k values) as a list of k Python numbers."""
    if isinstance(value, (int, float)):
        return [value] * k
    a = np.asarray(value)
    return [a.item()] * k if a.ndim == 0 else a.ravel().tolist()


class Engine:
    """The conversion tasks of one emission phase over ``batch`` (module docstring): made one at a time (scalar
    routes) or many at once (vectorised routes), numbered in the order made, added at ``flush``."""

    def __init__(self, ctx: CompileContext, batch: TaskBatch) -> None:
        self.ctx, self.batch = ctx, batch
        # tasks made one at a time: (dur, kind, op, dev, alloc, cat, prio_op, stage code, cls, tensor, sub,
        # owner, lag) and resources, numbered from ``_first``
        self._rows: list[tuple[Any, ...]] = []
        self._res: list[tuple[int, ...]] = []
        self._moves: list[tuple[int, int, int, float]] = []    # (row, src, dst, bytes) of ``move``s not priced yet
        self._first = -1
        self._deps: list[tuple[int, int, int]] = []
        self._sub: dict[int, int] = defaultdict(int)

    # -- making tasks
    def _task(self, *, dur: float, kind: TaskKind, op: int, dev: int, alloc: float, cat: TaskCategory,
              prio_op: int, stage: str, cls: int, tensor: int, res: tuple[int, ...], owner: int,
              sub: int | None = None, lag: float = 0.0) -> int:
        """One task, numbered ``sub`` in its tensor (None: as made); returns its id."""
        rows = self._rows
        if not rows:
            self._first = self.batch.first_id + self.batch.n
        if sub is None:
            sub = self._sub[tensor]
            self._sub[tensor] = sub + 1
        rows.append((dur, int(kind), op, dev, alloc, int(cat), prio_op, STAGE[stage], cls, tensor, sub, owner, lag))
        self._res.append(res)
        return self._first + len(rows) - 1

    def add(self, **cols: Any) -> np.ndarray:
        """Many tasks (``TaskBatch.add``'s arguments); returns their ids. A few are kept as rows, like tasks
        made one at a time, and added with them (one batch addition costs as much as hundreds of rows)."""
        k = len(cols["dur"])
        if k > _FEW_TASKS:
            self._flush_tasks()
            return self.batch.add(**cols)
        if not self._rows:
            self._first = self.batch.first_id + self.batch.n
        stage = cols["stage"]
        cols["stage"] = STAGE[stage] if isinstance(stage, str) else stage
        cols.setdefault("lag", 0.0)
        values = [_each(cols[name], k) for name in _ROW_COLS]
        res = np.asarray(cols["res_idx"], dtype=np.int64).ravel().tolist()
        first = self._first + len(self._rows)
        self._rows.extend(zip(*values))
        if not res:
            self._res.extend([()] * k)
        else:
            ends = list(itertools.accumulate(_each(cols["res_len"], k)))
            self._res.extend(tuple(res[lo:hi]) for lo, hi in zip([0, *ends[:-1]], ends))
        return np.arange(first, first + k, dtype=np.int64)

    def _flush_tasks(self) -> None:
        if not self._rows:
            return
        if self.batch.first_id + self.batch.n != self._first:
            raise AssertionError("tasks were added to the batch while conversion tasks were pending")
        dur, kind, op, dev, alloc, cat, prio_op, stage, cls, tensor, sub, owner, lag = \
            (np.array(c) for c in zip(*self._rows))
        dur, lag = dur.astype(np.float64), lag.astype(np.float64)
        if self._moves:                           # the moves' prices and paths, all at once
            row, a, b = (np.array(c, dtype=np.int64) for c in list(zip(*self._moves))[:3])
            nb = np.array([x[3] for x in self._moves], dtype=np.float64)
            dur[row], lag[row] = self.ctx.cost.transfer_times(a, b, nb), self.ctx.cost.transfer_latencies(a, b, nb)
            rlen, ridx = self.ctx.paths.resources(a, b)
            ends = np.cumsum(rlen).tolist()
            for r, lo, hi in zip(row.tolist(), [0, *ends[:-1]], ends):
                self._res[r] = tuple(ridx[lo:hi].tolist())
            self._moves = []
        self.batch.add(dur=dur, kind=kind, op=op, dev=dev, alloc=alloc.astype(np.float64),
                       cat=cat, prio_op=prio_op, stage=stage, cls=cls, tensor=tensor, sub=sub, owner=owner,
                       res_len=np.array([len(r) for r in self._res], dtype=np.int64),
                       res_idx=np.array([x for r in self._res for x in r], dtype=np.int64), lag=lag)
        self._rows, self._res = [], []

    def dep(self, task: int, on: int, owner: int) -> None:
        """``task`` waits for ``on`` (one dependency, added at ``flush``)."""
        self._deps.append((task, on, owner))

    def dep_each(self, tasks: Iterable[int], on: Iterable[int], owner: int) -> None:
        """``dep(t, o, owner)`` for each pair of ``tasks`` and ``on``, in that order."""
        self._deps.extend(zip(tasks, on, itertools.repeat(owner)))

    def deps(self, task: npt.ArrayLike, on: npt.ArrayLike, owner: npt.ArrayLike) -> None:
        """``task[i]`` waits for ``on[i]`` (``TaskBatch.deps``)."""
        self.batch.deps(task, on, owner)

    def flush(self) -> None:
        """Add the tasks and dependencies made one at a time to the batch (with the ids they were given)."""
        self._flush_tasks()
        if self._deps:
            task, on, owner = np.array(self._deps, dtype=np.int64).T
            self.batch.deps(task, on, owner)
            self._deps = []

    # -- collectives over a group: the table's conversions
    def collective(self, kind: Conversion, devices: tuple[int, ...], nbytes: npt.ArrayLike, after: np.ndarray, *,
                   op: npt.ArrayLike, tensor: npt.ArrayLike, prio_op: npt.ArrayLike, stage: str, cls: int,
                   owner: npt.ArrayLike, sub: npt.ArrayLike | None = None, have: np.ndarray | None = None,
                   need: np.ndarray | None = None, gradient: bool = False, in_layer: bool = False) -> np.ndarray:
        """(K,) one collective ``kind`` (``heterog.placement.Conversion``) per tensor of ``nbytes`` (K,) over
        ``devices``, each after its row of ``after`` (K, x) task ids; ``have``/``need``: each device's part of
        the sharded side (``collective_seconds``); ``in_layer``: one of the producer op's layer's own
        collectives, free where a layer profile covers it. ``sub=None``: one tensor, numbered as made."""
        nb = np.atleast_1d(np.asarray(nbytes, dtype=np.float64))
        after = np.asarray(after, dtype=np.int64).reshape(len(nb), -1)
        if sub is None:                          # one tensor
            if len(nb) != 1:
                raise ValueError("collectives numbered as made are made one at a time")
            cid = self.collective_one(kind, devices, float(nb[0]), after[0].tolist(), op=int(np.asarray(op)),
                                      tensor=int(np.asarray(tensor)), prio_op=int(np.asarray(prio_op)), stage=stage,
                                      cls=cls, owner=int(np.asarray(owner)), have=have, need=need, gradient=gradient,
                                      in_layer=in_layer)
            return np.array([cid], dtype=np.int64)
        res = ring_resources(self.ctx, devices)
        times = collective_seconds(self.ctx, kind, devices, nb, have, need, gradient) if len(nb) > 1 else \
            np.array([_collective_s(self.ctx, kind, devices, float(nb[0]), have, need, gradient)])
        if in_layer:
            ops = np.broadcast_to(np.asarray(op), nb.shape)
            times = np.where(covered(self.ctx)[ops][:, list(devices)].all(axis=1), 0.0, times)
        ids = self.add(dur=times, kind=TaskKind.COLLECTIVE, op=op, dev=-1, alloc=0.0, cat=TaskCategory.COLLECTIVE,
                       prio_op=prio_op, stage=stage, cls=cls, tensor=tensor, sub=sub, owner=owner,
                       res_len=len(res), res_idx=np.tile(np.array(res, dtype=np.int64), len(nb)))
        k = after.shape[1]
        self.deps(np.repeat(ids, k), after.ravel(), np.repeat(np.broadcast_to(np.asarray(owner), (len(nb),)), k))
        return ids

    def collective_one(self, kind: Conversion, devices: tuple[int, ...], nbytes: float, after: Sequence[int], *,
                       op: int, tensor: int, prio_op: int, stage: str, cls: int, owner: int,
                       have: np.ndarray | None = None, need: np.ndarray | None = None, gradient: bool = False,
                       in_layer: bool = False) -> int:
        """``collective`` of one tensor numbered as made, after the tasks ``after``: priced once per context;
        returns its id."""
        ctx = self.ctx
        dur = _collective_s(ctx, kind, devices, nbytes, have, need, gradient)
        if in_layer and covered(ctx)[op, list(devices)].all():
            dur = 0.0
        cid = self._task(dur=dur, kind=TaskKind.COLLECTIVE, op=op, dev=-1, alloc=0.0, cat=TaskCategory.COLLECTIVE,
                         prio_op=prio_op, stage=stage, cls=cls, tensor=tensor, res=ring_resources(ctx, devices),
                         owner=owner)
        deps = self._deps
        for s in after:
            deps.append((cid, s, owner))
        return cid

    def land(self, collective: int, devices: Sequence[int] | np.ndarray, nbytes: float, parts: npt.ArrayLike, *,
             op: int, tensor: int, prio_op: int, cls: int, owner: int, sub: npt.ArrayLike | None = None) -> np.ndarray:
        """A collective's result landing on each of ``devices``: a zero-time task allocating ``parts[i]`` of
        ``nbytes`` there, after the collective. ``sub=None``: numbered as made."""
        alloc = nbytes * np.asarray(parts, dtype=np.float64)
        if sub is None:
            made = []
            for d, a in zip(devices, alloc.tolist()):
                tid = self._task(dur=0.0, kind=TaskKind.CONCAT, op=op, dev=int(d), alloc=a,
                                 cat=TaskCategory.COLLECTIVE, prio_op=prio_op, stage="transfer", cls=cls,
                                 tensor=tensor, res=(), owner=owner)
                self._deps.append((tid, collective, owner))
                made.append(tid)
            return np.array(made, dtype=np.int64)
        dev = np.asarray(devices, dtype=np.int64)
        out = self.add(dur=np.zeros(len(dev)), kind=TaskKind.CONCAT, op=op, dev=dev, alloc=alloc,
                       cat=TaskCategory.COLLECTIVE, prio_op=prio_op, stage="transfer", cls=cls, tensor=tensor,
                       sub=sub, owner=owner, res_len=0, res_idx=np.zeros(0, dtype=np.int64))
        self.deps(out, np.full(len(dev), collective), owner)
        return out

    def allreduce(self, tensors: np.ndarray, ops: np.ndarray, devices: tuple[int, ...],
                  after: np.ndarray) -> np.ndarray:
        """(K,) the data-parallel AllReduce of the partial results ``tensors`` (K,) of ``ops`` over ``devices``,
        each after its row of ``after`` (K, n): priced and held as ``CompileContext.allreduce`` chose (ring or
        hierarchical)."""
        costs = self.ctx.allreduce(devices)
        code = costs.algo[tensors]
        nccl = (self.ctx.nccl_resource,) if self.ctx.nccl_resource >= 0 else ()
        res = [costs.links[a] + nccl + costs.hosts for a in range(len(costs.names))]
        ids = self.add(dur=costs.times_s[tensors], kind=TaskKind.ALLREDUCE, op=ops, dev=-1, alloc=0.0,
                       cat=TaskCategory.ALLREDUCE, prio_op=ops, stage="aggregate", cls=0, tensor=tensors, sub=0,
                       owner=ops, res_len=np.array([len(r) for r in res], dtype=np.int64)[code],
                       res_idx=np.array([x for a in code.tolist() for x in res[a]], dtype=np.int64))
        k = after.shape[1]
        self.deps(np.repeat(ids, k), after.ravel(), np.repeat(ops, k))
        return ids

    def statistics(self, op: int, devices: tuple[int, ...], nbytes: float, after: np.ndarray) -> int:
        """The all-reduce of a synced batch norm ``op``'s statistics (``nbytes``, ``heterog.compiler.sync_stats``)
        over ``devices``, after its instances ``after``: a STATISTICS task priced as a value
        (``CostModel.allreduce_times``, no time on one device), holding the links of the first algorithm of
        ``CompileContext.allreduce``, the NCCL stream and the hosts where it spans several devices."""
        dur = float(self.ctx.cost.allreduce_times(devices, np.array([nbytes]))[0][0])
        res: tuple[int, ...] = ()
        if len(devices) > 1:
            costs = self.ctx.allreduce(devices)
            nccl = (self.ctx.nccl_resource,) if self.ctx.nccl_resource >= 0 else ()
            res = costs.links[0] + nccl + costs.hosts
        s = int(self.add(dur=np.array([dur]), kind=TaskKind.STATISTICS, op=op, dev=-1, alloc=0.0,
                         cat=TaskCategory.ALLREDUCE, prio_op=op, stage="compute", cls=1, tensor=0, sub=0, owner=op,
                         res_len=len(res), res_idx=np.asarray(res, dtype=np.int64))[0])
        self.deps(np.full(len(after), s), after, op)
        return s

    def trigger(self, after: np.ndarray, *, op: int, tensor: int, prio_op: int, stage: str, cls: int, sub: int,
                owner: int) -> int:
        """A zero-time SYNC task that waits for ``after`` (a conversion that waits for it starts no earlier)."""
        sync = int(self.add(dur=np.zeros(1), kind=TaskKind.SYNC, op=op, dev=-1, alloc=0.0, cat=TaskCategory.SYNC,
                            prio_op=prio_op, stage=stage, cls=cls, tensor=tensor, sub=sub, owner=owner,
                            res_len=0, res_idx=np.zeros(0, dtype=np.int64))[0])
        if len(after):
            self.deps(np.full(len(after), sync), after, owner)
        return sync

    # -- moves between devices
    def transfers(self, after: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, *,
                  op: npt.ArrayLike, prio_op: npt.ArrayLike, stage: str, cls: int, tensor: npt.ArrayLike,
                  sub: npt.ArrayLike, owner: npt.ArrayLike, kind: TaskKind = TaskKind.TRANSFER,
                  cat: TaskCategory = TaskCategory.TRANSFER, dev: npt.ArrayLike | None = None) -> np.ndarray:
        """``nbytes[i]`` moved from device ``src[i]`` to ``dst[i]`` after ``after[i]``, holding the path's links
        and allocating the bytes on ``dev`` (default the destination)."""
        cost = self.ctx.cost
        rlen, ridx = self.ctx.paths.resources(src, dst)
        ids = self.add(dur=cost.transfer_times(src, dst, nbytes), kind=kind, op=op, dev=dst if dev is None else dev,
                       alloc=nbytes, cat=cat, prio_op=prio_op, stage=stage, cls=cls, tensor=tensor, sub=sub,
                       owner=owner, res_len=rlen, res_idx=ridx, lag=cost.transfer_latencies(src, dst, nbytes))
        self.deps(ids, after, owner)
        return ids

    def move(self, after: int, s: int, d: int, nbytes: float, *, op: int, prio_op: int, tensor: int) -> int:
        """One transfer of ``nbytes`` of ``tensor`` from ``s`` (after ``after``) to ``d``, numbered as made (class
        1, owned by the tensor's edges); priced and routed with the others pending at ``flush``."""
        owner = self.ctx.index.n_ops + tensor
        tr = self._task(dur=0.0, kind=TaskKind.TRANSFER, op=op, dev=d, alloc=nbytes, cat=TaskCategory.TRANSFER,
                        prio_op=prio_op, stage="transfer", cls=1, tensor=tensor, res=(), owner=owner)
        self._moves.append((len(self._rows) - 1, s, d, nbytes))
        self.dep(tr, after, owner)
        return tr

    def copies(self, tensor: np.ndarray, op: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, reader: np.ndarray,
               holders: np.ndarray, at: np.ndarray) -> np.ndarray:
        """(x,) for each row (a whole value ``tensor`` of ``op`` read on device ``dst`` that lacks it, by op
        ``reader``), the transfer that brings it: one per (tensor, device), from the holder (``holders`` (x, M))
        of the highest bandwidth to it, then the lowest latency, then the lowest id, after that holder's task
        (``at`` (n_tensors, M)); ordered before its first reader."""
        ctx, m = self.ctx, self.ctx.n_devices
        score_bw = np.where(holders, ctx.bandwidth_Bps[:, dst].T, -np.inf)
        best_bw = score_bw.max(axis=1, keepdims=True)
        s = np.argmin(np.where(score_bw == best_bw, ctx.latency_s[:, dst].T, np.inf), axis=1)
        uniq, first, inv = np.unique(tensor * m + dst, return_index=True, return_inverse=True)
        first_reader = np.full(len(uniq), np.iinfo(np.int64).max)
        np.minimum.at(first_reader, inv, reader)
        tt, ts, td = tensor[first], s[first], dst[first]
        tr = self.transfers(at[tt, ts], ts, td, nbytes[first], op=op[first], prio_op=first_reader, stage="transfer",
                            cls=0, tensor=tt, sub=td, owner=ctx.index.n_ops + tt)
        return tr[inv]

    def partitioned(self, t: int, u: int, holders: tuple[int, ...], group: tuple[int, ...], nbytes: float,
                    task_at: Callable[[int], int], prio: int) -> dict[int, int] | None:
        """A whole value that every device of a split ``group`` reads, held whole by each of ``holders`` (none in
        the group), moved partitioned when that is faster: each member gets an even piece from the holders in
        turn, then the group all-gathers (DeepSpeed's pipeline sends between tensor-parallel stages,
        ``PipelineEngine.is_pipe_partitioned``), instead of a whole copy per member. Returns each member's landing
        task, or None where whole copies are at least as fast (both priced as one link would carry them, in
        turn). ``task_at(h)``: the task after which holder ``h`` has the value."""
        ctx, k = self.ctx, len(group)
        srcs = [holders[i % len(holders)] for i in range(k)]
        a, b = np.array([ctx.cluster.best_source(holders, d) for d in group]), np.array(group)
        whole_s = float(ctx.cost.transfer_times(a, b, np.full(k, nbytes)).sum())
        piece = np.full(k, nbytes / k)
        gather_s = float(ctx.cost.sharded_ring_times(group, piece[None, :])[0])
        if float(ctx.cost.transfer_times(np.array(srcs), b, piece).sum()) + gather_s >= whole_s:
            return None
        moves = [self.move(task_at(s), s, d, nbytes / k, op=u, prio_op=prio, tensor=t) for s, d in zip(srcs, group)]
        owner = ctx.index.n_ops + t
        coll = self.collective(Conversion.ALL_GATHER, group, nbytes, np.array([moves]), op=u, tensor=t, prio_op=prio,
                               stage="transfer", cls=1, owner=owner, have=np.full(k, 1.0 / k), need=np.ones(k))
        lands = self.land(int(coll[0]), group, nbytes, np.ones(k), op=u, tensor=t, prio_op=prio, cls=1, owner=owner)
        return dict(zip(group, lands.tolist()))

    def relayout(self, layouts: LayoutTable, tensor: np.ndarray, op: np.ndarray, lay_u: np.ndarray,
                 lay_v: np.ndarray, nbytes: np.ndarray, prio_op: np.ndarray, src_inst: np.ndarray) -> np.ndarray:
        """Batch rows re-laid out, one re-layout per row (``tensor`` (R,) made by ``op`` on layout ``lay_u``, read
        on ``lay_v``; ``src_inst`` the producer's first instance): each producer entry cut into the pieces that
        overlap consumer entries (RELAYOUT, where it has several), pieces moved between devices (TRANSFER), each
        consumer entry joined from several (CONCAT). Returns (R, width) the task each consumer entry reads."""
        ctx, lay, B = self.ctx, layouts, self.ctx.batch_size
        n_lay = len(lay.devices)
        R = len(tensor)
        owner = ctx.index.n_ops + tensor
        pairs, r_pat = np.unique(lay_u * n_lay + lay_v, return_inverse=True)
        pats = [relayout_pattern(lay.devices[k // n_lay], lay.shares[k // n_lay], lay.devices[k % n_lay],
                                 lay.shares[k % n_lay]) for k in pairs.tolist()]

        def flat(attr: str) -> np.ndarray:
            return np.concatenate([getattr(p, attr) for p in pats])

        def ptr(attr: str) -> np.ndarray:
            return np.concatenate([[0], np.cumsum([len(getattr(p, attr)) for p in pats])]).astype(np.int64)

        P_ptr, S_ptr, C_ptr = ptr("pi"), ptr("split_i"), ptr("concat_j")
        f_pi, f_pj, f_pov, f_rem = flat("pi"), flat("pj"), flat("pov"), flat("remote")
        f_sslot, f_cslot, f_si, f_cj = flat("split_slot"), flat("concat_slot"), flat("split_i"), flat("concat_j")
        fu, fv = lay.ptr[lay_u], lay.ptr[lay_v]          # flat layout offsets of producer / consumer entries
        # cuts: (re-layout, producer entry cut into several pieces)
        n_s = S_ptr[r_pat + 1] - S_ptr[r_pat]
        s_r, s_k = ragged(n_s)
        s_i = f_si[S_ptr[r_pat[s_r]] + s_k]
        s_dev = lay.dev_flat[fu[s_r] + s_i]
        s_bytes = nbytes[s_r] * (lay.shares_flat[lay.ptr[lay_u[s_r]] + s_i] / B)
        # pieces: each read from its producer entry's cut, else from the producer instance itself
        n_p = P_ptr[r_pat + 1] - P_ptr[r_pat]
        p_r, p_k = ragged(n_p)
        fp = P_ptr[r_pat[p_r]] + p_k
        p_i, p_j, p_rem, p_ss, p_cs = f_pi[fp], f_pj[fp], f_rem[fp], f_sslot[fp], f_cslot[fp]
        s_first = np.concatenate([[0], np.cumsum(n_s)])[:-1]
        kept = (p_ss >= 0) & ~p_rem & input_ops(ctx)[op[p_r]]     # an input's rows a device keeps of its cut
        s_alloc = np.where(input_ops(ctx)[op[s_r]], 0.0, s_bytes)
        np.add.at(s_alloc, s_first[p_r[kept]] + p_ss[kept], nbytes[p_r[kept]] * f_pov[fp[kept]] / B)
        cut = self.add(dur=ctx.cost.copy_times(s_dev, s_bytes), kind=TaskKind.RELAYOUT, op=op[s_r], dev=s_dev,
                       alloc=s_alloc, cat=TaskCategory.SPLIT_CONCAT, prio_op=prio_op[s_r], stage="split", cls=1,
                       tensor=tensor[s_r], sub=s_k, owner=owner[s_r], res_len=1, res_idx=s_dev)
        self.deps(cut, src_inst[s_r] + s_i, owner[s_r])
        cut_base = s_first + (cut[0] if len(cut) else 0)
        piece = np.where(p_ss >= 0, cut_base[p_r] + p_ss, src_inst[p_r] + p_i)
        rem = np.nonzero(p_rem)[0]
        if len(rem):
            r = p_r[rem]
            piece[rem] = self.transfers(piece[rem], lay.dev_flat[fu[r] + p_i[rem]], lay.dev_flat[fv[r] + p_j[rem]],
                                        nbytes[r] * f_pov[fp[rem]] / B, op=op[r], prio_op=prio_op[r],
                                        stage="transfer", cls=1, tensor=tensor[r], sub=p_k[rem], owner=owner[r])
        # joins: (re-layout, consumer entry assembled from several pieces)
        n_c = C_ptr[r_pat + 1] - C_ptr[r_pat]
        c_r, c_k = ragged(n_c)
        c_j = f_cj[C_ptr[r_pat[c_r]] + c_k]
        c_dev = lay.dev_flat[fv[c_r] + c_j]
        c_bytes = nbytes[c_r] * (lay.shares_flat[lay.ptr[lay_v[c_r]] + c_j] / B)
        join = self.add(dur=ctx.cost.copy_times(c_dev, c_bytes), kind=TaskKind.CONCAT, op=op[c_r], dev=c_dev,
                        alloc=c_bytes, cat=TaskCategory.SPLIT_CONCAT, prio_op=prio_op[c_r], stage="concat", cls=1,
                        tensor=tensor[c_r], sub=c_k, owner=owner[c_r], res_len=1, res_idx=c_dev)
        join_base = np.concatenate([[0], np.cumsum(n_c)])[:-1] + (join[0] if len(join) else 0)
        joined = p_cs >= 0
        self.deps(join_base[p_r[joined]] + p_cs[joined], piece[joined], owner[p_r[joined]])
        # what each (re-layout, consumer entry) reads: its join, else its single piece
        out = np.full((R, max(len(lay.devices[k]) for k in np.unique(lay_v).tolist())), -1, dtype=np.int64)
        out[p_r[~joined], p_j[~joined]] = piece[~joined]
        out[c_r, c_j] = join_base[c_r] + c_k
        return out

    # -- host memory
    def host_copies(self, after: np.ndarray, dev: np.ndarray, nbytes: np.ndarray, concurrent: np.ndarray,
                    link: np.ndarray, *, op: npt.ArrayLike, prio_op: npt.ArrayLike, stage: str, cls: int,
                    tensor: npt.ArrayLike, sub: npt.ArrayLike, owner: npt.ArrayLike,
                    alloc: npt.ArrayLike = 0.0) -> np.ndarray:
        """``nbytes[i]`` copied between GPU ``dev[i]`` and its server's host over the PCIe ``link[i]`` (its
        GPU->host or host->GPU resource) while ``concurrent[i]`` GPUs of that server copy at once, after
        ``after[i]`` (none where < 0); allocating ``alloc`` on the GPU (default nothing: the host's bytes are
        resident; a shard of an offloaded parameter copied up is held until its readers have run)."""
        cl = self.ctx.cluster
        dur = np.array([pcie_time_s(cl, d, x, c)
                        for d, x, c in zip(dev.tolist(), nbytes.tolist(), concurrent.tolist())])
        ids = self.add(dur=dur, kind=TaskKind.TRANSFER, op=op, dev=dev, alloc=alloc, cat=TaskCategory.TRANSFER,
                       prio_op=prio_op, stage=stage, cls=cls, tensor=tensor, sub=sub, owner=owner, res_len=1,
                       res_idx=link)
        ok = np.asarray(after) >= 0
        self.deps(ids[ok], np.asarray(after)[ok], np.broadcast_to(np.asarray(owner), ids.shape)[ok])
        return ids


# ----------------------------------------------------------------------------------- re-layout patterns
@dataclass(frozen=True)
class Pattern:
    """How a batch tensor laid out as (devs_u, shares_u) is re-laid out as (devs_v, shares_v)."""

    pi: np.ndarray        # (P,) producer entry of each piece
    pj: np.ndarray        # (P,) consumer entry of each piece
    pov: np.ndarray       # (P,) samples in the piece
    remote: np.ndarray    # (P,) piece crosses devices -> transfer
    split_i: np.ndarray   # (S,) producer entries cut into several pieces
    split_slot: np.ndarray  # (P,) index into split_i of the piece's producer, -1 if not cut
    concat_j: np.ndarray  # (C,) consumer entries assembled from several pieces
    concat_slot: np.ndarray  # (P,) index into concat_j of the piece's consumer, -1 if single piece


_PATTERNS: dict[tuple[tuple[int, ...], ...], Pattern] = {}


def relayout_pattern(devs_u: tuple[int, ...], shares_u: tuple[int, ...], devs_v: tuple[int, ...],
                     shares_v: tuple[int, ...]) -> Pattern:
    """Pieces (i, j, overlap) where entry i of the producer and entry j of the consumer overlap (cached: the
    same layouts recur across strategies)."""
    key = (devs_u, shares_u, devs_v, shares_v)
    pat = _PATTERNS.get(key)
    if pat is not None:
        return pat
    cu = np.concatenate([[0], np.cumsum(shares_u)])
    cv = np.concatenate([[0], np.cumsum(shares_v)])
    ov = np.minimum(cu[1:, None], cv[None, 1:]) - np.maximum(cu[:-1, None], cv[None, :-1])   # (nu, nv)
    pi, pj = np.nonzero(ov > 0)
    n_i = np.bincount(pi, minlength=len(devs_u))
    n_j = np.bincount(pj, minlength=len(devs_v))
    split_i, concat_j = np.nonzero(n_i > 1)[0], np.nonzero(n_j > 1)[0]
    slot_i = np.full(len(devs_u), -1)
    slot_i[split_i] = np.arange(len(split_i))
    slot_j = np.full(len(devs_v), -1)
    slot_j[concat_j] = np.arange(len(concat_j))
    pat = Pattern(pi, pj, ov[pi, pj].astype(np.float64), np.asarray(devs_u)[pi] != np.asarray(devs_v)[pj],
                  split_i, slot_i[pi], concat_j, slot_j[pj])
    if len(_PATTERNS) > 4096:
        _PATTERNS.clear()
    _PATTERNS[key] = pat
    return pat
