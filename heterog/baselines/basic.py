"""The HeteroG paper's data-parallel baselines, single-device training and uniform random actions.

EV: one replica per device with even shares; CP: shares in proportion to computation power. Under PS the
servers are the compiler's load-aware choice with the largest groups' servers checked by simulation
(``heterog.baselines.ps_refine``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from heterog.baselines.ps_refine import refine_ps_devices

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.strategy import Strategy

# offsets of the data-parallel actions after the M model-parallel ones
DP_OFFSETS = {"ev-ps": 0, "ev-ar": 1, "cp-ps": 2, "cp-ar": 3}


def uniform_actions(ev: PlanEvaluator, action: int) -> np.ndarray:
    return np.full(ev.n_groups, int(action), dtype=np.int64)


def single(ev: PlanEvaluator, device: int | None = None) -> Strategy:
    """Everything on one device (default: the most powerful one, lowest index on ties)."""
    d = int(np.argmax(ev.cluster.power)) if device is None else int(device)
    return ev.strategy(uniform_actions(ev, d))


def _dp(kind: str) -> Callable[[PlanEvaluator], Strategy]:
    def plan(ev: PlanEvaluator) -> Strategy:
        strategy = ev.strategy(uniform_actions(ev, ev.cluster.n_devices + DP_OFFSETS[kind]))
        return refine_ps_devices(ev, strategy) if kind.endswith("-ps") else strategy
    plan.__name__ = plan.__qualname__ = kind.replace("-", "_")
    plan.__doc__ = f"Data parallelism {kind.upper()} for every group" + (
        " (PS devices: ``refine_ps_devices``)." if kind.endswith("-ps") else ".")
    return plan


ev_ps, ev_ar, cp_ps, cp_ar = _dp("ev-ps"), _dp("ev-ar"), _dp("cp-ps"), _dp("cp-ar")


def random_plan(ev: PlanEvaluator, seed: int = 0) -> Strategy:
    """Uniform random (M+4)-way action per group: the sanity floor."""
    rng = np.random.default_rng(seed)
    return ev.strategy(rng.integers(0, ev.cluster.n_devices + 4, size=ev.n_groups))
