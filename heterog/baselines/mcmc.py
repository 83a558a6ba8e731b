"""FlexFlow-style Markov chain Monte Carlo search over per-group (M+4)-way actions, scored by the simulator
(Metropolis-Hastings from several starting plans, global best kept, time or evaluation budget)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from heterog.baselines import register
from heterog.errors import HeterogError
from heterog.strategy import Strategy, decode_action, n_actions

DEFAULT_STARTS = ("single", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "random")


@dataclass
class ActionSearch:
    """Scores action vectors (one action per evaluator group) with the evaluator.

    What does not depend on the strategy is built once: the M+4 decoded configs (shared objects, so the
    compiler sees few distinct configs) and the group layout; scores of action vectors already seen are
    remembered, so a proposal that revisits a plan costs nothing. ``n_evals`` counts simulations.
    """

    ev: object
    oom_factor: float = 10.0
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
        t, oom = self.ev.iteration_time(self.strategy(actions))
        self.eval_time_s += time.perf_counter() - t0
        self.n_evals += 1
        c = t * self.oom_factor if oom else t
        self._seen[key] = c
        return c


def start_actions(ev, name: str, rng: np.random.Generator) -> np.ndarray:
    """The action vector of a starting plan: single (most powerful device), ev-ps, ev-ar, cp-ps, cp-ar, random."""
    m, g = ev.cluster.n_devices, ev.n_groups
    dp = {"ev-ps": 0, "ev-ar": 1, "cp-ps": 2, "cp-ar": 3}
    if name == "single":
        return np.full(g, int(np.argmax(ev.cluster.power)), dtype=np.int64)
    if name in dp:
        return np.full(g, m + dp[name], dtype=np.int64)
    if name == "random":
        return rng.integers(0, m + 4, size=g).astype(np.int64)
    raise HeterogError(f"unknown MCMC start {name!r}; choose from {', '.join(DEFAULT_STARTS)}")


@register("mcmc")
def mcmc(ev, budget_s: float = 60.0, seed: int = 0, starts: tuple[str, ...] | list[str] = DEFAULT_STARTS,
         temperature: float = 0.005, oom_factor: float = 10.0, max_evals: int | None = None, **_):
    """Metropolis-Hastings over one (M+4)-way action per group (FlexFlow's search).

    A proposal changes one random group's action to another random action; it is accepted with
    probability min(1, exp(beta * (cost - cost'))), cost = simulated iteration time (x ``oom_factor`` if
    out of memory), beta = 1 / (``temperature`` x the best starting cost): a plan ``temperature`` slower
    is accepted with probability 1/e. Chains start from each plan in ``starts``, worst first, each with
    an equal share of what is left of the budget (time that a chain leaves goes to the next ones); a
    chain stops when its share is spent or when half of it passes without improving the global best.
    The global best (never worse than the best start) is returned.

    ``max_evals``: budget in simulations instead of seconds (then the search is deterministic per seed).
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    search = ActionSearch(ev, oom_factor)
    g_count, a_count = ev.n_groups, n_actions(ev.cluster.n_devices)
    by_evals = max_evals is not None
    total = float(max_evals) if by_evals else float(budget_s)

    def clock() -> float:
        return float(search.n_evals) if by_evals else time.perf_counter() - t0

    cands = {name: start_actions(ev, name, rng) for name in dict.fromkeys(starts)}
    start_cost = {name: search.cost(a) for name, a in cands.items()}
    best_name = min(start_cost, key=lambda k: (start_cost[k], list(start_cost).index(k)))
    best, best_cost = cands[best_name].copy(), start_cost[best_name]
    beta = 1.0 / (temperature * best_cost)
    chains = sorted(cands, key=lambda k: (-start_cost[k], list(cands).index(k)))
    accepted = proposed = 0
    chain_log = []
    for k, name in enumerate(chains):
        now = clock()
        share = (total - now) / (len(chains) - k)
        if share <= 0:
            break
        end, last_gain = now + share, now
        cur, cur_cost = cands[name].copy(), start_cost[name]
        chain_best = cur_cost
        while g_count and clock() < end and clock() - last_gain < share / 2:
            g = int(rng.integers(g_count))
            a = int(rng.integers(a_count - 1))
            a += a >= cur[g]
            cand = cur.copy()
            cand[g] = a
            c = search.cost(cand)
            proposed += 1
            if c <= cur_cost or rng.random() < math.exp(beta * (cur_cost - c)):
                cur, cur_cost = cand, c
                accepted += 1
                chain_best = min(chain_best, c)
                if c < best_cost:
                    best, best_cost, last_gain = cand.copy(), c, clock()
        chain_log.append({"start": name, "start_cost_s": start_cost[name], "best_cost_s": chain_best})
    elapsed = time.perf_counter() - t0
    strategy = search.strategy(best)
    strategy.meta.update({
        "evals_per_s": search.n_evals / elapsed if elapsed > 0 else 0.0,
        "sim_evals_per_s": search.n_evals / search.eval_time_s if search.eval_time_s > 0 else 0.0,
        "n_evals": search.n_evals, "proposals": proposed, "accepted": accepted,
        "best_cost_s": best_cost, "best_start": best_name, "best_start_cost_s": start_cost[best_name],
        "chains": chain_log})
    return strategy
