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
The offsets are stated once here (``N_DP_ACTIONS``, ``N_CLUSTER_SPLIT_ACTIONS``, ``cluster_split_action``,
``server_split_action``, ``device_action_blocks``); the env (``envs.actions``) and the policy's heads
(``agents.networks``) read them. ``decode_action`` turns an action of the first M + 4 into a ParallelConfig,
``decode_split_action`` one of the split actions; ``strategy_from_actions`` decodes a whole plan.
The core uses this encoding too (the Evaluator, local search, the comparison's tables), so it lives in
``heterog``, below ``envs``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from heterog.errors import StrategyError
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


def n_actions(n_devices: int, splits: bool = False) -> int:
    """Actions per group on ``n_devices`` devices: ``M + 4``, or with ``splits`` beyond the batch
    ``3 M + 6`` (the two cluster-wide splits, then an even and a proportional split over each device's
    server)."""
    m = int(n_devices)
    return m + N_DP_ACTIONS + ((N_CLUSTER_SPLIT_ACTIONS + 2 * m) if splits else 0)


def devices_of(n_actions_: int, splits: bool = False) -> int:
    """``M``, the devices of an action space of ``n_actions_`` actions (the inverse of ``n_actions``)."""
    extra = int(n_actions_) - N_DP_ACTIONS - (N_CLUSTER_SPLIT_ACTIONS if splits else 0)
    return extra // 3 if splits else extra


def cluster_split_action(n_devices: int, proportional: bool = False) -> int:
    """``M + 4`` (tp-even) or ``M + 5`` (tp-prop): the split over all devices."""
    return int(n_devices) + N_DP_ACTIONS + int(bool(proportional))


def server_split_action(n_devices: int, device: int, proportional: bool = False) -> int:
    """``M + 6 + d`` (tp-even) or ``2 M + 6 + d`` (tp-prop): the split over device ``d``'s server."""
    m = int(n_devices)
    return m + N_DP_ACTIONS + N_CLUSTER_SPLIT_ACTIONS + (m if proportional else 0) + int(device)


def device_action_blocks(n_devices: int, splits: bool = False) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of actions with one action per device: model parallelism and, with
    ``splits``, the even and the proportional split over each device's server."""
    m = int(n_devices)
    blocks = [(0, m)]
    if splits:
        blocks += [(server_split_action(m, 0, p), server_split_action(m, m, p)) for p in (False, True)]
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


def strategy_from_actions(actions: Sequence[int] | np.ndarray, group_of: np.ndarray, graph: "OpGraph",
                          cluster: "Cluster", method: str = "", weights: np.ndarray | None = None) -> Strategy:
    """Decode one action per group (of the M + 4, or split actions where the graph has split options)
    into a Strategy. ``weights`` (G, M) optionally gives per-group device speeds for proportional shares
    (otherwise device peak FLOP/s)."""
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
