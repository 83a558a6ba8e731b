"""Phases 1-3 of a compilation: each group's config, each PS group's server and each op's layout, as a
``Placement``, the part of a strategy that the emitting phases and the patching read.

Semantics: docs/design.md, "Replication, re-layout and aggregation" and "Parameter-server choice".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.coupled import place_coupled
from heterog.compiler.index import GraphIndex
from heterog.compiler.offload import check_offloading, offloads
from heterog.compiler.ps import choose_ps_devices, problem_from_configs
from heterog.compiler.registries import ConfigTable, Grouping, LayoutTable, PSDemand
from heterog.compiler.sharded_state import StatePlacement, place_state
from heterog.compiler.shards import ShardChoice, choose_shards
from heterog.compiler.sync_stats import place_synced
from heterog.errors import StrategyError
from heterog.strategy import Strategy


@dataclass(frozen=True)
class Placement:
    """Where everything of a strategy runs: ``group_cfg`` (G,) config ids (of the compiler's
    ``ConfigTable``); ``op_cfg``, ``op_ps`` (ops under a PS config with several replicas), ``op_lay``
    (n_ops,) layout ids (of its ``LayoutTable``); ``aggregate`` (n_tensors,) partial results to aggregate;
    ``group_ps`` (G,) PS device of each PS group, -1 for the others; ``grouping`` the strategy's groups;
    ``n_micro`` its micro-batches and ``schedule`` their order; ``recompute`` (n_ops,) the ops whose
    instances are recomputed before their backward (``recomputed_ops``), None when none is; ``shards`` the
    ``ShardChoice`` of each split config of the plan, ``op_shard`` (n_ops,) the index in ``shards`` of each
    op's (-1: its group is not split beyond the batch) and ``out_split`` (n_ops,) the part of each op's
    output bytes divided among its devices; both None when no group is split. ``state`` the sharded state
    of the plan's groups (``heterog.compiler.sharded_state``), None when no group shards it. ``synced``
    (n_ops,) the batch norms whose statistics are synchronized (``heterog.compiler.sync_stats``), None when
    none is."""

    group_cfg: np.ndarray
    op_cfg: np.ndarray
    op_ps: np.ndarray
    aggregate: np.ndarray
    group_ps: np.ndarray
    op_lay: np.ndarray
    grouping: Grouping
    n_micro: int = 1
    schedule: str = "1f1b"
    recompute: np.ndarray | None = None
    shards: tuple[ShardChoice, ...] = ()
    op_shard: np.ndarray | None = None
    out_split: np.ndarray | None = None
    state: StatePlacement | None = None
    synced: np.ndarray | None = None


def assign_configs(configs: ConfigTable, strategy: Strategy) -> np.ndarray:
    """Phase 1: each group's config id in ``configs`` (configs compared by object first, then by value,
    with the strategy's micro-batches)."""
    listed = strategy.configs
    obj_ids = np.fromiter(map(id, listed), dtype=np.int64, count=len(listed))
    _, first, inv = np.unique(obj_ids, return_index=True, return_inverse=True)
    ids = np.array([configs.id_of(listed[i], strategy.micro_batches) for i in first.tolist()], dtype=np.int64)
    configs.refresh()
    return ids[inv.ravel()]


def choose_ps(ctx: CompileContext, configs: ConfigTable, demand: PSDemand, group_cfg: np.ndarray,
              aggregate: np.ndarray) -> np.ndarray:
    """Phase 2: the PS device of every PS group (the given one, or the replica chosen with the plan's
    other PS groups and AllReduces already queued on each candidate's links and aggregation,
    ``heterog.compiler.ps``); -1 for the other groups."""
    grouping, gi = demand.grouping, ctx.index
    out = np.full(grouping.n_groups, -1, dtype=np.int64)
    ps_groups = np.nonzero(configs.is_ps[group_cfg])[0]
    if not len(ps_groups):
        return out
    t_cfg = group_cfg[grouping.t_group]
    n_push = np.bincount(grouping.t_group[aggregate], minlength=grouping.n_groups).astype(np.float64)
    b_push = np.bincount(grouping.t_group[aggregate], weights=gi.t_bytes[aggregate], minlength=grouping.n_groups)
    n_pull, b_pull = demand.pulled()
    amount = np.stack([n_push, b_push, n_pull, b_pull], axis=1)[ps_groups]
    # the plan's AllReduces: (total duration, resources) per (config, algorithm), configs in order of first use
    allreduces = []
    ar = aggregate & ~configs.is_ps[t_cfg]
    used, first = np.unique(t_cfg[ar], return_index=True)
    for k in used[np.argsort(first)].tolist():
        sel = ar & (t_cfg == k)
        costs = ctx.allreduce(configs.configs[k].devices)
        times, algo = costs.times_s[sel], costs.algo[sel]
        for a in np.unique(algo).tolist():
            allreduces.append((float(np.sum(times[algo == a])), costs.links[a] + costs.hosts))
    ps_cfg = group_cfg[ps_groups]
    need = np.zeros((len(ps_groups), ctx.n_devices))
    for k in np.unique(ps_cfg).tolist():
        rows = ps_cfg == k
        need[rows] = demand.parameters_needed(configs.configs[k])[ps_groups[rows]]
    devices = {k: configs.configs[k].devices for k in np.unique(ps_cfg).tolist()}
    problem = problem_from_configs(ps_groups, ps_cfg, devices, configs.fixed_ps, amount,
                                   need, allreduces, ctx.cost, ctx.paths, ctx.n_devices + ctx.n_links)
    out[ps_groups] = choose_ps_devices(problem)
    return out


