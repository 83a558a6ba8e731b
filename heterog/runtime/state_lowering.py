"""Lowering sharded and offloaded state (docs/design.md, "Sharded state" and "Offloading"): the parameters of
data-parallel groups that keep their optimizer state, gradients or parameters in shards over the replicas
(ZeRO stages 1-3), or their optimizer state in host memory, as the runtime runs them.

Shards are whole rows of dim 0: replica i of a config (its devices in the config's order) holds rows
``split_shares_of(rows, weights)[i]`` (``HeldState.part``: ``Part("S0", rows, shares, i)``) of the parameter's
optimizer state (stage >= 1), of its gradient (stage >= 2) and of the parameter (stage 3). A parameter without
a dim 0, or with fewer rows than replicas, is held whole by every replica (its gradient all-reduced at the
compiler's key of the reduce-scatter, no gathers). The update ops over whole tensors (``rows_ops``: those whose
value has the parameter's shape) run on the replica's rows; the scalar ones (step counters, bias corrections)
run whole on every replica. Every collective runs at the key of the compiler's task for it (the simulated
order):

  stage 1  the gradient is all-reduced as in data parallelism; an update op reads its rows of every value
           of the parameter's rows (gradient, parameter) cut from the whole (``Derive``), its own rows of the
           state; the new parameter is all-gathered into the old one (the compiler's COLLECTIVE after its writer)
  stage 2  the gradient as the update reads it (its view chain run on each replica's accumulated partial
           result, weighted by its share) is reduce-scattered instead: each replica gets the sum of its rows
  stage 3  the parameter is held as rows too: all-gathered before its readers in forward and again before
           those in backward (the gathers their landings wait for; a recomputed reader reads the backward
           one, pulled before it), the whole value kept until that phase's last reader on the device and
           sent whole to a reader on another device; the update writes the replica's rows, no gather follows
  offload  the state over whole tensors and a master copy of the parameter (its rows, or the whole at stage
           0 and on one device) live in host memory (``RankProgram.host``); what the update ops read from
           the device is copied down (``Copy``; the gradient at the compiler's key of its copy down), they run
           on the host CPU (``Compute.host``), and the new parameter is copied up into the old one (its
           rows) at the compiler's key of its copy up, then gathered as above
  offloaded parameters  (stage 3, ``offload="parameters"``) the parameter's rows themselves live in host memory
           (no separate master copy); before each gather the rows are copied up (``Copy``, at the compiler's
           key of that copy up) and gathered from there; the update writes the new rows on the host, and
           nothing is copied up after it

The gradient is read only by its parameter's update, the state and the new values only by the update ops
and the step's end: a plan that reads them elsewhere is refused in one line (``HeterogError``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from heterog.compiler import TaskKind
from heterog.compiler.compile import VALUE_FREE_TARGETS
from heterog.compiler.sharded_state import OFFLOAD_CODES
from heterog.errors import HeterogError
from heterog.runtime.instructions import (
    AllGather,
    AllReduce,
    Assemble,
    Compute,
    Copy,
    Derive,
    Env,
    Input,
    Instruction,
    Part,
    Piece,
    Recv,
    ReduceScatter,
    Source,
    Stash,
    Zeros,
)
from heterog.runtime.kernel import Kernel
from heterog.runtime.layout import in_memory_order
from heterog.runtime.resharding import Sharding, memory_order
from heterog.shares import split_shares_of

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.compiler import CompiledPlan
    from heterog.cost import CostModel
    from heterog.graph.opgraph import OpGraph
    from heterog.runtime.instructions import RankProgram
    from heterog.runtime.stepprog import LeafInfo, Read, StepProgram

Leaf = tuple[int, int]


def master_name(placeholder: str) -> str:
    """The host copy (fp32 master) of an offloaded parameter's placeholder ``placeholder``."""
    return placeholder + "~master"


