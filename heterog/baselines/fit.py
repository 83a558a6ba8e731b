"""The one routine by which planners make a plan fit in memory: ``fit`` tries each way to fit
(recomputation, sharded state, more micro-batches), simulates every candidate and keeps the fastest that fits.

Ways (``WAYS``), each a search over its own candidates of one plan:

  recompute      the fewest leading groups recomputed that fit (the first groups' activations live
                 longest), by bisection;
  sharded        every group that may keeps its state in shards or offloads it (each choice of
                 ``STATE_CHOICES`` x shard weights of ``SHARD_BY``: stages 1-3 on the GPUs, then stages
                 1-3 with the optimizer state on the host, then stage 3 with the parameter shards there
                 too; a group of one device only offloads its optimizer state; the strongest of each
                 weights first, the other choices of those weights only where it fits), then, for the
                 fastest of those that fits, the fewest groups holding the most state that fit, by
                 bisection; the way is reported as "offload" where the plan kept offloads;
  micro-batches  the fewest micro-batches (doubling, up to a cap) that fit, under the plan's schedule.

When no way fits alone, each way is tried on the plan that another way frees the most memory in (the
strongest sharded state, every group recomputed, the most micro-batches): "sharded+recompute" and so
on. The way chosen is reported in the plan's ``meta["fit"]`` ("fits" where the plan fitted as given,
"none" where nothing fits). With a ``deadline`` (a ``time.perf_counter()`` value), no candidate is simulated
once it has passed: the search keeps what it has simulated by then, so that a planner's budget bounds it
(a way cut short returns the fewest that fit of those it tried, or nothing).

Offloading is a kind of sharded state (``STATE_CHOICES``), so every search over sharded state (this routine,
MCMC's shard moves) offers it: it costs PCIe transfers and a host optimizer step, priced by the simulator,
against the GPU memory it frees.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import reduce
from itertools import product
from math import gcd
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.errors import HeterogError
from heterog.sharded import SHARD_BY, STAGES, ShardedState, state_weights
from heterog.strategy import ParallelConfig, Strategy, most_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.evaluator_protocol import PlanEvaluator

# the sharded-state choices the planners offer, as ``ShardedState`` arguments beside the weights: each stage
# on the GPUs, then each stage with the optimizer state offloaded to the host, then stage 3 with the
# parameter shards there too (the last frees the most); stage 0 only offloads the optimizer state, which a
# group of one device does (``sharded_variants``)
STATE_CHOICES: tuple[dict[str, Any], ...] = (tuple({"stage": s} for s in STAGES if s > 0)
                                             + tuple({"stage": s, "offload": "optimizer"} for s in STAGES if s > 0)
                                             + ({"stage": 3, "offload": "parameters"},))
FITS, NONE, OFFLOAD = "fits", "none", "offload"


def past(deadline: float | None) -> bool:
    """Whether ``deadline`` (a ``time.perf_counter()`` value; None: none) has passed."""
    return deadline is not None and time.perf_counter() >= deadline


@dataclass(frozen=True)
class Fitted:
    """A plan, its simulated iteration time, whether it is out of memory and the way that made it fit
    (``FITS``: it fitted as given; ``NONE``: no way fits, the plan is the one given)."""

    strategy: Strategy
    time_s: float
    oom: bool
    way: str


# ----------------------------------------------------------------------------- sharded state
def shardable(cfg: ParallelConfig) -> bool:
    """Whether ``cfg`` may keep sharded state: an AllReduce data-parallel config of 2+ replicas, none yet."""
    return cfg.sync == "allreduce" and cfg.split is None and len(cfg.devices) > 1 and cfg.sharded is None


def offloadable(cfg: ParallelConfig) -> bool:
    """Whether ``cfg`` may offload its state without sharding it: a config of one device, unsplit, with no
    sharded state yet (ZeRO-Offload on one GPU)."""
    return len(cfg.devices) == 1 and cfg.split is None and cfg.sharded is None


def holds_state(cfg: ParallelConfig) -> bool:
    """Whether some choice of ``STATE_CHOICES`` applies to ``cfg`` (``shardable`` or ``offloadable``)."""
    return shardable(cfg) or offloadable(cfg)


def sharded_variants(cfg: ParallelConfig, cluster: Cluster, choices: Sequence[dict[str, Any]] = STATE_CHOICES,
                     by: Sequence[str] = SHARD_BY) -> list[ParallelConfig]:
    """``cfg`` keeping sharded state, one config per (choice, weights) of ``choices`` x ``by``, weights in
    lowest terms and equal ones once (on alike devices, memory and speed shards are even), in that order;
    a config of one device (``offloadable``) only offloads: stage 0 with each offload among ``choices``,
    once; choices that offload only where every device's server has a host (``host:`` in the cluster
    file); empty where ``cfg`` can do neither."""
    if not all(cluster.servers[int(cluster.server_of[d])].host is not None for d in cfg.devices):
        choices = [c for c in choices if c.get("offload", "none") == "none"]
    if offloadable(cfg):
        kinds = dict.fromkeys(str(c["offload"]) for c in choices if c.get("offload", "none") == "optimizer")
        return [replace(cfg, sharded=ShardedState(0, (1,), offload=k)) for k in kinds]
    if not shardable(cfg):
        return []
    weights = list(dict.fromkeys(_lowest_terms(state_weights(b, cfg.devices, cluster)) for b in by))
    return [replace(cfg, sharded=ShardedState(weights=w, **choice)) for choice in choices for w in weights]


def _lowest_terms(weights: tuple[int, ...]) -> tuple[int, ...]:
    d = reduce(gcd, weights)
    return tuple(w // d for w in weights)


def with_sharded(strategy: Strategy, groups: Sequence[int], variant: Callable[[ParallelConfig], ParallelConfig]
                 ) -> Strategy:
    """``strategy`` with the configs of ``groups`` replaced by ``variant(config)``; groups that shared one
    config object share its variant (the compiler sees few distinct configs)."""
    made: dict[int, ParallelConfig] = {}
    configs = list(strategy.configs)
    for g in groups:
        cfg = configs[g]
        if id(cfg) not in made:
            made[id(cfg)] = variant(cfg)
        configs[g] = made[id(cfg)]
    return replace(strategy, configs=configs, meta=dict(strategy.meta))


def state_order(ev: PlanEvaluator, strategy: Strategy) -> list[int]:
    """The groups that may keep sharded state or offload it (``holds_state``), those holding the most
    resident bytes (parameters, gradients, optimizer state) first (ties: lower id first)."""
    held = np.bincount(strategy.group_of, weights=ev.graph.resident_bytes, minlength=strategy.n_groups)
    groups = [g for g, cfg in enumerate(strategy.configs) if holds_state(cfg) and held[g] > 0]
    return sorted(groups, key=lambda g: (-held[g], g))


def _sharded_all(ev: PlanEvaluator, strategy: Strategy, groups: list[int]) -> list[tuple[str, Strategy]]:
    """``strategy`` with every one of ``groups`` keeping each (choice, weights) of sharded state (a group
    that cannot take a choice, one device under a choice that does not offload, kept as it is), with the
    ``SHARD_BY`` of its weights; equal plans and plans changing nothing once."""
    out: dict[tuple, tuple[str, Strategy]] = {}
    for choice, by in product(STATE_CHOICES, SHARD_BY):
        def variant(cfg: ParallelConfig, choice: dict[str, Any] = choice, by: str = by) -> ParallelConfig:
            made = sharded_variants(cfg, ev.cluster, (choice,), (by,))
            return made[0] if made else cfg

        s = with_sharded(strategy, groups, variant)
        key = _state_key(s, groups)
        if any(k is not None for k in key):
            out.setdefault(key, (by, s))
    return list(out.values())


def _state_key(strategy: Strategy, groups: list[int]) -> tuple:
    """The sharded state of each of ``groups``: what tells the sharded search's plans apart."""
    return tuple(strategy.configs[g].sharded for g in groups)


