"""How the agent is trained: ``TrainerSettings`` (every setting declared once, checked as a whole), and
``TrainerView``, what checkpoints and training reports read of a trainer."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from heterog.errors import HeterogError
from heterog.strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from agents.networks import StrategyPolicy

ALGORITHMS = ("reinforce", "ppo")


@dataclass
class TrainerSettings:
    """How the policy is trained; every setting is declared here once (hydra's ``trainer/`` fills it)."""

    algorithm: str = "reinforce"
    """``"reinforce"`` (HeteroG's rule) or ``"ppo"`` (clipped objective, ``ppo_epochs`` per round)."""
    learning_rate: float = 1e-3
    """Adam step size. At 1e-2 the policy stops learning per-group choices (its greedy plan stays the
    uniform one; docs/results.md, "Agent"); ``initial_dp_bias`` gives a fresh policy its head start on
    the DP actions."""
    samples_per_graph: int = 32
    """Strategies sampled per graph from one forward pass (k). The default mix (32: 26 mutations, 2
    explorations, 2 replays, 2 of the policy's own draws) spends most of a round on the local search
    around the best plan, guided by the policy (``mutate_guided``), and updates the policy once per 32
    simulated plans. Against the earlier 16 (4, 4, 2, 6), from scratch in 120 s: equal or better on
    paper-8gpu and paper-12gpu (bert_large 474.1 against 476.0 ms, 488.2 against 491.3; vgg19 and
    transformer within 0.1%) and much better on the held-out gen-65 (bert_large 561.2 against 624.9,
    gpt2 379.2 against 413.0; docs/results.md, "The search mix"). Pretraining
    (``experiment=pretrain``) keeps the earlier mix, with more of the policy's own draws, and with it the
    recipe of the shipped checkpoint; the new mix was not tried there."""
    graphs_per_round: int = 0
    """Graphs updated together per round, drawn without replacement by the seeded generator (0: all)."""
    baseline_decay: float = 0.9
    """Moving-average factor of each graph's reward baseline: b <- decay b + (1 - decay) mean(r)."""
    normalize_advantage: bool = True
    """Divide advantages by a running per-graph reward standard deviation (same decay as the baseline)."""
    entropy_coef: float = 0.01
    """Weight of the mean per-group entropy bonus."""
    imitation_coef: float = 0.0
    """Weight of the imitation term (expert iteration, self-imitation): the policy's per-group
    cross-entropy against the best strategy found so far for the graph (a weighted mean over groups,
    ``imitation_by_load``), added to the loss each round (0: none). The search (mutations, block moves,
    replays) finds plans that the policy-gradient signal alone does not teach the policy: a plan that
    moves a whole block is found a few times, while the policy's own samples that move part of it are
    many and slow. With it the policy's greedy plan follows the best plan found; :meth:`Trainer.distill`
    finishes the job after pretraining (docs/results.md, "Imitation and distillation")."""
    imitation_by_load: float = 0.5
    """Share of the imitation term's per-group weights spread by load: a group weighs ``1 - a`` plus
    ``a`` times G times the mean of its shares of the graph's FLOPs and of its aggregated gradient bytes
    (weights average 1; 0: every group alike). A plain mean over groups gives bert_large's 12 embedding
    groups 0.9% of the term, though placing them is worth 12% of its step on paper-8gpu (558.1 -> 488.5
    ms); these weights give them 5.1% (``imitation_weights``)."""
    max_grad_norm: float = 1.0
    """Clip the gradient's global norm to this (0: no clipping)."""
    replay_pool_size: int = 8
    """Best distinct strategies kept per graph for replay (0: no pool)."""
    replay_samples: int = 2
    """Pool strategies replayed per graph and round as extra samples (advantage clipped at 0)."""
    greedy_samples: int = 0
    """Of the k samples, how many are the policy's greedy strategy (each group's most likely decision: the
    plan the policy itself proposes, ``evaluate_policy``'s and zero-shot's plan; 0 or 1). Used like replays.
    Independent per-group draws from a policy that is 70% sure of each of 100+ groups almost never
    produce its most likely plan, so without it a round never scores the policy's own proposal: the
    policy-alone ablation (no mutation, exploration or replay samples) needs it to keep a pretrained
    policy's zero-shot quality. Off by default: with the local search on, fine-tuning gpt2 for 30 s on
    gen-65 ended 5% slower with it (the greedy plan becomes the best that mutations start from, a local
    optimum; docs/results.md, "One policy for any cluster")."""
    explore_samples: int = 2
    """Of the k samples, how many come from the policy with its head bias perturbed (0: none): one
    Gaussian offset per action, shared by all groups of the strategy, so that whole-plan changes
    (e.g. every group from even to proportional shares) get tried. Used like replays."""
    explore_noise: float = 2.0
    """Standard deviation of that per-action logit offset."""
    mutate_samples: int = 26
    """Of the k samples, how many are the best strategy found so far with ``mutate_groups`` random
    groups set to random actions (FlexFlow's local moves, around the best instead of the policy;
    0: none). Used like replays. They let the search finish what the policy roughly found."""
    mutate_groups: int = 1
    """Groups changed per mutated strategy."""
    mutate_blocks: float = 0.25
    """Probability that a mutation sample instead sets one coupled block of groups (groups joined by the
    graph's heaviest tensors, e.g. a tied embedding and its LM head) to one action: MCMC's block move
    (``heterog.baselines.chains.coupled_blocks``), which single-group moves cannot make when every plan
    on the way re-lays out a large tensor."""
    mutate_memory: float = 0.25
    """Probability that a mutation sample instead changes the best strategy's plan-level decisions: half
    of these take another number of micro-batches (uniformly among the other choices), the other half
    flip the recompute bits of ``mutate_groups`` random groups (0: mutations never change them)."""
    tie_blocks: bool = True
    """The policy's own samples (its draws, the greedy and the exploration samples) give every coupled
    block of groups (as ``mutate_blocks``) the action of the block's leader (the group that synchronises
    the most gradient bytes), and only the leader's choice counts in the loss: one decision per block. A
    policy that draws each group on its own has to put all of a block's groups on one device in the same
    sample before it sees what that is worth, and a sample that moves part of a block is slower, so the
    gradient points away from it (bert_large's tied embedding block: docs/results.md, "The policy
    alone"). Mutations, seeds and replays stay free; they train every group, the leader included, so
    the leader is the group whose action in a free plan says where the block belongs (a block's first
    group may be a bias that the best plans put on PS while its weight goes to AllReduce)."""
    mutate_guided: float = 0.5
    """Share of the mutation samples proposed by the policy instead of uniformly: the groups to change
    drawn in proportion to how likely the policy is to leave the best strategy's action there, the new
    action from the policy's distribution without that action. A pretrained policy's prior on where to
    move then steers the local search (docs/results.md, "Agent")."""
    seed_uniform_plans: bool = True
    """Before a graph's first round, simulate the M + 4 plans that give every group the same action (the
    whole graph on one device, or one data-parallel scheme everywhere: the DP baselines ev-ps, ev-ar,
    cp-ps, cp-ar; with split actions also the 2 M + 2 plans that split every group the same way, among
    them the homogeneous tensor-parallel plan), and cp-ar-ps-small (CP-AR with the groups of small
    gradients on CP-PS, MCMC's start:
    ``heterog.baselines.mcmc.start_actions``), and record them like samples: they enter the replay pool
    and the best one is where the mutation samples start. Without them the search can settle on a plan
    worse than plain data parallelism."""
    extended_plans: bool = False
    """The search's plans are those of the extended actions (``envs.actions``, ``heterog.extended_actions``:
    stages on device subsets, grids, every number of micro-batches under each schedule), so that it holds,
    records and mutates every planner's plan (seeds, demonstrations); the policy samples and learns in its
    own actions, and plans beyond them count as its off-policy samples only where it holds them. Simulated
    in this process, whatever ``workers`` (the same results)."""
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
        for name in ("graphs_per_round", "replay_pool_size", "replay_samples", "entropy_coef", "imitation_coef",
                     "max_grad_norm", "eval_cache_size"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be non-negative, got {getattr(self, name)}")
        if not 0.0 <= self.baseline_decay < 1.0:
            problems.append(f"baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if self.greedy_samples not in (0, 1):
            problems.append(f"greedy_samples must be 0 or 1, got {self.greedy_samples}")
        if self.explore_samples < 0 or self.mutate_samples < 0 or \
                self.greedy_samples + self.explore_samples + self.mutate_samples >= self.samples_per_graph:
            problems.append(f"greedy_samples {self.greedy_samples} + explore_samples {self.explore_samples} + "
                            f"mutate_samples {self.mutate_samples} must be in 0..samples_per_graph-1 "
                            f"({self.samples_per_graph - 1}), each non-negative")
        for name in ("mutate_guided", "mutate_blocks", "mutate_memory", "imitation_by_load"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.append(f"{name} must be in [0, 1], got {getattr(self, name)}")
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


class TrainerView(Protocol):
    """What checkpoints (``agents.checkpoint``) and reports (``agents.reporting``) read of a trainer
    (``agents.trainer.Trainer``)."""

    @property
    def policy(self) -> StrategyPolicy: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    settings: TrainerSettings
    tasks: list[Any]                   # GraphTask
    states: dict[str, Any]             # task key -> TaskState
    generator: torch.Generator
    rng: np.random.Generator
    rounds: int
    episodes: int
    n_sims: int
    wall_s: float
    cpu_s: float

    def best_strategy(self, task: Any = None) -> Strategy: ...
