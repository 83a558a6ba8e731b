"""The per-group action: the integer a planner or the agent picks for each group of ops, its offsets,
names and its one decoding into a ParallelConfig (and of one action per group into a Strategy).

Action encoding (M = number of GPUs), one action per group:
  0..M-1        model parallelism: the whole group on that device
  M             DP-even-PS          M+1  DP-even-AR
  M+2           DP-proportional-PS  M+3  DP-proportional-AR
and, in the action space with splits beyond the batch (``n_actions(M, splits=True)``, 3 M + 6 actions):
  M+4           tp-even: the group's parameters divided evenly over all devices
  M+5           tp-prop: ... in proportion to device speed
  M+6+d         tp-even over the devices of device d's server (d = 0..M-1)
  2M+6+d        tp-prop over the devices of device d's server
and, in an action space with state actions (``n_actions(M, splits, states=True)``), 2 S more after those
(S = ``N_STATE_CHOICES`` = 21), the AllReduce data-parallel actions keeping sharded state:
  A + s         DP-even-AR keeping state choice s        (A = ``n_actions(M, splits)``, s = 0..S-1)
  A + S + s     DP-proportional-AR keeping state choice s
where choice s is ``STATE_CHOICES[s]`` = (stage, shard sizing, offload): offload "none" then "optimizer",
within each stage 1, 2, 3, within each shards even, by memory, by speed (``heterog.sharded.SHARD_BY``), so
s = 9 o + 3 (stage - 1) + by; then stage 3 with the parameters offloaded too, s = 18 + by. A config with
fewer than two replicas keeps no sharded state (the state choice is dropped: the plain AllReduce config);
one with a replica on a server without a host keeps its
optimizer state on the GPUs (the offload is dropped). ``state_action``, ``state_of``, ``decode_state_action``,
``with_state``, ``state_choice`` and ``encode_strategy`` (a plan's configs back to actions) read this table.
The offsets are stated once here (``N_DP_ACTIONS``, ``N_CLUSTER_SPLIT_ACTIONS``, ``cluster_split_action``,
``server_split_action``, ``device_action_blocks``); the env (``envs.actions``) and the policy's heads
(``agents.networks``) read them. ``decode_action`` turns an action of the first M + 4 into a ParallelConfig,
``decode_split_action`` one of the split actions; ``strategy_from_actions`` decodes a whole plan.
The core uses this encoding too (the Evaluator, local search, the comparison's tables), so it lives in
``heterog``, below ``envs``.
"""
from __future__ import annotations

from dataclasses import replace
from functools import reduce
from math import gcd
from typing import TYPE_CHECKING, Sequence

import numpy as np

from heterog.errors import StrategyError
from heterog.sharded import SHARD_BY, ShardedState, state_weights
from heterog.shares import Floats, even_shares, proportional_shares, split_weights
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph

N_DP_ACTIONS = 4
"""The data-parallel actions ``M .. M+3``, named by ``DP_ACTION_NAMES``."""
DP_ACTION_NAMES = ("dp-even-ps", "dp-even-ar", "dp-prop-ps", "dp-prop-ar")
N_CLUSTER_SPLIT_ACTIONS = 2
"""The split actions over the whole cluster (``M+4``, ``M+5``), named by ``SPLIT_ACTION_NAMES``; then one
pointer per device for its server, even and proportional."""
SPLIT_ACTION_NAMES = ("tp-even", "tp-prop")
STATE_OFFLOADS = ("none", "optimizer")
STATE_CHOICES: tuple[tuple[int, str, str], ...] = tuple(
    (stage, by, offload) for offload in STATE_OFFLOADS for stage in (1, 2, 3) for by in SHARD_BY) + tuple(
    (3, by, "parameters") for by in SHARD_BY)
"""The sharded-state choices of the state actions, (ZeRO stage, shard sizing, offload), in their order."""
N_STATE_CHOICES = len(STATE_CHOICES)
STATE_BASES = (1, 3)
"""The data-parallel actions (offsets from ``M``: DP-even-AR, DP-proportional-AR) that have state actions."""


