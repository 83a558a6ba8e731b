"""Compile a Strategy on an OpGraph into a simulator TaskGraph (DESIGN.md section 3).

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
Memory: parameters, gradients and optimizer state are resident where they live; every other output
is allocated when its task starts and freed after its last consumer (frees = data dependencies).
Resources: a compute, split, concat or aggregate task holds its device; a transfer or push holds the
links of its path and an AllReduce the links of its algorithm, plus, on devices whose own cores move
the bytes (``DeviceType.host_driven_comm``, CPU workers), those endpoint devices.

The pipeline, one function per phase (a ``Compiler`` holds what does not depend on the strategy):

  assign_configs   group -> config id (the compiler's registry), ops to replicate, tensors to aggregate
  choose_ps        group -> parameter-server device (``heterog.compiler.ps``)
  lay_out          op -> layout id (devices and batch shares of its instances)
  emit_instances / emit_aggregation / emit_connections   (``heterog.compiler.emit``) -> tasks
  assemble         tasks in their canonical order (``heterog.compiler.tasks``) -> TaskGraph

``Compiler.compile`` patches the closest plan it compiled recently when a strategy differs from it in
a few groups (``heterog.compiler.delta``); the result is the TaskGraph a compilation from scratch gives.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.emit import Providers, emit_aggregation, emit_connections, emit_instances
from heterog.compiler.index import VALUE_FREE_TARGETS, GraphIndex, Paths, graph_index, path_table
from heterog.compiler.ps import choose_ps_devices, problem_from_configs
from heterog.compiler.tasks import CATEGORIES, COMM_KINDS, OrderKey, TaskBatch, TaskKind, Tasks
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.compiler.delta import Dirty

__all__ = ["CATEGORIES", "COMM_KINDS", "CompiledPlan", "Compiler", "GraphIndex", "Placement", "TaskKind",
           "VALUE_FREE_TARGETS", "compile_strategy", "graph_index"]


# ----------------------------------------------------------------------------------- result
@dataclass
class CompiledPlan:
    """A TaskGraph plus what each task stands for (kind, op, device) and the resource layout."""

    tg: object                      # simulator.TaskGraph
    task_kind: np.ndarray
    task_op: np.ndarray
    task_device: np.ndarray         # compute device, or destination device of a transfer, -1 for collectives
    op_priority: np.ndarray | None  # per-op priorities from the strategy (None: ranked by the scheduler)
    task_prio_op: np.ndarray        # op whose priority a task inherits
    n_devices: int
    n_links: int
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    ps_device: dict = field(default_factory=dict)        # group -> chosen PS device
    allreduce_algo: dict = field(default_factory=dict)   # aggregated op -> "ring" | "hierarchical"
    # the layout decisions, for the runtime (which must reproduce them) and for reports
    op_layout: np.ndarray | None = None        # (n_ops,) layout id of each op's instances
    layout_devices: list = field(default_factory=list)   # layout id -> tuple of devices
    layout_shares: list = field(default_factory=list)    # layout id -> tuple of batch shares (DUP: B each)
    tensor_layout: np.ndarray | None = None    # (n_tensors,) layout whose devices hold each tensor's value
    aggregated: dict = field(default_factory=dict)       # tensor id -> ("ps", ps device) | ("allreduce", devices)

    @property
    def n_tasks(self) -> int:
        return len(self.task_kind)

    def counts(self) -> dict:
        return {k.name.lower(): int(np.sum(self.task_kind == k)) for k in TaskKind}


# ----------------------------------------------------------------------------------- registries
class LayoutTable:
    """Layouts (devices, batch shares) numbered as first seen, ids stable for the compiler's life; the
    first M are the single devices at the whole batch. Flat views: ``length`` (L,), ``ptr`` (L + 1,),
    ``dev_flat``, ``shares_flat``, ``frac_flat`` (ptr[-1],), ``dev_mask`` (L, M)."""

    def __init__(self, n_devices: int, batch_size: int) -> None:
        self.n_devices, self.batch_size = n_devices, batch_size
        self.devices: list[tuple[int, ...]] = []
        self.shares: list[tuple[int, ...]] = []
        self._id: dict[tuple, int] = {}
        self._built = -1
        for d in range(n_devices):
            self.add((d,), (batch_size,))

    def add(self, devices, shares) -> int:
        key = (tuple(int(d) for d in devices), tuple(int(s) for s in shares))
        lid = self._id.get(key)
        if lid is None:
            lid = self._id[key] = len(self.devices)
            self.devices.append(key[0])
            self.shares.append(key[1])
        return lid

    def __len__(self) -> int:
        return len(self.devices)

    def refresh(self) -> LayoutTable:
        """Rebuild the flat views if layouts were added since."""
        if self._built != len(self.devices):
            lengths = np.array([len(d) for d in self.devices], dtype=np.int64)
            self.length = lengths
            self.ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            self.dev_flat = np.array([d for ds in self.devices for d in ds], dtype=np.int64)
            self.shares_flat = np.array([s for ss in self.shares for s in ss], dtype=np.float64)
            self.frac_flat = np.array([s / self.batch_size for ss in self.shares for s in ss], dtype=np.float64)
            self.dev_mask = np.zeros((len(lengths), self.n_devices), dtype=bool)
            self.dev_mask[np.repeat(np.arange(len(lengths)), lengths), self.dev_flat] = True
            self._built = len(self.devices)
        return self


class ConfigTable:
    """ParallelConfigs numbered as first seen (by value), with per-config arrays: ``n_replicas``,
    ``is_ps`` (PS sync over several replicas), ``fixed_ps`` (the given PS device, -1: the compiler's
    choice), ``split_layout`` / ``dup_layout`` (layout of batch ops / of duplicated ops)."""

    def __init__(self, layouts: LayoutTable) -> None:
        self.layouts = layouts
        self.configs: list[ParallelConfig] = []
        self._id: dict[ParallelConfig, int] = {}
        self._rows: list[tuple[int, bool, int, int, int]] = []
        self._built = -1

    def id_of(self, config: ParallelConfig) -> int:
        cid = self._id.get(config)
        if cid is None:
            cid = self._id[config] = len(self.configs)
            self.configs.append(config)
            B = self.layouts.batch_size
            self._rows.append((config.n_replicas, config.sync == "ps" and config.n_replicas > 1,
                               -1 if config.ps_device is None else int(config.ps_device),
                               self.layouts.add(config.devices, config.shares),
                               self.layouts.add(config.devices, (B,) * config.n_replicas)))
        return cid

    def __len__(self) -> int:
        return len(self.configs)

    def refresh(self) -> ConfigTable:
        if self._built != len(self._rows):
            cols = list(zip(*self._rows))
            self.n_replicas = np.array(cols[0], dtype=np.int64)
            self.is_ps = np.array(cols[1], dtype=bool)
            self.fixed_ps = np.array(cols[2], dtype=np.int64)
            self.split_layout = np.array(cols[3], dtype=np.int64)
            self.dup_layout = np.array(cols[4], dtype=np.int64)
            self._built = len(self._rows)
        return self


@dataclass(frozen=True)
class AllReduceCosts:
    """AllReduce of every tensor over one device set: ``times_s`` (n_tensors,) and ``algo`` (n_tensors,),
    the algorithm as an index into ``names`` (sorted); ``links[i]`` the link resources algorithm
    ``names[i]`` holds; ``hosts`` the members that drive their own communication (held too)."""

    times_s: np.ndarray
    algo: np.ndarray
    names: tuple[str, ...]
    links: tuple[tuple[int, ...], ...]
    hosts: tuple[int, ...]


@dataclass(frozen=True)
class Grouping:
    """A strategy's op groups: ``op_group`` (n_ops,), and the group of each tensor's producer (n_tensors,)."""

    op_group: np.ndarray
    t_group: np.ndarray
    n_groups: int


# ----------------------------------------------------------------------------------- phases 1-3
@dataclass(frozen=True)
class Placement:
    """Where everything runs (phases 1-3): ``group_cfg`` (G,) config ids; ``op_cfg``, ``op_ps`` (ops under
    a PS config with several replicas), ``op_lay`` (n_ops,); ``aggregate`` (n_tensors,) partial results to
    aggregate; ``group_ps`` (G,) PS device of each PS group, -1 for the others."""

    group_cfg: np.ndarray
    op_cfg: np.ndarray
    op_ps: np.ndarray
    aggregate: np.ndarray
    group_ps: np.ndarray
    op_lay: np.ndarray


def assign_configs(c: Compiler, strategy: Strategy) -> np.ndarray:
    """Phase 1: each group's config id (configs compared by object first, then by value)."""
    configs = strategy.configs
    obj_ids = np.fromiter(map(id, configs), dtype=np.int64, count=len(configs))
    _, first, inv = np.unique(obj_ids, return_index=True, return_inverse=True)
    ids = np.array([c.configs.id_of(configs[i]) for i in first.tolist()], dtype=np.int64)
    c.configs.refresh()
    return ids[inv.ravel()]


