"""Synchronized batch statistics: which batch norms of a plan use the statistics of the whole batch, their
all-reduce's tasks and the waits on them.

The plan option (``Strategy.sync_batch_stats`` for every group, ``ParallelConfig.sync_batch_stats`` for one)
makes a batch norm's statistics those of the whole batch, as single-device training computes them, not of
each replica's (or micro-batch's) samples.

Semantics (docs/design.md, "Synchronized batch statistics"). A batch norm op of a synced group whose
layout has several instances (replicas, micro-batches) is *synced*:
  - forward: every instance computes its samples' count, sum and sum of squares per channel; they are
    summed over the instances (on a device over its micro-batches, then all-reduced over the devices);
    every instance then normalises with the mean and variance of the whole batch and updates the running
    statistics with them (``torch.nn.SyncBatchNorm``'s semantics, over micro-batches too);
  - backward: the two per-channel reductions of the batch norm's backward (the sum of the incoming
    gradient and of its product with the normalised input) are summed the same way before each instance
    computes its input gradient; the weight and bias gradients stay partial results, aggregated as any.
Priced as one STATISTICS task per synced op (made by the conversion engine, ``heterog.compiler.convert``): an
AllReduce of ``2 C + 1`` float64 values (the count and the
two sums per channel) over the layout's devices (no time on one device), after every instance of the op; every
task that reads an instance's outputs waits for it. A plan with synced ops runs 1F1B as GPipe (the
statistics of a layer need every micro-batch's forward, its backward sums every micro-batch's backward).

A batch norm of a group divided beyond the batch runs on every device over the whole batch: exact without
synchronising, unless the group is a grid (the batch divided over its groups) or the plan has several
micro-batches; then, synced, it runs as a data-parallel op over the first device of each of the config's
groups (``place_synced``), the values it reads and makes converted like any other between a divided op
and an undivided one.
"""
from __future__ import annotations

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.convert import Engine
from heterog.compiler.registries import ConfigTable, LayoutTable
from heterog.compiler.tasks import Deps, Providers, TaskKind, Tasks, pair_order
from heterog.strategy import ParallelConfig, Strategy

FORWARD_TARGETS = frozenset({"aten._native_batch_norm_legit.default", "aten._native_batch_norm_legit.no_stats",
                             "aten._native_batch_norm_legit_functional.default", "aten.native_batch_norm.default"})
BACKWARD_TARGETS = frozenset({"aten.native_batch_norm_backward.default"})
STAT_BYTES = 8                                 # the statistics are summed in float64


def group_flags(strategy: Strategy) -> np.ndarray:
    """(G,) the groups whose batch statistics are synchronized."""
    return np.array([bool(strategy.sync_batch_stats or c.sync_batch_stats) for c in strategy.configs], dtype=bool)


def batch_norm_ops(ctx: CompileContext) -> np.ndarray:
    """(n_ops,) the batch norm ops of the graph (forward or backward, over the batch)."""
    targets = FORWARD_TARGETS | BACKWARD_TARGETS
    return np.array([op.target in targets for op in ctx.graph.ops], dtype=bool) & ctx.index.has_batch


