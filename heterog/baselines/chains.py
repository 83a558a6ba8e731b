"""The pieces of a Markov chain search over per-group (M+4)-way actions that run wherever the chain runs
(here, or on a ``heterog.parallel`` worker): the scorer of action vectors and one Metropolis-Hastings chain."""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from heterog.actions import decode_action, n_actions
from heterog.baselines.fit import sharded_variants
from heterog.extended_actions import grid_configs
from heterog.shares import split_weights
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph

BLOCK_FRACTIONS = (0.5, 0.25)      # heavy edges: at least this share of the graph's largest edge's bytes
BLOCK_MAX_FLOPS_SHARE = 0.3        # a block is a small part of the work, not the model
BLOCK_MOVES = 0.1                  # share of a chain's proposals that move a block
SHARD_MOVES = 0.2                  # share of a chain's proposals that set or clear a group's sharded state


def split_action_configs(cluster: "Cluster", batch_size: int) -> list[tuple[str, ParallelConfig]]:
    """The splits beyond the batch that local search offers after the (M+4) actions, as (name, config):
    a group's parameters divided over every device (``tp-even``, ``tp-prop``: even shares, or in proportion
    to peak FLOP/s), and, on a cluster of several servers, over each server of several devices
    (``tp-even:<server>``, ``tp-prop:<server>``); on a cluster of several servers of the same number of devices
    (at least two), the grid of them (``tp-grid-even``, ``tp-grid-prop``, ``grid_configs``)."""
    spans = [("", tuple(range(cluster.n_devices)))]
    if len(cluster.servers) > 1:
        spans += [(f":{s.name}", tuple(int(d) for d in s.devices)) for s in cluster.servers]
    out: list[tuple[str, ParallelConfig]] = []
    for suffix, devs in spans:
        if len(devs) < 2:
            continue
        out.append((f"tp-even{suffix}", ParallelConfig.split_over(devs, [1] * len(devs), batch_size)))
        prop = split_weights(np.asarray(cluster.power)[list(devs)])
        out.append((f"tp-prop{suffix}", ParallelConfig.split_over(devs, prop, batch_size)))
    return out + grid_configs(cluster, batch_size)


class Block(NamedTuple):
    """Groups a search moves together (``coupled_blocks``), the gradient bytes they synchronise under
    data parallelism (what placing the block on one device can save) and the block's leader: the group
    that synchronises the most of them (the first where none does)."""

    groups: np.ndarray
    sync_bytes: float
    leader: int


