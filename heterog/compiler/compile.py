"""Compile a Strategy on an OpGraph into a simulator TaskGraph: ``Compiler`` runs the phases in order,
from scratch or by patching a recent plan, and ``compile_strategy`` compiles one strategy.

Semantics (docs/design.md, "Replication, re-layout and aggregation" and "Resources, memory and time").
Per op, the group's ParallelConfig gives its *layout* (a list of (device, batch share)):
  - ops that touch a batch-carrying tensor are split along the batch over the config's replicas;
  - ops without any batch tensor are duplicated on every replica (parameters are present on every
    replica's device), except under PS where parameters, optimizer state and everything computed
    after gradient aggregation (the update) live on the PS device only;
  - a replicated op whose inputs carry the batch but whose output does not (weight gradient, loss)
    yields partial results; if anything reads their value, they are aggregated: PS (push to the PS,
    aggregate there) or AllReduce (ring or hierarchical, whichever the cost model says is cheaper).
Edges between different layouts become split -> transfers -> concat; a non-batch tensor needed on a
device that lacks it is transferred once per (tensor, device) from the best-connected holder.
Memory: parameters, buffers and optimizer state are resident where they live; every other output,
gradients included, is allocated when its task starts and freed after its last reader, updates and
collectives working in place (``heterog.compiler.memory``).
Resources: a compute, split, concat or aggregate task holds its device; a transfer or push holds the
links of its path and an AllReduce the links of its algorithm, plus, on devices whose own cores move
the bytes (``DeviceType.host_driven_comm``, CPU workers), those endpoint devices.

The modules, bottom up (each imports only those above it in this list):

  tasks, index     task columns, kinds and categories, the canonical order; the graph's and cluster's tables
  context          ``CompileContext``: what one (graph, cluster, cost model) fixes, frozen
  registries       ``LayoutTable``, ``ConfigTable``, ``Grouping``, ``PSDemand``: what a compiler grows
  convert          the conversion engine: every task that converts a value between placements, priced
  sharded_state    sharded state's tasks and memory (ZeRO stages)
  offload          offloaded state's tasks, memory and host resources (ZeRO-Offload)
  coupled          the ops that couple samples: once over the whole batch, on one device
  sync_stats       synchronized batch statistics: the synced batch norms, the STATISTICS all-reduces they need
  ps               the load-aware parameter-server choice
  place            phases 1-3 -> ``Placement``: assign_configs, choose_ps, lay_out
  reshard          who needs what of values divided beyond the batch (splits, grids)
  emit             phases 4-6 -> tasks: emit_instances, emit_aggregation, emit_connections
  recompute        the recomputed instances of a plan's recomputed groups and their triggers
  micro            a plan's micro-batch schedule (SYNC tasks) and the topological order of its tasks
  plan             phase 7: assemble -> ``CompiledPlan`` (the schedule and one ``OpPlacements``), ``PlanState``;
                   ``PatchCache``
  delta            patch_plan: re-emit what a strategy change touches, merge with the base plan
  compile          ``Compiler``: the context, the registries and the patch cache, and the phases in order
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.context import AllReduceCosts, CompileContext
from heterog.compiler.delta import dirty_units, patch_plan
from heterog.compiler.emit import Providers, emit_aggregation, emit_connections, emit_instances
from heterog.compiler.index import VALUE_FREE_TARGETS, GraphIndex, graph_index
from heterog.compiler.place import Placement, place
from heterog.compiler.plan import (
    Aggregation,
    CompiledPlan,
    OpPlacements,
    PatchCache,
    PlanState,
    SplitConfig,
    aggregation_of,
    finish,
)
from heterog.compiler.recompute import add_recompute
from heterog.compiler.registries import ConfigTable, Grouping, Layout, LayoutTable, PSDemand
from heterog.compiler.tasks import CATEGORIES, COMM_KINDS, COMPUTE_KINDS, TaskBatch, TaskCategory, TaskKind, pair_order
from heterog.strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.cost.model import CostModel
    from heterog.graph.opgraph import OpGraph

__all__ = ["Aggregation", "AllReduceCosts", "CATEGORIES", "COMM_KINDS", "COMPUTE_KINDS", "CompileContext",
           "CompiledPlan", "Compiler", "GraphIndex", "Layout", "OpPlacements", "PatchCache", "Placement", "PlanState",
           "SplitConfig", "TaskCategory", "TaskKind", "VALUE_FREE_TARGETS", "compile_strategy", "graph_index"]


def op_priority_of(strategy: Strategy) -> np.ndarray | None:
    """The strategy's own per-op priorities (None: the scheduler ranks the tasks)."""
    return None if strategy.priorities is None else np.asarray(strategy.priorities)


