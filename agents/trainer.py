"""Training the strategy policy by policy gradient over several graphs at once: the settings, the
rollout and the REINFORCE/PPO update.

HeteroG's update rule: per graph, one forward pass gives the per-group distribution, k strategies
are sampled from it and simulated, and the advantage of each is its reward minus the graph's
moving-average baseline. A strategy is a plan (``envs.actions``, a row of length ``2 G + 1``): each
group's config and recompute bit and the number of micro-batches; its log probability, the loss and the
entropy bonus cover all three. PPO (clipped, a few epochs over the same samples) is an option. Besides the
policy's samples a round simulates candidates from :mod:`agents.candidates` (exploration offsets,
mutations of the best plan, replays of the best plans found); :mod:`agents.losses` has the losses,
:mod:`agents.reporting` writes the TensorBoard records and plots, :mod:`agents.checkpoint` the
checkpoints. Everything is determined by
the seed; ``state_dict``/``load_state_dict`` resume a run exactly.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from agents.candidates import BlockMoves, CandidateSearch, Scorer, in_policy, promising_uniform, uniform_plans
from agents.checkpoint import load_trainer_state, save_checkpoint, trainer_state
from agents.losses import (
    imitation_loss,
    imitation_weights,
    mean_entropy,
    per_group_log_prob,
    plan_columns,
    policy_loss,
)
from agents.networks import StrategyPolicy
from agents.networks.plan import PlanLogits, plan_entropy, plan_log_prob_parts
from agents.reporting import TrainingLog, action_breakdown, time_to_quality
from agents.settings import ALGORITHMS, TrainerSettings
from agents.tasks import GraphTask, TaskState, make_task
from envs.actions import MICRO_CHOICES, full_plan, micro_neighbours, plan_length, plan_strategy
from heterog.actions import N_DP_ACTIONS, n_actions
from heterog.errors import CheckpointError, HeterogError
from heterog.strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["ALGORITHMS", "GraphTask", "TaskState", "Trainer", "TrainerSettings", "action_breakdown",
           "bias_towards_data_parallel", "make_task", "mean_entropy", "per_group_log_prob", "plan_columns",
           "plan_log_prob_parts", "policy_loss", "time_to_quality"]

UNIFORM_REST_SHARE = 0.25   # of the time left that the uniform plans beyond the promising ones may take


class BudgetSpent(Exception):
    """The trainer's ``deadline`` passed with plans of a call left unscored (those scored are recorded)."""


@dataclass
class _Sample:
    """One graph's part of a round: the plans, their advantages and old log probabilities per decision (of
    the groups whose choice is a decision, ``decisions``, and the micro-batch choice; all groups when None)."""

    task: GraphTask
    actions: Tensor          # (K + R, 2G + 1) plans sampled then replayed
    advantages: Tensor       # (K + R,)
    log_p_old: Tensor        # (K + R, 2G + 1) per decision
    logits: PlanLogits       # along the plans, with their graph (used by the first epoch)
    rewards: np.ndarray      # (K,) rewards of the sampled strategies
    sampled: np.ndarray      # (K, 2G + 1) the sampled plans (for the action histogram)
    decisions: Tensor | None = None     # (D,) groups whose choice is a decision (``tie_blocks``); None: all
    target: Tensor | None = None        # (1, 2G + 1) the best plan found, imitated (``imitation_coef``)
    target_logits: PlanLogits | None = None  # the logits along it, with their graph (first epoch)

    def columns(self) -> Tensor | None:
        """The plan entries that are decisions (:func:`plan_columns` of ``decisions``; None: all)."""
        return None if self.decisions is None else plan_columns(self.decisions, self.task.n_groups)

    @property
    def n_decisions(self) -> int:
        """Groups whose choice is a decision."""
        return self.task.n_groups if self.decisions is None else len(self.decisions)


