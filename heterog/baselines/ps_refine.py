"""Parameter-server devices of a plan checked with the simulator: the compiler's load-aware choice, then
each large PS group's server tried on every replica (docs/design.md, "Parameter-server choice").

The compiler's greedy (``heterog.compiler.ps``) prices a PS device by the load it puts on each resource and
by how late the forward pass gets its parameters; it cannot see that on exclusive links a large pull
started early holds a worker's NIC while the small pulls that worker needs first wait behind it
(head-of-line blocking). Where one group holds more parameter bytes than a device's fair share, several
servers tie or nearly tie in its model while the simulated step differs by 10% or more (vgg19's fc6, 75%
of its parameters: docs/results.md, "Parameter-server choice"). Here each such group, largest first, is
pinned to each of its replicas in turn, the other groups kept where the compiler put them, and the
fastest simulated plan is kept (ties: the compiler's choice). A group of more than
``MAX_TRIALS_PER_GROUP`` replicas (clusters of hundreds of GPUs) tries one replica of each kind of place
(``place_kind``: the same device type, slowdown and batch share, on a server of the same devices and
links) other than the compiler's choice's: replicas of one kind differ only by the load other groups put
near them, which the compiler's load-aware choice weighs. At most ``max_groups`` x
``MAX_TRIALS_PER_GROUP`` evaluations, each a patch of the last compiled plan.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from heterog.baselines.fit import past

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.strategy import ParallelConfig, Strategy

MAX_GROUPS = 2          # groups re-checked per plan, largest first
MAX_TRIALS_PER_GROUP = 16   # replicas tried as a group's PS; beyond it, one per kind of place


def ps_group_bytes(ev: PlanEvaluator, strategy: Strategy) -> np.ndarray:
    """(G,) gradient bytes of each group of ``strategy`` (what its PS receives from each worker)."""
    grad = np.array([op.grad_bytes for op in ev.graph.ops], dtype=np.float64)
    return np.bincount(strategy.group_of, weights=grad, minlength=len(strategy.configs))


def large_ps_groups(strategy: Strategy, group_bytes: np.ndarray, max_groups: int = MAX_GROUPS) -> list[int]:
    """The PS groups (several replicas, some parameters) of more bytes than a fair share (all PS groups'
    bytes over the devices that can serve them), largest first (ties: lower group), at most ``max_groups``."""
    ps = [g for g, c in enumerate(strategy.configs) if c.sync == "ps" and len(c.devices) > 1 and group_bytes[g] > 0]
    if not ps:
        return []
    servers = {d for g in ps for d in strategy.configs[g].devices}
    fair = float(group_bytes[ps].sum()) / len(servers)
    large = sorted((g for g in ps if group_bytes[g] > fair), key=lambda g: (-group_bytes[g], g))
    return large[:max_groups]


def place_kind(cluster: Cluster, config: ParallelConfig, device: int) -> tuple:
    """What makes replica ``device`` of ``config`` a kind of place: its device type and slowdown, its batch
    share, and its server's interconnect, NIC and multiset of device types and slowdowns."""
    dev = cluster.devices[device]
    s = cluster.servers[dev.server]
    server = (s.intra, s.intra_bandwidth_Bps, s.intra_latency_s, s.nic_bandwidth_Bps, s.nic_latency_s,
              tuple(sorted((cluster.devices[d].type.name, cluster.devices[d].slowdown) for d in s.devices)))
    return dev.type.name, dev.slowdown, config.shares[config.devices.index(device)], server


def ps_trials(cluster: Cluster, config: ParallelConfig) -> list[int]:
    """The replicas of ``config`` tried as its PS besides its current one: every replica, or, for more than
    ``MAX_TRIALS_PER_GROUP``, the first of each kind of place (``place_kind``) other than the current one's,
    at most ``MAX_TRIALS_PER_GROUP``."""
    others = [d for d in config.devices if d != config.ps_device]
    if len(config.devices) <= MAX_TRIALS_PER_GROUP:
        return others
    seen = {place_kind(cluster, config, config.ps_device)} if config.ps_device in config.devices else set()
    out = []
    for d in others:
        kind = place_kind(cluster, config, d)
        if kind not in seen:
            seen.add(kind)
            out.append(d)
    return out[:MAX_TRIALS_PER_GROUP]


def refine_ps_devices(ev: PlanEvaluator, strategy: Strategy, max_groups: int = MAX_GROUPS,
                      deadline: float | None = None) -> Strategy:
    """``strategy`` with the PS device of every PS group named: the compiler's choice, except that each
    group of ``large_ps_groups`` goes to the replica whose simulated plan is fastest (under ``ev``'s order;
    a plan that fits in memory first; kept only if strictly faster). A config that names its PS device
    keeps it. No replica is tried once ``time.perf_counter()`` passes ``deadline`` (the best found stands)."""
    chosen = ev.ps_devices(strategy)
    if not chosen:
        return strategy
    configs = [replace(c, ps_device=chosen[g]) if g in chosen and c.ps_device is None else c
               for g, c in enumerate(strategy.configs)]
    best = replace(strategy, configs=configs)
    open_ps = [g for g, c in enumerate(strategy.configs) if g in chosen and c.ps_device is None]
    groups = [g for g in large_ps_groups(strategy, ps_group_bytes(ev, strategy), len(strategy.configs))
              if g in open_ps][:max_groups]
    if not groups or past(deadline):
        return best
    time_s, oom = ev.iteration_time(best)
    for g in groups:
        for d in ps_trials(ev.cluster, best.configs[g]):
            if past(deadline):
                return best
            trial = list(best.configs)
            trial[g] = replace(trial[g], ps_device=d)
            cand = replace(best, configs=trial)
            t, o = ev.iteration_time(cand)
            if (o, t) < (oom, time_s):
                best, time_s, oom = cand, t, o
    return best