def place_synced(ctx: CompileContext, configs: ConfigTable, strategy: Strategy, op_cfg: np.ndarray,
                 op_lay: np.ndarray, op_shard: np.ndarray | None, out_split: np.ndarray | None, *,
                 everywhere: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
    """(the synced batch norm ops of ``strategy`` (module docstring), None when none is; the ops moved out of
    their split layouts), both (n_ops,). Moves those of grids and of micro-batched split groups to the first
    device of each of their config's groups (edits ``op_lay``, ``op_shard``, ``out_split``). ``everywhere``:
    every group synchronized, whatever the strategy says."""
    moved = np.zeros(len(op_lay), dtype=bool)
    flags = group_flags(strategy) | bool(everywhere)
    if not flags.any():
        return None, moved
    cand = batch_norm_ops(ctx) & flags[strategy.group_of]
    if not cand.any():
        return None, moved
    layouts = configs.layouts
    for cfg in np.unique(op_cfg[cand]).tolist():
        config = configs.configs[cfg]
        if config.split is None or (config.grid == 1 and strategy.n_micro == 1):
            continue
        groups = config.groups
        firsts = ParallelConfig(tuple(g[0] for g in groups), tuple(config.shares[::config.group_size]))
        sel = cand & (op_cfg == cfg)
        moved |= sel
        cid = configs.id_of(firsts, strategy.micro_batches)
        op_lay[sel] = configs.refresh().split_layout[cid]
        if op_shard is not None and out_split is not None:
            op_shard[sel] = -1
            out_split[sel] = 0.0
    layouts.refresh()
    synced = cand & (layouts.length[op_lay] > 1)
    if op_shard is not None:
        synced &= op_shard < 0
    return (synced if synced.any() else None), moved


def statistics_bytes(ctx: CompileContext, op: int) -> float:
    """Bytes a synced op's statistics all-reduce moves: the count and two sums per channel (``2 C + 1``)."""
    o = ctx.graph.ops[op]
    channels = int(o.output_shapes[0][1]) if len(o.output_shapes[0]) > 1 else 1
    return float(STAT_BYTES * (2 * channels + 1))


def emit_statistics(ctx: CompileContext, layouts: LayoutTable, conv: Engine, ops: np.ndarray,
                    op_lay: np.ndarray, synced: np.ndarray, prov: Providers) -> None:
    """One STATISTICS task per synced op among ``ops`` (whose instances ``prov`` has), after every instance,
    over the devices of its layout (made by the conversion engine, ``Engine.statistics``)."""
    for op in ops[synced[ops]].tolist():
        lid = int(op_lay[op])
        n = int(layouts.length[lid])
        conv.statistics(op, layouts.unique_devices(lid), statistics_bytes(ctx, op),
                        int(prov.inst_start[op]) + np.arange(n))


def wait_for_statistics(tasks: Tasks, deps: Deps, synced: np.ndarray) -> Deps:
    """``deps`` (sorted by (task, on)) with every task that waits for an instance of a synced op waiting for
    that op's STATISTICS task too (but the STATISTICS task itself, the op's own instances and the zero-time
    SYNC tasks that only order others: a recomputation's trigger), sorted. A trigger no longer waits for an
    earlier instance of its own op (a partial result accumulated over micro-batches): every instance that
    reads a synced op waits for its statistics, which puts them in one slot of the micro-batch order
    (``heterog.compiler.micro``), where the trigger, ordered before its op's instances, could not follow one."""
    task, on, owner = deps
    trigger = (tasks.kind[task] == TaskKind.SYNC) & (tasks.kind[on] == TaskKind.COMPUTE) & \
        (tasks.op[on] == tasks.op[task])
    if trigger.any():
        task, on, owner = task[~trigger], on[~trigger], owner[~trigger]
    stat_of = np.full(len(synced), -1, dtype=np.int64)
    stats = np.nonzero(tasks.kind == TaskKind.STATISTICS)[0]
    stat_of[tasks.op[stats]] = stats
    inst = (tasks.kind == TaskKind.COMPUTE) & synced[tasks.op]
    hit = inst[on] & (tasks.kind[task] != TaskKind.STATISTICS) & (tasks.kind[task] != TaskKind.SYNC) & \
        ~(inst[task] & (tasks.op[task] == tasks.op[on]))
    if not hit.any():
        return task, on, owner
    new_task = np.concatenate([task, task[hit]])
    new_on = np.concatenate([on, stat_of[tasks.op[on[hit]]]])
    new_owner = np.concatenate([owner, owner[hit]])
    s = pair_order(new_task, new_on, tasks.n)
    return new_task[s], new_on[s], new_owner[s]
