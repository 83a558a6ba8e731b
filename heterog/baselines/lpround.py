"""``lp-round``: a data-parallel plan read off the action-space LP (``heterog.bounds.data_parallel_lp``).

The LP spreads each group's weight over the data-parallel actions (AllReduce, or PS on a chosen device,
even or proportional shares) so that every link and device carries as little as possible; the heaviest
groups are kept integral (a MILP), the rest are rounded to the action of largest weight. The plan then

- keeps each group's aggregation (AllReduce, or PS on the LP's device) and, with ``layout="prop"``
  (default), gives every group the proportional layout: the LP sees no re-layouts between groups of
  different shares, the simulator does;
- with ``order="topo"`` (default) fixes an op order, earlier ops first, so that PS pulls arrive in the
  order the forward pass reads them (under FIFO they queue in task order and stall the forward pass).

It is a starting point and a check on the bound, not a search: the rounded plan carries the LP's link
loads, but not its schedule (pulls that queue, idle links between the last pull and the first gradient,
rings that need every link at once); docs/results.md has the measured gap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluator_protocol import PlanEvaluator


def lp_round_strategy(evaluator: PlanEvaluator, integral_groups: int = 50, time_limit_s: float = 30.0,
                      layout: str = "prop", order: str = "topo") -> Strategy:
    from heterog.bounds import data_parallel_lp, dp_action_configs
    from heterog.errors import HeterogError

    if layout not in ("prop", "lp"):
        raise HeterogError(f"lp-round: unknown layout {layout!r} (choose prop or lp)")
    if order not in ("topo", "none"):
        raise HeterogError(f"lp-round: unknown order {order!r} (choose topo or none)")
    graph, cluster = evaluator.graph, evaluator.cluster
    m = cluster.n_devices
    lp = data_parallel_lp(evaluator, integral_groups=integral_groups, time_limit_s=time_limit_s)
    choice = np.asarray(lp["weights"]).argmax(axis=1)
    configs = dp_action_configs(evaluator)
    if layout == "prop":                       # same sync, proportional shares: actions 1, 2 + M + p
        prop = configs[1]
        configs = [prop] + configs[1:2] + [ParallelConfig(prop.devices, prop.shares, "ps", c.ps_device)
                                           for c in configs[2:2 + m]] + configs[2 + m:]
    n = graph.n_ops
    prio = (n - np.arange(n)).astype(np.float64) if order == "topo" else None
    return Strategy(graph.fingerprint, cluster.name, m, graph.batch_size, evaluator.group_of,
                    [configs[a] for a in choice.tolist()], "lp-round", priorities=prio,
                    meta={"lp_bound_s": lp["bound_s"], "lp_actions": choice.tolist(),
                          "integral_groups": int(integral_groups)})


def lp_round(ev: PlanEvaluator, integral_groups: int = 50, time_limit_s: float = 30.0, layout: str = "prop",
             order: str = "topo") -> Strategy:
    return lp_round_strategy(ev, integral_groups, time_limit_s, layout, order)
