"""Lower a compiled plan to one instruction list per device (rank): what the runtime executes.

The layout decisions are the compiler's (``CompiledPlan.placements``: each op's layout, the layouts'
entries, each partial result's aggregation); this module turns them into concrete work on leaves (see
``heterog.runtime.stepprog``), with the batch-scaling rules of ``heterog.runtime.scaling``:

  compute    an op instance: its fx nodes at the replica's local batch of one micro-batch (ops without a
             batch tensor run on the whole batch, once); inputs come from this device's values,
             re-laid-out copies, aggregated values or received copies, each followed by its view chain;
             its values are named per micro-batch (``env_name``); a recomputed op runs again at its
             recomputed instance's key, under names of its own that its group's backward ops read
  send       a leaf (or a batch slice of it) to another rank, non-blocking, right after it is produced
  assemble   received and local pieces concatenated along the batch dim, each piece rescaled from its
             producer's share to the consumer's (re-layout), or one received non-batch tensor
  aggregate  on a device with several micro-batches, its share-weighted partial results summed after each;
             PS: the sum of the share-weighted partial results pushed by the workers and its own
  allreduce  a share-weighted partial result summed over the replicas' process subgroup (asynchronous;
             waited for where the value is first read)
Values reaching a rank other than from its own kernel take the captured leaf's dim order (the strides the
captured views were traced on: ``LeafInfo.memory_order``). Synced batch norms: ``heterog.runtime.sync_stats``.

Order: every instruction has a key (simulated start time, task id, sub-order) from the simulated
schedule; each rank runs its instructions in key order. Keys respect every data dependency (a send
follows its producer, an assemble precedes its first consumer, tasks are numbered topologically), and
collectives carry one key for all members, so no rank ever waits for something another rank has not
yet been able to do: the order is deadlock-free. Receives are posted before the step starts, or in it
(``post_early``) at their transfer's simulated start (``heterog.runtime.transfers``; NCCL: in order per pair).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from heterog.compiler import TaskKind
from heterog.compiler.compile import VALUE_FREE_TARGETS, graph_index
from heterog.errors import HeterogError
from heterog.placement import P
from heterog.runtime.instructions import (
    END,
    Aggregate,
    AllReduce,
    Assemble,
    Compute,
    Const,
    Env,
    Input,
    InputSlice,
    Instruction,
    Lowered,
    Message,
    Piece,
    RankProgram,
    Receive,
    Recv,
    Send,
    Slice,
    Source,
    Stash,
    Zeros,
    env_name,
    last_uses,
    with_tags,
)
from heterog.runtime.layout import batch_slice
from heterog.runtime.rng import block_batches
from heterog.runtime.scaling import Exponents
from heterog.runtime.split_lowering import SplitLowering
from heterog.runtime.state_lowering import StateLowering
from heterog.runtime.stepprog import LeafInfo, Read, StepProgram
from heterog.runtime.sync_stats import SyncLowering
from heterog.runtime.transfers import held_until

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.compiler import CompiledPlan
    from heterog.graph.opgraph import OpGraph


class _Builder:
    def __init__(self, prog: StepProgram, graph: OpGraph, cluster: Cluster, plan: CompiledPlan, start: np.ndarray,
                 exps: Exponents, *, emulate: bool, post_early: bool, finish: np.ndarray | None = None) -> None:
        self.placed = plan.placements
        self.op_layout: np.ndarray = self.placed.op_layout
        self.prog, self.graph, self.cluster, self.plan, self.exps = prog, graph, cluster, plan, exps
        self.start = np.asarray(start, dtype=np.float64)
        self.emulate, self.post_early, self.finish = emulate, post_early, finish
        self.B = graph.batch_size
        self.m = cluster.n_devices
        self.ranks = [RankProgram(r, cluster.devices[r].name, float(cluster.devices[r].slowdown) if emulate else 1.0)
                      for r in range(self.m)]
        self.items: list[list[list]] = [[] for _ in range(self.m)]      # per rank: [key, seq, instruction]
        self.messages: list[Message] = []
        self.groups: list[tuple[int, ...]] = []
        self.exports: dict[tuple[int, int, int, bool], set[str]] = {}  # (op, device, micro, recomputed) -> names kept
        self.memo: dict[Any, Any] = {}
        self.deps: dict[int, list[list]] = {}       # id(item) -> items that must run before it (``pull``)
        self.parts: dict[str, tuple[str, tuple[int, ...]]] = {}     # Lowered.parts
        self.n_ar = self.n_agg = self.seq = 0
        # tasks of the simulated plan
        kinds, ops, devs = plan.task_kind, plan.task_op, plan.task_device
        micro = plan.task_micro
        self.inst_task: dict[tuple[int, int, int], int] = {}       # (op, device, micro-batch) -> task
        for t in np.nonzero((kinds == TaskKind.COMPUTE) | (kinds == TaskKind.PLACEHOLDER))[0].tolist():
            self.inst_task[(int(ops[t]), int(devs[t]), max(int(micro[t]), 0))] = t
        self.recompute_task: dict[tuple[int, int, int], int] = {}  # the same, of recomputed instances
        for t in np.nonzero(kinds == TaskKind.RECOMPUTE)[0].tolist():
            self.recompute_task[(int(ops[t]), int(devs[t]), max(int(micro[t]), 0))] = t
        self.recomputed = self.placed.op_recompute if self.placed.op_recompute is not None \
            else np.zeros(graph.n_ops, dtype=bool)
        self.phase = graph.phase_index
        self.agg_tasks: dict[int, list[int]] = {}
        for t in np.nonzero((kinds == TaskKind.AGGREGATE) | (kinds == TaskKind.ALLREDUCE))[0].tolist():
            self.agg_tasks.setdefault(int(ops[t]), []).append(t)
        gi = graph_index(graph)
        self.tensor_of: dict[tuple[int, int], int] = {(int(gi.e_src[e]), int(graph.edges[e].src_output)): int(t)
                                                      for e, t in enumerate(gi.e_tensor.tolist())}
        by_op: dict[int, list[int]] = {}
        for t in sorted(self.placed.aggregation):
            by_op.setdefault(int(gi.t_op[t]), []).append(t)
        # tensor -> index among its op's aggregated tensors
        self.agg_rank: dict[int, int] = {t: i for tl in by_op.values() for i, t in enumerate(tl)}
        from heterog.cost import CostModel

        self.nominal = CostModel(cluster)            # emulated link speeds: the cluster's nominal ones
        self.split, self.sync = SplitLowering(self), SyncLowering(self)
        self.state = StateLowering(self)          # sharded and offloaded state (after the split ops)

    # ------------------------------------------------------------------ layouts
    def lay_devs(self, lay: int) -> tuple[int, ...]:
        """The devices of a layout, each once, in order of first entry."""
        return tuple(dict.fromkeys(int(d) for d in self.placed.layouts[lay].devices))

    def lay_ranges(self, lay: int) -> list[tuple[int, int, int, int]]:
        """(device, first sample, end sample, micro-batch) of each entry of a split layout (of a layout of
        ops divided beyond the batch: every device over each micro-batch, ``SplitLowering.ranges``)."""
        if lay in self.split.layouts:
            return self.split.ranges(lay)
        layout = self.placed.layouts[lay]
        devs, shares, micro = layout.devices, layout.shares, layout.micro
        out, lo = [], 0
        for d, s, m in zip(devs, shares, micro):
            out.append((int(d), lo, lo + int(s), int(m)))
            lo += int(s)
        if lo != self.B:
            raise AssertionError(f"layout {lay} is not a split of the batch: shares {shares}")
        return out

    def op_lay(self, op: int) -> int:
        return int(self.op_layout[op])

    def entries(self, op: int) -> list[tuple[int, int, int, int]]:
        """(device, first sample, end sample, micro-batch) of each instance of ``op``: its layout's entries,
        or each device once at the whole batch for ops without a batch tensor."""
        if not self.prog.op_has_batch[op]:
            return [(d, 0, self.B, 0) for d in self.lay_devs(self.op_lay(op))]
        return self.lay_ranges(self.op_lay(op))

    # ------------------------------------------------------------------ keys and instructions
    def inst_key(self, op: int, dev: int, micro: int = 0, recompute: bool = False) -> tuple:
        t = (self.recompute_task if recompute else self.inst_task).get((op, dev, micro))
        if t is None:
            raise HeterogError(f"plan has no instance of op {self.graph.ops[op].name} on device {dev} "
                               f"(micro-batch {micro})")
        t = self.sync.task(op, t)                     # a synced batch norm: at its statistics' key
        return (float(self.start[t]), int(t))

    def subgroup(self, devices: tuple[int, ...]) -> int:
        """The index of the process subgroup of ``devices`` (registered if new): gradient AllReduces and the
        collectives of divided values share them."""
        group = tuple(sorted(devices))
        if group not in self.groups:
            self.groups.append(group)
        return self.groups.index(group)

    def emit(self, rank: int, key: tuple, instr: Instruction) -> list:
        item = [key, self.seq, instr]
        self.seq += 1
        self.items[rank].append(item)
        return item

    def pull(self, item: list, key: tuple) -> None:
        """Run ``item`` (and what it needs, ``deps``) no later than ``key``."""
        if key < item[0]:
            item[0] = key
            for before in self.deps.get(id(item), ()):
                self.pull(before, key)

    def export(self, op: int, dev: int, micro: int, name: str, recomputed: bool = False) -> None:
        if self.prog.op_kind[op] == "compute":
            self.exports.setdefault((op, dev, micro, recomputed), set()).add(name)

    def reads_recomputed(self, u: int, op: int, recompute: bool) -> bool:
        """Whether ``op`` (its recomputed instance: ``recompute``) reads op ``u``'s recomputed copy: ``u`` is
        recomputed, ``op`` a backward op or a recomputed op of its group, not coupled (``recompute_edges``)."""
        group = self.placed.op_group
        return bool(self.recomputed[u] and group[u] == group[op] and (self.phase[op] > 0 or recompute)
                    and not self.graph.ops[op].coupled)

    def leaf(self, leaf: tuple[int, int]) -> LeafInfo:
        return self.prog.leaves[leaf]

    def message(self, src: int, dst: int, key: tuple, shape: tuple, dtype: torch.dtype) -> int:
        self.messages.append(Message(src, dst, key, tuple(int(s) for s in shape), dtype))
        return len(self.messages) - 1

    def link(self, src: int, dst: int) -> tuple[float, float]:
        """(latency s, seconds per byte) that the emulation enforces on src -> dst."""
        return (float(self.cluster.latency_s[src, dst]), 1.0 / float(self.cluster.bandwidth_Bps[src, dst])) \
            if self.emulate else (0.0, 0.0)

    def send(self, src_dev: int, dst_dev: int, key: tuple, source: Source, slice_: Slice | None, scale: float,
             shape: tuple, dtype: torch.dtype) -> int:
        """A message from ``src_dev`` to ``dst_dev``; its tag is the message index until ``_finish``."""
        msg = self.message(src_dev, dst_dev, key, shape, dtype)
        self.emit(src_dev, key, Send(source, slice_, scale, dst_dev, msg, self.link(src_dev, dst_dev)))
        return msg

    # ------------------------------------------------------------------ value sources
    def producer_source(self, leaf: LeafInfo, dev: int, micro: int = 0) -> Source:
        """This device's own copy of a leaf (its producer ran here, for micro-batch ``micro``)."""
        if self.prog.op_kind[leaf.op] == "buffer" and leaf.node in self.prog.consts:
            return Const(leaf.read_node)
        if not self.prog.op_has_batch[leaf.op]:
            micro = 0                                  # one value for the whole step
        self.export(leaf.op, dev, micro, leaf.read_node)
        return Env(env_name(leaf.read_node, micro))

    def relayout(self, leaf_id: tuple[int, int], lay_v: int, dev: int, micro: int, at: tuple) -> tuple[Stash, float]:
        """The batch leaf re-laid out for layout ``lay_v``, its entry on ``dev`` of micro-batch ``micro`` (read
        before key ``at``), and the scale its readers apply (one piece is left a view, scaled where read)."""
        leaf = self.leaf(leaf_id)
        memo_key = ("relayout", leaf_id, lay_v)
        entry = self.memo.get(memo_key)
        if entry is None:
            entry = {}
            e = self.exps[leaf_id]
            bd, per = leaf.batch_dim, leaf.per_sample
            if bd is None:
                raise AssertionError(f"output {leaf.k} of {self.graph.ops[leaf.op].name} has no batch to re-lay out")
            block = per if leaf_id in self.exps.sample_minor else 0      # see heterog.runtime.scaling
            stride = self.exps.positional.get(leaf_id, 0)
            divided = leaf.op in self.split
            prod = self.lay_ranges(self.op_lay(leaf.op))
            if divided:            # put together whole on the consumer's device, per micro-batch (and group)
                prod = list({(mi, p0): (dj, p0, p1, mi) for dj, p0, p1, mi in prod}.values())
            for dj, c0, c1, mj in self.lay_ranges(lay_v):
                stash_key = ("r", leaf.node, lay_v) if mj == 0 else ("r", leaf.node, lay_v, mj)
                pieces, before = [], []
                for di, p0, p1, mi in prod:
                    lo, hi = max(p0, c0), min(p1, c1)
                    if hi <= lo:
                        continue
                    whole = (lo, hi) == (p0, p1)
                    sl = None if whole else batch_slice(bd, lo - p0, hi - p0, per, block)
                    scale = float(((c1 - c0) / (p1 - p0)) ** e) if e else 1.0
                    shift = (p0 - c0) * stride          # positional values: from the producer's origin to ours
                    if divided:
                        src = self.split.whole(leaf_id, dj, mi, END, of=di)
                        group = self.split.ops[leaf.op].group(di)
                        before.append(self.memo.get(self.split.whole_key(
                            leaf_id, dj, mi, group if self.split.ops[leaf.op].grid and dj not in group else None)))
                        di = dj
                    else:
                        src = self.producer_source(leaf, di, mi)
                    if di == dj:
                        pieces.append(Piece(src, sl, scale, shift))
                    else:
                        key = self.inst_key(leaf.op, di, mi) + (1,)
                        msg = self.send(di, dj, key, src, sl, 1.0, leaf.local_shape(hi - lo), leaf.dtype)
                        pieces.append(Piece(Recv(msg), None, scale, shift))
                if len(pieces) == 1 and not pieces[0].shift and pieces[0].scale != 1.0:
                    self.memo[("rscale", stash_key, dj)], pieces = pieces[0].scale, [pieces[0]._replace(scale=1.0)]
                entry[(dj, mj)] = self.emit(dj, END + (-1,), Assemble(stash_key, (bd, block), tuple(pieces),
                                                                       leaf.memory_order))
                self.deps[id(entry[(dj, mj)])] = [it for it in before if it is not None]
            self.memo[memo_key] = entry
        item = entry[(dev, micro)]
        self.pull(item, at + (-1,))
        return Stash(item[2].key), self.memo.get(("rscale", item[2].key, dev), 1.0)

    def device_sums(self, leaf_id: tuple[int, int]) -> list[tuple[int, Source, float, tuple]]:
        """Per device with instances of a partial leaf's producer: (device, value, weight, key after it).
        One instance: its value with its share's weight. Several (one per micro-batch): their weighted sum,
        accumulated on the device after each instance (weight 1)."""
        memo_key = ("sums", leaf_id)
        got = self.memo.get(memo_key)
        if got is not None:
            return got
        leaf = self.leaf(leaf_id)
        e = self.exps[leaf_id]
        by_dev: dict[int, list[tuple[int, int]]] = {}
        for d, lo, hi, m in self.lay_ranges(self.op_lay(leaf.op)):
            by_dev.setdefault(d, []).append((m, hi - lo))
        got = []
        for d, ents in by_dev.items():
            m0, b0 = ents[0]
            src, w = self.producer_source(leaf, d, m0), float((b0 / self.B) ** (1 - e))
            after = self.inst_key(leaf.op, d, m0) + (1,)
            for m, b in ents[1:]:
                key = ("a", leaf.node, m)
                at = self.inst_key(leaf.op, d, m)
                self.emit(d, at + (1,), Aggregate(key, (Piece(src, None, w, 0), Piece(
                    self.producer_source(leaf, d, m), None, float((b / self.B) ** (1 - e)), 0)), leaf.memory_order))
                src, w, after = Stash(key), 1.0, at + (2,)
            got.append((d, src, w, after))
        self.memo[memo_key] = got
        return got

    def summed(self, leaf_id: tuple[int, int]) -> bool:
        """Whether a non-batch leaf is a partial result summed over instances: aggregated by the plan, or
        accumulated over the micro-batches of its producer's one device."""
        t = self.tensor_of.get(leaf_id)
        u = leaf_id[0]
        return (t is not None and t in self.placed.aggregation) or (        # one device, several instances
            self.prog.op_has_batch[u] and len(self.lay_devs(self.op_lay(u))) == 1 < len(self.entries(u)))

    def aggregated(self, leaf_id: tuple[int, int]) -> tuple[tuple[int, ...], Source, tuple]:
        """Aggregate a partial leaf as the plan says (or accumulate it on its one device); returns
        (holders, its source on them, key after it)."""
        memo_key = ("agg", leaf_id)
        got = self.memo.get(memo_key)
        if got is not None:
            return got
        leaf = self.leaf(leaf_id)
        t = self.tensor_of[leaf_id]
        sums = self.device_sums(leaf_id)
        how = self.placed.aggregation.get(t)
        if how is None:                              # one device: its accumulated sum
            (d, src, w, after), = sums
            if w != 1.0:
                raise AssertionError(f"output {leaf.k} of {self.graph.ops[leaf.op].name} is not summed")
            got = ((d,), src, after)
            self.memo[memo_key] = got
            return got
        tasks = self.agg_tasks.get(leaf.op, [])
        i = self.agg_rank[t]
        if i >= len(tasks):
            raise AssertionError(f"plan has no aggregation task for output {leaf.k} of {self.graph.ops[leaf.op].name}")
        akey = (float(self.start[tasks[i]]), int(tasks[i]))
        stash_key = ("g", leaf.node)
        holders: tuple[int, ...]
        if how.kind == "ps":
            ps = how.devices[0]
            parts = []
            for d, src, w, after in sums:
                if d == ps:
                    parts.append(Piece(src, None, w, 0))
                else:
                    msg = self.send(d, ps, after, src, None, w, leaf.shape, leaf.dtype)
                    parts.append(Piece(Recv(msg), None, 1.0, 0))
            self.emit(ps, akey + (0,), Aggregate(stash_key, tuple(parts), leaf.memory_order))
            holders = (ps,)
            self.n_agg += 1
        else:
            devs = tuple(sorted(d for d, _, _, _ in sums))
            g = self.subgroup(devs)
            emu = float(self.nominal.allreduce_times(devs, np.array([float(leaf.nbytes_global)]))[0][0]) \
                if self.emulate else 0.0
            for d, src, w, _ in sums:
                self.emit(d, akey + (0,), AllReduce(stash_key, g, src, w, emu, leaf.memory_order))
            holders = devs
            self.n_ar += 1
        got = (holders, Stash(stash_key), akey + (1,))
        self.memo[memo_key] = got
        return got

    def fetch_global(self, leaf_id: tuple[int, int], dev: int, consumer_key: tuple) -> Source:
        """A non-batch leaf's (global) value on ``dev``: local, aggregated here, or received once from the
        best-connected holder (highest bandwidth, then lowest latency, then lowest id)."""
        leaf = self.leaf(leaf_id)
        if leaf.op in self.split:
            return self.split.whole(leaf_id, dev, 0, consumer_key)
        if self.summed(leaf_id):
            holders, summed, after = self.aggregated(leaf_id)
            if dev in holders:
                return summed
            stash_key = ("x", leaf.node)
            def source_of(h: int) -> tuple[Source, tuple]:
                return (summed, after)
        else:
            if leaf.node in self.prog.consts:
                return Const(leaf.read_node)
            holders = self.lay_devs(self.op_lay(leaf.op))
            if dev in holders:
                return self.producer_source(leaf, dev)
            stash_key = ("x", leaf.node)
            def source_of(h: int) -> tuple[Source, tuple]:
                return (self.producer_source(leaf, h), self.inst_key(leaf.op, h) + (1,))
        memo_key = ("xfer", stash_key, dev)
        item = self.memo.get(memo_key)
        if item is None:
            h = self.cluster.best_source(holders, dev)
            src, key = source_of(h)
            msg = self.send(h, dev, key, src, None, 1.0, leaf.shape, leaf.dtype)
            item = self.emit(dev, consumer_key + (-1,), Assemble(stash_key, None, (Piece(Recv(msg), None, 1.0, 0),),
                                                                  leaf.memory_order))
            self.memo[memo_key] = item
        self.pull(item, consumer_key + (-1,))
        return Stash(stash_key)

    # ------------------------------------------------------------------ ops
    def compute(self, op: int, dev: int, first: int, end: int, micro: int, recompute: bool = False) -> None:
        """Op ``op``'s instance on ``dev`` over samples ``first .. end`` of micro-batch ``micro`` (its
        recomputed copy: ``recompute``)."""
        if op in self.split or op in self.state:
            (self.split if op in self.split else self.state).compute(op, dev, first, end, micro)
            return
        prog = self.prog
        b = end - first
        key = self.inst_key(op, dev, micro, recompute)
        inputs = []
        for r in prog.reads[op]:
            src, chain, scale = self.read_source(op, r, dev, micro, b, key, recompute)
            inputs.append(Input(r.node, src, self.leaf(r.leaf).node, chain, scale, r.tuple_index))
        self.ranks[dev].batches.add(b)
        if prog.op_draws(op):
            self.ranks[dev].batches.update(block_batches(self.B))    # random values are drawn in blocks
        ins = Compute(op, b, tuple(inputs), (), first, micro, recompute)
        self.sync.add(dev, ins) if op in self.sync else self.emit(dev, key + (0,), ins)

    def read_source(self, op: int, r: Read, dev: int, micro: int, b: int, key: tuple, recompute: bool = False
                    ) -> tuple[Source, tuple[str, ...], float]:
        """(source, view chain, scale) of what ``op``'s instance on ``dev`` (``b`` samples of micro-batch
        ``micro``, running at ``key``) reads for ``r``."""
        if (held := self.state.read(op, r, dev, key, recompute)) is not None:
            return held                                 # a parameter of stage 3, gathered
        prog = self.prog
        lay = self.op_lay(op)
        value_free = prog.op_target[op] in VALUE_FREE_TARGETS
        leaf = self.leaf(r.leaf)
        node = r.held_node(leaf)                       # what the producer's device keeps for this read
        u = r.leaf[0]
        placeholder = prog.op_kind[u] != "compute"
        chain, scale = r.chain, 1.0
        src: Source
        if leaf.batch_dim is not None:
            if value_free and self.op_lay(u) != lay:     # a shape read: no value moves
                return Zeros(leaf.local_shape(b), leaf.dtype, leaf.memory_order), chain, scale
            if self.op_lay(u) == lay:
                if placeholder:
                    src = self.producer_source(leaf, dev, micro)
                else:
                    again = self.reads_recomputed(u, op, recompute)
                    src, chain = Env(env_name(node, micro, again)), ()
                    self.export(u, dev, micro, node, again)
            else:
                src, scale = self.relayout(r.leaf, lay, dev, micro, key)
            return src, chain, scale
        e = self.exps[r.leaf]
        if e and prog.op_has_batch[op] and b != self.B:
            scale = float((b / self.B) ** e)
        if r.leaf in self.exps.statistics and prog.op_has_batch[op] and self.op_lay(u) == lay:
            src, chain = Env(env_name(node, micro)), ()   # a batch statistic: this instance's own
            self.export(u, dev, micro, node)
        elif value_free and (prog.op_has_batch[u] or u in self.split):   # a shape read: no value needed
            src = Zeros(leaf.shape, leaf.dtype, leaf.memory_order)
        elif u in self.split or self.summed(r.leaf):
            src = self.fetch_global(r.leaf, dev, key)
        elif leaf.node in prog.consts:
            src = Const(leaf.node)
        elif dev in self.lay_devs(self.op_lay(u)):
            if placeholder:
                src = self.producer_source(leaf, dev)
            else:
                src, chain = Env(node), ()
                self.export(u, dev, 0, node)
        elif value_free:
            src = Zeros(leaf.shape, leaf.dtype, leaf.memory_order)
        else:
            if prog.op_has_batch[u] and len(self.lay_devs(self.op_lay(u))) > 1:
                raise AssertionError(f"partial output {leaf.k} of {self.graph.ops[u].name} is read by "
                                     f"{self.graph.ops[op].name} but the plan does not aggregate it")
            src = self.fetch_global(r.leaf, dev, key)
        return src, chain, scale

    def build(self) -> Lowered:
        prog, graph = self.prog, self.graph
        for op in range(graph.n_ops):
            if prog.op_kind[op] != "compute" or not prog.op_nodes[op]:
                continue
            for dev, first, end, micro in self.entries(op):
                self.compute(op, dev, first, end, micro)
                if self.recomputed[op]:
                    self.compute(op, dev, first, end, micro, recompute=True)
        self.sync.emit_all()
        self._placeholders()
        self._step_end()
        return self._finish()

    def _placeholders(self) -> None:
        """Which rank holds which parameter, buffer, optimizer state and input slice."""
        prog = self.prog
        n_p, n_b = len(prog.param_names), len(prog.buffer_names)
        for i, name in enumerate(prog.placeholders):
            op = prog.node_op[name]
            lay = self.op_lay(op)
            if i < n_p + n_b + len(prog.state_names):
                for d in self.lay_devs(lay):
                    self.ranks[d].persist[name] = None          # filled by the caller with initial values
                    part = self.split.held_part(op, d) or self.state.held_part(op, d)
                    if part is not None:
                        self.ranks[d].persist_parts[name] = part
                        host = self.split if op in self.split else self.state
                        self.parts[name] = (part.placement, host.holders(op))
                    self.state.place(name, op, self.ranks[d])
            elif not prog.op_has_batch[op]:                    # an input without the batch: whole everywhere
                for d in self.lay_devs(lay):
                    self.ranks[d].inputs.append(InputSlice(name, i - n_p - n_b - len(prog.state_names), 0, None))
            else:
                for d, lo, hi, m in self.lay_ranges(lay):
                    self.ranks[d].inputs.append(InputSlice(env_name(name, m), i - n_p - n_b - len(prog.state_names),
                                                           lo, hi))

    def _step_end(self) -> None:
        """New parameters and state where the placeholders live; the loss terms; what each rank reports."""
        prog = self.prog
        n_p, n_b = len(prog.param_names), len(prog.buffer_names)
        for ph, out in prog.new_values():
            if out == ph:
                continue
            u = prog.node_op[out]
            leaf_id = prog.node_leaf.get(out)
            if leaf_id is None:
                raise HeterogError(f"step output {out} is not an op output; cannot place it")
            for d in self.lay_devs(self.op_lay(prog.node_op[ph])):
                if (held := self.state.updates(ph, out, d)) is not None:     # sharded or offloaded state
                    self.ranks[d].updates.extend(held)
                    continue
                src: Source
                if u in self.split:
                    src = self.split.update(ph, out, leaf_id, d, Env(out))
                elif prog.op_has_batch[u] and prog.op_kind[u] == "compute":     # a buffer a batch norm writes
                    src = self.sync.last_instance(leaf_id, d)
                elif d in self.lay_devs(self.op_lay(u)) and prog.op_kind[u] == "compute":
                    self.export(u, d, 0, out)
                    src = Env(out)
                else:
                    src = self.fetch_global(leaf_id, d, END)
                if prog.node_op[ph] in self.split and u not in self.split:
                    src = self.split.update(ph, out, leaf_id, d, src)
                self.ranks[d].updates.append((ph, src))
        loss = prog.outputs[0]
        u = prog.node_op[loss]
        leaf_id = prog.node_leaf.get(loss, (u, 0))
        e = self.exps[leaf_id]
        if prog.op_has_batch[u]:
            for d, lo, hi, m in self.lay_ranges(self.op_lay(u)):
                if u in self.split and d != self.split.ops[u].group(d)[0] and \
                        self.split.ops[u].output(leaf_id[1]) != P:
                    continue      # a divided loss held whole on a group's devices: one copy (partial sums: all)
                self.export(u, d, m, loss)
                self.ranks[d].loss_terms.append((Env(env_name(loss, m)), float(((hi - lo) / self.B) ** (1 - e))))
        else:
            d = self.lay_devs(self.op_lay(u))[0]
            self.export(u, d, 0, loss)
            self.ranks[d].loss_terms.append((Env(loss), 1.0))
        # one holder reports each parameter / state / buffer at the end
        kinds = (["param"] * n_p + ["buffer"] * n_b + ["state"] * len(prog.state_names))
        for i, kind in enumerate(kinds):
            ph = prog.placeholders[i]
            devs = self.lay_devs(self.op_lay(prog.node_op[ph]))
            for d in (devs if ph in self.parts else (min(devs),)):
                self.ranks[d].report.append((kind, ph))

    def _finish(self) -> Lowered:
        # message tags in global key order (NCCL matches point-to-point messages in order per pair)
        order = sorted(range(len(self.messages)), key=lambda i: (self.messages[i].key, i))
        for tag, i in enumerate(order):
            self.messages[i].tag = tag
        tag_of = [m.tag for m in self.messages]
        for msg in self.messages:
            self.ranks[msg.dst].recvs.append(Receive(msg.tag, msg.src, msg.shape, msg.dtype, msg.key))
        for r, at, ins in held_until(self.plan, self.start, self.finish, self.messages, self.items, self.post_early,
                                     not self.emulate):
            self.emit(r, at, ins)
        for rp in self.ranks:
            rp.recvs.sort(key=lambda r: r.tag)
        for r, items in enumerate(self.items):
            items.sort(key=lambda it: (it[0], it[1]))
            rp = self.ranks[r]
            for key, _, instr in items:
                if isinstance(instr, Compute):
                    kept = self.exports.get((instr.op, r, instr.micro, instr.recompute), ())
                    instr = replace(instr, exports=tuple(sorted(kept)))
                rp.instrs.append(with_tags(instr, tag_of))
                rp.keys.append(key)
            rp.frees = last_uses(rp)
        return Lowered(self.ranks, self.groups, self.messages, self.n_ar, self.n_agg, self.parts)


def lower(prog: StepProgram, graph: OpGraph, cluster: Cluster, plan: CompiledPlan, start: np.ndarray,
          exps: Exponents, *, emulate: bool, post_early: bool = False, finish: np.ndarray | None = None) -> Lowered:
    """Per-rank programs for ``plan`` (of ``graph`` on ``cluster``) in the order of the simulated start times
    ``start`` (``finish``: their ends, at which messages' buffers are held as simulated: ``transfers``);
    ``emulate``: enforce link speeds and slowdowns (local-cpu); ``post_early``: post receives in the step."""
    b = _Builder(prog, graph, cluster, plan, start, exps, emulate=emulate, post_early=post_early, finish=finish)
    return b.build()
