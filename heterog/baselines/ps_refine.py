"""Parameter-server devices of a plan checked with the simulator: the compiler's load-aware choice, then
each large PS group's server tried on every replica (docs/design.md, "Parameter-server choice").

The compiler's greedy (``heterog.compiler.ps``) prices a PS device by the load it puts on each resource and
by how late the forward pass gets its parameters; it cannot see that on exclusive links a large pull
started early holds a worker's NIC while the small pulls that worker needs first wait behind it
(head-of-line blocking). Where one group holds more parameter bytes than a device's fair share, several
servers tie or nearly tie in its model while the simulated step differs by 10% or more (vgg19's fc6, 75%
of its parameters: docs/results.md, "Parameter-server choice"). Here each such group, largest first, is
pinned to each of its replicas in turn, the other groups kept where the compiler put them, and the
fastest simulated plan is kept (ties: the compiler's choice). At most ``max_groups`` x replicas
evaluations, each a patch of the last compiled plan.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.strategy import Strategy

MAX_GROUPS = 2          # groups re-checked per plan, largest first


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


def refine_ps_devices(ev: PlanEvaluator, strategy: Strategy, max_groups: int = MAX_GROUPS) -> Strategy:
    """``strategy`` with the PS device of every PS group named: the compiler's choice, except that each
    group of ``large_ps_groups`` goes to the replica whose simulated plan is fastest (under ``ev``'s order;
    a plan that fits in memory first; kept only if strictly faster). A config that names its PS device
    keeps it."""
    chosen = ev.ps_devices(strategy)
    if not chosen:
        return strategy
    configs = [replace(c, ps_device=chosen[g]) if g in chosen and c.ps_device is None else c
               for g, c in enumerate(strategy.configs)]
    best = replace(strategy, configs=configs)
    open_ps = [g for g, c in enumerate(strategy.configs) if g in chosen and c.ps_device is None]
    groups = [g for g in large_ps_groups(strategy, ps_group_bytes(ev, strategy), len(strategy.configs))
              if g in open_ps][:max_groups]
    if not groups:
        return best
    time_s, oom = ev.iteration_time(best)
    for g in groups:
        for d in best.configs[g].devices:
            if d == best.configs[g].ps_device:
                continue
            trial = list(best.configs)
            trial[g] = replace(trial[g], ps_device=d)
            cand = replace(best, configs=trial)
            t, o = ev.iteration_time(cand)
            if (o, t) < (oom, time_s):
                best, time_s, oom = cand, t, o
    return best