def _strongest_of(cluster: Cluster, by: str) -> Callable[[ParallelConfig], ParallelConfig]:
    """A config keeping the last of ``STATE_CHOICES`` it may take, weights ``by`` (itself where it takes none)."""
    def strongest(cfg: ParallelConfig) -> ParallelConfig:
        made = sharded_variants(cfg, cluster, STATE_CHOICES, (by,))
        return made[-1] if made else cfg

    return strongest


def _way_of(strategy: Strategy) -> str:
    """"offload" where a group of ``strategy`` offloads its state, else "sharded"."""
    return OFFLOAD if any(c.sharded is not None and c.sharded.offloads for c in strategy.configs) else "sharded"


def sharded_way(ev: PlanEvaluator, strategy: Strategy, deadline: float | None = None,
                bisect: bool = True) -> Fitted | None:
    """The fastest plan that fits with sharded state (``sharded_variants`` on every group of
    ``state_order``); with ``bisect``, also the fewest of those groups, most state first, that fit under
    the fastest fitting choice, kept if faster. None where no group can or none fits (of those simulated
    before ``deadline``).

    The strongest state of each weights (``SHARD_BY``) is simulated first: where it is out of memory, no
    other choice with those weights is simulated. This assumes, as ``fit``'s early exit does, that no choice
    frees more than the strongest (the simulated peaks depend on the order the tasks run in, so this is
    not a theorem; the tests check it on random plans). On a plan whose memory goes to activations that is
    three simulations where there were one per (choice, weights)."""
    groups = state_order(ev, strategy)
    if not groups:
        return None
    simulated: dict[tuple, tuple[float, bool]] = {}

    def simulate(s: Strategy) -> tuple[float, bool]:
        key = _state_key(s, groups)
        if key not in simulated:
            simulated[key] = ev.iteration_time(s)
        return simulated[key]

    hopeless: set[str] = set()
    for by in SHARD_BY:
        if past(deadline):
            break
        if simulate(with_sharded(strategy, groups, _strongest_of(ev.cluster, by)))[1]:
            hopeless.add(by)
    best: Fitted | None = None
    for by, s in _sharded_all(ev, strategy, groups):
        if by in hopeless or (_state_key(s, groups) not in simulated and past(deadline)):
            continue
        t, oom = simulate(s)
        if not oom and (best is None or t < best.time_s):
            best = Fitted(s, float(t), False, _way_of(s))
    if best is None or not bisect or len(groups) == 1:
        return best
    chosen = {id(strategy.configs[g]): best.strategy.configs[g] for g in groups}
    found = _fewest_that_fit(ev, len(groups), lambda k: with_sharded(strategy, groups[:k], lambda c: chosen[id(c)]),
                             deadline)
    if found is not None and found.time_s < best.time_s:
        return replace(found, way=_way_of(found.strategy))
    return best


