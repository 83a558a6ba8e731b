"""The extended per-group actions and their decoding: what a planner's plan holds beyond the actions of
``heterog.actions`` (model parallelism, the four data-parallel schemes, the splits over the cluster or a
server, the state actions), so that every plan a planner returns is some actions' decoding.

After the ``A = n_actions(M, splits, states)`` actions of a space, ``n_actions(M, splits, states,
extended=True)`` adds (offsets in ``heterog.actions``: ``offload_action``, ``grid_action``, ``row_action``):

  A + d              model parallelism on device d offloading its optimizer state to the host (sharded
                     state stage 0, ``heterog.baselines.fit.sharded_variants`` of one device); plain model
                     parallelism where d's server has no host
  A + M, A + M + 1   tp-grid-even, tp-grid-prop: the group's parameters divided inside each server and the
                     batch over the servers (``grid_configs``; on a cluster whose servers differ in size,
                     or of one server, the cluster-wide split tp-even or tp-prop)
  A + M + 2 + k      a row action: the group's devices and shares are its *row*, ``M`` integers (one per
                     device, 0: not one of its devices), ``k`` one of ``ROW_ACTION_NAMES`` then ``dp-row-ar``
                     keeping state choice ``k - 3`` (``heterog.actions.STATE_CHOICES``):
                       dp-row-ps, dp-row-ar  data parallelism over the devices of nonzero entries with
                                             batch shares in proportion to them (the entries are the shares
                                             themselves when they sum to the batch: exact)
                       tp-row                the parameters divided over those devices with the entries as
                                             split shares (``ParallelConfig.split_over``; one device: model
                                             parallelism on it)
                     a row of zeros is every device, even.
  A + M + 2 + R + d  ``dp-row-ps`` with its parameter server on device d (``ParallelConfig.ps_device``; R =
                     ``N_ROW_ACTIONS``), as the PS baselines pin the servers of their largest groups

A row's entries lie in ``0 .. row_levels(batch) - 1``: up to the batch (batch shares) and up to
``SPLIT_WEIGHT_TOTAL`` (split shares in thousandths). ``encode_configs`` turns a plan's configs into one action
per group and the rows (each config's action of ``heterog.actions.encode_strategy`` where there is one, an
extended action where not, checked by decoding it again); ``apply_extended`` decodes the extended actions of a
strategy decoded from the others.
"""
from __future__ import annotations

from dataclasses import replace
from functools import reduce
from math import gcd
from typing import TYPE_CHECKING, Sequence

import numpy as np

from heterog.actions import (
    GRID_ACTION_NAMES,
    ROW_ACTION_NAMES,
    ROW_STATE_BASE,
    cluster_split_action,
    decode_split_action,
    encode_strategy,
    extended_of,
    grid_action,
    n_actions,
    offload_action,
    ps_row_action,
    row_action,
    state_choice,
    state_choice_name,
    with_configs,
    with_state,
)
from heterog.errors import HeterogError, StrategyError
from heterog.sharded import ShardedState
from heterog.shares import SPLIT_WEIGHT_TOTAL, proportional_shares, split_weights
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster

OFFLOADED = ShardedState(0, (1,), "optimizer")
"""The sharded state of an offloading model-parallel action: stage 0, the optimizer state on the host."""


def row_levels(batch_size: int) -> int:
    """The values a row entry takes, ``0 .. row_levels - 1``: batch shares up to the batch, split shares up to
    ``SPLIT_WEIGHT_TOTAL``."""
    return max(int(batch_size), SPLIT_WEIGHT_TOTAL) + 1


