"""Synchronized batch statistics in the runtime (``heterog.compiler.sync_stats`` says when they apply).

A synced batch norm op runs on each device in three instructions at its STATISTICS task's key:

  ``BatchStats``  its instances' (one per micro-batch on the device) count and per-channel sums, weighted to
                  the whole batch's convention (``heterog.runtime.scaling``) and summed: forward the sum and the
                  sum of squares of the input, backward the sum of the incoming gradient and of its product
                  with the centred input, in float64
  ``AllReduce``   of those sums over the layout's devices (none on one device)
  ``Compute``     each instance, its batch-norm node replaced by ``synced_forward`` / ``synced_backward``
                  (``heterog.runtime.batch_stats``),
                  which take the whole batch's sums (``Compute.stats``): the forward normalises with the batch's
                  mean and (biased) variance and updates the running statistics with them (the unbiased
                  variance, as torch does); the backward computes the input gradient from the batch's sums,
                  the weight and bias gradients from its own samples (partial results, aggregated as any)

Every instruction of the op takes the STATISTICS task's key (``task``), so every rank issues the AllReduce at
one key and what reads the op's outputs comes after it, as the compiled plan orders them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from heterog.compiler import TaskKind
from heterog.runtime.instructions import (
    END,
    AllReduce,
    Assemble,
    BatchStats,
    Compute,
    Env,
    Piece,
    Recv,
    Source,
    Stash,
    env_name,
)
from heterog.runtime.kernel import Ref

if TYPE_CHECKING:  # pragma: no cover
    from heterog.compiler import CompiledPlan
    from heterog.cost import CostModel
    from heterog.runtime.scaling import Exponents
    from heterog.runtime.stepprog import StepProgram

# ---------------------------------------------------------------------------- lowering
class Builder(Protocol):
    """What the synced ops' lowering reads of ``heterog.runtime.lowering``'s builder."""

    prog: StepProgram
    plan: CompiledPlan
    start: np.ndarray
    exps: Exponents
    emulate: bool
    nominal: CostModel
    B: int

    memo: dict[Any, Any]

    def lay_devs(self, lay: int) -> tuple[int, ...]: ...

    def op_lay(self, op: int) -> int: ...

    def entries(self, op: int) -> list[tuple[int, int, int, int]]: ...

    def inst_key(self, op: int, dev: int, micro: int = 0, recompute: bool = False) -> tuple: ...

    def export(self, op: int, dev: int, micro: int, name: str, recomputed: bool = False) -> None: ...

    def send(self, src_dev: int, dst_dev: int, key: tuple, source: Any, slice_: Any, scale: float, shape: tuple,
             dtype: torch.dtype) -> int: ...

    def pull(self, item: list, key: tuple) -> None: ...

    def subgroup(self, devices: tuple[int, ...]) -> int: ...

    def emit(self, rank: int, key: tuple, instr: Any) -> list: ...


class SyncLowering:
    """The synced batch norms of one plan (module docstring): ``task`` gives their instances' key, ``add``
    collects their instances, ``emit_all`` writes the instructions."""

    def __init__(self, b: Builder) -> None:
        self.b = b
        synced = b.plan.placements.op_synced
        self.ops = set(np.nonzero(synced)[0].tolist()) if synced is not None else set()
        kinds = b.plan.task_kind
        self.stat_task = {int(b.plan.task_op[t]): int(t) for t in np.nonzero(kinds == TaskKind.STATISTICS)[0]}
        self.pending: dict[tuple[int, int], list[Compute]] = {}

    def __contains__(self, op: int) -> bool:
        return op in self.ops

    def task(self, op: int, t: int) -> int:
        """The task whose start keys op ``op``'s instance task ``t``: its STATISTICS task if it is synced."""
        return self.stat_task[op] if op in self.ops else t

    def add(self, dev: int, ins: Compute) -> None:
        self.pending.setdefault((ins.op, dev), []).append(ins)

    def last_instance(self, leaf_id: tuple[int, int], dev: int) -> Source:
        """On ``dev``, a buffer's new value that batch op ``leaf_id[0]`` makes (a batch norm's running
        statistics): its last instance's (of the last micro-batch, on the last replica). With synchronized
        statistics every instance's is the whole batch's; without, it is the last replica's, as data
        parallelism keeps each replica's."""
        b = self.b
        u = leaf_id[0]
        d_last, _, _, m_last = b.entries(u)[-1]
        leaf = b.prog.leaves[leaf_id]
        node = leaf.read_node
        b.export(u, d_last, m_last, node)
        if dev == d_last:
            return Env(env_name(node, m_last))
        item = b.memo.get(("last", leaf_id, dev))
        if item is None:
            msg = b.send(d_last, dev, b.inst_key(u, d_last, m_last) + (1,), Env(env_name(node, m_last)), None, 1.0,
                         leaf.shape, leaf.dtype)
            item = b.memo[("last", leaf_id, dev)] = b.emit(dev, END + (-1,), Assemble(
                ("last", node), None, (Piece(Recv(msg), None, 1.0, 0),), leaf.memory_order))
        return Stash(("last", node))

    def _row_exponent(self, op: int) -> int:
        """The exponent of the batch-norm node's first argument (the input forward, the gradient backward)."""
        prog = self.b.prog
        node = prog.op_nodes[op][0]
        first = prog.calls[node].args[0]
        name = first.name if isinstance(first, Ref) else ""
        read = next((r for r in prog.reads[op] if r.node == name), None)
        return self.b.exps[read.leaf] if read is not None else 0

    def emit_all(self, emitted: Callable[[int, tuple, Any], list] | None = None) -> None:
        b = self.b
        emit = emitted or b.emit
        for (op, dev), instances in self.pending.items():
            t = self.stat_task[op]
            key = (float(b.start[t]), t)
            node = b.prog.op_nodes[op][0]
            e = self._row_exponent(op)
            weights = tuple(float((c.local_batch / b.B) ** -e) if e else 1.0 for c in instances)
            local = ("bs", node, dev)
            emit(dev, key + (0,), BatchStats(local, node, tuple(instances), weights))
            stats: Stash = Stash(local)
            devs = b.lay_devs(b.op_lay(op))
            if len(devs) > 1:
                nbytes = 8.0 * (2 * int(b.prog.leaves[(op, 0)].shape[1]) + 1)
                emu = float(b.nominal.allreduce_times(devs, np.array([nbytes]))[0][0]) if b.emulate else 0.0
                emit(dev, key + (0,), AllReduce(("bg", node), b.subgroup(devs), stats, 1.0, emu, None))
                stats = Stash(("bg", node))
            for c, w in zip(instances, weights):
                emit(dev, key + (0, 1), replace(c, stats=stats, stats_scale=1.0 / w))