N_GRID_ACTIONS = 2
"""The grid actions of the extended space (``grid_action``), named by ``GRID_ACTION_NAMES``."""
GRID_ACTION_NAMES = ("tp-grid-even", "tp-grid-prop")
ROW_ACTION_NAMES = ("dp-row-ps", "dp-row-ar", "tp-row")
"""The row actions of the extended space (``row_action``) before the AllReduce row actions keeping state."""
N_ROW_ACTIONS = len(ROW_ACTION_NAMES) + N_STATE_CHOICES
ROW_STATE_BASE = 1
"""The row action (``dp-row-ar``) whose config the row actions keeping state choice ``s`` keep it on."""


def n_actions(n_devices: int, splits: bool = False, states: bool = False, extended: bool = False) -> int:
    """Actions per group on ``n_devices`` devices: ``M + 4``, or with ``splits`` beyond the batch
    ``3 M + 6`` (the two cluster-wide splits, then an even and a proportional split over each device's
    server); with ``states`` ``2 N_STATE_CHOICES`` more (the AllReduce actions keeping sharded state); with
    ``extended`` ``2 M + N_GRID_ACTIONS + N_ROW_ACTIONS`` more after those (``heterog.extended_actions``)."""
    m = int(n_devices)
    return (m + N_DP_ACTIONS + ((N_CLUSTER_SPLIT_ACTIONS + 2 * m) if splits else 0)
            + (len(STATE_BASES) * N_STATE_CHOICES if states else 0)
            + ((2 * m + N_GRID_ACTIONS + N_ROW_ACTIONS) if extended else 0))


def devices_of(n_actions_: int, splits: bool = False, states: bool = False, extended: bool = False) -> int:
    """``M``, the devices of an action space of ``n_actions_`` actions (the inverse of ``n_actions``)."""
    extra = (int(n_actions_) - N_DP_ACTIONS - (N_CLUSTER_SPLIT_ACTIONS if splits else 0)
             - (len(STATE_BASES) * N_STATE_CHOICES if states else 0)
             - ((N_GRID_ACTIONS + N_ROW_ACTIONS) if extended else 0))
    return extra // (1 + (2 if splits else 0) + (2 if extended else 0))


def offload_action(n_devices: int, device: int, splits: bool = False, states: bool = False) -> int:
    """``A + d`` (``A = n_actions(M, splits, states)``): model parallelism on device ``d`` offloading its
    optimizer state to the host."""
    return n_actions(n_devices, splits, states) + int(device)


def grid_action(n_devices: int, proportional: bool = False, splits: bool = False, states: bool = False) -> int:
    """``A + M`` (tp-grid-even) or ``A + M + 1`` (tp-grid-prop): the split over the grid of the servers."""
    return n_actions(n_devices, splits, states) + int(n_devices) + int(bool(proportional))


def row_action(n_devices: int, kind: int, splits: bool = False, states: bool = False) -> int:
    """``A + M + N_GRID_ACTIONS + k``: row action ``k`` (``ROW_ACTION_NAMES``, then ``dp-row-ar`` keeping
    state choice ``k - len(ROW_ACTION_NAMES)``), whose devices and shares are the group's row."""
    if not 0 <= int(kind) < N_ROW_ACTIONS:
        raise StrategyError(f"row action {int(kind)} is out of range 0..{N_ROW_ACTIONS - 1}")
    return n_actions(n_devices, splits, states) + int(n_devices) + N_GRID_ACTIONS + int(kind)


def ps_row_action(n_devices: int, device: int, splits: bool = False, states: bool = False) -> int:
    """``A + M + N_GRID_ACTIONS + N_ROW_ACTIONS + d``: ``dp-row-ps`` with its parameter server on device ``d``
    (``ParallelConfig.ps_device``), the devices and shares the group's row."""
    return n_actions(n_devices, splits, states) + int(n_devices) + N_GRID_ACTIONS + N_ROW_ACTIONS + int(device)


def extended_of(action: int, n_devices: int, splits: bool = False, states: bool = False) -> tuple[str, int] | None:
    """``("offload", d)``, ``("grid", proportional)``, ``("row", k)`` or ``("ps", d)`` for an action of the
    extended families of the space of ``splits`` and ``states``; None for an action before them
    (StrategyError past them)."""
    m, a = int(n_devices), int(action)
    k = a - n_actions(m, splits, states)
    if k < 0:
        return None
    if k < m:
        return "offload", k
    if k < m + N_GRID_ACTIONS:
        return "grid", k - m
    if k < m + N_GRID_ACTIONS + N_ROW_ACTIONS:
        return "row", k - m - N_GRID_ACTIONS
    if k < 2 * m + N_GRID_ACTIONS + N_ROW_ACTIONS:
        return "ps", k - m - N_GRID_ACTIONS - N_ROW_ACTIONS
    raise StrategyError(f"action {a} is out of range for {m} devices with extended actions "
                        f"(valid: 0..{n_actions(m, splits, states, extended=True) - 1})")