def strongest_sharded(ev: PlanEvaluator, strategy: Strategy) -> Strategy | None:
    """Every group that can keeping the last of ``STATE_CHOICES`` it may take (the most it frees: stage 3,
    the optimizer state offloaded where its servers have hosts; a group of one device offloading), weights
    by memory."""
    groups = state_order(ev, strategy)
    if not groups:
        return None
    return with_sharded(strategy, groups, _strongest_of(ev.cluster, "memory"))


# ----------------------------------------------------------------------------- recomputation
def _fewest_that_fit(ev: PlanEvaluator, n: int, make: Callable[[int], Strategy],
                     deadline: float | None = None) -> Fitted | None:
    """The plan ``make(k)`` of the smallest k in 1..n that fits, by bisection (fitting assumed to hold
    from some k on), where ``make(n)`` fits; None where it does not, or where ``deadline`` has passed before
    it is simulated (after it, the bisection stops at the deadline with the smallest k found to fit)."""
    if past(deadline):
        return None
    top = make(n)
    t_top, oom = ev.iteration_time(top)
    if oom:
        return None
    best = Fitted(top, float(t_top), False, "")
    lo, hi = 0, n                       # k = lo is out of memory, k = hi fits
    while hi - lo > 1 and not past(deadline):
        mid = (lo + hi) // 2
        s = make(mid)
        t, oom = ev.iteration_time(s)
        if oom:
            lo = mid
        else:
            hi, best = mid, Fitted(s, float(t), False, "")
    return best