def bias_towards_data_parallel(policy: StrategyPolicy, bias: float) -> None:
    """Add ``bias`` to the head bias of the four data-parallel actions (a fresh policy then samples DP
    with probability 4 e^b / (M + 4 e^b) per group instead of 4 / (M + 4))."""
    if bias:
        policy.add_data_parallel_bias(bias)


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
                 writer: SummaryWriter | None = None, run_dir: str | Path | None = None,
                 ray_address: str | None = None) -> None:
        if not tasks:
            raise HeterogError("the trainer needs at least one graph")
        for task in tasks:
            if not policy.fits_devices(task.inputs.n_devices):
                raise CheckpointError(
                    f"policy has {policy.n_actions} actions ({policy.n_devices} devices"
                    f"{', at most' if policy.head_kind == 'tokens' else ''}) but graph {task.name} "
                    f"is planned for {task.evaluator.cluster.name!r} with {task.inputs.n_devices} devices "
                    f"({task.inputs.n_devices + N_DP_ACTIONS} actions)")
            if policy.split_actions and task.evaluator.graph.splits is None:
                raise HeterogError(f"the policy has split actions but graph {task.name} was captured without the "
                                   f"per-op split options (recapture it)")
        keys = [t.key for t in tasks]
        if len(set(keys)) != len(keys):
            raise HeterogError(f"the same graph is given twice: {keys}")
        self.policy, self.tasks, self.settings = policy, tasks, settings
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=settings.learning_rate)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.rng = np.random.default_rng(settings.seed)
        random.seed(settings.seed)
        torch.manual_seed(settings.seed)
        self.states = {t.key: TaskState() for t in tasks}
        self.search = CandidateSearch(settings, n_actions(policy.n_devices, policy.split_actions,
                                                          policy.state_actions), self.generator, self.rng)
        self._blocks: dict[str, BlockMoves] = {}                 # task key -> its coupled blocks
        self._imitation_weights: dict[str, Tensor] = {}          # task key -> its groups' imitation weights
        self.scorer = Scorer(tasks, settings.oom_factor, settings.eval_cache_size, settings.workers, ray_address,
                             states=policy.state_actions, splits=policy.split_actions,
                             extended=settings.extended_plans)
        self.report = TrainingLog(writer, run_dir, settings.log_every)
        # ---- counters, derived at run time (checkpointed; simulations run are counted by the scorer)
        self.rounds = 0            # updates done
        self.episodes = 0          # strategies sampled, all graphs
        self.wall_s = 0.0          # training wall time, over resumes
        self.cpu_s = 0.0           # training process CPU time, over resumes
        self._t0: float | None = None   # wall and CPU clocks at the start of the current train() call
        self._c0: float | None = None
        # no simulation starts after this time.perf_counter() time but a call's first (train()'s budget; set
        # by a caller for the seeds): the strategies scored by then are recorded, then BudgetSpent
        self.deadline: float | None = None

    @property
    def n_sims(self) -> int:
        """Simulations actually run (cache misses)."""
        return self.scorer.n_sims

    @n_sims.setter
    def n_sims(self, value: int) -> None:
        self.scorer.n_sims = value

    # -------------------------------------------------------------------------------- one round
    def update(self) -> dict[str, float | np.ndarray]:
        """One round: a rollout per graph (:meth:`rollout`), then one (REINFORCE) or ``ppo_epochs`` (PPO)
        gradient steps on the mean policy-gradient loss minus the entropy bonus, plus the imitation term
        (``imitation_coef``). Returns the round's statistics."""
        s = self.settings
        self.policy.train()
        t_start, sims_before = time.perf_counter(), self.n_sims
        samples = [self.rollout(task) for task in self.pick_tasks()]

        epochs = 1 if s.algorithm == "reinforce" else s.ppo_epochs
        for epoch in range(epochs):
            loss_pg, entropy, loss_im = torch.zeros(()), torch.zeros(()), torch.zeros(())
            for sample in samples:
                if sample.target is not None:
                    target_logits = (sample.target_logits if epoch == 0 and sample.target_logits is not None
                                     else self.strategy_logits(sample.task, sample.target))
                    loss_im = loss_im + imitation_loss(target_logits, sample.target,
                                                       self.imitation_weights(sample.task)) / len(samples)
                logits = sample.logits if epoch == 0 else self.strategy_logits(sample.task, sample.actions)
                log_p, log_p_old = plan_log_prob_parts(logits, sample.actions), sample.log_p_old
                columns = sample.columns()
                if columns is not None:
                    log_p, log_p_old = log_p[:, columns], log_p_old[:, columns]
                loss_pg = loss_pg + policy_loss(log_p, log_p_old, sample.advantages, s.algorithm,
                                                s.ppo_clip, per=sample.n_decisions) / len(samples)
                entropy = entropy + plan_entropy(logits, sample.decisions) / len(samples)
            loss = loss_pg - s.entropy_coef * entropy + s.imitation_coef * loss_im
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = (torch.nn.utils.clip_grad_norm_(self.policy.parameters(), s.max_grad_norm)
                         if s.max_grad_norm > 0 else torch.zeros(()))
            self.optimizer.step()
        approx_kl = 0.0
        if s.algorithm == "ppo":
            with torch.no_grad():
                kl = [sm.log_p_old - plan_log_prob_parts(self.strategy_logits(sm.task, sm.actions), sm.actions)
                      for sm in samples]
                approx_kl = float(np.mean([(d if sm.decisions is None else d[:, sm.columns()]).mean()
                                           for d, sm in zip(kl, samples)]))

        self.rounds += 1
        rewards = np.concatenate([sm.rewards for sm in samples])
        return {"reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()),
                "loss_policy": float(loss_pg.detach()), "loss_imitation": float(loss_im.detach()),
                "entropy": float(entropy.detach()),
                "grad_norm": float(grad_norm), "approx_kl": approx_kl,
                "round_s": time.perf_counter() - t_start, "sims": self.n_sims - sims_before,
                "actions": np.concatenate([sm.sampled[:, :sm.task.n_groups].ravel() for sm in samples]),
                "micro_choices": np.concatenate([sm.sampled[:, 2 * sm.task.n_groups] for sm in samples]),
                "recompute_share": float(np.mean([sm.sampled[:, sm.task.n_groups:2 * sm.task.n_groups].mean()
                                                  for sm in samples]))}

    def rollout(self, task: GraphTask) -> _Sample:
        """One graph's part of a round: one encoder pass (for an independent policy, also one pass of the
        strategy network, whose logits serve the draws, the guide and the update); k strategies (the
        policy's samples, then ``greedy_samples`` greedy ones, ``explore_samples`` from perturbed logits,
        then ``mutate_samples`` local moves around the best strategy found), simulated and recorded;
        replays from the pool; advantages against the graph's moving-average baseline; the logits along
        all of them, with their graph for the update."""
        s, state, inputs, n_groups = self.settings, self.states[task.key], task.inputs, task.n_groups
        if s.seed_uniform_plans and state.best_actions is None:
            self.seed_uniform(task, state)
        group_emb = self.policy.embed_groups(*inputs.args())
        devices = self.policy.embed_devices(inputs.dev_x, inputs.dev_mask)          # None for the fixed head
        n_actions = self.policy.n_actions_for(devices)
        n_policy = s.samples_per_graph - s.greedy_samples - s.explore_samples - s.mutate_samples
        offsets = torch.cat([torch.zeros(n_policy, n_actions),
                             self.search.explore_offsets(s.explore_samples, n_actions)])
        # an independent policy's logits are the same along every strategy: one pass of the strategy network
        # serves the draws, the guide and the update (an autoregressive policy decodes, then re-reads)
        once = None if self.policy.autoregressive else \
            self.policy.plan_logits_from_group_embeddings(group_emb, inputs.group_mask, devices)
        with torch.inference_mode():
            def sample(n: int, **how: Any) -> Tensor:
                if once is None:
                    return self.policy.sample_plans(group_emb.detach(), inputs.group_mask, n, devices=devices, **how)
                return self.policy.draw_plans(once.detach(), inputs.group_mask, n, **how)

            drawn = sample(len(offsets), generator=self.generator, offsets=offsets)          # (n, 2G + 1)
            drawn = torch.cat([drawn[:n_policy], sample(s.greedy_samples, greedy=True), drawn[n_policy:]])
            tie = self.tie(task)
            if tie is not None:
                drawn = drawn[:, plan_columns(tie, n_groups)]
            width = self.scorer.width(task)
            drawn = torch.as_tensor(full_plan(drawn.numpy(), n_groups, width))
            best = drawn[0] if state.best_actions is None else \
                torch.as_tensor(full_plan(state.best_actions, n_groups, width))
            guide = None
            if s.mutate_guided > 0 and s.mutate_samples > 0:
                along = best[None, :plan_length(n_groups)].clone()    # the policy's reading of an extended plan:
                along[0, :n_groups][along[0, :n_groups] >= n_actions] = 0                        # its own actions
                along[0, -1] *= int(along[0, -1]) < len(MICRO_CHOICES)
                guide = (once.groups.detach() if once is not None else
                         self.policy.action_logits(group_emb.detach(), inputs.group_mask, along, devices)[0]
                         ).softmax(-1)
        batch = task.evaluator.graph.batch_size
        actions = torch.cat([drawn, self.search.mutate_plans(
            best, n_groups, n_actions, s.mutate_samples, guide, self.block_moves(task),
            micro_moves=(lambda index: micro_neighbours(index, batch)) if width else None)])
        rewards, times, ooms = self.score_and_record(task, state, actions.numpy())            # (k,) each
        replay_actions, replay_rewards = self.search.replay(state, n_groups, width)
        # greedy, exploration, mutation and replayed samples are off-policy: they only pull towards plans
        # better than the baseline
        adv = self.advantages(state, rewards[:n_policy], np.concatenate([rewards[n_policy:], replay_rewards]))
        all_actions = torch.cat([actions, torch.as_tensor(replay_actions, dtype=torch.long)])
        held = in_policy(all_actions, n_groups, n_actions)       # plans beyond the policy's actions: no update
        all_actions, adv = all_actions[held][:, :plan_length(n_groups)], adv[held.numpy()]
        logits = (self.policy.plan_logits(group_emb, inputs.group_mask, all_actions, devices) if once is None
                  else once.expand(len(all_actions)))                                           # along k + R plans
        target = target_logits = None
        if s.imitation_coef > 0:          # the best strategy found, this round's samples included
            target = self.imitation_target(task)
        if target is not None:
            target_logits = (self.policy.plan_logits(group_emb, inputs.group_mask, target, devices) if once is None
                             else once.expand(1))
        return _Sample(task, all_actions, torch.as_tensor(adv, dtype=torch.float32),
                       plan_log_prob_parts(logits.detach(), all_actions), logits, rewards, actions.numpy(),
                       None if tie is None else torch.nonzero(tie == torch.arange(len(tie))).squeeze(1),
                       target, target_logits)

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

    def strategy_logits(self, task: GraphTask, actions: Tensor) -> PlanLogits:
        """The current policy's logits along plans ``actions`` ``(K, 2 G + 1)`` of ``task``."""
        group_emb = self.policy.embed_groups(*task.inputs.args())
        devices = self.policy.embed_devices(task.inputs.dev_x, task.inputs.dev_mask)
        return self.policy.plan_logits(group_emb, task.inputs.group_mask, actions, devices)

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
        (results are cached per graph; :class:`agents.candidates.Scorer`); with a ``deadline``, those of the
        first ``k'`` scored by then (at least one)."""
        return self.scorer.score(task, actions, self.deadline)

    def score_and_record(self, task: GraphTask, state: TaskState, actions: np.ndarray, *,
                         sampled: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`evaluate` then :meth:`record` the strategies scored; :class:`BudgetSpent` where the
        ``deadline`` left some unscored."""
        rewards, times, ooms = self.evaluate(task, actions)
        self.record(task, state, actions[:len(rewards)], rewards, times, ooms, sampled=sampled)
        if len(rewards) < len(actions):
            raise BudgetSpent(f"{len(actions) - len(rewards)} of {len(actions)} plans left at the deadline")
        return rewards, times, ooms

    def record(self, task: GraphTask, state: TaskState, actions: np.ndarray, rewards: np.ndarray,
               times: np.ndarray, ooms: np.ndarray, *, sampled: bool = True) -> None:
        """Count the episodes (``sampled``: strategies the agent drew, not given ones), keep the best
        strategy, the replay pool and the history."""
        if sampled:
            state.episodes += len(actions)
            self.episodes += len(actions)
        state.keep_best(actions, rewards, times, ooms, self.wall_s + self._elapsed(), self.cpu_s + self._cpu_elapsed())
        state.keep_held(actions, rewards, self.held(task, actions))
        self.search.remember(state, actions, rewards)

    def blocks(self, task: GraphTask) -> BlockMoves:
        """The task's coupled blocks (computed once per task)."""
        if task.key not in self._blocks:
            self._blocks[task.key] = BlockMoves.of(task.evaluator)
        return self._blocks[task.key]

    def block_moves(self, task: GraphTask) -> BlockMoves | None:
        """The task's coupled blocks for block mutations (None when disabled)."""
        return self.blocks(task) if self.settings.mutate_blocks > 0 else None

    def imitation_weights(self, task: GraphTask) -> Tensor:
        """The task's per-group weights in the imitation term (``imitation_by_load``; computed once)."""
        if task.key not in self._imitation_weights:
            from heterog.baselines.chains import group_loads

            ev = task.evaluator
            self._imitation_weights[task.key] = imitation_weights(
                *group_loads(ev.graph, np.asarray(ev.group_of)), self.settings.imitation_by_load)
        return self._imitation_weights[task.key]

    def held(self, task: GraphTask, actions: np.ndarray) -> np.ndarray:
        """Which plans ``(k, L)`` the policy's actions hold (``in_policy``): ``(k,)`` bool."""
        plans = torch.as_tensor(full_plan(np.asarray(actions, dtype=np.int64), task.n_groups, self.scorer.width(task)))
        return in_policy(plans, task.n_groups, n_actions(task.inputs.n_devices, self.policy.split_actions,
                                                         self.policy.state_actions)).numpy()

    def imitation_target(self, task: GraphTask) -> Tensor | None:
        """The imitation term's target ``(1, 2 G + 1)``: the task's best plan, or where the policy's actions do
        not hold it (an extended plan: a demonstrated pipeline, a parameter server's rows), the best plan they
        hold; None before any such plan was recorded."""
        state = self.states[task.key]
        target = state.held_actions
        if state.best_actions is not None and self.held(task, np.asarray([state.best_plan()]))[0]:
            target = state.best_plan()
        if target is None:
            return None
        plan = full_plan(target, task.n_groups, self.scorer.width(task))
        return torch.as_tensor(plan)[None, :plan_length(task.n_groups)]

    def tie(self, task: GraphTask) -> Tensor | None:
        """Each group's representative for the policy's own samples (``tie_blocks``; None when off or when
        the graph has no blocks): ``actions[:, tie]`` gives every block its leader's action."""
        if not self.settings.tie_blocks or not self.blocks(task).groups:
            return None
        return self.blocks(task).tie(task.evaluator.n_groups)

    def seed_uniform(self, task: GraphTask, state: TaskState) -> None:
        """Simulate and record the plans with one action for every group (one per action), and cp-ar-ps-small
        (one micro-batch, no recomputation): first cp-ar-ps-small and those of ``promising_uniform``, then
        the others, which with a ``deadline`` stop at ``UNIFORM_REST_SHARE`` of the time left (on a graph
        whose simulation takes a second, the 80 uniform plans of 12 devices with splits and state actions
        would take the whole budget)."""
        from heterog.baselines.mcmc import start_actions

        m, splits, states = task.inputs.n_devices, self.policy.split_actions, self.policy.state_actions
        first = [start_actions(task.evaluator, "cp-ar-ps-small", self.rng)]
        first += [np.full(task.n_groups, a, dtype=np.int64) for a in promising_uniform(m, splits, states).values()]
        actions = uniform_plans(n_actions(m, splits, states), task.n_groups)  # (A, G)
        rest = [a for a in actions if not any((a == f).all() for f in first)]
        width = self.scorer.width(task)
        self.score_and_record(task, state, full_plan(np.stack(first), task.n_groups, width), sampled=False)
        deadline = self.deadline
        if deadline is not None:
            self.deadline = min(deadline, time.perf_counter() + UNIFORM_REST_SHARE * (deadline - time.perf_counter()))
        try:
            self.score_and_record(task, state, full_plan(np.stack(rest), task.n_groups, width), sampled=False)
        except BudgetSpent:
            if deadline is not None and time.perf_counter() >= deadline:
                raise                                   # the budget itself is spent
        finally:
            self.deadline = deadline

    def seed_plans(self, task: GraphTask, actions: np.ndarray) -> None:
        """Simulate and record given plans ``(k, 2G + 1)`` (other planners', in the policy's actions; with
        ``extended_plans`` also of the extended actions, ``(k, (M + 2) G + 1)``) as the first plans are (after
        them, when ``seed_uniform_plans``): the best becomes the one the search's moves start from, and the
        replay pool and the imitation term pull the policy towards it (the imitation term where the policy's
        actions hold it)."""
        state = self.states[task.key]
        if self.settings.seed_uniform_plans and state.best_actions is None:
            self.seed_uniform(task, state)
        self.score_and_record(task, state, full_plan(np.asarray(actions, dtype=np.int64), task.n_groups,
                                                     self.scorer.width(task)), sampled=False)

    def close(self) -> None:
        """Stop the simulation workers (if any were started)."""
        self.scorer.close()

    # -------------------------------------------------------------------------------- the loop
    def train(self, *, rounds: int | None = None, episodes: int | None = None, budget_s: float | None = None,
              on_round: Callable[[Trainer, dict], None] | None = None, checkpoint_path: str | Path | None = None,
              checkpoint_every: int = 0) -> dict[str, Any]:
        """Run rounds until ``rounds`` more rounds, ``episodes`` more sampled strategies or ``budget_s``
        seconds of wall time (whichever comes first; at least one must be given; the budget is a
        ``deadline``: the round under way when it passes ends after its plans scored by then, without an
        update, so that training ends within the budget plus one simulation; a round is always started, so
        that its first plan is scored). Logs every round,
        checkpoints every ``checkpoint_every`` rounds and at the end (with ``checkpoint_path``), then
        writes the learning curve and the best plans' Gantt charts. Returns :meth:`summary`."""
        if rounds is None and episodes is None and budget_s is None:
            raise HeterogError("train() needs rounds, episodes or budget_s")
        start_rounds, start_episodes = self.rounds, self.episodes
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        self.deadline = None if budget_s is None else self._t0 + budget_s
        try:
            while True:
                if rounds is not None and self.rounds - start_rounds >= rounds:
                    break
                if episodes is not None and self.episodes - start_episodes >= episodes:
                    break
                if budget_s is not None and self._elapsed() >= budget_s and self.rounds > start_rounds:
                    break
                try:
                    stats = self.update()
                except BudgetSpent:           # the last round's plans are recorded; no update on a part
                    break
                self.report.log_round(self, stats)
                if on_round is not None:
                    on_round(self, stats)
                if checkpoint_path is not None and checkpoint_every and self.rounds % checkpoint_every == 0:
                    self.save(checkpoint_path)
        finally:
            self.wall_s += self._elapsed()
            self.cpu_s += self._cpu_elapsed()
            self._t0 = self._c0 = self.deadline = None
        if checkpoint_path is not None:
            self.save(checkpoint_path)
        self.report.finish(self)
        return self.summary()

    def distill(self, epochs: int) -> list[float]:
        """Fit the policy to the best strategy found for every graph: ``epochs`` passes over the graphs
        (in a seeded order), one Adam step per graph on the policy's cross-entropy against its best
        plan (``imitation_target``: the best plan the policy's actions hold where the best is an extended one;
        the imitation term alone, weighted as ``imitation_by_load``; a best strategy of configs alone is the
        plan of one micro-batch without recomputation).

        Expert iteration's policy step: training rounds visit a graph a few dozen times while the search
        finds its best plan, too few for the policy to follow it; after this the policy's greedy plan is
        the best plan found, group by group, as far as the policy can tell the groups apart. Counts
        towards ``wall_s`` and ``cpu_s``; returns each epoch's mean loss (also logged to TensorBoard as
        ``losses/distill``)."""
        if epochs < 0:
            raise HeterogError(f"distill epochs must be non-negative, got {epochs}")
        tasks = [t for t in self.tasks if self.imitation_target(t) is not None]
        t0, c0 = time.perf_counter(), time.process_time()
        self.policy.train()
        losses = []
        for epoch in range(epochs if tasks else 0):
            total = 0.0
            for i in self.rng.permutation(len(tasks)):
                task = tasks[i]
                target = self.imitation_target(task)
                assert target is not None
                loss = imitation_loss(self.strategy_logits(task, target), target, self.imitation_weights(task))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self.settings.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.settings.max_grad_norm)
                self.optimizer.step()
                total += float(loss.detach())
            losses.append(total / len(tasks))
            self.report.log_distill(epoch, losses[-1])
        self.wall_s += time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0
        return losses

    def evaluate_policy(self, samples: int) -> dict[str, dict[str, Any]]:
        """Score the policy without updating it: per graph, its greedy strategy (the most likely decision
        of every group, :func:`agents.networks.most_likely_actions`) and ``samples`` sampled ones are
        simulated and the best is recorded. Returns, per graph, the greedy, best and mean iteration times."""
        self.policy.eval()
        out = {}
        with torch.no_grad():
            for task in self.tasks:
                group_emb, mask = self.policy.embed_groups(*task.inputs.args()), task.inputs.group_mask
                devices = self.policy.embed_devices(task.inputs.dev_x, task.inputs.dev_mask)
                drawn = torch.cat([self.policy.sample_plans(group_emb, mask, 1, greedy=True, devices=devices),
                                   self.policy.sample_plans(group_emb, mask, samples, generator=self.generator,
                                                            devices=devices)])
                tie = self.tie(task)
                actions = full_plan((drawn if tie is None else drawn[:, plan_columns(tie, task.n_groups)]).numpy(),
                                    task.n_groups, self.scorer.width(task))
                rewards, times, ooms = self.evaluate(task, actions)
                state = self.states[task.key]
                self.record(task, state, actions, rewards, times, ooms)
                out[task.name] = {"greedy_iteration_time_s": float(times[0]), "greedy_oom": bool(ooms[0]),
                                  "mean_iteration_time_s": float(times.mean()),
                                  "best_iteration_time_s": state.best_iteration_time_s, "best_oom": state.best_oom}
        return out

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0 if self._t0 is not None else 0.0

    def _cpu_elapsed(self) -> float:
        return time.process_time() - self._c0 if self._c0 is not None else 0.0

    # ----------------------------------------------------------------------------- results
    def best_strategy(self, task: GraphTask | str | None = None) -> Strategy:
        """The best strategy found for ``task`` (a task, its name, or None for the only/first task)."""
        task = self._task(task)
        state = self.states[task.key]
        if state.best_actions is None:
            raise HeterogError(f"no strategy sampled yet for {task.name}")
        width = self.scorer.width(task)
        strategy = plan_strategy(task.evaluator, full_plan(state.best_actions, task.n_groups, width), "agent",
                                 states=self.policy.state_actions, splits=self.policy.split_actions,
                                 extended=width > 0)
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

    def _task(self, task: GraphTask | str | None) -> GraphTask:
        if isinstance(task, GraphTask):
            return task
        if task is None:
            return self.tasks[0]
        for t in self.tasks:
            if task in (t.name, t.key):
                return t
        raise HeterogError(f"unknown graph {task!r}; known: {[t.name for t in self.tasks]}")

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (:func:`agents.checkpoint.trainer_state`)."""
        return trainer_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run ``state`` came from (:func:`agents.checkpoint.load_trainer_state`)."""
        load_trainer_state(self, state)

    def save(self, path: str | Path) -> Path:
        """Write the checkpoint atomically (see :mod:`agents.checkpoint`)."""
        return save_checkpoint(path, self.state_dict())
