"""Phase 7 of a compilation and what it yields: tasks in canonical order become a TaskGraph and a
``CompiledPlan``; a ``PlanState`` keeps what patching the plan needs, a ``PatchCache`` the recent ones.

A ``CompiledPlan`` is the schedule (the TaskGraph and what each task stands for) plus one ``OpPlacements``
record: where each op runs (``Layout``, ``SplitConfig``) and how its partial results are summed
(``Aggregation``).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.memory import memory_entries, part_copies, victims
from heterog.compiler.micro import add_schedule, micro_order, window_exempt
from heterog.compiler.offload import host_resources, offloaded_memory, offloads
from heterog.compiler.place import Placement
from heterog.compiler.registries import Layout, LayoutTable
from heterog.compiler.sharded_state import (
    StatePlacement,
    gradient_shares,
    reduce_scattered,
    resident_saved,
    update_gather_readers,
)
from heterog.compiler.sync_stats import wait_for_statistics
from heterog.compiler.tasks import Deps, Providers, TaskBatch, TaskKind, Tasks, pair_order, ragged

if TYPE_CHECKING:  # pragma: no cover
    from simulator.taskgraph import TaskGraph

# the owner of a dependency that only orders two tasks (``overwrite_after_reads``): the waiting task reads
# nothing of the other, so it releases none of its memory
ORDER_ONLY = -1


@dataclass(frozen=True)
class SplitConfig:
    """A split config of a plan (``ParallelConfig.split``): its ``devices`` in config order, each one's split
    share ``weights`` (a grid's groups divide alike, by the first ``len(groups[0])``) and the ``groups`` of a
    grid's devices (one group of all of them without a grid)."""

    devices: tuple[int, ...]
    weights: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Aggregation:
    """How a partial result (a tensor whose replicas' values are summed) is aggregated: ``kind`` "ps" (pushed
    to the PS ``devices[0]``, summed and kept there), "allreduce" (all-reduced over ``devices`` with the
    ``algorithm`` the cost model found faster: "ring" or "hierarchical"; "" otherwise) or "reduce-scatter"
    (a gradient of sharded state, stage 2 or 3: each of ``devices`` keeps the sum of its shard)."""

    kind: str
    devices: tuple[int, ...]
    algorithm: str = ""


@dataclass(frozen=True)
class OpPlacements:
    """Where each op of a compiled plan runs and how its partial results are kept: what the runtime
    reproduces and reports read. Read-only (the arrays may be the compiler's own).

    Layout and split-config ids are the compiler's: ``layouts`` holds every layout it had met when the plan
    was compiled. A new way of placing ops or their state (optimizer state sharded over a group, state
    offloaded to the host) is a new field of this record.

    Shapes: ``op_layout``, ``op_group`` (n_ops,); ``op_recompute``, ``op_split``, ``op_option`` (n_ops,) or
    None; ``tensor_layout`` (n_tensors,).
    """

    op_layout: np.ndarray                  # layout id of each op's instances (index into ``layouts``)
    layouts: tuple[Layout, ...]            # layout id -> its entries (devices, batch shares, micro-batches)
    tensor_layout: np.ndarray              # layout whose devices hold each tensor's value
    op_group: np.ndarray                   # each op's group (which reads of a recomputed op are recomputed:
                                           # ``heterog.compiler.place.recompute_edges``)
    op_recompute: np.ndarray | None        # ops recomputed before their backward; None: none is
    op_split: np.ndarray | None            # index into ``splits`` of the split config each op is divided under
                                           # beyond the batch, -1: none; None: no op is
    op_option: np.ndarray | None           # the option each divided op runs (index into its ``OpGraph.splits``
                                           # options), -1: whole on every device
    splits: tuple[SplitConfig, ...]        # the plan's split configs
    aggregation: Mapping[int, Aggregation]  # aggregated tensor -> how its partial results are summed
    ps_device: Mapping[int, int]           # PS group -> its chosen PS device
    state: StatePlacement | None = None    # sharded optimizer state, gradients, parameters of data-parallel
                                           # groups (``heterog.compiler.sharded_state``); None: no group's
    op_synced: np.ndarray | None = None    # (n_ops,) batch norms with synchronized statistics
                                           # (``heterog.compiler.sync_stats``); None: none


@dataclass(frozen=True)
class CompiledPlan:
    """A TaskGraph, what each task stands for (kind, op, device, micro-batch, slot) and where each op runs.

    Shapes: task arrays (n_tasks,); ``dep_ptr`` (n_tasks + 1,), ``dep_idx`` (dep_ptr[-1],): the tasks
    each task waits for, as CSR.
    """

    tg: TaskGraph
    task_kind: np.ndarray           # TaskKind
    task_op: np.ndarray
    task_device: np.ndarray         # compute device, or destination device of a transfer, -1 for collectives
    op_priority: np.ndarray | None  # per-op priorities from the strategy (None: ranked by the scheduler)
    task_prio_op: np.ndarray        # op whose priority a task inherits
    n_devices: int
    n_links: int
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    task_micro: np.ndarray          # micro-batch of an op instance's samples, -1 for other tasks
    task_slot: np.ndarray | None    # each task's slot in the micro-batch order; None: one micro-batch
    n_micro: int                    # micro-batches of the plan
    schedule: str                   # the order of its micro-batches applied (heterog.compiler.micro)
    placements: OpPlacements        # where each op runs, its partial results' aggregation

    @property
    def n_tasks(self) -> int:
        return len(self.task_kind)

    def counts(self) -> dict[str, int]:
        """Tasks of each kind, by the kind's name in lower case."""
        return {k.name.lower(): int(np.sum(self.task_kind == k)) for k in TaskKind}


@dataclass
class PlanState:
    """A compiled plan and what patching it needs: its tasks in canonical order, every dependency as
    emitted (``dep_task`` waits for ``dep_on``; duplicates kept, sorted by (task, on), with the emission
    unit that owns it), the placement and the providers (task ids of these tasks). With one micro-batch
    these are the plan's own tasks; with several, the tasks before the schedule is added (``finish``)."""

    plan: CompiledPlan
    tasks: Tasks
    dep_task: np.ndarray
    dep_on: np.ndarray
    dep_owner: np.ndarray
    placement: Placement
    providers: Providers


class PatchCache:
    """The plans a compiler keeps to patch: the ``max_plans`` most recently used, and beside them the most
    recently used plan of each other micro-batch schedule (number of micro-batches and schedule), up to
    ``max_plans`` of those, each under a key of its own (``id(state)``). A plan is patched only from one of its
    own schedule; a search that moves among schedules (the agent's mutations of the micro-batches, MCMC's) finds
    a plan of the one it returns to, where an LRU of ``max_plans`` alone would have dropped it and compiled the
    plan from scratch. Layout and config ids in them index the compiler's current tables."""

    def __init__(self, max_plans: int) -> None:
        self.max_plans = int(max_plans)
        self._states: OrderedDict[int, PlanState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    @staticmethod
    def _schedule(state: PlanState) -> tuple[int, str | None]:
        pl = state.placement
        return pl.n_micro, (pl.schedule if pl.n_micro > 1 else None)

    def __setitem__(self, key: int, state: PlanState) -> None:
        """Keep ``state`` as the most recently used plan; past the limits the least recently used goes that
        is not the last of its schedule, or, past ``max_plans`` schedules kept so, the least recently used."""
        self._states[key] = state
        while len(self._states) > self.max_plans:
            order = list(self._states)
            recent = set(order[-self.max_plans:]) if self.max_plans else set()
            last_of: dict[tuple[int, str | None], int] = {}
            for k in order:
                last_of[self._schedule(self._states[k])] = k
            extras = [k for k in order if k not in recent and last_of[self._schedule(self._states[k])] == k]
            spare = [k for k in order if k not in recent and k not in extras]
            if spare:
                del self._states[spare[0]]
            elif len(extras) > self.max_plans:
                del self._states[extras[0]]
            else:
                break

    def clear(self) -> None:
        self._states.clear()

    def closest(self, placement: Placement) -> tuple[int, PlanState] | None:
        """The kept plan of as many micro-batches (and the same schedule) whose groups' configs differ from
        ``placement``'s in the fewest groups (the least recently used among equals) and its key; None if
        none is kept."""
        same = [kv for kv in self._states.items() if kv[1].placement.n_micro == placement.n_micro
                and (placement.n_micro == 1 or kv[1].placement.schedule == placement.schedule)]
        if not same:
            return None
        return min(same, key=lambda kv: np.count_nonzero(kv[1].placement.group_cfg != placement.group_cfg))

    def touch(self, key: int) -> None:
        """Mark the plan under ``key`` as the most recently used."""
        self._states.move_to_end(key)

    def __repr__(self) -> str:
        return f"PatchCache({len(self)} of at most {self.max_plans} plans)"


def resident_bytes(ctx: CompileContext, layouts: LayoutTable, op_lay: np.ndarray,
                   out_split: np.ndarray | None = None) -> np.ndarray:
    """(M,) bytes of parameters, buffers and optimizer state resident on each device when op ``o``'s
    instances run on layout ``op_lay[o]`` (a parameter divided beyond the batch, ``out_split[o]`` > 0,
    holds its entry's share there)."""
    ops = ctx.resident_ops
    rows, local = ragged(layouts.length[op_lay[ops]])
    flat = layouts.ptr[op_lay[ops]][rows] + local
    weights = ctx.index.resident_bytes[ops][rows]
    if out_split is not None:
        w = out_split[ops][rows]
        weights = np.where(w > 0, weights * (1.0 - w + w * layouts.split_flat[flat]), weights)
    return np.bincount(layouts.dev_flat[flat], weights=weights, minlength=ctx.n_devices)


def aggregation_of(ctx: CompileContext, layouts: LayoutTable, place: Placement,
                   tensors: np.ndarray) -> dict[int, Aggregation]:
    """How each of ``tensors`` (aggregated ones) is aggregated (``Aggregation``; one record shared by the
    tensors aggregated alike)."""
    ops = ctx.index.t_op[tensors]
    is_ps = place.op_ps[ops]
    ps = place.group_ps[place.grouping.op_group[ops]]
    lay = place.op_lay[ops]
    out: dict[int, Aggregation] = {}
    for p in np.unique(ps[is_ps]).tolist():
        out.update(dict.fromkeys(tensors[is_ps & (ps == p)].tolist(), Aggregation("ps", (p,))))
    scattered = reduce_scattered(ctx, place.state, tensors)
    for k in np.unique(lay[scattered]).tolist():
        out.update(dict.fromkeys(tensors[scattered & (lay == k)].tolist(),
                                 Aggregation("reduce-scatter", layouts.unique_devices(k))))
    for k in np.unique(lay[~is_ps & ~scattered]).tolist():
        sel = tensors[~is_ps & ~scattered & (lay == k)]
        devices = layouts.unique_devices(k)
        costs = ctx.allreduce(devices)                     # the table the AllReduce tasks were priced with
        records = [Aggregation("allreduce", devices, name) for name in costs.names]
        out.update(zip(sel.tolist(), (records[a] for a in costs.algo[sel].tolist())))
    return out


def assemble(ctx: CompileContext, layouts: LayoutTable, op_priority: np.ndarray | None, tasks: Tasks,
             deps: tuple[np.ndarray, np.ndarray, np.ndarray], place: Placement, prov: Providers,
             aggregation: Mapping[int, Aggregation], *, validate: bool = True,
             csr: tuple[np.ndarray, np.ndarray] | None = None, schedule: str | None = None,
             slot: np.ndarray | None = None) -> PlanState:
    """Phase 7: the TaskGraph of ``tasks``, already in canonical order, and of ``deps`` (task, on, owner),
    sorted by (task, on) (duplicates allowed) in the same ids (``validate``: the TaskGraph checks every
    task; ``csr``: the dependencies without duplicates as (ptr, idx), if already at hand; ``schedule``: the
    micro-batch schedule applied, default the placement's; ``slot``: each task's slot in that order, None with
    one micro-batch)."""
    dep_task, dep_on, dep_owner = deps
    n = tasks.n
    if csr is None:
        keep = np.ones(len(dep_task), dtype=bool)
        if len(dep_task):
            keep[1:] = (dep_task[1:] != dep_task[:-1]) | (dep_on[1:] != dep_on[:-1])
        dep_t, dep_o = dep_task[keep], dep_on[keep]
        dep_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(dep_t, minlength=n), out=dep_ptr[1:])
    else:
        dep_ptr, dep_o = csr
        dep_t = np.repeat(np.arange(n), np.diff(dep_ptr))
    if np.any(dep_o >= dep_t):
        raise AssertionError("compiler produced a dependency on a later task")
    resident = np.zeros(ctx.resources.n_resources)
    resident[:ctx.n_devices] = resident_bytes(ctx, layouts, place.op_lay, place.out_split)
    if place.state is not None:       # sharded optimizer state, gradients, parameters
        resident[:ctx.n_devices] -= resident_saved(ctx, layouts, place.op_lay, place.state)
    if offloads(place.state):         # state in host memory: host resources, their memory resident
        assert place.state is not None
        saved, host_bytes = offloaded_memory(ctx, layouts, place.op_lay, place.state)
        # a device whose every parameter lives in shards on the host keeps nothing: the shares sum to 1 up to
        # rounding, which must not leave a few negative bytes
        resident[:ctx.n_devices] = np.maximum(resident[:ctx.n_devices] - saved, 0.0)
        tg = host_resources(ctx, resident, host_bytes)
    else:
        tg = ctx.resources.empty_copy(resident_bytes=resident)
    held = state_held(place.state)
    reads = dep_owner != ORDER_ONLY               # the dependencies that read what they wait for
    copies = part_copies(ctx, layouts, place.op_lay, [c.copied for c in place.shards], place.op_shard, tasks)
    mem = memory_entries(ctx, layouts, place.op_lay, place.out_split, tasks,
                         deps if reads.all() else (dep_task[reads], dep_on[reads], dep_owner[reads]), held,
                         gradient_shares(ctx, place.state), copies)
    tg.adopt_tasks(tasks.dur, tasks.lag, ctx.category_codes[tasks.cat], tasks.res_ptr, tasks.res_idx, dep_ptr, dep_o,
                   mem.mem_ptr, mem.mem_res, mem.mem_bytes, validate=validate, frees=(mem.free_ptr, mem.free_idx),
                   free_entry=mem.free_entry)
    plan = CompiledPlan(tg=tg, task_kind=tasks.kind, task_op=tasks.op, task_device=tasks.dev,
                        op_priority=op_priority, task_prio_op=tasks.prio_op, n_devices=ctx.n_devices,
                        n_links=ctx.n_links, dep_ptr=dep_ptr, dep_idx=dep_o, task_micro=tasks.micro, task_slot=slot,
                        n_micro=place.n_micro, schedule=schedule or place.schedule,
                        placements=op_placements(layouts, place, prov, aggregation))
    return PlanState(plan, tasks, dep_task, dep_on, dep_owner, place, prov)


def state_held(state: StatePlacement | None) -> np.ndarray | None:
    """(n_ops,) ops whose group's state is sharded or offloaded (None: none is; ``memory_entries``)."""
    return None if state is None else (state.op_stage > 0) | (state.op_offload > 0)


def overwrite_after_reads(ctx: CompileContext, tasks: Tasks, deps: Deps, state: StatePlacement | None) -> Deps:
    """``deps`` (sorted by (task, on)) with each task that writes into a value in place waiting for every other
    task that reads that value (owner ``ORDER_ONLY``: the writer releases none of its readers' memory), sorted:

    - an op instance of the update that writes its output into the parameter or optimizer state it replaces
      (``heterog.compiler.memory.victims``, not under sharded or offloaded state), for the readers of the value
      it overwrites from the same task (a backward op that reads the parameter, e.g. the input gradient of a
      linear layer, which nothing else orders before the weight's update; a transfer of it);
    - the all-gather of a parameter's next value at stages 1 and 2, which lands in the resident parameter
      (``sharded_state.emit_update_gathers``), for every reader of the parameter.

    The write in place, which the memory model counts, is then what the runtime can do: it overwrites a value
    that no later instruction reads (``heterog.runtime.in_place``), where a schedule that ran the writer first
    would make the runtime hold the old and the new value at once."""
    task, on, owner = deps
    held = state_held(state)
    vic = victims(ctx)
    op = tasks.op[task]
    opc = np.maximum(op, 0)
    writes = (tasks.kind[task] == TaskKind.COMPUTE) & (tasks.dev[task] >= 0) & (op >= 0) & vic.placeholder[opc] & \
        (owner == ctx.index.n_ops + vic.tensor[opc])
    if held is not None:
        writes &= ~(vic.param[opc] & held[opc])
    writer, value = task[writes], on[writes]
    by_on = np.argsort(on, kind="stable")
    lo, hi = np.searchsorted(on[by_on], value, "left"), np.searchsorted(on[by_on], value, "right")
    r, k = ragged(hi - lo)
    add_task, add_on = writer[r], task[by_on[lo[r] + k]]
    # readers come before the update in the canonical order (the update's op follows the backward's)
    keep = add_on < add_task
    add_task, add_on = add_task[keep], add_on[keep]
    if state is not None:
        gather, reader = update_gather_readers(ctx, tasks, deps, state)
        add_task, add_on = np.concatenate([add_task, gather]), np.concatenate([add_on, reader])
    new = (add_on != add_task) & (tasks.kind[add_on] != TaskKind.SYNC)
    if not new.any():
        return deps
    pairs = np.unique(np.stack([add_task[new], add_on[new]]), axis=1)
    new_task = np.concatenate([task, pairs[0]])
    new_on = np.concatenate([on, pairs[1]])
    new_owner = np.concatenate([owner, np.full(pairs.shape[1], ORDER_ONLY, dtype=owner.dtype)])
    s = pair_order(new_task, new_on, tasks.n)
    return new_task[s], new_on[s], new_owner[s]


def op_placements(layouts: LayoutTable, place: Placement, prov: Providers,
                  aggregation: Mapping[int, Aggregation]) -> OpPlacements:
    """The ``OpPlacements`` of a plan placed as ``place`` whose tensors' values are held as ``prov`` says."""
    ps_groups = np.nonzero(place.group_ps >= 0)[0]
    return OpPlacements(op_layout=place.op_lay, layouts=layouts.records(), tensor_layout=prov.layout,
                        op_group=place.grouping.op_group, op_recompute=place.recompute, op_split=place.op_shard,
                        op_option=_op_options(place),
                        splits=tuple(SplitConfig(c.devices, c.weights, c.groups) for c in place.shards),
                        aggregation=aggregation,
                        ps_device=dict(zip(ps_groups.tolist(), place.group_ps[ps_groups].tolist())),
                        state=place.state, op_synced=place.synced)


def _op_options(place: Placement) -> np.ndarray | None:
    """(n_ops,) each divided op's option in its ``OpGraph.splits`` list (``OpPlacements.op_option``)."""
    if place.op_shard is None:
        return None
    out = np.full(len(place.op_shard), -1, dtype=np.int64)
    for k, choice in enumerate(place.shards):
        assert choice.original is not None
        sel = place.op_shard == k
        out[sel] = choice.original[sel]
    return out


def finish(ctx: CompileContext, layouts: LayoutTable, op_priority: np.ndarray | None, tasks: Tasks, deps: Deps,
           place: Placement, prov: Providers, aggregation: Mapping[int, Aggregation], *,
           validate: bool = True, csr: tuple[np.ndarray, np.ndarray] | None = None) -> PlanState:
    """Phase 7 for ``tasks`` in canonical order and ``deps`` (sorted by (task, on)): with one micro-batch,
    ``assemble`` them; with several, add the schedule's SYNC tasks, put every task in slot order
    (``heterog.compiler.micro``) and assemble that, the PlanState keeping the canonical tasks, dependencies
    and providers that a patch starts from. ``validate`` and ``csr`` as for ``assemble`` (one micro-batch)."""
    kept = deps                       # what a patch starts from: the dependencies as emitted
    ordered = overwrite_after_reads(ctx, tasks, deps, place.state)
    if ordered is not deps:           # an update that overwrites a value waits for its other readers
        deps, csr = ordered, None
    if place.synced is not None:      # readers of synced batch norms wait for their statistics too
        deps, csr = wait_for_statistics(tasks, deps, place.synced), None
    if place.n_micro == 1:
        state = assemble(ctx, layouts, op_priority, tasks, deps, place, prov, aggregation, validate=validate,
                         csr=csr)
        return state if deps is kept else replace(state, dep_task=kept[0], dep_on=kept[1], dep_owner=kept[2])
    exempt = window_exempt(ctx, place.op_lay)
    batch = TaskBatch.of(tasks, deps, ctx.order_key)
    schedule = add_schedule(ctx, batch, place.schedule, place.n_micro, exempt)
    every = batch.tasks()
    task, on, owner = batch.dependencies()
    perm, slot = micro_order(every, task, on, schedule, place.n_micro, exempt)
    new_of = np.empty(every.n + 1, dtype=np.int64)
    new_of[perm] = np.arange(every.n)
    new_of[-1] = -1                                   # index -1 (no provider) stays -1
    task, on = new_of[task], new_of[on]
    s = pair_order(task, on, every.n)
    state = assemble(ctx, layouts, op_priority, every.take(perm), (task[s], on[s], owner[s]), place,
                     Providers(new_of[prov.inst_start], new_of[prov.at], prov.layout), aggregation,
                     validate=validate, schedule=schedule, slot=slot[perm])
    return replace(state, tasks=tasks, dep_task=kept[0], dep_on=kept[1], dep_owner=kept[2], providers=prov)