def recompute_way(ev: PlanEvaluator, strategy: Strategy, deadline: float | None = None) -> Fitted | None:
    """``strategy`` recomputing the fewest leading groups that fit (groups split beyond the batch are not
    recomputed), if recomputing all of them fits; None otherwise or where it already recomputes. The
    activations of the first groups live longest (until the backward comes back to them), so the
    recomputed groups are a prefix, its length found by bisection (about log2 G evaluations)."""
    groups = [g for g, cfg in enumerate(strategy.configs) if cfg.split is None]
    if strategy.recompute or not groups:
        return None
    found = _fewest_that_fit(ev, len(groups), lambda k: strategy.with_recompute(groups[:k]), deadline)
    return None if found is None else replace(found, way="recompute")


def strongest_recompute(ev: PlanEvaluator, strategy: Strategy) -> Strategy | None:
    """``strategy`` recomputing every group it may (None where it already recomputes or none may)."""
    groups = [g for g, cfg in enumerate(strategy.configs) if cfg.split is None]
    return None if strategy.recompute or not groups else strategy.with_recompute(groups)


# ----------------------------------------------------------------------------- micro-batches
MAX_FIT_MICRO_BATCHES = 64


def _micro_counts(strategy: Strategy, most: int) -> list[int]:
    cap = min(most_micro_batches(strategy), most)
    out, k = [], 2 * strategy.n_micro
    while k <= cap:
        out.append(k)
        k *= 2
    return out


def micro_batch_way(ev: PlanEvaluator, strategy: Strategy, deadline: float | None = None,
                    most: int = MAX_FIT_MICRO_BATCHES) -> Fitted | None:
    """``strategy`` over the fewest micro-batches (twice its own, doubling, up to ``most`` and what the plan
    allows) that fit, under its schedule; None where none does (of those simulated before ``deadline``)."""
    for k in _micro_counts(strategy, most):
        if past(deadline):
            break
        s = strategy.with_micro_batches(k)
        t, oom = ev.iteration_time(s)
        if not oom:
            return Fitted(s, float(t), False, "micro-batches")
    return None


def strongest_micro(ev: PlanEvaluator, strategy: Strategy) -> Strategy | None:
    """``strategy`` over the most micro-batches ``micro_batch_way`` tries (None where it tries none)."""
    counts = _micro_counts(strategy, MAX_FIT_MICRO_BATCHES)
    return strategy.with_micro_batches(counts[-1]) if counts else None


# ----------------------------------------------------------------------------- the routine
# a way: (its search for the fastest plan that fits, simulating nothing once its deadline has passed, its plan
# that frees the most memory)
Way = tuple[Callable[["PlanEvaluator", Strategy, "float | None"], "Fitted | None"],
            Callable[["PlanEvaluator", Strategy], "Strategy | None"]]
WAYS: dict[str, Way] = {                        # the cheapest search first: a bisection, then up to 21 plans
    "recompute": (recompute_way, strongest_recompute),
    "sharded": (sharded_way, strongest_sharded),
    "micro-batches": (micro_batch_way, strongest_micro),
}
DEFAULT_WAYS = tuple(WAYS)
# the ways whose strongest plan frees the most memory any of their plans frees (``fit``'s early exit)
BOUNDED_WAYS = ("sharded", "recompute")


def check_ways(ways: Sequence[str]) -> tuple[str, ...]:
    """``ways`` as a tuple; a HeterogError naming the known ways for any other."""
    bad = [w for w in ways if w not in WAYS]
    if bad:
        raise HeterogError(f"unknown way{'s' if len(bad) > 1 else ''} to fit {', '.join(map(repr, bad))}; "
                           f"known: {', '.join(WAYS)}")
    return tuple(ways)