def group_loads(graph: OpGraph, group_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the FLOPs of its ops and the bytes of the gradients it aggregates under data
    parallelism. Shapes: -> ``(G,)`` each."""
    from heterog.compiler.index import graph_index

    n_groups = int(group_of.max()) + 1 if len(group_of) else 0
    flops = np.bincount(group_of, weights=graph.flops, minlength=n_groups)
    gi = graph_index(graph)
    agg = gi.t_needs_agg
    return flops, np.bincount(group_of[gi.t_op[agg]], weights=gi.t_bytes[agg], minlength=n_groups)


def coupled_blocks(graph: OpGraph, group_of: np.ndarray, fractions: tuple[float, ...] = BLOCK_FRACTIONS,
                   max_flops_share: float = BLOCK_MAX_FLOPS_SHARE) -> list[Block]:
    """Sets of groups that a search should move together: for each ``f`` in ``fractions``, the connected
    components of the group graph whose edges carry at least ``f`` times the bytes of the graph's largest
    edge, keeping those of two or more groups and at most ``max_flops_share`` of the graph's FLOPs
    (sorted group ids, distinct blocks in order of discovery, each with the bytes of the gradients its
    groups aggregate and the group that aggregates the most, its leader).

    Why: the heaviest tensors join ops that only pay off on one device together. In bert_large a tied
    word embedding (125 MB), the LM head that shares its weight and the 117 MB logits between them are 12
    groups. On one device they need no gradient AllReduce of the two 125 MB partial gradients; moved one
    group at a time, every plan on the way re-lays out a 117 MB or 125 MB tensor and is slower, so a chain
    of single-group moves does not get there (docs/results.md, "Bounds and the 10% target")."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    src, dst, nbytes = graph.edge_src, graph.edge_dst, graph.edge_bytes
    n_groups = int(group_of.max()) + 1 if len(group_of) else 0
    if not len(src) or n_groups < 2:
        return []
    flops, sync = group_loads(graph, group_of)
    total = max(float(flops.sum()), 1e-30)
    gs, gd = group_of[src], group_of[dst]
    blocks: dict[tuple[int, ...], Block] = {}
    for f in fractions:
        heavy = (nbytes >= f * float(nbytes.max())) & (gs != gd)
        adj = coo_matrix((np.ones(int(heavy.sum())), (gs[heavy], gd[heavy])), shape=(n_groups, n_groups))
        _, label = connected_components(adj, directed=False)
        for comp in np.nonzero(np.bincount(label) >= 2)[0].tolist():
            members = np.nonzero(label == comp)[0]
            if flops[members].sum() <= max_flops_share * total:
                blocks.setdefault(tuple(members.tolist()), Block(members, float(sync[members].sum()),
                                                                 int(members[np.argmax(sync[members])])))
    return list(blocks.values())


def block_weights(blocks: list[Block]) -> np.ndarray:
    """Probabilities of drawing each block for a block move: half spread evenly, half in proportion to the
    gradient bytes each synchronises (all even where none does). A block without gradients only pays
    off on one device when its neighbours' layouts differ; one that aggregates a 125 MB gradient saves
    that AllReduce outright, so it is tried more often."""
    if not blocks:
        return np.zeros(0)
    even = np.full(len(blocks), 1.0 / len(blocks))
    sync = np.array([b.sync_bytes for b in blocks])
    return even if sync.sum() <= 0 else 0.5 * even + 0.5 * sync / sync.sum()


@dataclass
class ActionSearch:
    """Scores action vectors (one action per evaluator group) with the evaluator, under task order
    ``order`` (None: the evaluator's).

    What does not depend on the strategy is built once: the M+4 decoded configs (shared objects, so the
    compiler sees few distinct configs and patches the plan it compiled last) and the group layout;
    scores of action vectors already seen are remembered, so a proposal that revisits a plan costs
    nothing. ``n_evals`` counts simulations. ``blocks``: the groups block moves set together
    (``coupled_blocks``), drawn with probabilities ``block_p`` (``block_weights``).

    With ``sharded``, the AllReduce data-parallel actions (M+1, M+3) have variants keeping sharded state
    (``heterog.baselines.fit.sharded_variants``: each stage, shards even, by memory or by speed, on the GPUs
    and with the optimizer state offloaded where the servers have hosts), and so do the single-device
    actions 0..M-1 whose server has a host (offloading alone), numbered after the other actions:
    ``n_base`` actions are the plain ones, ``base_of`` maps each action to its plain one and ``family[a]``
    lists the plain action ``a`` and its variants (what a shard move picks among). Plans carry their plain
    actions in ``meta["actions"]`` and, where a group keeps sharded state, each group's (None or
    ``ShardedState.to_dict()``) in ``meta["sharded"]``.
    """

    ev: PlanEvaluator
    oom_factor: float = 10.0
    order: str | None = None
    splits: bool = False
    sharded: bool = False
    n_evals: int = 0
    eval_time_s: float = 0.0
    _configs: list[ParallelConfig] = field(default_factory=list, repr=False)
    _seen: dict[bytes, float] = field(default_factory=dict, repr=False)
    blocks: list[np.ndarray] = field(default_factory=list, repr=False)
    block_p: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    n_base: int = field(default=0, init=False, repr=False)
    base_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)
    family: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False)
    sharded_actions: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        c = self.ev.cluster
        blocks = coupled_blocks(self.ev.graph, np.asarray(self.ev.group_of))
        self.blocks = [b.groups for b in blocks]
        self.block_p = block_weights(blocks)
        self._configs = [decode_action(a, c.n_devices, self.ev.graph.batch_size, c.power)
                         for a in range(n_actions(c.n_devices))]
        # actions M+4, ...: with ``splits``, splits beyond the batch, where the graph has split options
        splits = split_action_configs(c, self.ev.graph.batch_size) \
            if self.splits and self.ev.graph.splits is not None else []
        self.split_names = [name for name, _ in splits]
        self._configs += [cfg for _, cfg in splits]
        self.n_base = len(self._configs)
        base_of = list(range(self.n_base))
        self.family = {}
        for a in (c.n_devices + 1, c.n_devices + 3, *range(c.n_devices)) if self.sharded else ():
            variants = sharded_variants(self._configs[a], c)
            if a < c.n_devices and not variants:          # one device: only where its server has a host
                continue
            self.family[a] = [a]
            for cfg in variants:
                self.family[a].append(len(self._configs))
                base_of.append(a)
                self._configs.append(cfg)
        self.base_of = np.asarray(base_of, dtype=np.int64)
        self.sharded_actions = [v for fam in self.family.values() for v in fam[1:]]

    @property
    def n_actions(self) -> int:
        """Actions per group: the (M+4) of ``heterog.strategy``, the splits (``split_names``) and the
        sharded-state variants."""
        return len(self._configs)

    def strategy(self, actions: np.ndarray) -> Strategy:
        g, c = self.ev.graph, self.ev.cluster
        configs = [self._configs[a] for a in actions.tolist()]
        meta: dict[str, Any] = {"actions": self.base_of[actions].tolist()}
        if any(cfg.sharded is not None for cfg in configs):
            meta["sharded"] = [None if cfg.sharded is None else cfg.sharded.to_dict() for cfg in configs]
        return Strategy(g.fingerprint, c.name, c.n_devices, g.batch_size, self.ev.group_of, configs, meta=meta)

    def shard_move(self, action: int, rng: np.random.Generator) -> int:
        """The action a shard move gives a group that has ``action``: another of its family (another
        stage or shard weights, or none) where it is an AllReduce data-parallel action, else a random
        sharded variant (data parallelism keeping sharded state)."""
        fam = self.family.get(int(self.base_of[action]), [])
        if len(fam) > 1:
            others = [a for a in fam if a != action]
            return int(others[int(rng.integers(len(others)))])
        return int(self.sharded_actions[int(rng.integers(len(self.sharded_actions)))])

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
    temperature of the acceptance rule; ``keep``: best distinct plans to return; ``block_moves``: share
    of proposals that set a whole block of coupled groups (``coupled_blocks``) to one action;
    ``shard_moves``: share of proposals that set or clear one group's sharded state (``ActionSearch.shard_move``;
    where the search offers it)."""

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
    block_moves: float = BLOCK_MOVES
    shard_moves: float = SHARD_MOVES


@dataclass
class ChainState:
    """A chain between two of its segments (``run_chain`` with ``segment``): all that the next segment,
    on this worker or another, needs to go on exactly as if the chain had not stopped."""

    cur: np.ndarray
    cur_cost: float
    top: dict[bytes, tuple[float, np.ndarray]]
    best: float
    rng: Mapping[str, Any]          # the chain generator's bit_generator.state
    proposals: int = 0
    accepted: int = 0
    last_gain: float = 0.0
    elapsed_s: float = 0.0          # wall time of the segments so far (the clock of a time budget)
    n_evals: int = 0
    eval_time_s: float = 0.0


@dataclass
class ChainResult:
    """What a chain found: its best plans (cost, actions), best first, and its counters. ``state`` is set
    when the chain stopped at the end of a segment with budget left: pass it back to ``run_chain``."""

    index: int
    name: str
    best: list[tuple[float, np.ndarray]]
    proposals: int
    accepted: int
    n_evals: int
    eval_time_s: float
    wall_s: float
    state: ChainState | None = None

    @property
    def best_cost(self) -> float:
        return self.best[0][0]


def run_chain(search: ActionSearch, chain: Chain, state: ChainState | None = None,
              segment: float | None = None) -> ChainResult:
    """Metropolis-Hastings from ``chain.start``: a proposal changes one random group's action to another
    random plain action (``ActionSearch.n_base``), or (a share ``chain.shard_moves`` of proposals, where the
    search offers sharded state) one random group's sharded state, or (a share ``chain.block_moves`` of
    proposals, where the graph has blocks) sets every
    group of a block (drawn by ``search.block_p``) to one random action not all of them have; it is
    accepted with probability min(1, exp(beta * (cost - cost'))).

    With ``segment`` (proposals or seconds, as the budget) the chain stops after that much more and, if
    its budget is not spent, returns its ``state``; ``run_chain(search, chain, state, ...)`` goes on from
    there. Split by proposals, the chain is the same Markov chain however it is cut (so a search can
    hand its chains' segments to whichever worker is free)."""
    t0 = time.perf_counter()
    evals0, eval_s0 = search.n_evals, search.eval_time_s
    g_count, a_count = len(chain.start), search.n_base
    if state is None:
        rng = np.random.default_rng([chain.seed, chain.index])
        cur = chain.start.copy()
        state = ChainState(cur, chain.start_cost, {cur.tobytes(): (chain.start_cost, cur.copy())},
                           min(chain.target, chain.start_cost), rng.bit_generator.state)
    else:
        rng = np.random.default_rng()
        rng.bit_generator.state = state.rng
    st = state
    cur, cur_cost, top, best = st.cur, st.cur_cost, st.top, st.best
    proposals, accepted, last_gain = st.proposals, st.accepted, st.last_gain

    def clock() -> float:
        return float(proposals) if chain.by_proposals else st.elapsed_s + time.perf_counter() - t0

    def running() -> bool:
        return bool(g_count) and clock() < chain.budget and clock() - last_gain < chain.budget / 2

    stop = math.inf if segment is None else clock() + segment
    while running() and clock() < stop:
        cand = cur.copy()
        if search.sharded_actions and rng.random() < chain.shard_moves:
            g = int(rng.integers(g_count))
            cand[g] = search.shard_move(int(cur[g]), rng)
        elif search.blocks and rng.random() < chain.block_moves:
            members = search.blocks[int(rng.choice(len(search.blocks), p=search.block_p))]
            held = np.unique(cur[members])
            a = int(rng.integers(a_count - 1)) if len(held) == 1 else int(rng.integers(a_count))
            a += len(held) == 1 and a >= held[0]
            cand[members] = a
        else:
            g = int(rng.integers(g_count))
            a = int(rng.integers(a_count - 1))
            a += a >= search.base_of[cur[g]]
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
    more = running()
    state = ChainState(cur, cur_cost, top, best, rng.bit_generator.state, proposals, accepted, last_gain,
                       st.elapsed_s + time.perf_counter() - t0, st.n_evals + search.n_evals - evals0,
                       st.eval_time_s + search.eval_time_s - eval_s0)
    ranked = sorted(top.values(), key=lambda v: v[0])
    return ChainResult(chain.index, chain.name, ranked, proposals, accepted, state.n_evals, state.eval_time_s,
                       state.elapsed_s, state if more else None)
