"""The strategies the trainer simulates besides the policy's own samples, and how they are scored.

The trainer's strategies are plans (``envs.actions``): ``G`` group configs, ``G`` recompute bits and the
micro-batch choice, one row of length ``2 G + 1``. :class:`CandidateSearch` proposes the uniform seed
plans, exploration offsets (one logit offset per action, for whole-plan changes), mutations of the best
plan found (uniform, guided by the policy, one coupled block of groups at once: :class:`BlockMoves`, which
also ties a block's groups to one decision, or a change of the micro-batches or recompute bits) and
replays from the pool of the best distinct plans; every draw comes from the trainer's seeded generators.
:class:`Scorer` simulates strategies once each (a per-graph cache), here or on Ray workers.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from agents.settings import TrainerSettings
from agents.tasks import GraphTask, TaskState
from envs.actions import MICRO_CHOICES, SCHEDULE, full_plan, micro_batches, plan_length, plan_strategy, split_plan
from heterog.actions import (
    SPLIT_ACTION_NAMES,
    STATE_BASES,
    STATE_CHOICES,
    server_split_action,
    state_action,
    state_choice_name,
)
from heterog.errors import HeterogError
from heterog.evaluate import reward
from heterog.reporting import DP_BASELINES

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Sequence

    from heterog.cluster import Cluster
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.parallel import Pool


def plan_key(plan: np.ndarray) -> bytes:
    """A plan's key in the scorer's cache: a 16-byte digest of its entries (an extended plan's rows make it
    ``(M + 2) G + 1`` entries long)."""
    return hashlib.blake2b(np.ascontiguousarray(plan, dtype=np.int64).tobytes(), digest_size=16).digest()


def in_policy(plans: Tensor, n_groups: int, n_actions: int) -> Tensor:
    """Which plans ``(k, L)`` the policy's actions hold: every group's config among its ``n_actions`` and the
    micro-batch choice among ``MICRO_CHOICES`` (then the first ``2 G + 1`` entries are the plan, rows unread).
    Shapes: -> ``(k,)`` bool."""
    return (plans[:, :n_groups] < n_actions).all(dim=1) & (plans[:, 2 * n_groups] < len(MICRO_CHOICES))


def promising_uniform(n_devices: int, splits: bool = False, states: bool = False) -> dict[str, int]:
    """The actions whose uniform plans (every group under the one action) are the likeliest to be good: the
    four data-parallel schemes, with ``splits`` the two cluster-wide splits, with ``states`` the two
    AllReduce schemes keeping each state choice with shards by memory (name -> action; zero-shot's
    candidates beside the policy's plan, and the uniform plans a search simulates first)."""
    m = int(n_devices)
    names = DP_BASELINES + (SPLIT_ACTION_NAMES if splits else ())
    out = {name: m + k for k, name in enumerate(names)}
    if states:
        for base in STATE_BASES:
            for c, (_, by, _) in enumerate(STATE_CHOICES):
                if by == "memory":
                    out[f"{names[base]}:{state_choice_name(c)}"] = state_action(m, m + base, c, splits)
    return out


def server_splits(cluster: Cluster) -> dict[str, int]:
    """The actions whose uniform plans divide every group evenly over one server's devices (``tp-server:<name>``
    -> action, ``heterog.actions.server_split_action``), for each server of two or more devices, the servers of
    the most device power first (ties: the first listed): the plan that keeps slow links idle, MCMC's best
    start in half of the planner table's cases (``heterog.baselines.mcmc.start_actions``' ``tp-server``)."""
    m = cluster.n_devices
    servers = [s for s in cluster.servers if len(s.devices) >= 2]
    power = np.asarray(cluster.power, dtype=np.float64)
    servers.sort(key=lambda s: -float(power[list(s.devices)].sum()))
    return {f"tp-server:{s.name}": server_split_action(m, int(s.devices[0])) for s in servers}


def uniform_plans(n_actions: int, n_groups: int) -> np.ndarray:
    """The plans that give every group the same action, one per action (the whole graph on one device,
    or one data-parallel scheme everywhere: the DP baselines). Shapes: -> ``(A, G)``."""
    return np.repeat(np.arange(n_actions, dtype=np.int64)[:, None], n_groups, axis=1)


@dataclass(frozen=True)
class BlockMoves:
    """A task's coupled blocks for block mutations: each block's groups, the probability of drawing it
    and its leader, the group whose action a tied block takes (``heterog.baselines.chains.coupled_blocks``
    and ``block_weights``)."""

    groups: list[Tensor]
    p: Tensor
    leaders: list[int]

    @classmethod
    def of(cls, evaluator: PlanEvaluator) -> BlockMoves:
        from heterog.baselines.chains import block_weights, coupled_blocks

        found = coupled_blocks(evaluator.graph, np.asarray(evaluator.group_of))
        return cls([torch.as_tensor(b.groups, dtype=torch.long) for b in found],
                   torch.as_tensor(block_weights(found), dtype=torch.float64), [b.leader for b in found])

    def tie(self, n_groups: int) -> Tensor:
        """Each group's representative: its block's leader (the group that synchronises the most gradient
        bytes, so that a tied block moves with the tensor it is a block for; the later block where blocks
        overlap), or itself outside any block. ``actions[:, tie]`` gives every block its leader's action.
        Shapes: -> ``(G,)``."""
        rep = torch.arange(n_groups)
        for g, lead in zip(self.groups, self.leaders):
            rep[g] = lead
        return rep


class CandidateSearch:
    """Exploration offsets, mutations and replays for the trainer (settings ``explore_noise``,
    ``mutate_groups``, ``mutate_guided``, ``replay_pool_size``, ``replay_samples``).

    Args:
        settings: the trainer's settings.
        n_actions: the policy's action count (M + 4).
        generator: the torch generator the trainer samples with (offsets and mutations draw from it).
        rng: the numpy generator the trainer picks graphs with (replays draw from it).
    """

    def __init__(self, settings: TrainerSettings, n_actions: int, generator: torch.Generator,
                 rng: np.random.Generator) -> None:
        self.settings, self.n_actions, self.generator, self.rng = settings, n_actions, generator, rng

    def explore_offsets(self, n: int, n_actions: int | None = None) -> Tensor:
        """Logit offsets of ``n`` exploration strategies: one random offset per action, shared by all groups
        of a strategy (parameter-space noise on the head bias), for correlated changes that independent
        per-group sampling almost never makes. ``n_actions``: the cluster at hand's ``M + 4`` (None: the
        policy's). Shapes: -> ``(n, A)``."""
        size = self.n_actions if n_actions is None else n_actions
        return torch.randn(n, size, generator=self.generator) * self.settings.explore_noise

    def mutate(self, base: Tensor, n_actions: int, n: int, guide: Tensor | None = None,
               blocks: BlockMoves | None = None) -> Tensor:
        """``n`` copies of ``base`` with ``mutate_groups`` distinct groups each set to another action: random
        groups and actions, or for a share ``mutate_guided`` of the copies (with the policy's probabilities
        ``guide`` along ``base``) groups drawn in proportion to ``1 - guide[g, base[g]]`` and actions in
        proportion to ``guide[g]`` without ``base[g]``. Then each copy becomes, with probability
        ``mutate_blocks`` (where ``blocks`` has any), ``base`` with one coupled block (drawn by
        ``blocks.p``) set to one action it does not hold everywhere: MCMC's block move
        (``heterog.baselines.chains.coupled_blocks``).

        Shapes: base ``(G,)``, guide ``(G, A)`` -> ``(n, G)``.
        """
        out = base[None].repeat(n, 1)
        n_groups = len(base)
        if n == 0 or n_groups == 0 or n_actions < 2:
            return out
        k = min(self.settings.mutate_groups, n_groups)
        groups = torch.rand(n, n_groups, generator=self.generator).argsort(dim=1)[:, :k]        # (n, k)
        shift = torch.randint(1, n_actions, (n, k), generator=self.generator)                 # never the same
        rows = torch.arange(n)[:, None]
        new = (out[rows, groups] + shift) % n_actions
        n_guided = 0 if guide is None else round(self.settings.mutate_guided * n)
        if guide is not None and n_guided:
            others = guide.clone()
            inside = torch.nonzero(base < others.shape[1]).flatten()            # an extended action: none the same
            others[inside, base[inside]] = 0.0                                  # never the same action
            weight = others.sum(dim=1) + 1e-12
            guided = torch.multinomial(weight.expand(n_guided, -1), k, generator=self.generator)   # (n_guided, k)
            groups[:n_guided] = guided
            new[:n_guided] = torch.multinomial(others[guided.flatten()] + 1e-12, 1,
                                               generator=self.generator).reshape(n_guided, k)
        out[rows, groups] = new
        if blocks is not None and blocks.groups and self.settings.mutate_blocks > 0:
            chosen = torch.rand(n, generator=self.generator) < self.settings.mutate_blocks
            for i in torch.nonzero(chosen).flatten().tolist():
                members = blocks.groups[int(torch.multinomial(blocks.p, 1, generator=self.generator))]
                held = torch.unique(base[members])
                one = len(held) == 1 and int(held[0]) < n_actions               # one of the actions drawn from
                a = int(torch.randint(n_actions - one, (1,), generator=self.generator))
                a += int(one and a >= int(held[0]))
                out[i] = base
                out[i, members] = a
        return out

    def mutate_plans(self, base: Tensor, n_groups: int, n_actions: int, n: int, guide: Tensor | None = None,
                     blocks: BlockMoves | None = None, micro_choices: int = len(MICRO_CHOICES),
                     micro_moves: Callable[[int], Sequence[int]] | None = None) -> Tensor:
        """``n`` mutations of the plan ``base``: its configs mutated as :meth:`mutate` does, its recompute bits,
        micro-batch choice (and rows) kept; then each copy becomes, with probability ``mutate_memory``,
        ``base`` with another micro-batch choice (half of them: uniform over the other of ``micro_choices``
        choices, or over ``micro_moves(choice)`` where given, ``envs.actions.micro_neighbours`` for the extended
        choices) or with the recompute bits of ``mutate_groups`` random groups flipped (also where
        ``micro_moves`` gives no choice). A group under an extended action (beyond ``n_actions``; its row in
        ``base``) changes to one of the ``n_actions``.

        Shapes: base ``(2 G + 1,)`` (extended: ``(2 G + 1 + G M,)``), guide ``(G, A)`` -> ``(n, len(base))``.
        """
        out = torch.cat([self.mutate(base[:n_groups], n_actions, n, guide, blocks),
                         base[None, n_groups:].repeat(n, 1)], dim=1)
        if n == 0 or n_groups == 0 or self.settings.mutate_memory == 0:
            return out
        chosen = torch.rand(n, generator=self.generator) < self.settings.mutate_memory
        k = min(self.settings.mutate_groups, n_groups)
        moves = None if micro_moves is None else micro_moves(int(base[2 * n_groups]))
        for i in torch.nonzero(chosen).flatten().tolist():
            out[i] = base
            if float(torch.rand(1, generator=self.generator)) < 0.5 and (moves is None or len(moves)):
                if moves is None:
                    c = int(torch.randint(micro_choices - 1, (1,), generator=self.generator))
                    out[i, 2 * n_groups] = c + int(c >= int(base[2 * n_groups]))
                else:
                    out[i, 2 * n_groups] = int(moves[int(torch.randint(len(moves), (1,), generator=self.generator))])
            else:
                flip = n_groups + torch.randperm(n_groups, generator=self.generator)[:k]
                out[i, flip] = 1 - base[flip]
        return out

    def remember(self, state: TaskState, actions: np.ndarray, rewards: np.ndarray) -> None:
        """Add the strategies ``actions`` ``(k, G)`` not pooled yet to ``state``'s pool, best first, and keep
        the ``replay_pool_size`` best."""
        size = self.settings.replay_pool_size
        if size == 0:
            return
        known = {tuple(a) for _, a in state.pool}
        for j in np.argsort(-rewards, kind="stable"):
            a = actions[j].tolist()
            if tuple(a) not in known:
                state.pool.append((float(rewards[j]), a))
                known.add(tuple(a))
        state.pool.sort(key=lambda entry: -entry[0])
        del state.pool[size:]

    def replay(self, state: TaskState, n_groups: int | None = None,
               row_width: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``replay_samples`` strategies drawn from the pool (seeded), as (R, L) actions and (R,) rewards;
        ``n_groups``: give them as plans over that many groups (L = 2 G + 1, with ``row_width`` rows of that
        many entries: ``(row_width + 2) G + 1``; pooled configs alone are plans of one micro-batch without
        recomputation), None: as pooled."""
        n = min(self.settings.replay_samples, len(state.pool))
        if n == 0:
            width = len(state.best_actions or []) if n_groups is None else plan_length(n_groups, row_width)
            return np.zeros((0, width), dtype=np.int64), np.zeros(0)
        chosen = np.sort(self.rng.choice(len(state.pool), size=n, replace=False))
        rows = [state.pool[c][1] if n_groups is None else full_plan(state.pool[c][1], n_groups, row_width)
                for c in chosen]
        return np.array(rows, dtype=np.int64), np.array([state.pool[c][0] for c in chosen])


class Scorer:
    """Rewards, iteration times and OOM flags of strategies, each simulated once per graph (an LRU cache of
    ``cache_size`` results per graph), here or on ``workers`` Ray workers (the same numbers either way).

    Args:
        tasks: the graphs.
        oom_factor: reward multiplier of a plan that runs out of memory.
        cache_size: results remembered per graph.
        workers: simulation processes (1: simulate here).
        ray_address: the Ray cluster whose workers simulate (None: a local Ray when ``workers`` > 1).
        states, splits: the plans' configs are of the action space with state actions (after those of
            ``splits``; ``envs.actions.plan_strategy``); such plans are simulated here only.
        extended: the plans are those of the extended actions (with rows; ``Scorer.width``); simulated here
            (the workers idle), with the same results as on them.
    """

    def __init__(self, tasks: list[GraphTask], oom_factor: float, cache_size: int, workers: int = 1,
                 ray_address: str | None = None, states: bool = False, splits: bool = False,
                 extended: bool = False) -> None:
        if states and (workers > 1 or ray_address is not None):
            raise HeterogError("plans with state actions (sharded state) are simulated in this process: use one "
                               "worker and no Ray address")
        self.oom_factor, self.cache_size, self.workers, self.ray_address = oom_factor, cache_size, workers, ray_address
        self.states, self.splits, self.extended = states, splits, extended
        self.n_sims = 0                                       # simulations actually run (cache misses)
        self._cache: dict[str, OrderedDict] = {t.key: OrderedDict() for t in tasks}
        self._pool: Pool | None = None                        # simulation workers, started on first use
        self._pool_keys: dict[str, str] = {}

    def score(self, task: GraphTask, actions: np.ndarray,
              deadline: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rewards, iteration times and OOM flags ``(k,)`` of strategies ``(k, G)``. With ``deadline`` (a
        ``time.perf_counter()`` time) and simulations in this process, no simulation starts after it except
        the first: the results are those of the first ``k' <= k`` strategies (``k' >= 1``), all that were
        scored in order."""
        cache = self._cache[task.key]
        actions = full_plan(np.asarray(actions), task.n_groups, self.width(task))
        keys = [plan_key(a) for a in actions]
        missing = list(dict.fromkeys(k for k in keys if k not in cache))
        if missing and deadline is not None and self.here:
            for n, k in enumerate(missing):
                if n and time.perf_counter() >= deadline:
                    keys = keys[:keys.index(k)]                 # the strategies before the first not scored
                    break
                cache[k] = self.simulate(task, np.asarray(actions)[keys.index(k)][None])[0]
                self.n_sims += 1
        elif missing:
            rows = np.array([keys.index(k) for k in missing])
            for k, hit in zip(missing, self.simulate(task, np.asarray(actions)[rows])):
                cache[k] = hit
            self.n_sims += len(missing)
        rewards, times, ooms = np.empty(len(keys)), np.empty(len(keys)), np.zeros(len(keys), dtype=bool)
        for i, key in enumerate(keys):
            cache.move_to_end(key)
            times[i], ooms[i] = cache[key]
            rewards[i] = reward(times[i], ooms[i], self.oom_factor)
        while len(cache) > self.cache_size:
            cache.popitem(last=False)
        return rewards, times, ooms

    @property
    def here(self) -> bool:
        """Whether the plans are simulated in this process: one worker and no Ray address, or extended plans."""
        return self.workers == 1 and self.ray_address is None or self.extended

    def width(self, task: GraphTask) -> int:
        """The rows' width of ``task``'s plans: its devices with extended actions, else 0 (no rows)."""
        return task.inputs.n_devices if self.extended else 0

    def prime(self, task: GraphTask, actions: np.ndarray, results: list[tuple[float, bool]]) -> None:
        """Remember the (iteration time, OOM) of strategies ``actions`` ``(k, G)`` simulated elsewhere (the
        decoding of each must simulate exactly so), so that scoring them simulates nothing."""
        cache = self._cache[task.key]
        for a, hit in zip(full_plan(np.asarray(actions), task.n_groups, self.width(task)), results):
            cache[plan_key(a)] = (float(hit[0]), bool(hit[1]))

    def simulate(self, task: GraphTask, actions: np.ndarray) -> list[tuple[float, bool]]:
        """(iteration time, OOM) of strategies ``actions``, plans (K, 2 G + 1) or configs alone (K, G):
        here, or in ``workers`` contiguous chunks on Ray workers."""
        ev, n_groups = task.evaluator, task.n_groups
        plans = full_plan(actions, n_groups, self.width(task))
        if self.here or len(plans) <= 1:
            return [ev.iteration_time(plan_strategy(ev, a, "agent", states=self.states, splits=self.splits,
                                                    extended=self.extended)) for a in plans]
        from heterog.parallel import EvaluatorSpec, make_pool

        if self._pool is None:
            self._pool = make_pool(self.workers, self.ray_address)
        if task.key not in self._pool_keys:
            self._pool_keys[task.key] = self._pool.register(EvaluatorSpec.of(ev))
        extras = []
        for a in plans:
            plan = split_plan(a, n_groups, n_groups, ev.cluster.n_devices)
            extras.append((micro_batches(plan.micro_index, ev.graph.batch_size), SCHEDULE, tuple(plan.recomputed)))
        cuts = [c for c in np.array_split(np.arange(len(plans)), self._pool.n_workers) if len(c)]
        jobs = [(plans[c, :n_groups], [extras[i] for i in c.tolist()]) for c in cuts]
        return [hit for part in self._pool.map("plan_times", self._pool_keys[task.key], jobs) for hit in part]

    def close(self) -> None:
        """Stop the simulation workers (if any were started)."""
        if self._pool is not None:
            self._pool.close()
            self._pool, self._pool_keys = None, {}