def grid_configs(cluster: "Cluster", batch_size: int) -> list[tuple[str, ParallelConfig]]:
    """2-D splits over a cluster of several servers of the same number (at least two) of devices, as
    Megatron lays out tensor and data parallelism: each server a group dividing the ops beyond the batch
    among its devices, the batch divided over the servers in proportion to their speed. ``tp-grid-even``:
    even shares inside a group, a group's speed that of its slowest device times its devices;
    ``tp-grid-prop``: shares in proportion to the mean peak FLOP/s of the groups' devices at each position,
    a group's speed the sum of its devices'. Empty on other clusters (or a batch smaller than the servers)."""
    groups = [tuple(int(d) for d in s.devices) for s in cluster.servers]
    if len(groups) < 2 or len({len(g) for g in groups}) != 1 or len(groups[0]) < 2 or batch_size < len(groups):
        return []
    power = np.asarray(cluster.power, dtype=np.float64)
    at = power[np.array(groups)]                                        # (groups, positions)
    out = []
    for name, weights, speed in ((GRID_ACTION_NAMES[0], [1] * at.shape[1], at.min(axis=1) * at.shape[1]),
                                 (GRID_ACTION_NAMES[1], split_weights(at.mean(axis=0)), at.sum(axis=1))):
        shares = [max(1, s) for s in proportional_shares(batch_size, speed)]
        shares[int(np.argmax(shares))] -= sum(shares) - batch_size
        out.append((name, ParallelConfig.split_grid(groups, weights, shares)))
    return out


def decode_row(kind: int, row: Sequence[int] | np.ndarray, cluster: "Cluster", batch_size: int) -> ParallelConfig:
    """The config of row action ``kind`` (``heterog.actions.row_action``) with the group's ``row`` (``M``
    entries in ``0 .. row_levels(batch_size) - 1``)."""
    m = cluster.n_devices
    r = np.asarray(row, dtype=np.int64)
    if r.shape != (m,) or (r < 0).any() or (r >= row_levels(batch_size)).any():
        raise StrategyError(f"a row has {m} entries in 0..{row_levels(batch_size) - 1}, got {r.tolist()}")
    devs = np.flatnonzero(r).tolist()
    weights = r[devs].tolist()
    if not devs:
        devs, weights = list(range(m)), [1] * m
    k = int(kind)
    if k == ROW_ACTION_NAMES.index("tp-row"):
        if len(devs) == 1:
            return ParallelConfig.single(devs[0], batch_size)
        return ParallelConfig.split_over(devs, weights, batch_size)
    shares = proportional_shares(batch_size, weights)
    cfg = ParallelConfig.of(list(zip(devs, shares)), sync="ps" if k == 0 else "allreduce")
    if k >= len(ROW_ACTION_NAMES):
        return with_state(cfg, k - len(ROW_ACTION_NAMES), cluster)
    return cfg


def decode_extended(action: int, row: Sequence[int] | np.ndarray, cluster: "Cluster", batch_size: int,
                    splits: bool = False, states: bool = False) -> ParallelConfig:
    """The config of an extended action (``heterog.actions.extended_of``) of the space of ``splits`` and
    ``states``; ``row`` is read by the row actions only."""
    m = cluster.n_devices
    found = extended_of(action, m, splits, states)
    if found is None:
        raise StrategyError(f"action {int(action)} is not an extended action on {m} devices")
    family, k = found
    if family == "offload":
        if cluster.servers[int(cluster.server_of[k])].host is None:
            return ParallelConfig.single(k, batch_size)
        return replace(ParallelConfig.single(k, batch_size), sharded=OFFLOADED)
    if family == "grid":
        grids = grid_configs(cluster, batch_size)
        if grids:
            return grids[k][1]
        return decode_split_action(cluster_split_action(m, bool(k)), cluster, batch_size)
    if family == "ps":
        return replace(decode_row(ROW_ACTION_NAMES.index("dp-row-ps"), row, cluster, batch_size), ps_device=k)
    return decode_row(k, row, cluster, batch_size)