@dataclass(frozen=True)
class HeldState:
    """A parameter whose group keeps sharded or offloaded state: its placeholder op ``param``, the stage, the
    config's ``devices`` (part order), the rows each holds (``shares``; empty: held whole), whether the state
    lives on the host, the update ops over whole tensors (``rows_ops``) and the state placeholders over whole
    tensors (``state_ops``), and whether the parameter's rows live on the host too (``on_host``: stage 3 with
    offloaded parameters)."""

    param: int
    stage: int
    devices: tuple[int, ...]
    shares: tuple[int, ...]
    offload: bool
    rows_ops: frozenset[int]
    state_ops: frozenset[int]
    on_host: bool = False

    @property
    def sharded(self) -> bool:
        return bool(self.shares)

    def part(self, dev: int) -> Part | None:
        """The rows ``dev`` holds (None: the whole value)."""
        if not self.shares:
            return None
        return Part("S0", sum(self.shares), self.shares, self.devices.index(dev))

    def shard_shape(self, shape: Sequence[int], i: int) -> tuple[int, ...]:
        return (self.shares[i], *shape[1:]) if self.shares else tuple(shape)


class StateHost(Protocol):
    """What the state lowering uses of the plan's lowering (``heterog.runtime.lowering``)."""

    prog: StepProgram
    graph: OpGraph
    cluster: Cluster
    plan: CompiledPlan
    start: np.ndarray
    finish: np.ndarray | None
    memo: dict[Any, Any]
    deps: dict[int, list[list]]
    nominal: CostModel
    emulate: bool
    B: int
    ranks: list[RankProgram]
    inst_task: dict[tuple[int, int, int], int]
    tensor_of: dict[tuple[int, int], int]
    agg_tasks: dict[int, list[int]]

    def leaf(self, leaf: Leaf) -> LeafInfo: ...
    def lay_devs(self, lay: int) -> tuple[int, ...]: ...
    def op_lay(self, op: int) -> int: ...
    def inst_key(self, op: int, dev: int, micro: int = 0, recompute: bool = False) -> tuple: ...
    def emit(self, rank: int, key: tuple, instr: Instruction) -> list: ...
    def pull(self, item: list, key: tuple) -> None: ...
    def subgroup(self, devices: tuple[int, ...]) -> int: ...
    def export(self, op: int, dev: int, micro: int, name: str, recomputed: bool = False) -> None: ...
    def producer_source(self, leaf: LeafInfo, dev: int, micro: int = 0) -> Source: ...
    def device_sums(self, leaf_id: Leaf) -> list[tuple[int, Source, float, tuple]]: ...
    def send(self, src_dev: int, dst_dev: int, key: tuple, source: Source, slice_: Any, scale: float,
             shape: tuple, dtype: torch.dtype) -> int: ...
    def read_source(self, op: int, r: Read, dev: int, micro: int, b: int, key: tuple, recompute: bool = False
                    ) -> tuple[Source, tuple[str, ...], float]: ...


