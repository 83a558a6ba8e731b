"""The pieces of a Markov chain search over per-group (M+4)-way actions that run wherever the chain runs
(here, or on a ``heterog.parallel`` worker): the scorer of action vectors and one Metropolis-Hastings chain."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from heterog.strategy import Strategy, decode_action, n_actions


@dataclass
class ActionSearch:
    """Scores action vectors (one action per evaluator group) with the evaluator, under task order
    ``order`` (None: the evaluator's).

    What does not depend on the strategy is built once: the M+4 decoded configs (shared objects, so the
    compiler sees few distinct configs and patches the plan it compiled last) and the group layout;
    scores of action vectors already seen are remembered, so a proposal that revisits a plan costs
    nothing. ``n_evals`` counts simulations.
    """

    ev: object
    oom_factor: float = 10.0
    order: str | None = None
    n_evals: int = 0
    eval_time_s: float = 0.0
    _configs: list = field(default_factory=list, repr=False)
    _seen: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        c = self.ev.cluster
        self._configs = [decode_action(a, c.n_devices, self.ev.graph.batch_size, c.power)
                         for a in range(n_actions(c.n_devices))]

    def strategy(self, actions: np.ndarray) -> Strategy:
        g, c = self.ev.graph, self.ev.cluster
        return Strategy(g.fingerprint, c.name, c.n_devices, g.batch_size, self.ev.group_of,
                        [self._configs[a] for a in actions.tolist()], meta={"actions": actions.tolist()})

    def cost(self, actions: np.ndarray) -> float:
        """Iteration time of the plan, times ``oom_factor`` if a device runs out of memory."""
        key = actions.tobytes()
        hit = self._seen.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        t, oom = self.ev.iteration_time(self.strategy(actions), self.order)
        self.eval_time_s += time.perf_counter() - t0
        self.n_evals += 1
        c = t * self.oom_factor if oom else t
        if len(self._seen) > 200_000:
            self._seen.clear()
        self._seen[key] = c
        return c


# ----------------------------------------------------------------------------- one chain
@dataclass(frozen=True)
class Chain:
    """One Markov chain to run: from ``start`` (cost ``start_cost``), ``budget`` proposals (``by_proposals``)
    or seconds, drawing from ``np.random.default_rng([seed, index])``; it stops early when half its
    budget passes without beating ``target`` (the best starting cost) or its own best. ``beta``: inverse
    temperature of the acceptance rule; ``keep``: best distinct plans to return."""

    index: int
    name: str
    start: np.ndarray
    start_cost: float
    target: float
    beta: float
    budget: float
    by_proposals: bool
    seed: int
    keep: int = 4


@dataclass
class ChainResult:
    """What a chain found: its best plans (cost, actions), best first, and its counters."""

    index: int
    name: str
    best: list[tuple[float, np.ndarray]]
    proposals: int
    accepted: int
    n_evals: int
    eval_time_s: float
    wall_s: float

    @property
    def best_cost(self) -> float:
        return self.best[0][0]


def run_chain(search: ActionSearch, chain: Chain) -> ChainResult:
    """Metropolis-Hastings from ``chain.start``: a proposal changes one random group's action to another
    random action and is accepted with probability min(1, exp(beta * (cost - cost')))."""
    t0 = time.perf_counter()
    evals0, eval_s0 = search.n_evals, search.eval_time_s
    rng = np.random.default_rng([chain.seed, chain.index])
    g_count, a_count = len(chain.start), n_actions(search.ev.cluster.n_devices)
    cur, cur_cost = chain.start.copy(), chain.start_cost
    top: dict[bytes, tuple[float, np.ndarray]] = {cur.tobytes(): (cur_cost, cur.copy())}
    best = min(chain.target, cur_cost)
    proposals = accepted = 0

    def clock() -> float:
        return float(proposals) if chain.by_proposals else time.perf_counter() - t0

    last_gain = 0.0
    while g_count and clock() < chain.budget and clock() - last_gain < chain.budget / 2:
        g = int(rng.integers(g_count))
        a = int(rng.integers(a_count - 1))
        a += a >= cur[g]
        cand = cur.copy()
        cand[g] = a
        c = search.cost(cand)
        proposals += 1
        if c <= cur_cost or rng.random() < math.exp(chain.beta * (cur_cost - c)):
            cur, cur_cost = cand, c
            accepted += 1
            key = cand.tobytes()
            if key not in top and (len(top) < chain.keep or c < max(v[0] for v in top.values())):
                top[key] = (c, cand)
                if len(top) > chain.keep:
                    del top[max(top, key=lambda k: top[k][0])]
            if c < best:
                best, last_gain = c, clock()
    ranked = sorted(top.values(), key=lambda v: v[0])
    return ChainResult(chain.index, chain.name, ranked, proposals, accepted, search.n_evals - evals0,
                       search.eval_time_s - eval_s0, time.perf_counter() - t0)