def choose_ps(c: Compiler, group_cfg: np.ndarray, aggregate: np.ndarray) -> np.ndarray:
    """Phase 2: the PS device of every PS group (the given one, or the replica chosen with the plan's
    other PS groups and AllReduces already queued on each candidate's links and aggregation,
    ``heterog.compiler.ps``); -1 for the other groups."""
    cfg, grouping = c.configs, c.grouping
    out = np.full(grouping.n_groups, -1, dtype=np.int64)
    ps_groups = np.nonzero(cfg.is_ps[group_cfg])[0]
    if not len(ps_groups):
        return out
    t_cfg = group_cfg[grouping.t_group]
    gi = c.gi
    n_push = np.bincount(grouping.t_group[aggregate], minlength=grouping.n_groups).astype(np.float64)
    b_push = np.bincount(grouping.t_group[aggregate], weights=gi.t_bytes[aggregate], minlength=grouping.n_groups)
    n_pull, b_pull = c.pulled_per_group()
    amount = np.stack([n_push, b_push, n_pull, b_pull], axis=1)[ps_groups]
    # the plan's AllReduces: (total duration, resources) per (config, algorithm), configs in order of first use
    allreduces = []
    ar = aggregate & ~cfg.is_ps[t_cfg]
    used, first = np.unique(t_cfg[ar], return_index=True)
    for k in used[np.argsort(first)].tolist():
        sel = ar & (t_cfg == k)
        costs = c.allreduce_costs(cfg.configs[k].devices)
        times, algo = costs.times_s[sel], costs.algo[sel]
        for a in np.unique(algo).tolist():
            allreduces.append((float(np.sum(times[algo == a])), costs.links[a] + costs.hosts))
    ps_cfg = group_cfg[ps_groups]
    need = np.zeros((len(ps_groups), c.n_devices))
    for k in np.unique(ps_cfg).tolist():
        rows = ps_cfg == k
        need[rows] = c.parameters_needed(k)[ps_groups[rows]]
    devices = {k: cfg.configs[k].devices for k in np.unique(ps_cfg).tolist()}
    problem = problem_from_configs(ps_groups, ps_cfg, devices, cfg.fixed_ps, amount,
                                   need, allreduces, c.cost, c.paths, c.n_devices + c.n_links)
    out[ps_groups] = choose_ps_devices(problem)
    return out