class StateLowering:
    """The parameters of one plan that keep sharded or offloaded state, lowered into the builder's rank
    programs (module docstring)."""

    def __init__(self, b: StateHost) -> None:
        self.b = b
        self.params: dict[int, HeldState] = {}        # param placeholder op -> its state
        self.of_op: dict[int, HeldState] = {}         # rows op, state placeholder or param op -> the same
        self.grads: dict[Leaf, HeldState] = {}        # reduce-scattered gradient leaf -> its parameter's
        self.update_of: dict[int, HeldState] = {}    # every update op of those parameters -> the same
        st = b.plan.placements.state
        if st is None:
            return
        graph, prog = b.graph, b.prog
        phase = graph.phase_index
        by_name = {op.param: i for i, op in enumerate(graph.ops) if op.kind == "param"}
        of_param: dict[str, list[int]] = {}
        for o, op in enumerate(graph.ops):
            if op.param is not None and op.kind != "param":
                of_param.setdefault(op.param, []).append(o)
        for p in by_name.values():
            row = int(st.op_row[p])
            if row < 0:
                continue
            shape = b.leaf((p, 0)).shape
            name = str(graph.ops[p].param)
            mine = of_param.get(name, [])
            rows_ops = frozenset(o for o in mine if phase[o] == 2 and prog.op_kind[o] == "compute"
                                 and self._whole(o, shape))
            state_ops = frozenset(o for o in mine if prog.op_kind[o] == "state" and self._whole(o, shape))
            for o in rows_ops | state_ops:
                if int(st.op_row[o]) != row:
                    raise HeterogError(f"parameter {name!r} keeps its state under one config and "
                                       f"{graph.ops[o].name} under another: sharded and offloaded state need a "
                                       f"parameter's state and update in its group")
            devs = tuple(int(d) for d in st.devices[row])
            stage = int(st.op_stage[p])
            weights = st.weights[row] if st.weights else (1,) * len(devs)
            shares = tuple(split_shares_of(shape[0], weights)) if stage >= 1 and shape and shape[0] >= len(devs) \
                and len(devs) > 1 else ()
            offload = int(st.op_offload[p]) > 0 and bool(rows_ops)     # else its update runs on the device
            on_host = offload and stage == 3 and bool(shares) and int(st.op_offload[p]) == OFFLOAD_CODES["parameters"]
            hs = HeldState(p, stage, devs, shares, offload, rows_ops, state_ops, on_host)
            self.params[p] = hs
            for o in (p, *rows_ops, *state_ops):
                self.of_op[o] = hs
            self.update_of.update(dict.fromkeys((o for o in mine if phase[o] == 2), hs))
        self.grad_ops: dict[int, HeldState] = {}     # ops that pick a reduce-scattered gradient: run on rows
        readers: dict[Leaf, list[int]] = {}
        for v, reads in enumerate(prog.reads):
            for r in reads:
                readers.setdefault(r.leaf, []).append(v)
        kinds, ops = b.plan.task_kind, b.plan.task_op
        self.tasks: dict[tuple[int, int], list[int]] = {}      # (kind, op) -> tasks, of the kinds looked up
        for t in np.nonzero(np.isin(kinds, (TaskKind.COLLECTIVE, TaskKind.TRANSFER, TaskKind.CONCAT)))[0].tolist():
            self.tasks.setdefault((int(kinds[t]), int(ops[t])), []).append(t)
        inverse = {t: leaf for leaf, t in b.tensor_of.items()}
        for t, how in b.plan.placements.aggregation.items():
            if how.kind == "reduce-scatter":
                self._scattered(inverse[int(t)], how.devices, readers)

    def _scattered(self, leaf: Leaf, devices: tuple[int, ...], readers: dict[Leaf, list[int]]) -> None:
        """Reduce-scattered gradient ``leaf`` over ``devices``: reduce-scattered where every reader leads to the
        update of one parameter of the same devices, directly or through an op that picks it (an element of a
        multi-output backward's tuple, an op of its own: run on the rows too); else all-reduced whole at the
        reduce-scatter's key (the builder's aggregation: a reader in another group, such as the bias of a
        layer norm whose weight's group holds the backward, needs the whole sum)."""
        b = self.b
        picks: dict[int, HeldState | None] = {}
        lead: set[HeldState | None] = set()
        for v in readers.get(leaf, []):
            hs = self.update_of.get(v)
            if hs is None and b.graph.phase_index[v] < 2 and b.leaf((v, 0)).batch_dim is None:
                got = {self.update_of.get(w) for w in readers.get((v, 0), [])}
                hs = got.pop() if len(got) == 1 else None
                if hs is not None and (b.leaf((v, 0)).shape != b.leaf((hs.param, 0)).shape
                                       or set(b.lay_devs(b.op_lay(v))) != set(hs.devices)):
                    hs = None
                picks[v] = hs
            lead.add(hs)
        hs = lead.pop() if len(lead) == 1 else None
        if hs is None or set(hs.devices) != set(devices):
            u = leaf[0]                       # all-reduced at the key of the compiler's reduce-scatter
            b.agg_tasks[u] = sorted(t for t in self.tasks.get((int(TaskKind.COLLECTIVE), u), [])
                                    if any(int(b.plan.task_op[d]) == u and int(b.plan.task_kind[d]) == TaskKind.COMPUTE
                                           for d in self._deps(t)))
            return
        self.grads[leaf] = hs
        for v in picks:
            self.grad_ops[v] = self.of_op[v] = hs

    def _whole(self, o: int, shape: tuple[int, ...]) -> bool:
        """Whether op ``o``'s value is a whole tensor of its parameter (its shape; more than one element);
        another shape of more than one element cannot run on rows (refused)."""
        leaf = self.b.prog.leaves.get((o, 0))
        got = leaf.shape if leaf is not None else ()
        if int(np.prod(got)) <= 1:
            return False
        if tuple(got) != tuple(shape):
            raise HeterogError(f"{self.b.graph.ops[o].name} of parameter {self.b.graph.ops[o].param!r} holds a "
                               f"value of shape {list(got)}, not the parameter's {list(shape)}: its state cannot "
                               f"be held in shards or on the host")
        return True

    def __contains__(self, op: int) -> bool:
        """Op ``op`` runs on rows: an update op over whole tensors of a parameter with sharded or offloaded
        state, or an op picking its reduce-scattered gradient."""
        hs = self.of_op.get(op)
        return hs is not None and (op in hs.rows_ops or op in self.grad_ops)

    # ------------------------------------------------------------------ the compiler's tasks
    def _key(self, t: int) -> tuple:
        return (float(self.b.start[t]), int(t))

    def _deps(self, t: int) -> list[int]:
        plan = self.b.plan
        return plan.dep_idx[plan.dep_ptr[t]:plan.dep_ptr[t + 1]].tolist()

    def _upstream(self, t: int, op: int, kinds: tuple[TaskKind, ...]) -> list[int]:
        """The tasks of ``kinds`` of op ``op`` that task ``t`` waits for, directly or through other tasks of
        ``op``, latest start first."""
        plan, seen, found = self.b.plan, set(), []
        frontier = [d for d in self._deps(t) if int(plan.task_op[d]) == op]
        while frontier:
            d = frontier.pop()
            if d in seen:
                continue
            seen.add(d)
            if int(plan.task_kind[d]) in kinds:
                found.append(d)
            else:
                frontier += [x for x in self._deps(d) if int(plan.task_op[x]) == op]
        return sorted(found, key=lambda x: (-float(self.b.start[x]), -x))

    def _one(self, kind: TaskKind, op: int, dev: int | None = None) -> int | None:
        """The task of ``kind`` of op ``op`` (on ``dev``: its destination), if the compiler emitted one."""
        got = [t for t in self.tasks.get((int(kind), op), []) if dev is None or int(self.b.plan.task_device[t]) == dev]
        return got[0] if got else None

    # ------------------------------------------------------------------ placeholders
    def held_part(self, op: int, dev: int) -> Part | None:
        """The rows of placeholder op ``op`` that ``dev`` holds (None: all of it)."""
        hs = self.of_op.get(op)
        if hs is None or not (op in hs.state_ops or (op == hs.param and hs.stage == 3)):
            return None
        return hs.part(dev)

    def holders(self, op: int) -> tuple[int, ...]:
        return self.of_op[op].devices

    def place(self, name: str, op: int, rp: RankProgram) -> None:
        """Offloaded state of placeholder ``name`` (op ``op``) on rank program ``rp``: the state in host
        memory, and a master copy of a parameter's rows there."""
        hs = self.of_op.get(op)
        if hs is None or not hs.offload:
            return
        if op in hs.state_ops or (op == hs.param and hs.on_host):
            rp.host[name] = name
        elif op == hs.param:
            m = master_name(name)
            rp.persist[m] = None
            rp.host[m] = name
            part = hs.part(rp.rank)
            if part is not None:
                rp.persist_parts[m] = part

    # ------------------------------------------------------------------ reads
    def read(self, op: int, r: Read, dev: int, key: tuple, recompute: bool
             ) -> tuple[Source, tuple[str, ...], float] | None:
        """What op ``op`` (not an update op over whole tensors) reads for ``r`` where it is held as state:
        a stage-3 parameter gathered whole; None where the default read applies."""
        if op in self:
            return None
        b = self.b
        hs = self.of_op.get(r.leaf[0])
        if r.leaf in self.grads and not self.grads[r.leaf].sharded and self.update_of.get(op) is self.grads[r.leaf]:
            return self.scattered(r, op, dev), (), 1.0        # a parameter held whole: its gradient summed whole
        if r.leaf in self.grads or (hs is not None and r.leaf[0] != hs.param and (hs.sharded or hs.offload)):
            raise HeterogError(f"{b.graph.ops[op].name} reads {b.graph.ops[r.leaf[0]].name}, held in shards or on "
                               f"the host for the update of parameter {b.graph.ops[r.leaf[0]].param!r} alone")
        if hs is None or hs.stage < 3 or not hs.sharded:
            return None
        leaf = b.leaf(r.leaf)
        if b.prog.op_target[op] in VALUE_FREE_TARGETS:          # a shape read: no value moves
            return Zeros(leaf.shape, leaf.dtype, leaf.memory_order), r.chain, 1.0
        if b.graph.phase_index[op] == 2:
            raise HeterogError(f"{b.graph.ops[op].name} reads parameter {b.graph.ops[hs.param].param!r}, held in "
                               f"shards at stage 3, in the update")
        return self.gathered(hs, op, dev, key, recompute), r.chain, 1.0

    def gathered(self, hs: HeldState, op: int, dev: int, key: tuple, recompute: bool) -> Source:
        """A stage-3 parameter whole on ``dev`` for op ``op``'s instance at ``key``: the all-gather its landing
        waits for (a recomputed instance: the backward one, else the forward one), pulled before it (before what
        the reader's own path puts at ``key + (-1,)``); a device outside the shards' receives it whole from the
        best-connected one right after the gather."""
        b = self.b
        task = self._gather_task(hs, op, dev, recompute)
        leaf = b.leaf((hs.param, 0))
        stash = ("zg", leaf.read_node, task)
        at = self._key(task) if task is not None else key + (-2,)
        items: dict[int, list] | None = b.memo.get(("zg", hs.param, task))
        if items is None:
            g = b.subgroup(tuple(sorted(hs.devices)))
            parts = tuple((d, hs.shard_shape(leaf.shape, i)) for i, d in enumerate(hs.devices))
            emu = self._ring_s(hs, leaf.shape, leaf.dtype)
            items = {d: b.emit(d, at + (0,), AllGather(stash, g, self._shard_source(hs, leaf, d, task, at), "S0",
                                                       parts, emu, leaf.memory_order)) for d in hs.devices}
            for item in items.values():
                b.deps[id(item)] = [other for other in items.values() if other is not item]
            b.memo[("zg", hs.param, task)] = items
        h = dev if dev in items else b.cluster.best_source(hs.devices, dev)
        b.pull(items[h], key + (-2,))                        # every member's with it (``deps``)
        if dev in items:
            return Stash(stash)
        got = b.memo.get(("zx", hs.param, task, dev))          # a reader elsewhere: sent whole
        if got is None:
            msg = b.send(h, dev, items[h][0] + (1,), Stash(stash), None, 1.0, leaf.shape, leaf.dtype)
            got = b.emit(dev, key + (-1,), Assemble(("zx", leaf.read_node, task), None,
                                                    (Piece(Recv(msg), None, 1.0, 0),), leaf.memory_order))
            b.memo[("zx", hs.param, task, dev)] = got
            b.deps[id(got)] = [items[h]]
        b.pull(got, key + (-1,))
        return Stash(got[2].key)

    def _shard_source(self, hs: HeldState, leaf: LeafInfo, dev: int, gather: int | None, at: tuple) -> Source:
        """Where ``dev``'s rows of stage-3 parameter ``hs`` come from for the gather ``gather`` (at key ``at``):
        the resident rows, or, held on the host, their copy up at the key of the compiler's copy up that the
        gather waits for."""
        b = self.b
        if not hs.on_host:
            return b.producer_source(leaf, dev)
        ups = [t for t in self._upstream(gather, hs.param, (TaskKind.TRANSFER,))
               if int(b.plan.task_device[t]) == dev] if gather is not None else []
        key = ("zc", leaf.read_node, gather)
        b.emit(dev, (self._key(ups[0]) if ups else at + (-1,)) + (0,), Copy(key, Env(leaf.read_node), False))
        return Stash(key)

    def _gather_task(self, hs: HeldState, op: int, dev: int, recompute: bool) -> int | None:
        """The compiler's all-gather of stage-3 parameter ``hs`` that op ``op``'s instance on ``dev`` waits for
        (through its landing); for a recomputed instance the backward one; for a reader the compiler moves the
        parameter to without a gather (an op divided beyond the batch) any of them, else None (the runtime
        gathers it before that reader: not priced)."""
        b = self.b
        kinds = (TaskKind.COLLECTIVE,)
        if not recompute:
            t = b.inst_task.get((op, dev, 0))
            micro = [m for (o, d, m) in b.inst_task if o == op and d == dev]
            t = b.inst_task[(op, dev, min(micro))] if t is None and micro else t
            land = self._upstream(t, hs.param, (TaskKind.CONCAT, TaskKind.TRANSFER)) if t is not None else []
            got = [g for x in land for g in self._upstream(x, hs.param, kinds)]
            if got:
                return got[0]
        gathers = sorted(self.tasks.get((int(TaskKind.COLLECTIVE), hs.param), []))
        return None if not gathers else gathers[-1] if recompute else gathers[0]

    def _ring_s(self, hs: HeldState, shape: tuple[int, ...], dtype: torch.dtype) -> float:
        """The nominal time of an all-gather or reduce-scatter of a value of ``shape`` in ``hs``'s rows (the
        emulation's)."""
        if not self.b.emulate:
            return 0.0
        sizes = [float(np.prod(hs.shard_shape(shape, i))) * dtype.itemsize for i in range(len(hs.devices))]
        return float(self.b.nominal.sharded_ring_times(hs.devices, np.array([sizes]))[0])

    # ------------------------------------------------------------------ the update
    def compute(self, op: int, dev: int, first: int, end: int, micro: int) -> None:
        """Op ``op``'s instance on ``dev`` (an update op, or an op picking a sharded gradient): on the rows ``dev``
        holds, an update op on the host when offloaded."""
        b = self.b
        hs = self.of_op[op]
        key = b.inst_key(op, dev, micro)
        host = hs.offload and op in hs.rows_ops
        inputs = tuple(self._input(hs, op, r, dev, key, host) for r in b.prog.reads[op])
        b.ranks[dev].batches.add(end - first)
        b.emit(dev, key + (0,), Compute(op, end - first, inputs, (), first, micro, False, None, host=host))

    def _input(self, hs: HeldState, op: int, r: Read, dev: int, key: tuple, host: bool) -> Input:
        """What op ``op`` (run on rows, on the host: ``host``) reads for ``r`` on ``dev`` (module docstring)."""
        b = self.b
        u = r.leaf[0]
        leaf = b.leaf(r.leaf)
        if u == hs.param and hs.offload:
            node = leaf.read_node if hs.on_host else master_name(leaf.read_node)
            return Input(r.node, Env(node), leaf.node, r.chain, 1.0, r.tuple_index)
        if u in hs.state_ops or (u == hs.param and (hs.stage == 3 or not hs.sharded)):
            return Input(r.node, b.producer_source(leaf, dev), leaf.node, r.chain, 1.0, r.tuple_index)
        if u in hs.rows_ops or u in self.grad_ops:
            got: Source = Env(node := r.held_node(leaf))
            b.export(u, dev, 0, node)
            if host and u in self.grad_ops:         # a gradient's rows picked on the device
                got = self.copy_down(got, dev, ("zp", r.node), self._down_key(op, u, dev, key))
            return Input(r.node, got, leaf.node, (), 1.0, r.tuple_index)
        if r.leaf in self.grads:
            src: Source = self.scattered(r, op, dev)
            if host:
                src = self.copy_down(src, dev, ("zs", r.node), self._down_key(op, u, dev, key))
            return Input(r.node, src, None, (), 1.0, r.tuple_index)
        src, chain, scale = b.read_source(op, r, dev, 0, b.B, key)
        shape = self.shape_of(r)
        cut = hs.sharded and len(shape) == len(b.leaf((hs.param, 0)).shape) and shape[0] == sum(hs.shares)
        if not cut and not host:
            return Input(r.node, src, leaf.node, chain, scale, r.tuple_index)
        at = self._down_key(op, u, dev, key) if host else self._rows_key(op, u, dev, key, src) if cut else key
        if cut or chain or scale != 1.0:           # an all-reduced gradient's rows: their own, the rest let go
            src = self.derive(dev, at, src, leaf.read_node, chain, scale, hs.part(dev) if cut else None, r.node,
                              r.tuple_index, own=at != key and not host)
        if host:                  # a value on the device: copied down (the gradient as priced)
            src = self.copy_down(src, dev, ("zd", r.node), at)
        return Input(r.node, src, None, (), 1.0, r.tuple_index)

    def derive(self, dev: int, at: tuple, source: Source, leaf: str, chain: tuple[str, ...], scale: float,
               part: Part | None, name: str, index: int | None, own: bool = False) -> Stash:
        """``Derive`` on ``dev`` before key ``at`` (one per value, part and scale; ``own``: ``Derive.own``), after
        what the default read puts there before its reader (``at + (-1,)``: a value received whole)."""
        b = self.b
        stash_key = ("zr", name, part, scale, source)
        item = b.memo.get(("zr", dev, stash_key))
        if item is None:
            item = b.emit(dev, at + (-1, 1), Derive(stash_key, source, scale, leaf, chain, b.B, None, part, None,
                                                    index, own))
            b.memo[("zr", dev, stash_key)] = item
        b.pull(item, at + (-1, 1))
        return Stash(stash_key)

    def copy_down(self, source: Source, dev: int, name: tuple, at: tuple) -> Stash:
        """``source`` copied to host memory on ``dev`` before key ``at`` (once)."""
        b = self.b
        stash_key = ("zh", *name)
        item = b.memo.get(("zh", dev, stash_key))
        if item is None:
            item = b.memo[("zh", dev, stash_key)] = b.emit(dev, at + (-1, 2), Copy(stash_key, source, True))
        b.pull(item, at + (-1, 2))
        return Stash(stash_key)

    def _rows_key(self, op: int, u: int, dev: int, key: tuple, src: Source) -> tuple:
        """Where ``dev`` takes its rows of what op ``op`` at ``key`` reads from op ``u``: an all-reduced gradient
        (stage 1) at the end of the compiler's AllReduce, the whole then let go, as ZeRO-1 keeps its partition of
        it (``compiler.sharded_state.gradient_shares``); else (the parameter) before the reader."""
        got = self._upstream(self.b.inst_task[(op, dev, 0)], u, (TaskKind.ALLREDUCE,)) \
            if self.b.finish is not None and isinstance(src, Stash) and src.key[0] == "g" else []
        return (float(self.b.finish[got[0]]), got[0], 3) if got and self.b.finish is not None else key

    def _down_key(self, op: int, u: int, dev: int, key: tuple) -> tuple:
        """The key of the compiler's copy down of op ``u``'s value that ``op``'s instance on ``dev`` waits for
        (its own key where none is priced: scalars, constants)."""
        t = self.b.inst_task[(op, dev, 0)]
        got = self._upstream(t, u, (TaskKind.TRANSFER,))
        return self._key(got[0]) if got else key

    def shape_of(self, r: Read) -> tuple[int, ...]:
        """The shape of what ``r`` reads at the whole batch (its leaf's view chain run on the meta device)."""
        return self._meta(r).shape

    def _meta(self, r: Read) -> torch.Tensor:
        b = self.b
        got = b.memo.get(("zmeta", r.node, r.leaf))
        if got is None:
            leaf = b.leaf(r.leaf)
            env = {leaf.read_node: in_memory_order(torch.empty(leaf.shape, dtype=leaf.dtype, device="meta"),
                                                   leaf.memory_order)}
            if r.chain:
                Kernel([b.prog.view_calls[c] for c in r.chain])(env, b.prog.sizes_at(b.B))
            got = b.memo[("zmeta", r.node, r.leaf)] = env[r.chain[-1] if r.chain else leaf.read_node]
        return got

    def scattered(self, r: Read, op: int, dev: int) -> Stash:
        """The reduce-scattered gradient that ``r`` reads: ``dev``'s rows of the sum over the replicas of their
        partial results (each accumulated over its micro-batches, its view chain run, weighted by its share),
        at the compiler's key of the reduce-scatter (a parameter held whole: the whole sum, all-reduced)."""
        b = self.b
        hs = self.grads[r.leaf]
        stash_key = ("zs", r.node)
        items = b.memo.get(stash_key)
        if items is None:
            t = b.inst_task[(op, dev, 0)]
            found = self._upstream(t, r.leaf[0], (TaskKind.COLLECTIVE,))
            if not found:
                raise HeterogError(f"plan has no reduce-scatter of the gradient {b.graph.ops[r.leaf[0]].name}")
            at = self._key(found[0])
            leaf = b.leaf(r.leaf)
            meta = self._meta(r)
            shape, order, dtype = tuple(meta.shape), memory_order(meta), leaf.dtype
            if tuple(shape) != b.leaf((hs.param, 0)).shape:
                raise HeterogError(f"the update of parameter {b.graph.ops[hs.param].param!r} reads its gradient "
                                   f"as {list(shape)}, not in the parameter's shape")
            sums = {d: (src, w) for d, src, w, _ in b.device_sums(r.leaf)}
            g = b.subgroup(tuple(sorted(hs.devices)))
            instrs: dict[int, Instruction] = {}
            for d in hs.devices:
                src, w = sums[d]
                if r.chain:
                    src, w = self.derive(d, at, src, leaf.read_node, r.chain, w, None, r.node, r.tuple_index), 1.0
                if hs.sharded:
                    need = Sharding("S0", sum(hs.shares), hs.shares)
                    instrs[d] = ReduceScatter(stash_key, g, src, w, hs.devices, need, self._ring_s(hs, shape, dtype),
                                              order)
                else:
                    emu = float(b.nominal.allreduce_times(hs.devices, np.array([float(np.prod(shape)) * dtype.itemsize])
                                                          )[0][0]) if b.emulate else 0.0
                    instrs[d] = AllReduce(stash_key, g, src, w, emu, order)
            items = {d: b.emit(d, at + (0,), ins) for d, ins in instrs.items()}
            b.memo[stash_key] = items
        return Stash(stash_key)

    # ------------------------------------------------------------------ the step's end
    def updates(self, ph: str, out: str, dev: int) -> list[tuple[str, Source]] | None:
        """The next values on ``dev`` of placeholder ``ph`` from step output ``out`` where ``ph`` is held as
        state (None: the default applies): the state's rows; the parameter gathered whole (stages 1-2), its rows
        (stage 3) or the whole (held whole), copied up first and its master copy kept where offloaded."""
        b = self.b
        op = b.prog.node_op[ph]
        hs = self.of_op.get(op)
        if hs is None or not (op in hs.state_ops or op == hs.param):
            return None
        u = b.prog.node_op[out]
        if u not in hs.rows_ops and not (hs.sharded or hs.offload):
            return None
        if u not in hs.rows_ops:
            raise HeterogError(f"the next value of {b.graph.ops[op].name} is not written by the update of parameter "
                               f"{b.graph.ops[hs.param].param!r}")
        b.export(u, dev, 0, out)
        if op in hs.state_ops or hs.on_host:           # state, and parameter rows held on the host: stay there
            return [(ph, Env(out))]
        kept: list[tuple[str, Source]] = [(master_name(ph), Env(out))] if hs.offload else []
        new: Source = Env(out)
        if hs.offload:
            up = self._one(TaskKind.TRANSFER, u, dev)
            at = self._key(up) if up is not None else b.inst_key(u, dev) + (1,)
            b.emit(dev, at + (0,), Copy(("zu", out), Env(out), False, ph, hs.part(dev) if hs.stage < 3 else None))
            new = Stash(("zu", out))
        if hs.sharded and hs.stage < 3:
            new = self._gather_update(hs, u, ph, out, dev, new)
        return kept + [(ph, new)]

    def _gather_update(self, hs: HeldState, u: int, ph: str, out: str, dev: int, shard: Source) -> Stash:
        """Stages 1-2: the new parameter gathered whole from the replicas' rows into the old one's buffer, at
        the key of the compiler's all-gather after writer op ``u`` (which lands in the resident parameter)."""
        b = self.b
        t = self._one(TaskKind.COLLECTIVE, u)
        if t is None:
            raise HeterogError(f"plan has no all-gather of the new parameter {b.graph.ops[hs.param].param!r}")
        leaf = b.leaf((hs.param, 0))
        g = b.subgroup(tuple(sorted(hs.devices)))
        parts = tuple((d, hs.shard_shape(leaf.shape, i)) for i, d in enumerate(hs.devices))
        stash = ("zn", ph)
        emu = self._ring_s(hs, leaf.shape, leaf.dtype)
        b.emit(dev, self._key(t) + (0,), AllGather(stash, g, shard, "S0", parts, emu, leaf.memory_order, ph))
        return Stash(stash)