def extended_action_name(action: int, n_devices: int, splits: bool = False, states: bool = False) -> str:
    """``mp-offload:<d>``, ``tp-grid-even``, ``tp-grid-prop``, ``dp-row-ps``, ``dp-row-ar``, ``tp-row``,
    ``dp-row-ar:<state choice>`` (``state_choice_name``) or ``dp-row-ps@<d>``."""
    found = extended_of(action, n_devices, splits, states)
    if found is None:
        raise StrategyError(f"action {int(action)} is not an extended action on {int(n_devices)} devices")
    family, k = found
    if family == "offload":
        return f"mp-offload:{k}"
    if family == "grid":
        return GRID_ACTION_NAMES[k]
    if family == "ps":
        return f"{ROW_ACTION_NAMES[0]}@{k}"
    if k < len(ROW_ACTION_NAMES):
        return ROW_ACTION_NAMES[k]
    return f"{ROW_ACTION_NAMES[ROW_STATE_BASE]}:{state_choice_name(k - len(ROW_ACTION_NAMES))}"


def apply_extended(strategy: Strategy, actions: Sequence[int] | np.ndarray, rows: np.ndarray, cluster: "Cluster",
                   splits: bool = False, states: bool = False) -> Strategy:
    """``strategy`` (decoded from the other actions) with each group of an extended action given its config
    (``decode_extended``, the group's row of ``rows`` ``(G, M)``); groups of the same action and row share
    one config. ``meta["sharded"]`` is set again where any group keeps sharded state."""
    codes = np.asarray(actions, dtype=np.int64)
    first = n_actions(cluster.n_devices, splits, states)
    made: dict[tuple[int, tuple[int, ...]], ParallelConfig] = {}
    configs = list(strategy.configs)
    for g in np.flatnonzero(codes >= first).tolist():
        a = int(codes[g])
        found = extended_of(a, cluster.n_devices, splits, states)
        key = (a, tuple(int(x) for x in rows[g]) if found is not None and found[0] in ("row", "ps") else ())
        if key not in made:
            made[key] = decode_extended(a, rows[g], cluster, strategy.batch_size, splits, states)
        configs[g] = made[key]
    return with_configs(strategy, configs)


def regroup(strategy: Strategy, group_of: np.ndarray) -> Strategy:
    """``strategy`` over another grouping of the same ops (``group_of``, e.g. an Evaluator's, whose groups a
    plan action has one entry each for): each group takes the config its ops have (one object per distinct
    config) and is recomputed where its ops are. StrategyError where a group's ops have different configs, or
    some are recomputed and some not. ``strategy`` itself where its grouping is ``group_of``."""
    new = np.asarray(group_of, dtype=np.int64)
    if np.array_equal(new, strategy.group_of):
        return strategy
    if new.shape != strategy.group_of.shape:
        raise StrategyError(f"a grouping of {len(new)} ops for a strategy of {len(strategy.group_of)} ops")
    n = int(new.max()) + 1 if len(new) else 0
    configs: list[ParallelConfig | None] = [None] * n
    first_op = np.full(n, -1, dtype=np.int64)
    recomputed = set(strategy.recompute)
    rec: list[bool | None] = [None] * n
    for op, (g, old) in enumerate(zip(new.tolist(), strategy.group_of.tolist())):
        cfg, r = strategy.configs[old], old in recomputed
        if configs[g] is None:
            configs[g], rec[g], first_op[g] = cfg, r, op
        elif configs[g] != cfg or rec[g] != r:
            raise StrategyError(f"group {g} holds ops {int(first_op[g])} and {op}, which the plan "
                                f"{'recomputes differently' if configs[g] == cfg else 'places differently'}")
    if any(c is None for c in configs):
        raise StrategyError(f"grouping with empty groups {[g for g, c in enumerate(configs) if c is None][:5]}")
    return replace(strategy, group_of=new, configs=[c for c in configs if c is not None],
                   recompute=tuple(g for g in range(n) if rec[g]), meta=dict(strategy.meta))