def lay_out(c: Compiler, group_cfg: np.ndarray, group_ps: np.ndarray) -> np.ndarray:
    """Phase 3: each op's layout: its config's replicas at their shares (batch ops) or at the whole batch
    (duplicated ops); under PS, parameters, state and what follows aggregation on the PS alone."""
    gi, cfg = c.gi, c.configs
    op_cfg = group_cfg[c.grouping.op_group]
    op_lay = np.where(gi.has_batch, cfg.split_layout[op_cfg], cfg.dup_layout[op_cfg])
    ps_mode = cfg.is_ps[op_cfg] & ~gi.has_batch & (gi.post_agg | gi.placeholder_resident)
    op_lay[ps_mode] = group_ps[c.grouping.op_group[ps_mode]]          # layout d: device d alone
    return op_lay


def place(c: Compiler, strategy: Strategy) -> Placement:
    """Phases 1-3 for ``strategy``."""
    group_cfg = assign_configs(c, strategy)
    op_cfg = group_cfg[c.grouping.op_group]
    replicated = c.configs.n_replicas[op_cfg] > 1
    aggregate = c.gi.t_needs_agg & replicated[c.gi.t_op]
    group_ps = choose_ps(c, group_cfg, aggregate)
    c.layouts.refresh()
    return Placement(group_cfg, op_cfg, c.configs.is_ps[op_cfg], aggregate, group_ps, lay_out(c, group_cfg, group_ps))