def lay_out(index: GraphIndex, configs: ConfigTable, grouping: Grouping, group_cfg: np.ndarray,
            group_ps: np.ndarray) -> np.ndarray:
    """Phase 3: each op's layout id: its config's replicas at their shares (batch ops) or at the whole batch
    (duplicated ops); under PS, parameters, state and what follows aggregation on the PS alone."""
    op_cfg = group_cfg[grouping.op_group]
    op_lay = np.where(index.has_batch, configs.split_layout[op_cfg], configs.dup_layout[op_cfg])
    ps_mode = configs.is_ps[op_cfg] & ~index.has_batch & (index.post_agg | index.placeholder_resident)
    op_lay[ps_mode] = group_ps[grouping.op_group[ps_mode]]          # layout d: device d alone
    return op_lay


def lay_out_splits(ctx: CompileContext, configs: ConfigTable, op_cfg: np.ndarray, op_lay: np.ndarray
                   ) -> tuple[tuple[ShardChoice, ...], np.ndarray | None, np.ndarray | None]:
    """Phase 3 for the ops of split configs: each op's option under its config (``choose_shards``) and its
    layout, the config's devices at the whole batch with the op's shares of its divided dimension (edits
    ``op_lay``). Returns the plan's ``shards``, ``op_shard`` and ``out_split`` (``Placement``)."""
    split_cfgs = [k for k in np.unique(op_cfg).tolist() if configs.configs[k].split is not None]
    if not split_cfgs:
        return (), None, None
    if ctx.graph.splits is None:
        raise StrategyError(f"graph {ctx.graph.name!r} has no split options (it was not captured from a module, "
                            f"or its rules failed): no group of it can be split beyond the batch")
    layouts: LayoutTable = configs.layouts
    shards: list[ShardChoice] = []
    op_shard = np.full(len(op_cfg), -1, dtype=np.int64)
    out_split = np.zeros(len(op_cfg))
    for k in split_cfgs:
        cfg = configs.configs[k]
        choice = choose_shards(ctx, cfg)
        sel = np.nonzero(op_cfg == k)[0]
        op_shard[sel] = len(shards)
        shards.append(choice)
        out_split[sel] = choice.out_split[sel]
        pos = {d: i for i, d in enumerate(cfg.devices)}
        for base in np.unique(op_lay[sel]).tolist():   # the config's batch layout (its micro-batches) or its whole
            at = sel[op_lay[sel] == base]
            devs, shares, micro = layouts.devices[base], layouts.shares[base], layouts.micro[base]
            idx = [pos[d] for d in devs]
            rows, inv = np.unique(choice.frac[at], axis=0, return_inverse=True)
            lids = np.array([layouts.add(devs, shares, micro, split=r[idx].tolist()) for r in rows], dtype=np.int64)
            op_lay[at] = lids[inv.ravel()]
    layouts.refresh()
    return tuple(shards), op_shard, out_split