def _row_of(values: Sequence[int], devices: Sequence[int], n_devices: int, batch_size: int) -> np.ndarray | None:
    """``values`` scattered over ``devices`` in a row of ``n_devices`` entries, in lowest terms where they
    exceed the row's levels (None where they still do)."""
    v = [int(x) for x in values]
    if max(v) >= row_levels(batch_size):
        d = reduce(gcd, v)
        v = [x // d for x in v]
        if max(v) >= row_levels(batch_size):
            return None
    row = np.zeros(n_devices, dtype=np.int64)
    row[list(devices)] = v
    return row


def _extended_candidates(cfg: ParallelConfig, cluster: "Cluster", batch_size: int, splits: bool,
                         states: bool) -> list[tuple[int, np.ndarray]]:
    """The extended actions (and rows) that may decode into ``cfg``, most specific first."""
    m = cluster.n_devices
    zero = np.zeros(m, dtype=np.int64)
    out: list[tuple[int, np.ndarray]] = []
    if len(cfg.devices) == 1 and cfg.sharded is not None and cfg.split is None:
        out.append((offload_action(m, cfg.devices[0], splits, states), zero))
    if cfg.grid > 1:
        out += [(grid_action(m, bool(p), splits, states), zero) for p in range(len(GRID_ACTION_NAMES))]
    elif cfg.split is not None:
        row = _row_of(cfg.split_shares, cfg.devices, m, batch_size)
        if row is not None:
            out.append((row_action(m, ROW_ACTION_NAMES.index("tp-row"), splits, states), row))
    else:
        row = _row_of(cfg.shares, cfg.devices, m, batch_size)
        if row is not None:
            if cfg.sync == "ps" and cfg.ps_device is not None:
                out.append((ps_row_action(m, int(cfg.ps_device), splits, states), row))
                return out
            kind = 0 if cfg.sync == "ps" else 1
            if cfg.sharded is not None and len(cfg.devices) > 1:
                try:
                    choice = state_choice(cfg, cluster)
                except StrategyError:
                    choice = None
                if choice is None:
                    return out
                kind = len(ROW_ACTION_NAMES) + choice
            out.append((row_action(m, kind, splits, states), row))
    return out


def encode_configs(strategy: Strategy, cluster: "Cluster", splits: bool = False, states: bool = False,
                   extended: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One action per group and the rows ``(G, M)`` that decode into ``strategy``'s configs: a config's
    action of ``heterog.actions.encode_strategy`` in the space of ``splits`` and ``states`` where it has one,
    else (``extended``) an extended action whose decoding equals it. StrategyError names the first group
    whose config none gives. Shapes: -> ``(G,)``, ``(G, M)``."""
    m = cluster.n_devices
    actions = np.empty(strategy.n_groups, dtype=np.int64)
    rows = np.zeros((strategy.n_groups, m), dtype=np.int64)
    found: dict[ParallelConfig, tuple[int, np.ndarray]] = {}      # configs equal in value encode alike
    for g, cfg in enumerate(strategy.configs):
        if cfg not in found:
            found[cfg] = _encode_config(g, cfg, strategy, cluster, splits, states, extended)
        actions[g], rows[g] = found[cfg]
    return actions, rows


def _encode_config(g: int, cfg: ParallelConfig, strategy: Strategy, cluster: "Cluster", splits: bool, states: bool,
                   extended: bool) -> tuple[int, np.ndarray]:
    m = cluster.n_devices
    one = replace(strategy, configs=[cfg], group_of=np.zeros(1, dtype=np.int64), recompute=(), priorities=None,
                  meta={})
    try:
        return int(encode_strategy(one, cluster, splits, states)[0]), np.zeros(m, dtype=np.int64)
    except StrategyError as exc:
        if not extended:
            raise StrategyError(f"group {g}'s config: {exc}") from None
    for action, row in _extended_candidates(cfg, cluster, strategy.batch_size, splits, states):
        try:
            if decode_extended(action, row, cluster, strategy.batch_size, splits, states) == cfg:
                return action, row
        except HeterogError:
            continue
    raise StrategyError(f"group {g}'s config ({cfg.to_dict()}) is no action's decoding on {m} devices, extended "
                        f"actions included")


__all__ = ["OFFLOADED", "apply_extended", "decode_extended", "decode_row", "encode_configs", "extended_action_name",
           "grid_configs", "regroup", "row_levels"]