# ----------------------------------------------------------------------------------- plan state
@dataclass
class PlanState:
    """A compiled plan and what patching it needs: its tasks in TaskGraph order, every dependency as
    emitted (``dep_task`` waits for ``dep_on``; duplicates kept, sorted by (task, on), with the emission
    unit that owns it), the placement and the providers (task ids of this plan)."""

    plan: CompiledPlan
    tasks: Tasks
    dep_task: np.ndarray
    dep_on: np.ndarray
    dep_owner: np.ndarray
    placement: Placement
    providers: Providers
    grouping: Grouping
    allreduce_algo: dict[int, str]
    aggregated: dict[int, tuple]


def aggregated_of(c: Compiler, place: Placement, tensors: np.ndarray) -> dict[int, tuple]:
    """How each of ``tensors`` (aggregated ones) is aggregated: ("ps", device) or ("allreduce", devices)."""
    ops = c.gi.t_op[tensors]
    ps = place.group_ps[c.grouping.op_group[ops]]
    lay = place.op_lay[ops]
    return {t: ("ps", p) if is_ps else ("allreduce", c.layouts.devices[k])
            for t, p, is_ps, k in zip(tensors.tolist(), ps.tolist(), place.op_ps[ops].tolist(), lay.tolist())}


def emit_all(c: Compiler, place: Placement) -> tuple[TaskBatch, Providers, dict[int, str]]:
    """Phases 4-6 over the whole graph."""
    gi = c.gi
    prov = Providers(np.zeros(gi.n_ops, dtype=np.int64), np.full((gi.n_tensors, c.n_devices), -1, dtype=np.int64),
                     np.zeros(gi.n_tensors, dtype=np.int64))
    batch = TaskBatch(0, c.order_key)
    emit_instances(c, batch, np.arange(gi.n_ops), place, prov)
    algo = emit_aggregation(c, batch, np.nonzero(place.aggregate)[0], place, prov)
    emit_connections(c, batch, np.arange(len(gi.e_src)), place, prov)
    return batch, prov, algo


def assemble(c: Compiler, strategy: Strategy, tasks: Tasks, dep_task: np.ndarray, dep_on: np.ndarray,
             dep_owner: np.ndarray, place: Placement, prov: Providers, algo: dict[int, str],
             aggregated: dict[int, tuple], *, validate: bool = True,
             csr: tuple[np.ndarray, np.ndarray] | None = None) -> PlanState:
    """Phase 7: the TaskGraph of tasks already in canonical order and dependencies sorted by (task, on)
    (duplicates allowed) in the same ids (``validate``: the TaskGraph checks every task; ``csr``: the
    dependencies without duplicates as (ptr, idx), if already at hand)."""
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
    has_mem = (tasks.alloc > 0) & (tasks.dev >= 0)
    mem_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(has_mem, out=mem_ptr[1:])
    resident = np.zeros(c.resources.n_resources)
    resident[:c.n_devices] = c.resident_bytes(place.op_lay)
    tg = c.resources.empty_copy(resident_bytes=resident)
    tg.adopt_tasks(tasks.dur, tasks.lag, c.category_codes[tasks.cat], tasks.res_ptr, tasks.res_idx, dep_ptr, dep_o,
                   mem_ptr, tasks.dev[has_mem], np.rint(tasks.alloc[has_mem]).astype(np.int64), validate=validate)
    ps_groups = np.nonzero(place.group_ps >= 0)[0]
    plan = CompiledPlan(tg=tg, task_kind=tasks.kind, task_op=tasks.op, task_device=tasks.dev,
                        op_priority=None if strategy.priorities is None else np.asarray(strategy.priorities),
                        task_prio_op=tasks.prio_op, n_devices=c.n_devices, n_links=c.n_links,
                        dep_ptr=dep_ptr, dep_idx=dep_o,
                        ps_device=dict(zip(ps_groups.tolist(), place.group_ps[ps_groups].tolist())),
                        allreduce_algo=algo, op_layout=place.op_lay, layout_devices=list(c.layouts.devices),
                        layout_shares=list(c.layouts.shares), tensor_layout=prov.layout, aggregated=aggregated)
    return PlanState(plan, tasks, dep_task, dep_on, dep_owner, place, prov, c.grouping, algo, aggregated)