def state_choice_name(choice: int) -> str:
    """``s<stage>-<sizing>``, with ``+offload`` where the optimizer state is offloaded, ``+offload-params``
    where the parameter shards are too."""
    stage, by, offload = STATE_CHOICES[int(choice)]
    return f"s{stage}-{by}" + {"none": "", "optimizer": "+offload", "parameters": "+offload-params"}[offload]


def state_action(n_devices: int, base: int, choice: int, splits: bool = False) -> int:
    """The state action of AllReduce data-parallel action ``base`` (``M + 1`` or ``M + 3``) keeping state
    choice ``choice`` (an index into ``STATE_CHOICES``), in the action space of ``splits``."""
    m = int(n_devices)
    k = int(base) - m
    if k not in STATE_BASES or not 0 <= int(choice) < N_STATE_CHOICES:
        raise StrategyError(f"no state action for action {int(base)} with state choice {int(choice)} on {m} devices "
                            f"(bases {[m + b for b in STATE_BASES]}, choices 0..{N_STATE_CHOICES - 1})")
    return n_actions(m, splits) + STATE_BASES.index(k) * N_STATE_CHOICES + int(choice)


def state_of(action: int, n_devices: int, splits: bool = False) -> tuple[int, int] | None:
    """``(base action, state choice)`` of a state action of the action space of ``splits``; None for an
    action before them (StrategyError past them)."""
    m, a = int(n_devices), int(action)
    k = a - n_actions(m, splits)
    if k < 0:
        return None
    if k >= len(STATE_BASES) * N_STATE_CHOICES:
        raise StrategyError(f"action {a} is out of range for {m} devices with state actions "
                            f"(valid: 0..{n_actions(m, splits, states=True) - 1})")
    return m + STATE_BASES[k // N_STATE_CHOICES], k % N_STATE_CHOICES


def base_actions(actions: Sequence[int] | np.ndarray, n_devices: int, splits: bool = False
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Actions of the space with state actions split into their plain actions and state choices (-1: none).
    Shapes: ``(..., G)`` -> two ``(..., G)``."""
    a = np.asarray(actions, dtype=np.int64)
    first = n_actions(n_devices, splits)
    k = a - first
    if (k >= len(STATE_BASES) * N_STATE_CHOICES).any():
        raise StrategyError(f"action {int(a.max())} is out of range for {int(n_devices)} devices with state actions "
                            f"(valid: 0..{n_actions(n_devices, splits, states=True) - 1})")
    held = k >= 0
    bases = np.asarray([int(n_devices) + b for b in STATE_BASES], dtype=np.int64)
    plain = np.where(held, bases[np.clip(k, 0, None) // N_STATE_CHOICES], a)
    return plain, np.where(held, k % N_STATE_CHOICES, -1)


def holds_state(cfg: ParallelConfig) -> bool:
    """Whether ``cfg`` can keep sharded state: an AllReduce data-parallel config of 2+ replicas, unsplit."""
    return cfg.sync == "allreduce" and cfg.split is None and len(cfg.devices) > 1


def _lowest_terms(weights: tuple[int, ...]) -> tuple[int, ...]:
    d = reduce(gcd, weights)
    return tuple(w // d for w in weights)


def can_offload(devices: Sequence[int], cluster: "Cluster") -> bool:
    """Whether every one of ``devices`` has a host to offload state to (its server's ``host:`` entry)."""
    return all(cluster.servers[int(cluster.server_of[int(d)])].host is not None for d in devices)


def with_state(cfg: ParallelConfig, choice: int, cluster: "Cluster") -> ParallelConfig:
    """``cfg`` keeping state choice ``choice`` (shard weights in lowest terms), or ``cfg`` as it is where it
    cannot (``holds_state``); a choice that offloads keeps its state on the GPUs where a replica's server
    has no host (``can_offload``)."""
    if not holds_state(cfg):
        return cfg
    stage, by, offload = STATE_CHOICES[int(choice)]
    if offload != "none" and not can_offload(cfg.devices, cluster):
        offload = "none"
    weights = _lowest_terms(state_weights(by, cfg.devices, cluster))
    return replace(cfg, sharded=ShardedState(stage, weights, offload))


def state_choice(cfg: ParallelConfig, cluster: "Cluster") -> int | None:
    """The state choice ``cfg``'s sharded state is (the first of ``STATE_CHOICES`` whose shards are the same
    fractions), None where it keeps none; StrategyError where no choice gives it."""
    held = cfg.sharded
    if held is None:
        return None
    if holds_state(cfg):
        for s, (stage, by, offload) in enumerate(STATE_CHOICES):
            if (stage, offload) == (held.stage, held.offload) and np.allclose(
                    ShardedState(stage, state_weights(by, cfg.devices, cluster), offload).fractions, held.fractions):
                return s
    raise StrategyError(f"sharded state {held.to_dict()} of a {cfg.sync} config on devices {list(cfg.devices)} "
                        f"is none of the state actions' choices")


def decode_state_action(action: int, cluster: "Cluster", batch_size: int, splits: bool = False,
                        weights: Floats | None = None) -> ParallelConfig:
    """The decoding of a state action (``state_of``): its AllReduce config (``decode_action``) keeping the
    chosen sharded state (``with_state``)."""
    found = state_of(action, cluster.n_devices, splits)
    if found is None:
        raise StrategyError(f"action {int(action)} is not a state action on {cluster.n_devices} devices")
    base, choice = found
    return with_state(decode_action(base, cluster.n_devices, batch_size, cluster.power, weights), choice, cluster)


def cluster_split_action(n_devices: int, proportional: bool = False) -> int:
    """``M + 4`` (tp-even) or ``M + 5`` (tp-prop): the split over all devices."""
    return int(n_devices) + N_DP_ACTIONS + int(bool(proportional))


def server_split_action(n_devices: int, device: int, proportional: bool = False) -> int:
    """``M + 6 + d`` (tp-even) or ``2 M + 6 + d`` (tp-prop): the split over device ``d``'s server."""
    m = int(n_devices)
    return m + N_DP_ACTIONS + N_CLUSTER_SPLIT_ACTIONS + (m if proportional else 0) + int(device)


def device_action_blocks(n_devices: int, splits: bool = False, states: bool = False,
                         extended: bool = False) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of actions with one action per device: model parallelism and, with
    ``splits``, the even and the proportional split over each device's server; with ``extended`` the
    offloading model parallelism (``offload_action``) and the parameter-server rows (``ps_row_action``)."""
    m = int(n_devices)
    blocks = [(0, m)]
    if splits:
        blocks += [(server_split_action(m, 0, p), server_split_action(m, m, p)) for p in (False, True)]
    if extended:
        blocks.append((offload_action(m, 0, splits, states), offload_action(m, m, splits, states)))
        blocks.append((ps_row_action(m, 0, splits, states), ps_row_action(m, m, splits, states)))
    return blocks


def action_name(action: int, n_devices: int) -> str:
    """``mp:<device>``, a DP action's name, or ``split`` for any action past them (the split actions of
    the agent's action space, ``decode_split_action``, and those local search offers,
    ``heterog.baselines.chains.split_action_configs``)."""
    if 0 <= action < n_devices:
        return f"mp:{action}"
    if action >= cluster_split_action(n_devices):
        return "split"
    return DP_ACTION_NAMES[action - n_devices]


def split_action_name(action: int, n_devices: int) -> str:
    """The name of an action of the action space with splits (``n_actions(M, splits=True)``): the names
    of ``action_name`` for the first M + 4, then ``tp-even``, ``tp-prop``, ``tp-even:server-of-<d>`` and
    ``tp-prop:server-of-<d>``."""
    m = int(n_devices)
    k = int(action) - cluster_split_action(m)
    if k < 0:
        return action_name(action, m)
    if k < N_CLUSTER_SPLIT_ACTIONS:
        return SPLIT_ACTION_NAMES[k]
    k -= N_CLUSTER_SPLIT_ACTIONS
    return f"{SPLIT_ACTION_NAMES[k // m]}:server-of-{k % m}"


def decode_action(action: int, n_devices: int, batch_size: int, power: Floats,
                  weights: Floats | None = None) -> ParallelConfig:
    """The one decoding of an (M+4)-way action into a ParallelConfig.

    ``power`` is each device's peak FLOP/s (proportional shares follow it); ``weights`` overrides it,
    e.g. the group's own speed on each device when shares follow each op's speed.
    """
    a = int(action)
    m = int(n_devices)
    if not 0 <= a < n_actions(m):
        raise StrategyError(f"action {a} is out of range for {m} devices (valid: 0..{n_actions(m) - 1})")
    if a < m:
        return ParallelConfig.single(a, batch_size)
    k = a - m
    sync = "ps" if k in (0, 2) else "allreduce"
    if k < 2:
        shares = even_shares(batch_size, m)
    else:
        shares = proportional_shares(batch_size, weights if weights is not None else power)
    return ParallelConfig.of(list(zip(range(m), shares)), sync=sync)


def decode_split_action(action: int, cluster: "Cluster", batch_size: int,
                        weights: Floats | None = None) -> ParallelConfig:
    """The decoding of a split action (``M + 4 <= action < 3 M + 6``, the module docstring's table) into a
    ParallelConfig that divides the group's parameters among the devices of the whole cluster or of one
    server (``ParallelConfig.split_over``). Even shares are equal weights; proportional ones follow
    ``weights`` (one per device of the cluster, e.g. the group's own speed on each device) or else peak
    FLOP/s (``heterog.shares.split_weights``). A server of one device is model parallelism on it."""
    m = cluster.n_devices
    a = int(action)
    first = cluster_split_action(m)
    k = a - first
    if not 0 <= k < n_actions(m, splits=True) - first:
        raise StrategyError(f"split action {a} is out of range for {m} devices "
                            f"(valid: {first}..{n_actions(m, splits=True) - 1})")
    if k < N_CLUSTER_SPLIT_ACTIONS:
        devs, proportional = list(range(m)), k == 1
    else:
        k -= N_CLUSTER_SPLIT_ACTIONS
        proportional, device = k >= m, k % m
        devs = [int(d) for d in cluster.servers[int(cluster.server_of[device])].devices]
    if len(devs) == 1:
        return ParallelConfig.single(devs[0], batch_size)
    speed = np.asarray(weights if weights is not None else cluster.power, dtype=np.float64)[devs]
    return ParallelConfig.split_over(devs, split_weights(speed) if proportional else [1] * len(devs), batch_size)


def apply_states(strategy: Strategy, choices: Sequence[int] | np.ndarray, cluster: "Cluster") -> Strategy:
    """``strategy`` with each group of state choice ``choices[g] >= 0`` keeping it (``with_state``; -1: as it
    is); groups that shared a config share its variant. ``meta["sharded"]`` lists each group's sharded state
    (None or ``ShardedState.to_dict()``) where any group keeps some."""
    made: dict[tuple[int, int], ParallelConfig] = {}
    configs = list(strategy.configs)
    for g, s in enumerate(np.asarray(choices, dtype=np.int64).tolist()):
        if s >= 0:
            key = (id(configs[g]), s)
            if key not in made:
                made[key] = with_state(configs[g], s, cluster)
            configs[g] = made[key]
    return with_configs(strategy, configs)


def with_configs(strategy: Strategy, configs: list[ParallelConfig]) -> Strategy:
    """``strategy`` with ``configs``, its ``meta["sharded"]`` set again where any group keeps sharded state."""
    meta = dict(strategy.meta)
    meta.pop("sharded", None)
    if any(c.sharded is not None for c in configs):
        meta["sharded"] = [None if c.sharded is None else c.sharded.to_dict() for c in configs]
    return replace(strategy, configs=configs, meta=meta)


def state_action_name(action: int, n_devices: int, splits: bool = False) -> str:
    """The name of an action of the space with state actions: ``split_action_name``'s (``action_name``'s
    without ``splits``) before them, ``<base>:<state choice>`` for a state action (``dp-even-ar:s3-memory``)."""
    found = state_of(action, n_devices, splits)
    if found is None:
        return split_action_name(action, n_devices) if splits else action_name(action, n_devices)
    base, choice = found
    return f"{DP_ACTION_NAMES[base - int(n_devices)]}:{state_choice_name(choice)}"


def strategy_from_actions(actions: Sequence[int] | np.ndarray, group_of: np.ndarray, graph: "OpGraph",
                          cluster: "Cluster", method: str = "", weights: np.ndarray | None = None,
                          states: bool = False, splits: bool = False) -> Strategy:
    """Decode one action per group (of the M + 4, or split actions where the graph has split options)
    into a Strategy. ``weights`` (G, M) optionally gives per-group device speeds for proportional shares
    (otherwise device peak FLOP/s). ``states``: the actions are of the space with state actions after those
    of ``splits`` (the state actions decode as ``decode_state_action``; ``meta["sharded"]`` then lists each
    group's sharded state, None or ``ShardedState.to_dict()``, where any group keeps some)."""
    if states:
        plain, choices = base_actions(actions, cluster.n_devices, splits)
        if not splits and len(plain) and plain.max() >= cluster_split_action(cluster.n_devices):
            raise StrategyError(f"action {int(plain.max())} is a split action, which this space without splits lacks")
        out = apply_states(strategy_from_actions(plain, group_of, graph, cluster, method, weights), choices, cluster)
        out.meta["actions"] = np.asarray(actions, dtype=np.int64).tolist()
        return out
    codes = np.asarray(actions, dtype=np.int64)
    n_groups = int(group_of.max()) + 1 if len(group_of) else 0
    if codes.shape != (n_groups,):
        raise StrategyError(f"need one action per group: got {codes.shape[0] if codes.ndim else 0} actions "
                            f"for {n_groups} groups")
    m = cluster.n_devices
    if len(codes) and codes.max() >= cluster_split_action(m) and graph.splits is None:
        raise StrategyError(f"split action {int(codes.max())} on graph {graph.name!r}, which was captured without "
                            f"the per-op split options (recapture it)")

    def decode(a: int, w: Floats | None) -> ParallelConfig:
        if a >= cluster_split_action(m):
            return decode_split_action(a, cluster, graph.batch_size, w)
        return decode_action(a, m, graph.batch_size, cluster.power, w)

    cache: dict[int, ParallelConfig] = {}
    configs = []
    for g, a in enumerate(codes.tolist()):
        if weights is None:
            if a not in cache:
                cache[a] = decode(a, None)
            configs.append(cache[a])
        else:
            configs.append(decode(a, weights[g]))
    return Strategy(graph.fingerprint, cluster.name, m, graph.batch_size, group_of, configs, method,
                    meta={"actions": codes.tolist()})


def encode_strategy(strategy: Strategy, cluster: "Cluster", splits: bool = False, states: bool = False) -> np.ndarray:
    """The actions that decode into ``strategy``'s configs (``strategy_from_actions`` with device peak FLOP/s
    shares, of the space of ``splits`` and ``states``): each group's config matched against the decoding of
    every action, a config keeping sharded state by its plain action and ``state_choice``. StrategyError
    names the first group whose config no action gives. Shapes: -> ``(G,)``."""
    m, batch = cluster.n_devices, strategy.batch_size
    plain = [decode_action(a, m, batch, cluster.power) for a in range(n_actions(m))]
    if splits:
        plain += [decode_split_action(a, cluster, batch) for a in range(n_actions(m), n_actions(m, splits=True))]
    found: dict[ParallelConfig, int] = {}           # configs equal in value encode alike
    out = np.empty(strategy.n_groups, dtype=np.int64)
    for g, cfg in enumerate(strategy.configs):
        if cfg not in found:
            bare = replace(cfg, sharded=None)
            matches = [a for a, c in enumerate(plain) if c == bare]
            choice = state_choice(cfg, cluster) if states else None
            if cfg.sharded is not None and not states:
                matches = []
            if choice is not None:
                matches = [state_action(m, a, choice, splits) for a in matches if a - m in STATE_BASES]
            if not matches:
                raise StrategyError(f"group {g}'s config (devices {list(cfg.devices)}, {cfg.sync}"
                                    f"{', sharded' if cfg.sharded is not None else ''}) is no action's decoding "
                                    f"on {m} devices{' with splits' if splits else ''}"
                                    f"{' with state actions' if states else ''}")
            found[cfg] = matches[0]
        out[g] = found[cfg]
    return out