def recomputed_ops(ctx: CompileContext, op_group: np.ndarray, groups: tuple[int, ...]) -> np.ndarray | None:
    """(n_ops,) the ops recomputed when ``groups`` are (docs/design.md, "Recomputation"), None if none is:
    the forward batch compute ops of those groups (before the first backward op) without partial results
    (a loss sum and batch statistics stay), of which a backward op of the same group reads an output, or
    another such op that is."""
    if not groups:
        return None
    gi, phase = ctx.index, ctx.graph.phase_index
    chosen = np.zeros(int(op_group.max()) + 1, dtype=bool)
    chosen[np.asarray(groups, dtype=np.int64)] = True
    cand = chosen[op_group] & (phase == 0) & gi.is_compute & gi.has_batch & ~gi.has_partial & ~ctx.graph.coupled
    backward = (phase > 0) & gi.is_compute        # optimizer-state placeholders sit among the forward ops
    cand[int(np.argmax(backward)) if np.any(backward) else gi.n_ops:] = False     # forward ops before any backward
    src, dst = gi.e_src, gi.e_dst
    same = gi.e_batch & cand[src] & (op_group[src] == op_group[dst])
    out = np.zeros(gi.n_ops, dtype=bool)
    out[src[same & (phase[dst] > 0)]] = True
    inner = np.nonzero(same & cand[dst])[0]
    for e in inner[np.argsort(-dst[inner], kind="stable")].tolist():   # consumers last first: needed ones known
        if out[dst[e]]:
            out[src[e]] = True
    return out if out.any() else None


def recompute_edges(ctx: CompileContext, op_group: np.ndarray, recompute: np.ndarray) -> np.ndarray:
    """(E,) the edges that read a recomputed value: from a recomputed op to a backward op or a recomputed op
    of its own group (both batch ops of one layout), not an op that couples samples (it reads the kept value
    over the whole batch, ``heterog.compiler.coupled``)."""
    gi = ctx.index
    src, dst = gi.e_src, gi.e_dst
    return gi.e_batch & recompute[src] & (op_group[src] == op_group[dst]) & \
        ((ctx.graph.phase_index[dst] > 0) | recompute[dst]) & ~ctx.graph.coupled[dst]


def first_recomputed_reads(ctx: CompileContext, op_group: np.ndarray, recompute: np.ndarray) -> np.ndarray:
    """(n_groups,) each group's first backward op that reads a recomputed value (n_ops where none does): when
    the backward reaches it, the group's recomputation runs (``heterog.compiler.recompute``)."""
    gi = ctx.index
    edges = recompute_edges(ctx, op_group, recompute)
    back = edges & (ctx.graph.phase_index[gi.e_dst] > 0)
    first = np.full(int(op_group.max()) + 1, gi.n_ops, dtype=np.int64)
    np.minimum.at(first, op_group[gi.e_dst[back]], gi.e_dst[back])
    return first


def place(ctx: CompileContext, configs: ConfigTable, demand: PSDemand, strategy: Strategy, *,
          sync: bool = False) -> Placement:
    """Phases 1-3 for ``strategy``, whose groups are ``demand.grouping``; registers its configs and
    layouts in ``configs`` (``sync``: every group's batch statistics synchronized)."""
    gi, grouping = ctx.index, demand.grouping
    group_cfg = assign_configs(configs, strategy)
    op_cfg = group_cfg[grouping.op_group]
    replicated = (configs.n_replicas[op_cfg] > 1) & ~ctx.graph.coupled     # a coupled op: one instance
    aggregate = gi.t_needs_agg & replicated[gi.t_op]
    group_ps = choose_ps(ctx, configs, demand, group_cfg, aggregate)
    configs.layouts.refresh()
    op_lay = lay_out(gi, configs, grouping, group_cfg, group_ps)
    shards, op_shard, out_split = lay_out_splits(ctx, configs, op_cfg, op_lay)
    place_coupled(ctx, configs, op_cfg, op_lay, strategy.n_micro, op_shard, out_split)
    synced, moved = place_synced(ctx, configs, strategy, op_cfg, op_lay, op_shard, out_split, everywhere=sync)
    if moved.any():                    # batch norms moved out of a grid: their partial results are summed
        spread = configs.layouts.dev_mask[op_lay].sum(axis=1) > 1
        aggregate = aggregate | (gi.t_needs_agg & (moved & spread)[gi.t_op])
    state = place_state(ctx, configs, op_cfg, aggregate)
    if offloads(state):                 # state offloaded to hosts the cluster describes
        check_offloading(ctx.cluster, strategy.configs)
    return Placement(group_cfg, op_cfg, configs.is_ps[op_cfg], aggregate, group_ps, op_lay, grouping,
                     strategy.n_micro, strategy.schedule, recomputed_ops(ctx, grouping.op_group, strategy.recompute),
                     shards, op_shard, out_split, state, synced)
