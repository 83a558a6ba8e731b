"""Training the strategy policy by policy gradient over several graphs at once.

HeteroG's update rule: per graph, one forward pass gives the per-group distribution, k strategies
are sampled from it and simulated, and the advantage of each is its reward minus the graph's
moving-average baseline. PPO (clipped, a few epochs over the same samples) is an option, and so are
a pool of the best strategies found, replayed as extra samples, and exploration samples drawn with
one random logit offset per strategy (whole-plan changes). Everything is determined by the seed;
``state_dict``/``load_state_dict`` resume a run exactly. Metrics go to TensorBoard.
"""
from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from agents.features import PolicyInputs
from agents.networks import N_DP_SCHEMES, StrategyPolicy
from envs.features import graph_features
from heterog.errors import CheckpointError, HeterogError
from heterog.evaluate import Evaluator, reward
from heterog.strategy import Strategy, action_name

ALGORITHMS = ("reinforce", "ppo")


# ============================================================================================ settings
@dataclass
class TrainerSettings:
    """How the policy is trained; every setting is declared here once (hydra's ``trainer/`` fills it)."""

    algorithm: str = "reinforce"
    """``"reinforce"`` (HeteroG's rule) or ``"ppo"`` (clipped objective, ``ppo_epochs`` per round)."""
    learning_rate: float = 1e-3
    """Adam step size. At 1e-2 the policy does not learn per-group choices: its greedy plan stays the
    uniform one (gpt2 from scratch, 400 s: greedy 336.2 ms while the best plan found is 285.1 ms; even
    supervised imitation of a rule of the features is not learned, ``experiments.policy_probe``). At
    1e-3 its greedy plan is the best one found (283.5 ms) and the search is as good (vgg19 370.29 ms
    either way); ``initial_dp_bias`` gives a fresh policy its head start on the DP actions."""
    samples_per_graph: int = 16
    """Strategies sampled per graph from one forward pass (k)."""
    graphs_per_round: int = 0
    """Graphs updated together per round, drawn without replacement by the seeded generator (0: all)."""
    baseline_decay: float = 0.9
    """Moving-average factor of each graph's reward baseline: b <- decay b + (1 - decay) mean(r)."""
    normalize_advantage: bool = True
    """Divide advantages by a running per-graph reward standard deviation (same decay as the baseline)."""
    entropy_coef: float = 0.01
    """Weight of the mean per-group entropy bonus."""
    max_grad_norm: float = 1.0
    """Clip the gradient's global norm to this (0: no clipping)."""
    replay_pool_size: int = 8
    """Best distinct strategies kept per graph for replay (0: no pool)."""
    replay_samples: int = 2
    """Pool strategies replayed per graph and round as extra samples (advantage clipped at 0)."""
    explore_samples: int = 4
    """Of the k samples, how many come from the policy with its head bias perturbed (0: none): one
    Gaussian offset per action, shared by all groups of the strategy, so that whole-plan changes
    (e.g. every group from even to proportional shares) get tried. Used like replays."""
    explore_noise: float = 2.0
    """Standard deviation of that per-action logit offset."""
    mutate_samples: int = 4
    """Of the k samples, how many are the best strategy found so far with ``mutate_groups`` random
    groups set to random actions (FlexFlow's local moves, around the best instead of the policy;
    0: none). Used like replays. They let the search finish what the policy roughly found: on
    transformer from scratch (400 s) the best plan went from 190.8 to 186.6 ms with 4 of 16."""
    mutate_groups: int = 1
    """Groups changed per mutated strategy."""
    mutate_guided: float = 0.5
    """Share of the mutation samples proposed by the policy instead of uniformly: the groups to change
    drawn in proportion to how likely the policy is to leave the best strategy's action there, the new
    action from the policy's distribution without that action. A pretrained policy's prior on where to
    move (it gives the groups that an unseen graph's best plan puts on one device 5-12x the model-
    parallel probability of the others) then steers the local search. With 0.5 against 0 (400 s, one seed
    each): from scratch gpt2 279.3 against 283.5 ms and bert_large 537.9 against 543.6, fine-tuned 279.8
    against 282.4 and 532.4 against 536.0."""
    seed_uniform_plans: bool = True
    """Before a graph's first round, simulate the M + 4 plans that give every group the same action (the
    whole graph on one device, or one data-parallel scheme everywhere: the DP baselines ev-ps, ev-ar,
    cp-ps, cp-ar) and record them like samples: they enter the replay pool and the best one is where the
    mutation samples start. Without them the search can settle on a plan worse than plain data
    parallelism (vgg19 from scratch, seeds 1 and 2: 459.8 ms against cp-ar's 391.8 ms after 400 s)."""
    ppo_epochs: int = 4
    """PPO: passes over one round's samples."""
    ppo_clip: float = 0.2
    """PPO: clip range of the per-group probability ratio."""
    oom_factor: float = 10.0
    """Reward multiplier of a plan that runs out of memory."""
    initial_dp_bias: float = 3.0
    """Added to the head bias of the four data-parallel actions of a fresh policy (0: uniform start;
    3: P(DP) = 0.91 per group on 8 devices)."""
    eval_cache_size: int = 50_000
    """Simulated results remembered per graph so repeated samples are not simulated again."""
    log_every: int = 20
    """Rounds between the heavier TensorBoard records (action histogram, breakdown text)."""
    workers: int = 1
    """Processes that simulate a round's strategies: 1 simulates them here; more fan them out to Ray
    workers (``heterog.parallel``; the policy update stays here). Results do not depend on it."""
    seed: int = 0
    """Seeds the torch sampling generator, numpy and python generators."""

    def __post_init__(self) -> None:
        problems = []
        if self.algorithm not in ALGORITHMS:
            problems.append(f"algorithm {self.algorithm!r} is not one of {ALGORITHMS}")
        for name in ("learning_rate", "samples_per_graph", "ppo_epochs", "ppo_clip"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("graphs_per_round", "replay_pool_size", "replay_samples", "entropy_coef", "max_grad_norm",
                     "eval_cache_size"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be non-negative, got {getattr(self, name)}")
        if not 0.0 <= self.baseline_decay < 1.0:
            problems.append(f"baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if self.explore_samples < 0 or self.mutate_samples < 0 or \
                self.explore_samples + self.mutate_samples >= self.samples_per_graph:
            problems.append(f"explore_samples {self.explore_samples} + mutate_samples {self.mutate_samples} "
                            f"must be in 0..samples_per_graph-1 ({self.samples_per_graph - 1}), each non-negative")
        if not 0.0 <= self.mutate_guided <= 1.0:
            problems.append(f"mutate_guided must be in [0, 1], got {self.mutate_guided}")
        if self.mutate_groups < 1:
            problems.append(f"mutate_groups must be at least 1, got {self.mutate_groups}")
        if self.explore_noise < 0:
            problems.append(f"explore_noise must be non-negative, got {self.explore_noise}")
        if self.replay_samples > self.replay_pool_size:
            problems.append(f"replay_samples {self.replay_samples} exceeds replay_pool_size {self.replay_pool_size}")
        if self.log_every < 1:
            problems.append(f"log_every must be at least 1, got {self.log_every}")
        if self.workers < 1:
            problems.append(f"workers must be at least 1, got {self.workers}")
        if problems:
            raise HeterogError("bad trainer settings: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict) -> TrainerSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ============================================================================================== tasks
@dataclass
class GraphTask:
    """One (graph, cluster) the agent plans for: its evaluator and the policy's inputs."""

    name: str
    evaluator: Evaluator
    inputs: PolicyInputs

    @classmethod
    def from_evaluator(cls, evaluator: Evaluator, name: str | None = None) -> GraphTask:
        g = evaluator.graph
        features = graph_features(g, evaluator.cluster, evaluator.cost, evaluator.group_of)
        return cls(name or f"{g.name}-b{g.batch_size}", evaluator, PolicyInputs.from_features(features))

    @property
    def key(self) -> str:
        """Identifies the task in checkpoints: name, cluster and the graph's fingerprint."""
        g = self.evaluator.graph
        return f"{self.name}@{self.evaluator.cluster.name}:{g.fingerprint[:16]}"

    @property
    def n_groups(self) -> int:
        return self.inputs.n_groups


def make_task(graph, cluster, *, max_groups: int = 2000, name: str | None = None) -> GraphTask:
    """A GraphTask for ``graph`` on ``cluster`` (HeteroG grouping into at most ``max_groups`` groups)."""
    return GraphTask.from_evaluator(Evaluator(graph, cluster, max_groups=max_groups), name)


@dataclass
class TaskState:
    """What the trainer learns about one graph: its baseline, its best plans and its history."""

    baseline: float | None = None
    """Moving average of sampled rewards (None before the first round)."""
    reward_var: float = 0.0
    """Moving average of squared deviations from the baseline (advantage scale)."""
    best_reward: float = -math.inf
    """Highest reward seen (OOM plans count with the oom_factor penalty)."""
    best_iteration_time_s: float = math.inf
    """Iteration time of that best plan."""
    best_oom: bool = True
    """Whether that best plan runs out of memory."""
    best_actions: list[int] | None = None
    """Its action per group (None before the first sample)."""
    pool: list[tuple[float, list[int]]] = field(default_factory=list)
    """Best distinct strategies seen (reward, actions), best first."""
    episodes: int = 0
    """Strategies sampled for this graph (replays not counted)."""
    history: list[tuple[float, float, int, float]] = field(default_factory=list)
    """(wall_s, cpu_s, episodes, best_iteration_time_s) whenever the best improved."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TaskState:
        state = cls(**d)
        state.pool = [(float(r), list(a)) for r, a in state.pool]
        state.history = [tuple(h) for h in state.history]
        return state


# =========================================================================================== the update
def per_group_log_prob(logits: Tensor, actions: Tensor) -> Tensor:
    """Log probability of each group's action, from one set of logits for all strategies or one per
    strategy (an autoregressive policy's, :meth:`StrategyPolicy.action_logits`).

    Shapes: logits ``(G, A)`` or ``(K, G, A)``, actions ``(K, G)`` -> ``(K, G)``.
    """
    log_p = logits.log_softmax(dim=-1).expand(actions.shape[0], -1, -1)
    return log_p.gather(-1, actions[..., None])[..., 0]


def mean_entropy(logits: Tensor) -> Tensor:
    """Mean entropy of the per-group distributions. Shapes: ``(..., G, A)`` -> ``()``."""
    return -(logits.softmax(dim=-1) * logits.log_softmax(dim=-1)).sum(-1).mean()


def policy_loss(log_p: Tensor, log_p_old: Tensor, advantages: Tensor, algorithm: str, clip: float) -> Tensor:
    """Policy-gradient loss averaged over samples and groups (each group's decision is one factor of
    the strategy and shares the strategy's advantage).

    REINFORCE: ``-A log pi``. PPO: ``-min(rho A, clip(rho, 1-eps, 1+eps) A)`` with the per-group ratio
    ``rho = pi / pi_old`` (a ratio of whole-strategy probabilities over ~1000 groups would always clip).

    Shapes: log_p, log_p_old ``(K, G)``, advantages ``(K,)`` -> ``()``.
    """
    adv = advantages[:, None]
    if algorithm == "reinforce":
        return -(adv * log_p).mean()
    ratio = (log_p - log_p_old).exp()
    return -torch.min(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv).mean()


@dataclass
class _Sample:
    """One graph's part of a round: the strategies, their advantages and old log probabilities."""

    task: GraphTask
    actions: Tensor          # (K + R, G) sampled then replayed
    advantages: Tensor       # (K + R,)
    log_p_old: Tensor        # (K + R, G)
    logits: Tensor | None    # (K + R, G, A) along the strategies, with their graph (used by the first epoch)


def bias_towards_data_parallel(policy: StrategyPolicy, bias: float) -> None:
    """Add ``bias`` to the head bias of the four data-parallel actions (a fresh policy then samples DP
    with probability 4 e^b / (M + 4 e^b) per group instead of 4 / (M + 4))."""
    if bias:
        with torch.no_grad():
            policy.head.bias[policy.n_actions - N_DP_SCHEMES:] += bias


# ============================================================================================ trainer
class Trainer:
    """Policy-gradient training of ``policy`` on ``tasks`` (all for clusters of the policy's size).

    Args:
        policy: the strategy network (its action count must be M + 4 of every task's cluster).
        tasks: the graphs to train on.
        settings: see :class:`TrainerSettings`.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` or None.
        run_dir: where the learning-curve PNG and Gantt charts go (None: nowhere).
        ray_address: the Ray cluster whose workers simulate (``settings.workers`` of them; None: a local
            Ray when ``settings.workers`` > 1).
    """

    def __init__(self, policy: StrategyPolicy, tasks: list[GraphTask], settings: TrainerSettings, *,
                 writer=None, run_dir: str | Path | None = None, ray_address: str | None = None) -> None:
        if not tasks:
            raise HeterogError("the trainer needs at least one graph")
        for task in tasks:
            if task.inputs.n_devices + N_DP_SCHEMES != policy.n_actions:
                raise CheckpointError(
                    f"policy has {policy.n_actions} actions ({policy.n_devices} devices) but graph {task.name} "
                    f"is planned for {task.evaluator.cluster.name!r} with {task.inputs.n_devices} devices "
                    f"({task.inputs.n_devices + N_DP_SCHEMES} actions)")
        keys = [t.key for t in tasks]
        if len(set(keys)) != len(keys):
            raise HeterogError(f"the same graph is given twice: {keys}")
        self.policy, self.tasks, self.settings = policy, tasks, settings
        self.writer = writer
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=settings.learning_rate)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.rng = np.random.default_rng(settings.seed)
        random.seed(settings.seed)
        torch.manual_seed(settings.seed)
        self.states = {t.key: TaskState() for t in tasks}
        # ---- counters, derived at run time (checkpointed)
        self.rounds = 0            # updates done
        self.episodes = 0          # strategies sampled, all graphs
        self.n_sims = 0            # simulations actually run (cache misses)
        self.wall_s = 0.0          # training wall time, over resumes
        self.cpu_s = 0.0           # training process CPU time, over resumes
        # ---- caches, not checkpointed (pure speed-ups: results are the same)
        self._cache: dict[str, OrderedDict] = {t.key: OrderedDict() for t in tasks}
        self.ray_address = ray_address
        self._pool = None                                     # simulation workers, started on first use
        self._pool_keys: dict[str, str] = {}

    # -------------------------------------------------------------------------------- one round
    def update(self) -> dict[str, float]:
        """One round: sample k strategies per graph, simulate them, one (REINFORCE) or ``ppo_epochs``
        (PPO) gradient steps. Returns the round's statistics."""
        s = self.settings
        self.policy.train()
        t_start, sims_before = time.perf_counter(), self.n_sims
        samples, rewards_all, actions_all = [], [], []
        for task in self.pick_tasks():
            state = self.states[task.key]
            if s.seed_uniform_plans and state.best_actions is None:
                self.seed_uniform(task, state)
            # rollout: one encoder pass, k strategies: from the policy, then explore_samples from perturbed
            # logits, then mutate_samples local moves around the best strategy found
            inputs = task.inputs
            group_emb = self.policy.embed_groups(*inputs.args())
            n_policy = s.samples_per_graph - s.explore_samples - s.mutate_samples
            offsets = torch.cat([torch.zeros(n_policy, self.policy.n_actions), self.explore_offsets(s.explore_samples)])
            with torch.inference_mode():
                drawn = self.policy.sample_actions(group_emb.detach(), inputs.group_mask, len(offsets),
                                                   generator=self.generator, offsets=offsets)
                best = drawn[0] if state.best_actions is None else torch.as_tensor(state.best_actions)
                guide = (self.policy.action_logits(group_emb.detach(), inputs.group_mask, best[None])[0].softmax(-1)
                         if s.mutate_guided > 0 and s.mutate_samples > 0 else None)
            actions = torch.cat([drawn, self.mutate(best, self.policy.n_actions, s.mutate_samples, guide)])
            rewards, times, ooms = self.evaluate(task, actions.numpy())                      # (k,) each
            self.record(task, state, actions.numpy(), rewards, times, ooms)
            # replay: the best strategies found so far, as extra samples
            replay_actions, replay_rewards = self.replay(state)
            # advantages against the moving-average baseline (updated after use); exploration and
            # replayed samples are off-policy and only pull towards plans better than the baseline
            adv = self.advantages(state, rewards[:n_policy], np.concatenate([rewards[n_policy:], replay_rewards]))
            all_actions = torch.cat([actions, torch.as_tensor(replay_actions, dtype=torch.long)])
            logits = self.policy.action_logits(group_emb, inputs.group_mask, all_actions)     # (k + R, G, A)
            log_p_old = per_group_log_prob(logits.detach(), all_actions)
            samples.append(_Sample(task, all_actions, torch.as_tensor(adv, dtype=torch.float32), log_p_old,
                                   logits))
            rewards_all.append(rewards)
            actions_all.append(actions.numpy().ravel())

        epochs = 1 if s.algorithm == "reinforce" else s.ppo_epochs
        for epoch in range(epochs):
            loss_pg, entropy = torch.zeros(()), torch.zeros(())
            for sample in samples:
                logits = sample.logits if epoch == 0 else self.strategy_logits(sample.task, sample.actions)
                log_p = per_group_log_prob(logits, sample.actions)
                loss_pg = loss_pg + policy_loss(log_p, sample.log_p_old, sample.advantages, s.algorithm,
                                                s.ppo_clip) / len(samples)
                entropy = entropy + mean_entropy(logits) / len(samples)
            loss = loss_pg - s.entropy_coef * entropy
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = (torch.nn.utils.clip_grad_norm_(self.policy.parameters(), s.max_grad_norm)
                         if s.max_grad_norm > 0 else torch.zeros(()))
            self.optimizer.step()
        approx_kl = 0.0
        if s.algorithm == "ppo":
            with torch.no_grad():
                approx_kl = float(np.mean([(sm.log_p_old - per_group_log_prob(
                    self.strategy_logits(sm.task, sm.actions), sm.actions)).mean() for sm in samples]))

        self.rounds += 1
        round_s = time.perf_counter() - t_start
        rewards = np.concatenate(rewards_all)
        return {"reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()),
                "loss_policy": float(loss_pg.detach()), "entropy": float(entropy.detach()),
                "grad_norm": float(grad_norm),
                "approx_kl": approx_kl, "round_s": round_s, "sims": self.n_sims - sims_before,
                "actions": np.concatenate(actions_all)}

    def evaluate_policy(self, samples: int) -> dict[str, dict[str, Any]]:
        """Score the policy without updating it: per graph, its greedy strategy (the most likely action
        of every group) and ``samples`` sampled ones are simulated and the best is recorded. Returns, per
        graph, the greedy, best and mean iteration times."""
        self.policy.eval()
        out = {}
        with torch.no_grad():
            for task in self.tasks:
                group_emb, mask = self.policy.embed_groups(*task.inputs.args()), task.inputs.group_mask
                actions = torch.cat([self.policy.sample_actions(group_emb, mask, 1, greedy=True),
                                     self.policy.sample_actions(group_emb, mask, samples, generator=self.generator)
                                     ]).numpy()
                rewards, times, ooms = self.evaluate(task, actions)
                state = self.states[task.key]
                self.record(task, state, actions, rewards, times, ooms)
                out[task.name] = {"greedy_iteration_time_s": float(times[0]), "greedy_oom": bool(ooms[0]),
                                  "mean_iteration_time_s": float(times.mean()),
                                  "best_iteration_time_s": state.best_iteration_time_s, "best_oom": state.best_oom}
        return out

    # ------------------------------------------------------------------------------ the pieces
    def pick_tasks(self) -> list[GraphTask]:
        """All tasks, or ``graphs_per_round`` of them drawn without replacement (in task order)."""
        n = self.settings.graphs_per_round
        if n == 0 or n >= len(self.tasks):
            return list(self.tasks)
        chosen = np.sort(self.rng.choice(len(self.tasks), size=n, replace=False))
        return [self.tasks[i] for i in chosen]

    def evaluate(self, task: GraphTask, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rewards, iteration times and OOM flags ``(k,)`` of strategies ``(k, G)``, simulated once
        (results are cached per graph)."""
        cache = self._cache[task.key]
        keys = [a.astype(np.int16).tobytes() for a in actions]
        missing = list(dict.fromkeys(k for k in keys if k not in cache))
        if missing:
            rows = np.array([keys.index(k) for k in missing])
            for k, hit in zip(missing, self.simulate(task, np.asarray(actions)[rows])):
                cache[k] = hit
            self.n_sims += len(missing)
        rewards, times, ooms = np.empty(len(actions)), np.empty(len(actions)), np.zeros(len(actions), dtype=bool)
        for i, key in enumerate(keys):
            cache.move_to_end(key)
            times[i], ooms[i] = cache[key]
            rewards[i] = reward(times[i], ooms[i], self.settings.oom_factor)
        while len(cache) > self.settings.eval_cache_size:
            cache.popitem(last=False)
        return rewards, times, ooms

    def simulate(self, task: GraphTask, actions: np.ndarray) -> list[tuple[float, bool]]:
        """(iteration time, OOM) of strategies ``actions`` (K, G): here, or in ``settings.workers`` contiguous
        chunks on Ray workers (the same numbers either way)."""
        if self.settings.workers == 1 and self.ray_address is None or len(actions) == 1:
            return [task.evaluator.iteration_time(task.evaluator.strategy(a, "agent")) for a in actions]
        from heterog.parallel import EvaluatorSpec, make_pool

        if self._pool is None:
            self._pool = make_pool(self.settings.workers, self.ray_address)
        if task.key not in self._pool_keys:
            self._pool_keys[task.key] = self._pool.register(EvaluatorSpec.of(task.evaluator))
        chunks = [c for c in np.array_split(actions, self._pool.n_workers) if len(c)]
        return [hit for part in self._pool.map("iteration_times", self._pool_keys[task.key], chunks) for hit in part]

    def close(self) -> None:
        """Stop the simulation workers (if any were started)."""
        if self._pool is not None:
            self._pool.close()
            self._pool, self._pool_keys = None, {}

    def record(self, task: GraphTask, state: TaskState, actions: np.ndarray, rewards: np.ndarray,
               times: np.ndarray, ooms: np.ndarray, *, sampled: bool = True) -> None:
        """Count the episodes (``sampled``: strategies the agent drew, not given ones), keep the best
        strategy, the replay pool and the history."""
        if sampled:
            state.episodes += len(actions)
            self.episodes += len(actions)
        i = int(np.argmax(rewards))
        if rewards[i] > state.best_reward:
            state.best_reward = float(rewards[i])
            state.best_iteration_time_s = float(times[i])
            state.best_oom = bool(ooms[i])
            state.best_actions = actions[i].tolist()
            state.history.append((self.wall_s + self._elapsed(), self.cpu_s + self._cpu_elapsed(),
                                  state.episodes, state.best_iteration_time_s))
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

    def seed_uniform(self, task: GraphTask, state: TaskState) -> None:
        """Simulate and record the plans with one action for every group (one per action)."""
        n_actions = self.policy.n_actions
        actions = np.repeat(np.arange(n_actions, dtype=np.int64)[:, None], task.n_groups, axis=1)   # (A, G)
        rewards, times, ooms = self.evaluate(task, actions)
        self.record(task, state, actions, rewards, times, ooms, sampled=False)

    def strategy_logits(self, task: GraphTask, actions: Tensor) -> Tensor:
        """The current policy's logits along strategies ``actions`` of ``task``. Shapes: ``(K, G)`` -> ``(K, G, A)``."""
        group_emb = self.policy.embed_groups(*task.inputs.args())
        return self.policy.action_logits(group_emb, task.inputs.group_mask, actions)

    def explore_offsets(self, n: int) -> Tensor:
        """Logit offsets of ``n`` exploration strategies: one random offset per action, shared by all groups
        of a strategy (parameter-space noise on the head bias), for correlated changes that independent
        per-group sampling almost never makes. Shapes: -> ``(n, A)``."""
        return torch.randn(n, self.policy.n_actions, generator=self.generator) * self.settings.explore_noise

    def mutate(self, base: Tensor, n_actions: int, n: int, guide: Tensor | None = None) -> Tensor:
        """``n`` copies of ``base`` with ``mutate_groups`` distinct groups each set to another action: random
        groups and actions, or for a share ``mutate_guided`` of the copies (with the policy's probabilities
        ``guide`` along ``base``) groups drawn in proportion to ``1 - guide[g, base[g]]`` and actions in
        proportion to ``guide[g]`` without ``base[g]``.

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
        if n_guided:
            others = guide.clone()
            others[torch.arange(n_groups), base] = 0.0                            # never the same action
            weight = others.sum(dim=1) + 1e-12
            guided = torch.multinomial(weight.expand(n_guided, -1), k, generator=self.generator)   # (n_guided, k)
            groups[:n_guided] = guided
            new[:n_guided] = torch.multinomial(others[guided.flatten()] + 1e-12, 1,
                                               generator=self.generator).reshape(n_guided, k)
        out[rows, groups] = new
        return out

    def replay(self, state: TaskState) -> tuple[np.ndarray, np.ndarray]:
        """``replay_samples`` strategies drawn from the pool (seeded), as (R, G) actions and (R,) rewards."""
        n = min(self.settings.replay_samples, len(state.pool))
        if n == 0:
            return np.zeros((0, len(state.best_actions or [])), dtype=np.int64), np.zeros(0)
        chosen = np.sort(self.rng.choice(len(state.pool), size=n, replace=False))
        return (np.array([state.pool[c][1] for c in chosen], dtype=np.int64),
                np.array([state.pool[c][0] for c in chosen]))

    def advantages(self, state: TaskState, rewards: np.ndarray, off_policy_rewards: np.ndarray) -> np.ndarray:
        """``(r - b) / scale`` for the policy's samples, then for off-policy ones (exploration, replays)
        clipped at 0 (they only pull towards plans better than the baseline). ``b`` is the graph's
        baseline before this round (the round's mean on the first); baseline and scale then move
        towards the policy samples' rewards."""
        s = self.settings
        if state.baseline is None:
            state.baseline = float(rewards.mean())
            state.reward_var = float(((rewards - rewards.mean()) ** 2).mean())
        b = state.baseline
        scale = math.sqrt(state.reward_var + (1e-3 * abs(b)) ** 2 + 1e-12) if s.normalize_advantage else 1.0
        adv = np.concatenate([(rewards - b) / scale, np.maximum(off_policy_rewards - b, 0.0) / scale])
        state.baseline = s.baseline_decay * b + (1 - s.baseline_decay) * float(rewards.mean())
        state.reward_var = (s.baseline_decay * state.reward_var
                            + (1 - s.baseline_decay) * float(((rewards - b) ** 2).mean()))
        return adv

    # -------------------------------------------------------------------------------- the loop
    def train(self, *, rounds: int | None = None, episodes: int | None = None, budget_s: float | None = None,
              on_round: Callable[[Trainer, dict], None] | None = None, checkpoint_path: str | Path | None = None,
              checkpoint_every: int = 0) -> dict[str, Any]:
        """Run rounds until ``rounds`` more rounds, ``episodes`` more sampled strategies or ``budget_s``
        seconds of wall time (whichever comes first; at least one must be given). Logs every round,
        checkpoints every ``checkpoint_every`` rounds and at the end (with ``checkpoint_path``), then
        writes the learning curve and the best plans' Gantt charts. Returns :meth:`summary`."""
        if rounds is None and episodes is None and budget_s is None:
            raise HeterogError("train() needs rounds, episodes or budget_s")
        start_rounds, start_episodes = self.rounds, self.episodes
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        try:
            while True:
                if rounds is not None and self.rounds - start_rounds >= rounds:
                    break
                if episodes is not None and self.episodes - start_episodes >= episodes:
                    break
                if budget_s is not None and self._elapsed() >= budget_s:
                    break
                stats = self.update()
                self.log(stats)
                if on_round is not None:
                    on_round(self, stats)
                if checkpoint_path is not None and checkpoint_every and self.rounds % checkpoint_every == 0:
                    self.save(checkpoint_path)
        finally:
            self.wall_s += self._elapsed()
            self.cpu_s += self._cpu_elapsed()
            self._t0 = self._c0 = None
        if checkpoint_path is not None:
            self.save(checkpoint_path)
        self.finish()
        return self.summary()

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0 if getattr(self, "_t0", None) is not None else 0.0

    def _cpu_elapsed(self) -> float:
        return time.process_time() - self._c0 if getattr(self, "_c0", None) is not None else 0.0

    # ----------------------------------------------------------------------------- results
    def best_strategy(self, task: GraphTask | str | None = None) -> Strategy:
        """The best strategy found for ``task`` (a task, its name, or None for the only/first task)."""
        task = self._task(task)
        state = self.states[task.key]
        if state.best_actions is None:
            raise HeterogError(f"no strategy sampled yet for {task.name}")
        strategy = task.evaluator.strategy(np.asarray(state.best_actions), "agent")
        strategy.meta.update({"best_iteration_time_s": state.best_iteration_time_s, "oom": state.best_oom,
                              "episodes": state.episodes, "rounds": self.rounds})
        return strategy

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "episodes": self.episodes, "sims": self.n_sims, "wall_s": self.wall_s,
                "cpu_s": self.cpu_s,
                "graphs": {t.name: {"best_iteration_time_s": self.states[t.key].best_iteration_time_s,
                                    "oom": self.states[t.key].best_oom, "episodes": self.states[t.key].episodes,
                                    "history": [list(h) for h in self.states[t.key].history]}
                           for t in self.tasks}}

    def _task(self, task) -> GraphTask:
        if isinstance(task, GraphTask):
            return task
        if task is None:
            return self.tasks[0]
        for t in self.tasks:
            if task in (t.name, t.key):
                return t
        raise HeterogError(f"unknown graph {task!r}; known: {[t.name for t in self.tasks]}")

    # ----------------------------------------------------------------------------- logging
    def log(self, stats: dict) -> None:
        """Scalars every round; action histogram and breakdown text every ``log_every`` rounds."""
        w, step = self.writer, self.rounds
        if w is None:
            return
        w.add_scalar("charts/reward_mean", stats["reward_mean"], step)
        w.add_scalar("charts/reward_max", stats["reward_max"], step)
        w.add_scalar("charts/episodes", self.episodes, step)
        for t in self.tasks:
            st = self.states[t.key]
            if st.best_actions is not None:
                w.add_scalar(f"charts/best_iteration_time_s/{t.name}", st.best_iteration_time_s, step)
            if st.baseline is not None:
                w.add_scalar(f"charts/baseline/{t.name}", st.baseline, step)
        w.add_scalar("losses/policy", stats["loss_policy"], step)
        w.add_scalar("losses/entropy", stats["entropy"], step)
        w.add_scalar("losses/grad_norm", stats["grad_norm"], step)
        if self.settings.algorithm == "ppo":
            w.add_scalar("losses/approx_kl", stats["approx_kl"], step)
        w.add_scalar("perf/sims_per_s", stats["sims"] / max(stats["round_s"], 1e-9), step)
        w.add_scalar("perf/round_s", stats["round_s"], step)
        if step % self.settings.log_every == 0 or step == 1:
            w.add_histogram("actions/sampled", stats["actions"], step, bins=np.arange(self.policy.n_actions + 1) - 0.5)
            w.add_text("actions/breakdown", self.breakdown_markdown(), step)

    def breakdown_markdown(self) -> str:
        """The best plans' action breakdown (HeteroG Table 2): per action, groups, share of ops and share
        of compute time (mean full-batch op time over devices)."""
        out = []
        for t in self.tasks:
            st = self.states[t.key]
            if st.best_actions is None:
                continue
            rows = action_breakdown(t, np.asarray(st.best_actions))
            out.append(f"**{t.name}** on {t.evaluator.cluster.name}: best {st.best_iteration_time_s * 1e3:.2f} ms"
                       f"{' (OOM)' if st.best_oom else ''}\n")
            out.append("| action | groups | ops % | compute % |\n|---|---|---|---|")
            out.extend(f"| {r['action']} | {r['groups']} | {100 * r['op_share']:.1f} | {100 * r['compute_share']:.1f} |"
                       for r in rows)
            out.append("")
        return "\n".join(out)

    def finish(self) -> None:
        """Learning curve PNG and the best plans' Gantt charts (files in run_dir, images in TensorBoard)."""
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.save_learning_curves(self.run_dir / "learning_curve.png")
        for t in self.tasks:
            if self.states[t.key].best_actions is None:
                continue
            path = self.run_dir / f"gantt_{t.name}.png"
            self.gantt(t, path)
            if self.writer is not None:
                import matplotlib.image as mpimg

                self.writer.add_image(f"gantt/{t.name}", mpimg.imread(path)[..., :3], self.rounds,
                                      dataformats="HWC")
                self.writer.add_text("actions/breakdown", self.breakdown_markdown(), self.rounds)
        if self.writer is not None:
            self.writer.flush()

    def save_learning_curves(self, path: str | Path, references: dict[str, dict[str, float]] | None = None,
                             x: str = "wall_s") -> Path:
        """Best iteration time per graph against training time, as a PNG (see :func:`save_learning_curves`)."""
        return save_learning_curves({t.name: self.states[t.key].history for t in self.tasks}, path, references,
                                    x, end=(self.wall_s, self.cpu_s))

    def gantt(self, task: GraphTask, path: str | Path) -> Path:
        """Gantt chart PNG of ``task``'s best plan."""
        import simulator

        result = task.evaluator.evaluate(self.best_strategy(task))
        st = self.states[task.key]
        title = (f"{task.name} on {task.evaluator.cluster.name}: agent's best plan, "
                 f"{st.best_iteration_time_s * 1e3:.2f} ms after {st.episodes} episodes")
        return simulator.plot_gantt(result.plan.tg, result.sim, path, title)

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: weights, optimizer, per-graph baselines/pools/best plans,
        RNG states, counters and settings (plain types and tensors only)."""
        return {
            "policy_config": self.policy.config,
            "policy_state": self.policy.state_dict(),
            "optimizer_state": self.optimizer.state_dict(),
            "settings": asdict(self.settings),
            "tasks": {t.key: {"name": t.name, **self.states[t.key].to_dict()} for t in self.tasks},
            "best_strategies": {t.key: self.best_strategy(t).to_dict() for t in self.tasks
                                if self.states[t.key].best_actions is not None},
            "counters": {"rounds": self.rounds, "episodes": self.episodes, "n_sims": self.n_sims,
                         "wall_s": self.wall_s, "cpu_s": self.cpu_s},
            "rng": {"torch_generator": self.generator.get_state(), "torch_global": torch.get_rng_state(),
                    "numpy": _plain(self.rng.bit_generator.state), "python": _plain(random.getstate())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run ``state`` came from (same tasks: states of other graphs are ignored)."""
        self.policy.load_state_dict(state["policy_state"])
        self.optimizer.load_state_dict(state["optimizer_state"])
        for key, d in state["tasks"].items():
            if key in self.states:
                self.states[key] = TaskState.from_dict({k: v for k, v in d.items() if k != "name"})
        c = state["counters"]
        self.rounds, self.episodes, self.n_sims = int(c["rounds"]), int(c["episodes"]), int(c["n_sims"])
        self.wall_s, self.cpu_s = float(c["wall_s"]), float(c["cpu_s"])
        rng = state["rng"]
        self.generator.set_state(rng["torch_generator"])
        torch.set_rng_state(rng["torch_global"])
        self.rng.bit_generator.state = rng["numpy"]
        random.setstate(_python_state(rng["python"]))

    def save(self, path: str | Path) -> Path:
        """Write the checkpoint atomically (see :mod:`agents.checkpoint`)."""
        from agents.checkpoint import save_checkpoint

        return save_checkpoint(path, self.state_dict())


# ============================================================================================ helpers
def _plain(obj):
    """Tuples to lists, recursively (checkpoints hold plain containers)."""
    if isinstance(obj, (tuple, list)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _python_state(state):
    """random.setstate wants (version, tuple of ints, gauss_next)."""
    version, internal, gauss = state
    return int(version), tuple(int(x) for x in internal), gauss


def time_to_quality(history: list, target_s: float, clock: str = "wall_s") -> float | None:
    """Training time (``clock``: "wall_s" or "cpu_s") at which the best iteration time first reached
    ``target_s`` or better, from a TaskState history; None if it never did."""
    column = {"wall_s": 0, "cpu_s": 1}[clock]
    for entry in history:
        if entry[3] <= target_s:
            return float(entry[column])
    return None


def action_breakdown(task: GraphTask, actions: np.ndarray) -> list[dict[str, Any]]:
    """Per action used by ``actions`` (one per group): groups, share of ops, share of compute time."""
    ev = task.evaluator
    m = ev.cluster.n_devices
    op_action = np.asarray(actions)[ev.group_of]
    op_time = ev.cost.full_batch_times(ev.graph).mean(axis=1)
    total_time = max(float(op_time.sum()), 1e-30)
    rows = []
    for a in range(m + N_DP_SCHEMES):
        groups = int((np.asarray(actions) == a).sum())
        if groups == 0:
            continue
        on = op_action == a
        rows.append({"action": action_name(a, m), "groups": groups, "op_share": float(on.mean()),
                     "compute_share": float(op_time[on].sum() / total_time)})
    return rows


def save_learning_curves(histories: dict[str, list], path: str | Path,
                         references: dict[str, dict[str, float]] | None = None, x: str = "wall_s",
                         end: tuple[float, float] | None = None) -> Path:
    """PNG of the best iteration time against training time (``x``: "wall_s" or "cpu_s"), one panel per
    graph; ``references`` (graph -> {label: seconds}) draws horizontal lines, e.g. baselines; ``end``
    (wall_s, cpu_s) extends each curve to the end of training."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from heterog.atomic import atomic_write

    names = list(histories)
    fig = Figure(figsize=(6.0 * max(1, min(len(names), 3)), 4.0 * math.ceil(max(len(names), 1) / 3)))
    FigureCanvasAgg(fig)
    column = 0 if x == "wall_s" else 1
    for i, name in enumerate(names):
        ax = fig.add_subplot(math.ceil(len(names) / 3), min(len(names), 3), i + 1)
        h = histories[name]
        if h:
            xs = [e[column] for e in h]
            ys = [e[3] * 1e3 for e in h]
            points = (xs, ys)
            if end is not None and end[column] > xs[-1]:
                xs, ys = [*xs, end[column]], [*ys, ys[-1]]
            line = ax.step(xs, ys, where="post", label="agent best (improvements marked)")[0]
            ax.plot(*points, "o", markersize=2.5, color=line.get_color())
        for label, seconds in (references or {}).get(name, {}).items():
            ax.axhline(seconds * 1e3, linestyle="--", linewidth=1, label=label, color=None)
        ax.set_title(name)
        ax.set_xlabel("training wall time (s)" if x == "wall_s" else "training CPU time (s)")
        ax.set_ylabel("best iteration time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100), mode="wb")