def compile_all(c: Compiler, strategy: Strategy, place: Placement) -> PlanState:
    """Phases 4-7 from scratch."""
    batch, prov, algo = emit_all(c, place)
    tasks = batch.tasks()
    perm = np.argsort(tasks.order, kind="stable")
    new_of = np.empty(tasks.n + 1, dtype=np.int64)
    new_of[perm] = np.arange(tasks.n)
    new_of[-1] = -1                                   # index -1 (no provider) stays -1
    task, on, owner = batch.dependencies()
    task, on = new_of[task], new_of[on]
    s = np.lexsort((on, task))
    prov = Providers(new_of[prov.inst_start], new_of[prov.at], prov.layout)
    return assemble(c, strategy, tasks.take(perm), task[s], on[s], owner[s], place, prov, algo,
                    aggregated_of(c, place, np.nonzero(place.aggregate)[0]))


def patch_plan(c: Compiler, base: PlanState, strategy: Strategy, place: Placement, dirty: Dirty) -> PlanState:
    """The plan of ``strategy`` (placed as ``place``) from ``base``: re-emit the dirty units (found by
    ``heterog.compiler.delta.dirty_units``), keep the rest."""
    from heterog.compiler.delta import merge_kernel

    gi = c.gi
    n_base = base.tasks.n
    prov = base.providers.copy()
    batch = TaskBatch(n_base, c.order_key)
    ops = np.nonzero(dirty.ops)[0]
    emit_instances(c, batch, ops, place, prov)
    agg = np.nonzero(place.aggregate & dirty.ops[gi.t_op])[0]
    algo_new = emit_aggregation(c, batch, agg, place, prov)
    emit_connections(c, batch, np.nonzero(dirty.tensors[gi.e_tensor])[0], place, prov)

    new = batch.tasks()
    m = merge_kernel(base.tasks, (base.dep_task, base.dep_on, base.dep_owner), dirty.owners, new,
                     batch.dependencies())
    new_of = m.new_of

    prov.inst_start = new_of[prov.inst_start]
    prov.at = new_of[prov.at]
    algo = dict(base.allreduce_algo)
    aggregated = dict(base.aggregated)
    for o in ops.tolist():
        algo.pop(o, None)
    for t in np.nonzero(dirty.ops[gi.t_op] & base.placement.aggregate)[0].tolist():
        aggregated.pop(t, None)
    algo.update(algo_new)
    aggregated.update(aggregated_of(c, place, agg))
    # the TaskGraph's own checks ran on the kept tasks when they were first compiled; the new ones get
    # the checks that the compiler's construction does not guarantee
    if not np.all((new.dur >= 0) & (new.dur < np.inf) & (new.lag >= 0) & (new.lag < np.inf)):
        raise ValueError("compiler produced a task with a negative or infinite duration or lag")
    return assemble(c, strategy, m.tasks, m.dep_task, m.dep_on, m.dep_owner, place, prov, algo, aggregated,
                    validate=False, csr=(m.dep_ptr, m.dep_idx))


