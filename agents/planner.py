"""The agent as a planner (``heterog plan --method agent``): fine-tune a checkpoint (by default the
pretrained one shipped in this package, ``PRETRAINED``) or train from scratch, on one graph and cluster
for a number of episodes or a wall-clock budget, and return the best strategy found; with a budget of 0,
the checkpoint's plan zero-shot.

``PLANNER`` is what heterog's planner registry (``heterog.planners``) loads for method ``agent``,
through the entry point ``agent = "agents.planner:PLANNER"`` of the ``heterog.planners`` group
(pyproject.toml): heterog names no module of this package."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agents.candidates import BlockMoves, promising_uniform, server_splits
from agents.checkpoint import check_fits, load_checkpoint, policy_from_checkpoint, ties_blocks
from agents.losses import plan_columns
from agents.networks import StrategyPolicy
from agents.trainer import BudgetSpent, GraphTask, Trainer, TrainerSettings, bias_towards_data_parallel
from envs.actions import full_plan, plan_length, plan_strategy
from envs.features import DEVICE_FEATURE_DIM, MAX_DEVICES, op_feature_dim
from heterog.actions import SPLIT_ACTION_NAMES, n_actions
from heterog.baselines.mcmc import SPLIT_STARTS, start_plan
from heterog.baselines.ps_refine import refine_ps_devices
from heterog.compiler.compile import cycles_paused
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.planners import Planner
from heterog.reporting import DP_BASELINES
from heterog.strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter

    from heterog.evaluator_protocol import PlanEvaluator

DEFAULT_EPISODES = 2000
# The pretrained device-token policy shipped with the package: what ``plan`` starts from when no checkpoint
# is given. How it was trained, and how to retrain it: docs/design.md, "The shipped checkpoint".
PRETRAINED = Path(__file__).resolve().parent / "pretrained" / "tokens-small.pt"
# The same kind of policy with the split actions (``PolicyConfig.split_actions``): where ``plan(splits=True)``
# starts. Trained by experiment=pretrain_tokens_splits (docs/design.md, "The shipped checkpoint").
PRETRAINED_SPLITS = Path(__file__).resolve().parent / "pretrained" / "tokens-small-splits.pt"
SCRATCH = "scratch"          # checkpoint value (CLI: --agent scratch) that trains a fresh policy
# The planners whose plans seed a budgeted search (``plan``'s ``seeds``): those of a few evaluations, then the
# budgeted ones (pipeline) on ``SEED_SHARE`` of what is left of the budget, shared among them
SEED_PLANNERS = ("single", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "expert", "dpos", "pipeline")
SEED_SHARE = 0.3
# MCMC's starts that divide every group beyond the batch within the fastest server, or over the faster grid
# (``heterog.baselines.mcmc.start_actions``), seeds too where the search has splits and the graph and cluster
# have them: MCMC's best start in half of the planner table's cases (docs/results.md), one simulation per variant
SEED_STARTS = ("tp-server", "tp-grid")
# zero-shot compares the uniform plans beyond the four data-parallel ones and the strongest server's split (the
# other servers' and the cluster-wide splits, the sharded state choices) where each would end within this many
# seconds of its start, or while none of the plans compared fits (where none of those always compared fits,
# every state choice first: they free memory); it refines the PS plans' servers in the time left. A tenth of the
# second is kept for a comparison that takes longer than the last of its kind (a state choice after the plain
# data-parallel plans) and for what follows the last: on the planner table's 24 cases it keeps the plans the
# whole second kept, and every case that nothing makes compare more ends within the second (docs/results.md)
ZERO_SHOT_S = 0.9
# with a budget, the search's last share of it polishes the plan it returns (``polish``): group by group, each
# config the plan holds already, kept where faster. On the planner table's gpt2 on mixed-h100-a100-l4 such a pass
# gains in 5 s what the search gains in another 60 (docs/results.md)
POLISH_SHARE = 0.2
PS_BASELINES = ("ev-ps", "cp-ps")
log = logging.getLogger(__name__)
AGENT_SIZES = {"small": StrategyPolicy.small, "paper": StrategyPolicy.paper}


def build_policy(n_devices: int, size: str = "small", seed: int = 0, dp_bias: float = 0.0,
                 head: str = "fixed", max_devices: int = MAX_DEVICES, **overrides: Any) -> StrategyPolicy:
    """A fresh policy for a cluster of ``n_devices`` (``size``: "small" or "paper"), initialised from
    ``seed``, with ``dp_bias`` added to the data-parallel logits (see ``bias_towards_data_parallel``).
    ``head="tokens"`` builds the device-token head for any cluster of at most ``max_devices`` devices."""
    if size not in AGENT_SIZES:
        raise HeterogError(f"unknown agent size {size!r}; choose one of {sorted(AGENT_SIZES)}")
    if head == "tokens" and not 1 <= n_devices <= max_devices:
        raise HeterogError(f"a cluster of {n_devices} devices does not fit agent.max_devices={max_devices}")
    torch.manual_seed(seed)
    if head == "tokens":
        policy = AGENT_SIZES[size](op_feature_dim(max_devices, "device-free"), DEVICE_FEATURE_DIM,
                                   n_actions(max_devices), head=head, **overrides)
    else:
        policy = AGENT_SIZES[size](op_feature_dim(n_devices), DEVICE_FEATURE_DIM, n_actions(n_devices), head=head,
                                   **overrides)
    bias_towards_data_parallel(policy, dp_bias)
    return policy


def plan(evaluator: PlanEvaluator, checkpoint: str | Path | dict | None = None, episodes: int | None = None,
         budget_s: float | None = None, seed: int = 0, progress: bool = True, *,
         settings: TrainerSettings | None = None, size: str = "small", run_dir: str | Path | None = None,
         writer: SummaryWriter | None = None, workers: int = 1, ray_address: str | None = None,
         splits: bool = False, sharded: bool = False, seeds: Sequence[str] = SEED_PLANNERS + SEED_STARTS
         ) -> Strategy:
    """Search a strategy for ``evaluator.graph`` on ``evaluator.cluster`` with the learning agent.

    Args:
        evaluator: a :class:`heterog.evaluate.Evaluator` (its grouping and cost model are used).
        checkpoint: a checkpoint path (or loaded checkpoint) to fine-tune; None: the shipped pretrained
            checkpoint (``PRETRAINED``, with ``splits`` ``PRETRAINED_SPLITS``) when its policy fits the
            cluster, else from scratch (logged); ``"scratch"``: a fresh policy. A checkpoint's policy
            brings its own action space (with split actions or without).
        episodes: strategies to sample (one episode = one plan); default 2000 when no budget is given.
        budget_s: wall-clock budget in seconds, setup included. 0 with a checkpoint: zero-shot
            (``zero_shot``: the pretrained policy's plan, no update).
        seed: seeds the policy's initialisation and all sampling.
        progress: show a progress bar (on stderr).
        settings: trainer settings (default: ``TrainerSettings(seed=seed)``).
        size: policy size when training from scratch: "small" or "paper".
        run_dir, writer: optional learning-curve/Gantt output folder and TensorBoard writer.
        workers, ray_address: simulate each round's strategies on this many Ray workers, on the cluster at
            this address (``heterog.parallel``; ``settings.workers`` when settings are given).
        splits: plan with the split actions (splits beyond the batch, ``PolicyConfig.split_actions``):
            start from ``PRETRAINED_SPLITS`` or, from scratch, a policy with them.
        sharded: plan with the state actions too (``PolicyConfig.state_actions``: AllReduce data
            parallelism keeping sharded state, ZeRO stage 1-3, optionally the optimizer state offloaded;
            ``heterog.actions.STATE_CHOICES``). A checkpoint trained without them gains them untrained
            (``agents.networks.plan.STATE_PRIOR``: its greedy plan picks none); zero-shot also compares
            the uniform plans of each AllReduce scheme keeping each state choice with shards by memory.
            Simulated in this process (one worker).
        seeds: planners whose plans seed the search (not zero-shot; ``seed_plans``), and MCMC's split starts
            among them (``SEED_STARTS``, with ``splits``; ``seed_starts``): each plan the policy's
            actions hold is recorded as the first plans are (the search's moves start from the best, the
            replay pool and the imitation term pull the policy towards it), and each the extended actions hold
            (then the search's plans are extended ones, ``TrainerSettings.extended_plans``, simulated in this
            process); every one stays a candidate for the plan returned, which is
            the fastest that fits of the search's best and the seeds'. The seeds' known times prime the
            search's scorer; the budget is a deadline for the search (``Trainer.deadline``).

    Returns the best strategy found (its group configs, recomputed groups and micro-batches, as the agent
    chose them), method "agent", with meta ``search_time_s``, ``best_iteration_time_s``, ``oom``,
    ``episodes``, ``rounds``, ``seed``, ``checkpoint`` (the path started from; None from scratch),
    ``micro_batches`` (the number), ``recomputed_groups`` (how many) and ``extended_plans`` (whether the
    search's plans were extended ones); with seeds, ``seeds`` (planner ->
    simulated seconds, OOM marked by a negative value), ``seeds_in_actions`` (the planners whose plans the
    actions hold), ``best_seed`` and ``best_seed_s`` (the fastest seed that fits, or the fastest), ``from_seed``
    (the seed returned as found, "" when the search's plan is returned) and ``agent_added`` (the best seed's
    time over the plan's, minus 1: what the search added).
    """
    t0 = time.perf_counter()
    if not isinstance(evaluator, Evaluator):
        raise HeterogError(f"the agent plans with a heterog.evaluate.Evaluator (its grouping, cost model and "
                           f"detailed results), got a {type(evaluator).__name__}")
    zero = budget_s == 0 and episodes is None
    checkpoint = start_checkpoint(checkpoint, evaluator.cluster.n_devices, required=zero, splits=splits)
    source = None if checkpoint is None or isinstance(checkpoint, dict) else str(checkpoint)
    if zero:
        if checkpoint is None:
            raise HeterogError("zero-shot planning (budget 0, no episodes) needs a checkpoint")
        with cycles_paused():       # a second's work: no walks of the whole heap for the garbage it makes
            strategy = zero_shot(evaluator, checkpoint, states=sharded, t0=t0)
        strategy.meta.update({"search_time_s": time.perf_counter() - t0, "seed": seed, "checkpoint": source})
        return strategy
    if episodes is None and budget_s is None:
        episodes = DEFAULT_EPISODES
    if episodes is not None and episodes < 1:
        raise HeterogError(f"episodes must be at least 1, got {episodes}")
    if budget_s is not None and budget_s <= 0:
        raise HeterogError(f"budget_s must be positive (or 0 with a checkpoint: zero-shot), got {budget_s}")
    settings = settings or TrainerSettings(seed=seed, workers=workers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = evaluator.cluster.n_devices
        if checkpoint is not None:
            policy = _load_policy(checkpoint, m, states=sharded)
        else:
            policy = build_policy(m, size, seed, settings.initial_dp_bias, split_actions=splits, state_actions=sharded)
        task = GraphTask.from_evaluator(evaluator, layout=policy.feature_layout)
        starts = seed_starts(evaluator, [n for n in seeds if n in SPLIT_STARTS], splits,
                             None if budget_s is None else t0 + budget_s)
        seeded = {name: s for name, (s, _) in starts.items()}
        seeded.update(seed_plans(evaluator, [n for n in seeds if n not in SPLIT_STARTS], budget_s, t0, splits, sharded))
        scored = {name: starts[name][1] if name in starts else evaluator.iteration_time(s)    # within the budget
                  for name, s in seeded.items()}
        # the search holds a seed beyond the policy's actions (stages on device subsets, grids) in the extended
        # ones (then simulated in this process: the same plan with any number of workers)
        held = seed_actions(evaluator, seeded, policy, extended=True)
        if any(len(a) > plan_length(evaluator.n_groups) for a in held.values()):
            settings = replace(settings, extended_plans=True)
        trainer = Trainer(policy, [task], settings, writer=writer, run_dir=run_dir, ray_address=ray_address)
        try:
            # a seed without an order of its own decodes to a plan that simulates as it does (the round trip of
            # the plan actions): its time is known, and so is that of a uniform plan it equals
            plans = {n: full_plan(a, task.n_groups, trainer.scorer.width(task)) for n, a in held.items()}
            known = [n for n in plans if seeded[n].priorities is None]
            if known:
                trainer.scorer.prime(task, np.stack([plans[n] for n in known]), [scored[n] for n in known])
            if budget_s is not None:
                trainer.deadline = t0 + budget_s
            try:
                if plans:
                    trainer.seed_plans(task, np.stack(list(plans.values())))
            except BudgetSpent:
                pass                                        # the budget is spent: train() stops at once
            remaining = None if budget_s is None else (1.0 - POLISH_SHARE) * budget_s - (time.perf_counter() - t0)
            # a budget the seeds spent starts no round (a round's first plan is scored even past the deadline,
            # so that a search without seeds has a plan)
            if remaining is None or remaining > 0 or trainer.states[task.key].best_actions is None:
                remaining = None if remaining is None else max(remaining, 1e-3)
                with _Progress(progress, task.name, episodes, remaining) as bar:
                    trainer.train(episodes=episodes, budget_s=remaining, on_round=bar.update)
        finally:
            trainer.close()
    finally:
        torch.set_num_threads(threads)
    strategy = trainer.best_strategy(task)
    strategy.method = "agent"
    if seeded:
        strategy = best_of_seeds(evaluator, strategy, seeded, scored, held)
    if budget_s is not None:
        strategy = polish(evaluator, strategy, t0 + budget_s)
    strategy.meta.update({"search_time_s": time.perf_counter() - t0, "seed": seed, "checkpoint": source,
                          "extended_plans": settings.extended_plans})
    return strategy


def seed_plans(evaluator: Evaluator, names: Sequence[str], budget_s: float | None, t0: float, splits: bool,
               sharded: bool, share: float = SEED_SHARE) -> dict[str, Strategy]:
    """The plans of planners ``names`` (planner -> plan), each with the options of the agent's plan space it
    takes (``splits``, ``sharded``): first those without a budget, then the budgeted ones on ``share`` of
    what is left of ``budget_s`` (counted from ``t0``), shared among them; without a budget, none of those.
    A planner that cannot plan the case is skipped (logged)."""
    from heterog.planners import get
    from heterog.planners import plan as plan_with

    planners = {name: get(name) for name in names}
    budgeted = [n for n, p in planners.items() if "budget_s" in p.options]
    out: dict[str, Strategy] = {}
    for name in [n for n in planners if n not in budgeted] + (budgeted if budget_s is not None else []):
        opts: dict[str, Any] = {k: v for k, v in (("splits", splits), ("sharded", sharded))
                                if k in planners[name].own_options}
        if name in budgeted:
            assert budget_s is not None                     # budgeted seeds run with a budget only
            left = budget_s - (time.perf_counter() - t0)
            opts["budget_s"] = max(share * left / len(budgeted), 1e-3)
        try:
            out[name] = plan_with(name, evaluator=evaluator, **opts)
        except HeterogError as exc:
            log.warning("agent: seed planner %s skipped: %s", name, exc)
    return out


def seed_starts(evaluator: Evaluator, names: Sequence[str], splits: bool, deadline: float | None = None
                ) -> dict[str, tuple[Strategy, tuple[float, bool]]]:
    """The plans of MCMC's split starts ``names`` (``heterog.baselines.mcmc.SPLIT_STARTS``; start -> (plan, its
    ``iteration_time``), each chosen among its variants by simulation, none simulated after its first once
    ``time.perf_counter()`` passes ``deadline``) where ``splits`` is on and the graph has split options; a start
    the cluster does not have (one server, servers of unequal sizes) is skipped (logged)."""
    if not splits or not names or evaluator.graph.splits is None:
        return {}
    out: dict[str, tuple[Strategy, tuple[float, bool]]] = {}
    for name in names:
        try:
            out[name] = start_plan(evaluator, name, splits=True, deadline=deadline)
        except HeterogError as exc:
            log.info("agent: seed %s skipped: %s", name, exc)
    return out


def seed_actions(evaluator: Evaluator, seeded: dict[str, Strategy], policy: StrategyPolicy,
                 extended: bool = False) -> dict[str, np.ndarray]:
    """The seeds the policy's actions hold (``envs.actions.encode_plan`` over the evaluator's groups, the
    policy's action space), and with ``extended`` those that the extended actions hold beyond them (a plan
    action with rows, ``(M + 2) G + 1`` long): planner -> plan action."""
    from envs.actions import encode_plan

    out = {}
    for name, s in seeded.items():
        for wide in (False, True) if extended else (False,):
            try:
                out[name] = encode_plan(s, evaluator.cluster, policy.split_actions, policy.state_actions,
                                        extended=wide, group_of=evaluator.group_of)
                break
            except HeterogError:
                continue                     # beyond these actions: a candidate for the plan only
    return out


def best_of_seeds(evaluator: Evaluator, found: Strategy, seeded: dict[str, Strategy],
                  scored: dict[str, tuple[float, bool]], held: dict[str, np.ndarray]) -> Strategy:
    """The fastest that fits of the search's plan ``found`` and the seeds (``scored``: each seed's
    ``iteration_time``; ties: the search's), method "agent", with the seeds' meta (``plan``)."""
    from heterog.evaluate import reward

    mine = evaluator.iteration_time(found)
    best_seed = max(scored, key=lambda n: reward(*scored[n]))
    chosen = best_seed if reward(*scored[best_seed]) > reward(*mine) else ""
    out = found
    if chosen:                          # the seed's plan and meta, the search's counters, its action if held
        meta = {**seeded[chosen].meta, **{k: found.meta[k] for k in ("episodes", "rounds") if k in found.meta}}
        meta.pop("actions", None)
        if chosen in held:
            meta["actions"] = held[chosen].tolist()
        out = replace(seeded[chosen], method="agent", meta=meta)
    t_out = scored[chosen][0] if chosen else mine[0]
    out.meta.update({"seeds": {n: (-t if oom else t) for n, (t, oom) in scored.items()},
                     "seeds_in_actions": sorted(held), "best_seed": best_seed, "best_seed_s": scored[best_seed][0],
                     "from_seed": chosen, "agent_added": scored[best_seed][0] / t_out - 1.0})
    if chosen:
        out.meta.update({"best_iteration_time_s": t_out, "oom": scored[chosen][1]})
    return out


def polish(evaluator: Evaluator, strategy: Strategy, deadline: float) -> Strategy:
    """``strategy`` improved by passes over its groups until one changes nothing or ``deadline`` passes: each
    group in turn tries each config the plan holds (in order of first use), and keeps the one that makes the plan
    faster (``reward``: a plan out of memory counts as in training). Each trial is one evaluation, patched from
    the last by the delta compiler. Meta: ``polished`` (the groups changed) and ``polish_gain`` (the plan's time
    before over after, minus 1); where anything changed, ``best_iteration_time_s``, ``oom``, ``agent_added``
    (against the best seed) and ``from_seed`` ("": the plan is no seed's as found) follow, and ``actions`` (which
    may no longer hold the plan) is dropped."""
    from heterog.evaluate import reward

    before = best = evaluator.iteration_time(strategy)
    held = list(dict.fromkeys({id(c): c for c in strategy.configs}.values()))    # each config once, by value
    configs, changed = list(strategy.configs), set()
    improved = len(held) > 1
    while improved and time.perf_counter() < deadline:
        improved = False
        for g in range(len(configs)):
            for c in held:
                if time.perf_counter() >= deadline:
                    break
                if c == configs[g]:
                    continue
                trial = configs[:g] + [c] + configs[g + 1:]
                try:
                    got = evaluator.iteration_time(replace(strategy, configs=trial))
                except HeterogError:        # a config this group cannot take (a split group recomputed)
                    continue
                if reward(*got) > reward(*best):
                    best, configs, improved = got, trial, True
                    changed.add(g)
    out = replace(strategy, configs=configs, meta=dict(strategy.meta)) if changed else strategy
    out.meta.update({"polished": len(changed), "polish_gain": before[0] / best[0] - 1.0})
    if changed:
        out.meta.pop("actions", None)
        out.meta.update({"best_iteration_time_s": best[0], "oom": best[1]})
        if "from_seed" in out.meta:
            out.meta["from_seed"] = ""
        if "best_seed_s" in out.meta:
            out.meta["agent_added"] = out.meta["best_seed_s"] / best[0] - 1.0
    return out


def start_checkpoint(checkpoint: str | Path | dict | None, n_devices: int,
                     required: bool = False, splits: bool = False) -> str | Path | dict | None:
    """The checkpoint ``plan`` starts from on a cluster of ``n_devices``: ``checkpoint`` itself, None for
    ``SCRATCH``, and for None the shipped ``PRETRAINED`` checkpoint (``PRETRAINED_SPLITS`` with ``splits``)
    when its policy fits the cluster (else None, from scratch, with a warning). ``required`` (zero-shot):
    a checkpoint must result; otherwise the error names why there is none."""
    if isinstance(checkpoint, (str, Path)) and str(checkpoint) == SCRATCH:
        if required:
            raise HeterogError("budget_s 0 (zero-shot) plans with a pretrained policy, not from scratch")
        return None
    if checkpoint is not None:
        return checkpoint
    shipped = PRETRAINED_SPLITS if splits else PRETRAINED
    if not shipped.is_file():
        why = f"the shipped checkpoint {str(shipped)!r} is missing from this installation"
    else:
        try:
            check_fits(load_checkpoint(shipped), n_devices, None, DEVICE_FEATURE_DIM,
                       source="the shipped checkpoint")
            return shipped
        except HeterogError as exc:
            why = str(exc)
    if required:
        raise HeterogError(f"budget_s 0 (zero-shot) needs a pretrained policy: {why}; give one with --agent CKPT")
    log.warning("agent: training from scratch: %s", why)
    return None


def _load_policy(checkpoint: str | Path | dict, n_devices: int, state: dict | None = None,
                 states: bool = False) -> StrategyPolicy:
    """The checkpoint's policy, checked against ``n_devices`` (``state``: the checkpoint, if loaded);
    ``states``: with the state actions (``policy_from_checkpoint``)."""
    if state is None:
        state = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    check_fits(state, n_devices, None, DEVICE_FEATURE_DIM,
               source=f"checkpoint {str(checkpoint)!r}" if not isinstance(checkpoint, dict) else "checkpoint")
    return policy_from_checkpoint(state, state_actions=states)


def zero_shot(evaluator: Evaluator, checkpoint: str | Path | dict, states: bool = False,
              t0: float | None = None) -> Strategy:
    """The pretrained policy's plan for ``evaluator``'s graph and cluster without any update: its greedy plan (each
    group's most likely decision, ``agents.networks.most_likely_actions``, and its more likely recompute bit, and
    the most likely number of micro-batches; each coupled block its leader's, when the policy was trained with
    ``tie_blocks``), compared with the four data-parallel plans (every group under one DP action, one micro-batch,
    no recomputation) and, for a policy with split actions, each server's split (every group divided evenly over
    one server's devices, ``tp-server:<server>``, the servers of the most device power first:
    ``agents.candidates.server_splits``) and the two cluster-wide splits (every group under ``tp-even``, or
    ``tp-prop``) and, with ``states`` (the policy gains the state actions), the two AllReduce schemes keeping
    each state choice with shards by memory (``ev-ar:s2-memory``, ...); the fastest is returned (a plan out of
    memory counts ``oom_factor`` times slower, as in training). The policy's plan, the data-parallel ones and
    the split over the server of the most device power are always compared (the PS plans' servers refined,
    ``heterog.baselines.ps_refine``, after the comparison: each trial where it would end within ``ZERO_SHOT_S``,
    and the fastest plan's in full); each of the other splits and the state choices only where it would end within
    ``ZERO_SHOT_S`` of ``t0`` (default: this call's start), taking as long as the last comparison of its kind,
    or while no plan compared fits; where none of those always compared fits, every state choice is compared
    first (they free memory), each scheme's strongest before its others, which are skipped where the strongest
    is out of memory. Meta:
    ``policy_plan_s`` and ``policy_plan_oom`` (the greedy plan, before the comparison), ``zero_shot`` True,
    ``kept`` ("policy" or the uniform plan's name), ``compared`` (the names of the plans compared, in order),
    ``best_iteration_time_s``, ``oom``, ``episodes`` 0, ``rounds`` 0, ``micro_batches`` and
    ``recomputed_groups``."""
    from heterog.evaluate import reward

    t0 = time.perf_counter() if t0 is None else t0
    m = evaluator.cluster.n_devices
    state = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    policy = _load_policy(checkpoint, m, state, states)
    policy.eval()
    task = GraphTask.from_evaluator(evaluator, layout=policy.feature_layout)
    with torch.no_grad():
        emb = policy.embed_groups(*task.inputs.args())
        devices = policy.embed_devices(task.inputs.dev_x, task.inputs.dev_mask)
        greedy = policy.sample_plans(emb, task.inputs.group_mask, 1, greedy=True, devices=devices)[0]
    blocks = BlockMoves.of(evaluator) if ties_blocks(state) else None
    if blocks is not None and blocks.groups:
        greedy = greedy[plan_columns(blocks.tie(evaluator.n_groups), evaluator.n_groups)]
    servers = server_splits(evaluator.cluster) if policy.split_actions else {}
    # after the data-parallel plans, the servers' splits first (the strongest server's always compared)
    uniform = promising_uniform(m, policy.split_actions, states)
    uniform = {**{n: a for n, a in uniform.items() if n in DP_BASELINES}, **servers, **uniform}
    candidates = {"policy": greedy.numpy().astype(np.int64)}
    candidates.update({name: full_plan(np.full(evaluator.n_groups, a, dtype=np.int64), evaluator.n_groups)
                       for name, a in uniform.items()})

    def decode(a: np.ndarray, method: str = "") -> Strategy:
        return plan_strategy(evaluator, a, method, states=states, splits=policy.split_actions)

    plans: dict[str, Strategy] = {}
    scored: dict[str, tuple[float, bool]] = {}
    took: dict[str, float] = {}
    keys: dict[str, str] = {}      # plan key -> the first candidate compared with that plan

    def compare(name: str) -> None:
        """Scores candidate ``name``; one that decodes to a plan already compared (the even and the proportional
        shares are alike where the batch divides evenly) takes that plan's score and time."""
        start = time.perf_counter()
        plans[name] = decode(candidates[name], "agent")
        same = keys.setdefault(plans[name].plan_key(), name)
        scored[name] = evaluator.iteration_time(plans[name]) if same == name else scored[same]
        took[name] = time.perf_counter() - start if same == name else took[same]

    def split(name: str) -> bool:
        return name in servers or name in SPLIT_ACTION_NAMES

    def ends_in_time(name: str) -> bool:
        """Whether comparing ``name`` ends within ``ZERO_SHOT_S``, taking as long as the last comparison of
        its kind (a split, or a plan data-parallel over the cluster: the DP plans, the state choices)."""
        kind = [n for n in took if n != "policy" and split(n) == split(name)]
        return time.perf_counter() - t0 + (took[kind[-1]] if kind else 0.0) < ZERO_SHOT_S

    for name in ("policy", *DP_BASELINES, *list(servers)[:1]):
        compare(name)

    def fits() -> bool:
        return not all(oom for _, oom in scored.values())

    more = [n for n in candidates if n not in scored]
    # where nothing fits yet, every state choice (they free memory: the fastest of them that fits is wanted), each
    # scheme's strongest first (its last: ``promising_uniform`` keeps ``STATE_CHOICES``' order); where even that
    # is out of memory, none of the scheme's others is compared: no weaker choice frees more (the assumption of
    # ``heterog.baselines.fit``'s sharded search)
    every = [] if fits() else strongest_first([n for n in more if not split(n)])
    lead = {n.split(":")[0]: n for n in reversed(every)}          # each scheme's strongest
    for name in every + [n for n in more if n not in every]:
        if name in every:
            strongest = lead[name.split(":")[0]]
            if name == strongest or not scored[strongest][1]:
                compare(name)
        elif not fits() or ends_in_time(name):
            compare(name)
    # the PS baselines' servers (heterog.baselines.ps_refine): each trial where it would end in time, and for the
    # fastest plan every trial
    for name in sorted(PS_BASELINES, key=lambda n: -reward(*scored[n])):
        fastest = max(scored, key=lambda n: reward(*scored[n])) == name
        if fastest or ends_in_time(name):
            plans[name] = refine_ps_devices(evaluator, plans[name],
                                            deadline=None if fastest else t0 + ZERO_SHOT_S - took[name])
            scored[name] = evaluator.iteration_time(plans[name])
    kept = max(scored, key=lambda name: (reward(*scored[name]), name == "policy"))
    strategy = plans[kept]
    strategy.meta.update({"zero_shot": True, "kept": kept, "compared": list(scored),
                          "policy_plan_s": scored["policy"][0], "policy_plan_oom": scored["policy"][1],
                          "best_iteration_time_s": scored[kept][0], "oom": scored[kept][1], "episodes": 0,
                          "rounds": 0})
    return strategy


def strongest_first(states: Sequence[str]) -> list[str]:
    """``states`` (state choices named ``<scheme>:<choice>``, each scheme's in ``STATE_CHOICES``' order) with
    each scheme's last, its strongest, moved before the scheme's others."""
    schemes = list(dict.fromkeys(n.split(":")[0] for n in states))
    of = {b: [n for n in states if n.split(":")[0] == b] for b in schemes}
    return [n for b in schemes for n in (of[b][-1:] + of[b][:-1])]


class _Progress:
    """A rich progress bar over episodes or seconds (on stderr); does nothing when disabled."""

    def __init__(self, enabled: bool, name: str, episodes: int | None, budget_s: float | None) -> None:
        self.enabled, self.name = enabled, name
        self.by_time = episodes is None
        self.total = budget_s if self.by_time else episodes
        self.t0 = time.perf_counter()

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]agent[/] {task.description}"), BarColumn(),
                                TextColumn("{task.fields[best]}"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=False)
            self.bar.start()
            self.task_id = self.bar.add_task(self.name, total=self.total, best="")
        return self

    def update(self, trainer: Trainer, stats: dict) -> None:
        if not self.enabled:
            return
        state = next(iter(trainer.states.values()))
        done = time.perf_counter() - self.t0 if self.by_time else state.episodes
        best = f"best {state.best_iteration_time_s * 1e3:.2f} ms{' (OOM)' if state.best_oom else ''}"
        completed = done if self.total is None else min(done, self.total)
        self.bar.update(self.task_id, completed=completed, best=f"{best}, {state.episodes} episodes")

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.stop()


PLANNER = Planner("agent", plan, frozenset({"budget_s", "seed", "checkpoint", "episodes", "workers", "ray_address",
                                            "progress"}), default=False)