def emit_all(ctx: CompileContext, layouts: LayoutTable, place: Placement) -> tuple[TaskBatch, Providers]:
    """Phases 4-6 over the whole graph: the tasks in emission order and their providers."""
    gi = ctx.index
    prov = Providers(np.zeros(gi.n_ops, dtype=np.int64), np.full((gi.n_tensors, ctx.n_devices), -1, dtype=np.int64),
                     np.zeros(gi.n_tensors, dtype=np.int64))
    batch = TaskBatch(0, ctx.order_key)
    emit_instances(ctx, layouts, batch, np.arange(gi.n_ops), place, prov)
    emit_aggregation(ctx, layouts, batch, np.nonzero(place.aggregate)[0], place, prov)
    emit_connections(ctx, layouts, batch, np.arange(len(gi.e_src)), place, prov)
    return batch, prov


def compile_all(ctx: CompileContext, layouts: LayoutTable, op_priority: np.ndarray | None,
                place: Placement) -> PlanState:
    """Phases 4-7 from scratch: emit every task (and the recomputed ones), put them in canonical order,
    finish (the micro-batch schedule) and assemble."""
    batch, prov = emit_all(ctx, layouts, place)
    add_recompute(ctx, batch, place, prov)
    tasks = batch.tasks()
    task, on, owner = batch.dependencies()
    perm = np.argsort(tasks.order, kind="stable")
    new_of = np.empty(tasks.n + 1, dtype=np.int64)
    new_of[perm] = np.arange(tasks.n)
    new_of[-1] = -1                                   # index -1 (no provider) stays -1
    task, on = new_of[task], new_of[on]
    s = pair_order(task, on, tasks.n)
    prov = Providers(new_of[prov.inst_start], new_of[prov.at], prov.layout)
    return finish(ctx, layouts, op_priority, tasks.take(perm), (task[s], on[s], owner[s]), place, prov,
                  aggregation_of(ctx, layouts, place, np.nonzero(place.aggregate)[0]))