def fit(ev: PlanEvaluator, strategy: Strategy, ways: Sequence[str] = DEFAULT_WAYS, improve: bool = False,
        deadline: float | None = None, known: tuple[float, bool] | None = None) -> Fitted:
    """``strategy`` made to fit: as given where it fits; else the fastest plan that fits among each way's
    (``WAYS``, those named by ``ways``, in order; ties: the earlier way); where none fits alone, among
    each way applied after another way's strongest plan ("sharded+recompute", ...). The first of ``ways``
    is searched first (a caller names its cheapest first). Where it finds nothing, the plan with every way's
    strongest at once (``strongest_together``) is simulated where ``ways`` are among ``BOUNDED_WAYS``: where
    even it is out of memory, no way nor pair of ways fits (each of those ways' candidates frees at most
    what its strongest does) and the search stops, one simulation in place of dozens on a plan that cannot
    fit; where the first way fits, the check would tell nothing. (More micro-batches are not bounded so:
    under sharded state each micro-batch's local gradients may wait for their reduce-scatter, so the most
    micro-batches may hold more than fewer.) ``deadline``: after ``strategy`` itself, nothing is simulated once
    ``time.perf_counter()`` has passed it (the fastest that fits of what was simulated by then is returned;
    where the deadline leaves none but the plan with every way at its strongest, that one). ``improve``: a plan
    that fits is also tried with sharded state on all its data-parallel groups (where "sharded" is among
    ``ways``), kept if faster (a reduce-scatter and an all-gather cost what the AllReduce does, and each
    replica updates only its shard). ``known``: ``strategy``'s ``ev.iteration_time`` where the caller has
    simulated it already (not simulated again). The plan returned records the way in ``meta["fit"]``."""
    ways = check_ways(ways)
    t, oom = known if known is not None else ev.iteration_time(strategy)
    if not oom:
        found = Fitted(replace(strategy, meta=dict(strategy.meta)), float(t), False, FITS)
        if improve and "sharded" in ways:
            faster = sharded_way(ev, strategy, bisect=False, deadline=deadline)
            if faster is not None and faster.time_s < found.time_s:
                found = faster
        return _record(found)
    together = strongest_together(ev, strategy, ways) if set(ways) <= set(BOUNDED_WAYS) else None
    strongest: Fitted | None = None         # what fits where a deadline cuts the search before anything else
    tried: list[Fitted] = []
    for i, w in enumerate(ways):
        if i == 1 and not tried and together is not None and not past(deadline):
            t_all, oom_all = ev.iteration_time(together)
            if oom_all:
                return _record(Fitted(replace(strategy, meta=dict(strategy.meta)), float(t), True, NONE))
            applied = [_way_of(together) if x == "sharded" else x for x in ways
                       if (x == "sharded" and any(c.sharded for c in together.configs)) or
                       (x == "recompute" and together.recompute)]
            strongest = Fitted(together, float(t_all), False, "+".join(applied))
        if (f := WAYS[w][0](ev, strategy, deadline)) is not None:
            tried.append(f)
    if not tried:
        for first in ways:
            base = WAYS[first][1](ev, strategy)
            if base is None:
                continue
            for then in ways:
                if then != first and (f := WAYS[then][0](ev, base, deadline)) is not None:
                    label = _way_of(base) if first == "sharded" else first
                    tried.append(replace(f, way=f"{label}+{f.way}"))
    if not tried and strongest is not None:
        tried = [strongest]
    if not tried:
        return _record(Fitted(replace(strategy, meta=dict(strategy.meta)), float(t), True, NONE))
    return _record(min(tried, key=lambda f: f.time_s))


def strongest_together(ev: PlanEvaluator, strategy: Strategy, ways: Sequence[str]) -> Strategy | None:
    """``strategy`` with the strongest plan of each of ``ways`` applied in turn (the most sharded state or
    offloading, every group recomputed, the most micro-batches): the least memory the ways reach; None
    where no way changes it."""
    out, changed = strategy, False
    for w in ways:
        made = WAYS[w][1](ev, out)
        if made is not None:
            out, changed = made, True
    return out if changed else None


def _record(found: Fitted) -> Fitted:
    """``found`` with its way in its plan's ``meta["fit"]`` and, where a group keeps sharded state, each
    group's (None or ``ShardedState.to_dict()``) in ``meta["sharded"]``."""
    meta, configs = found.strategy.meta, found.strategy.configs
    meta["fit"] = found.way
    meta.pop("sharded", None)
    if any(c.sharded is not None for c in configs):
        meta["sharded"] = [None if c.sharded is None else c.sharded.to_dict() for c in configs]
    return found


__all__ = ["BOUNDED_WAYS", "DEFAULT_WAYS", "FITS", "Fitted", "NONE", "OFFLOAD", "STATE_CHOICES", "WAYS", "check_ways",
           "fit", "holds_state", "micro_batch_way", "offloadable", "past", "recompute_way", "shardable",
           "sharded_variants", "sharded_way", "state_order", "strongest_together", "with_sharded"]