# ----------------------------------------------------------------------------------- compiler
class Compiler:
    """Compiles strategies for one (graph, cluster, cost model): the strategy-independent tables, the
    registries of configs and layouts, caches of costs per config, and the last ``max_bases`` plans it
    compiled, which ``compile`` patches when a strategy differs from one of them in few groups.

    Args:
        graph: the OpGraph. cluster: the Cluster. cost: a CostModel of the cluster.
        serialize_collectives: NCCL-style: all AllReduces share one stream and run one at a time.
        max_bases: plans kept to patch (0: every strategy is compiled from scratch).
        delta_fraction: patch only when the ops to re-emit are at most this share of the graph.
    """

    def __init__(self, graph, cluster, cost, *, serialize_collectives: bool = False, max_bases: int = 4,
                 delta_fraction: float = 0.5) -> None:
        self.graph, self.cluster, self.cost = graph, cluster, cost
        self.gi: GraphIndex = graph_index(graph)
        self.paths: Paths = path_table(cluster)
        self.n_devices, self.n_links = cluster.n_devices, len(cluster.links)
        self.batch_size = graph.batch_size
        self.bandwidth_Bps, self.latency_s = cluster.bandwidth_Bps, cluster.latency_s
        self.nccl_resource = self.n_devices + self.n_links if serialize_collectives else -1
        self.order_key = OrderKey(max(self.gi.n_tensors, 1), 2 * self.n_devices + 2)
        self.max_bases, self.delta_fraction = int(max_bases), float(delta_fraction)
        self.layouts = LayoutTable(self.n_devices, self.batch_size)
        self.configs = ConfigTable(self.layouts)
        self.grouping: Grouping | None = None
        self.bases: OrderedDict[int, PlanState] = OrderedDict()
        self.n_full = self.n_patched = 0           # compilations from scratch / patches (statistics)
        self._allreduce: dict[tuple[int, ...], AllReduceCosts] = {}
        self._need: dict[int, np.ndarray] = {}
        self._pulled: tuple[np.ndarray, np.ndarray] | None = None
        self._resources = None
        self.category_codes: np.ndarray | None = None       # CATEGORIES -> codes in ``resources``
        self._resident_ops = np.nonzero(self.gi.placeholder_resident)[0]

    # ---------------------------------------------------------------- caches
    def allreduce_costs(self, devices: tuple[int, ...]) -> AllReduceCosts:
        """AllReduce of every tensor over ``devices`` (cached per device tuple)."""
        hit = self._allreduce.get(devices)
        if hit is None:
            if len(self._allreduce) > 1024:
                self._allreduce.clear()
            times, algos = self.cost.allreduce_times(devices, self.gi.t_bytes)
            names, code = np.unique(np.asarray(algos), return_inverse=True)
            links = tuple(tuple(self.n_devices + x for x in self.cost.allreduce_links(devices, a))
                          for a in names.tolist())
            hit = self._allreduce[devices] = AllReduceCosts(
                np.asarray(times, dtype=np.float64), code.ravel().astype(np.int64), tuple(names.tolist()), links,
                tuple(int(d) for d in devices if self.paths.host[d]))
        return hit

    def pulled_per_group(self) -> tuple[np.ndarray, np.ndarray]:
        """(G,) tensors and bytes each group's batch ops pull from a PS."""
        if self._pulled is None:
            g, gi = self.grouping, self.gi
            self._pulled = (np.bincount(g.t_group[gi.t_pulled], minlength=g.n_groups).astype(np.float64),
                            np.bincount(g.t_group[gi.t_pulled], weights=gi.t_bytes[gi.t_pulled], minlength=g.n_groups))
        return self._pulled

    def parameters_needed(self, cfg_id: int) -> np.ndarray:
        """(G, M) estimated time by which each replica device of config ``cfg_id`` needs each group's
        pulled parameters if the group ran under it: its forward and backward work before their first
        reader (op ids are topological), at its batch share, one op after another, plus its slack (the
        busiest replica's work minus its own); 0 where the group pulls nothing (cached per config)."""
        hit = self._need.get(cfg_id)
        if hit is not None:
            return hit
        gi, g = self.gi, self.grouping
        full = self.cost.full_batch_times(self.graph)
        work = gi.is_compute & ~gi.post_agg
        need = np.zeros((g.n_groups, full.shape[1]))
        e = np.nonzero(~gi.e_value_free & gi.has_batch[gi.e_dst])[0]
        first_reader = np.full(gi.n_tensors, np.iinfo(np.int64).max)
        np.minimum.at(first_reader, gi.e_tensor[e], gi.e_dst[e])
        pul = np.nonzero(gi.t_pulled & (first_reader < gi.n_ops))[0]
        cfg = self.configs.configs[cfg_id]
        op_s = [np.where(work, full[:, d] * np.where(gi.has_batch, share / self.batch_size, 1.0), 0.0)
                for d, share in zip(cfg.devices, cfg.shares)]
        longest = max(float(t.sum()) for t in op_s)
        for d, t in zip(cfg.devices, op_s):
            before = np.cumsum(t) - t
            at = np.full(g.n_groups, np.inf)
            np.minimum.at(at, g.t_group[pul], before[first_reader[pul]] + longest - float(t.sum()))
            need[:, d] = np.where(np.isinf(at), need[:, d], at)
        if len(self._need) > 256:
            self._need.clear()
        self._need[cfg_id] = need
        return need

    def resident_bytes(self, op_lay: np.ndarray) -> np.ndarray:
        """(M,) bytes of parameters, gradients and optimizer state resident on each device."""
        ops = self._resident_ops
        lay = self.layouts
        rows, local = _ragged_rows(lay.length[op_lay[ops]])
        devs = lay.dev_flat[lay.ptr[op_lay[ops]][rows] + local]
        return np.bincount(devs, weights=self.gi.resident_bytes[ops][rows], minlength=self.n_devices)

    @property
    def resources(self):
        """A TaskGraph without tasks holding the cluster's resources (devices, links, the NCCL stream)
        and the task categories; every plan's TaskGraph starts as a copy of it."""
        if self._resources is None:
            import simulator

            tg = simulator.TaskGraph()
            for d, device in enumerate(self.cluster.devices):
                tg.add_resource(device.name, memory_capacity_bytes=float(self.cluster.memory_bytes[d]))
            for link in self.cluster.links:
                tg.add_resource(link.name)
            if self.nccl_resource >= 0:
                tg.add_resource("nccl-stream")
            self.category_codes = np.array([tg.category(x) for x in CATEGORIES], dtype=np.int64)
            self._resources = tg
        return self._resources

    def _use_grouping(self, group_of: np.ndarray) -> None:
        """Adopt the strategy's op groups; a new grouping drops what depends on the old one."""
        g = self.grouping
        if g is not None and (g.op_group is group_of or np.array_equal(g.op_group, group_of)):
            return
        n_groups = int(group_of.max()) + 1 if len(group_of) else 0
        self.grouping = Grouping(group_of, group_of[self.gi.t_op], n_groups)
        self._need.clear()
        self._pulled = None
        self.bases.clear()

    # ---------------------------------------------------------------- compile
    def compile(self, strategy: Strategy, *, check: bool = True, patch: bool = True) -> CompiledPlan:
        """The CompiledPlan of ``strategy`` (``check``: refuse a strategy made for another graph or
        cluster; ``patch``: allow patching a recent plan)."""
        return self.compile_state(strategy, check=check, patch=patch).plan

    def compile_state(self, strategy: Strategy, *, check: bool = True, patch: bool = True) -> PlanState:
        from heterog.compiler.delta import dirty_units

        if check:
            strategy.check_fits(self.graph, self.cluster)
        self._use_grouping(strategy.group_of)
        if len(self.configs) > 100_000:              # bounded registries: start afresh
            self.__init__(self.graph, self.cluster, self.cost, serialize_collectives=self.nccl_resource >= 0,
                          max_bases=self.max_bases, delta_fraction=self.delta_fraction)
            self._use_grouping(strategy.group_of)
        placement = place(self, strategy)
        state = None
        if patch and self.max_bases > 0 and self.bases:
            key, base = min(self.bases.items(),
                            key=lambda kv: np.count_nonzero(kv[1].placement.group_cfg != placement.group_cfg))
            dirty = dirty_units(self, base.placement, placement)
            if dirty is None:                         # nothing changed: the same plan
                self.bases.move_to_end(key)
                state = base
                op_priority = None if strategy.priorities is None else np.asarray(strategy.priorities)
                if op_priority is not None or base.plan.op_priority is not None:
                    state = replace(base, plan=replace(base.plan, op_priority=op_priority))
                return state
            if np.count_nonzero(dirty.ops) <= self.delta_fraction * self.gi.n_ops:
                state = patch_plan(self, base, strategy, placement, dirty)
                self.n_patched += 1
        if state is None:
            state = compile_all(self, strategy, placement)
            self.n_full += 1
        if self.max_bases > 0:
            self.bases[id(state)] = state
            while len(self.bases) > self.max_bases:
                self.bases.popitem(last=False)
        return state


def _ragged_rows(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from heterog.compiler.tasks import ragged

    return ragged(counts)


def compile_strategy(graph, cluster, strategy: Strategy, cost, *, serialize_collectives: bool = False,
                     check: bool = True) -> CompiledPlan:
    """Build the TaskGraph of ``strategy`` for one training iteration of ``graph`` on ``cluster``.

    Args:
        graph: the OpGraph. cluster: the Cluster. strategy: a Strategy for this graph and cluster.
        cost: a CostModel of the cluster (op, transfer and collective times).
        serialize_collectives: NCCL-style: all AllReduces share one stream and run one at a time.
        check: refuse a strategy made for another graph or cluster.
    """
    compiler = Compiler(graph, cluster, cost, serialize_collectives=serialize_collectives, max_bases=0)
    return compiler.compile(strategy, check=check)