class Compiler:
    """Compiles strategies for one (graph, cluster, cost model).

    It holds the ``context`` (what the graph, cluster and cost model fix), the tables it grows as it meets
    strategies (``layouts``, ``configs``; the current ``grouping`` and its ``demand``), and in ``bases``
    the last ``max_bases`` plans it compiled, which ``compile`` patches when a strategy differs from one
    of them in few groups. Tables past ``MAX_CONFIGS`` configs start afresh (and the kept plans go).

    Args:
        graph: the OpGraph. cluster: the Cluster. cost: a CostModel of the cluster.
        serialize_collectives: NCCL-style: all AllReduces share one stream and run one at a time.
        max_bases: plans kept to patch (0: every strategy is compiled from scratch).
        delta_fraction: patch only when the ops to re-emit are at most this share of the graph.
        sync_batch_stats: every strategy's batch norms synchronized (``heterog.compiler.sync_stats``).
    """

    MAX_CONFIGS = 100_000

    def __init__(self, graph: OpGraph, cluster: Cluster, cost: CostModel, *, serialize_collectives: bool = False,
                 max_bases: int = 4, delta_fraction: float = 0.5, sync_batch_stats: bool = False) -> None:
        self.context = CompileContext.of(graph, cluster, cost, serialize_collectives=serialize_collectives)
        self.sync_batch_stats = bool(sync_batch_stats)
        self.delta_fraction = float(delta_fraction)
        self.bases = PatchCache(max_bases)
        self.n_full = self.n_patched = 0           # compilations from scratch / patches (statistics)
        self._new_tables()

    def _new_tables(self) -> None:
        """Empty layout and config tables, no grouping; the kept plans, which hold their ids, go too."""
        self.layouts = LayoutTable(self.context.n_devices, self.context.batch_size)
        self.configs = ConfigTable(self.layouts)
        self.grouping: Grouping | None = None
        self.demand: PSDemand | None = None
        self.bases.clear()

    def _use_grouping(self, op_group: np.ndarray) -> PSDemand:
        """Adopt the strategy's op groups (a new grouping drops the kept plans); its ``PSDemand``."""
        if self.grouping is None or not self.grouping.same_as(op_group):
            self.grouping = Grouping.of(op_group, self.context.index)
            self.demand = PSDemand(self.context, self.grouping)
            self.bases.clear()
        assert self.demand is not None                   # set with the grouping
        return self.demand

    def compile(self, strategy: Strategy, *, check: bool = True, patch: bool = True) -> CompiledPlan:
        """The CompiledPlan of ``strategy`` (``check``: refuse a strategy made for another graph or
        cluster; ``patch``: allow patching a recent plan)."""
        return self.compile_state(strategy, check=check, patch=patch).plan

    def compile_state(self, strategy: Strategy, *, check: bool = True, patch: bool = True) -> PlanState:
        """``compile``, with what patching the plan later needs. The cyclic garbage collector is paused while it
        runs (``cycles_paused``)."""
        with cycles_paused():
            return self._compile_state(strategy, check=check, patch=patch)

    def _compile_state(self, strategy: Strategy, *, check: bool, patch: bool) -> PlanState:
        ctx = self.context
        if check:
            strategy.check_fits(ctx.graph, ctx.cluster)
        demand = self._use_grouping(strategy.group_of)
        if len(self.configs) > self.MAX_CONFIGS:              # bounded tables: start afresh
            self._new_tables()
            demand = self._use_grouping(strategy.group_of)
        placement = place(ctx, self.configs, demand, strategy, sync=self.sync_batch_stats)
        op_priority = op_priority_of(strategy)
        state = None
        # plans with recomputation or synced batch statistics: from scratch
        patch = patch and placement.recompute is None and placement.synced is None
        closest = self.bases.closest(placement) if patch else None
        if closest is not None:
            key, base = closest
            dirty = dirty_units(ctx.index, base.placement, placement)
            if dirty is None:                         # nothing changed: the same plan
                self.bases.touch(key)
                if op_priority is not None or base.plan.op_priority is not None:
                    return replace(base, plan=replace(base.plan, op_priority=op_priority))
                return base
            if np.count_nonzero(dirty.ops) <= self.delta_fraction * ctx.index.n_ops:
                state = patch_plan(ctx, self.layouts, base, op_priority, placement, dirty)
                self.n_patched += 1
        if state is None:
            state = compile_all(ctx, self.layouts, op_priority, placement)
            self.n_full += 1
        if placement.recompute is None and placement.synced is None:
            self.bases[id(state)] = state
        return state

    def __repr__(self) -> str:
        ctx = self.context
        return (f"Compiler({ctx.graph.name!r} on {ctx.cluster.name!r}: {len(self.configs)} configs, "
                f"{len(self.layouts)} layouts, {self.bases!r})")


@contextmanager
def cycles_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (as it was after). A compilation allocates some 10^5 small
    objects and frees them by reference counting; each burst of allocations otherwise triggers collections
    that walk every live object of the process (a captured graph's hundreds of thousands)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def compile_strategy(graph: OpGraph, cluster: Cluster, strategy: Strategy, cost: CostModel, *,
                     serialize_collectives: bool = False, check: bool = True) -> CompiledPlan:
    """Build the TaskGraph of ``strategy`` for one training iteration of ``graph`` on ``cluster``.

    Args:
        graph: the OpGraph. cluster: the Cluster. strategy: a Strategy for this graph and cluster.
        cost: a CostModel of the cluster (op, transfer and collective times).
        serialize_collectives: NCCL-style: all AllReduces share one stream and run one at a time.
        check: refuse a strategy made for another graph or cluster.
    """
    compiler = Compiler(graph, cluster, cost, serialize_collectives=serialize_collectives, max_bases=0)
    return compiler.compile(strategy, check=check)
