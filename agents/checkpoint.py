"""Agent checkpoints: one file with the policy (config + weights), optimizer, per-graph baselines and
best strategies, RNG states and counters, written atomically; loading refuses a checkpoint made for
another action space (another number of devices) or another feature layout. :func:`trainer_state` and
:func:`load_trainer_state` are what a trainer's ``state_dict``/``load_state_dict`` save and restore.

Checkpoints saved before the policy chose micro-batches and recomputation load: their policy weights
lack the plan-level heads, which keep their initial values (noted in the log), their optimizer state is
re-indexed around those parameters, and their best strategies and pools of configs alone are plans of
one micro-batch without recomputation."""
from __future__ import annotations

import io
import logging
import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from agents.networks import StrategyPolicy
from agents.networks.policy import missing_new_parameters
from agents.settings import TrainerView
from agents.tasks import TaskState
from envs.actions import full_plan
from envs.features import DEVICE_FEATURE_DIM
from envs.features import op_feature_dim as envs_op_feature_dim
from heterog.actions import N_DP_ACTIONS
from heterog.atomic import atomic_write_bytes
from heterog.errors import CheckpointError

FORMAT = "heterog-agent"
VERSION = 1
log = logging.getLogger(__name__)


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (a :meth:`agents.trainer.Trainer.state_dict`) to ``path`` via a temporary file
    and a rename, so an existing checkpoint is never half-overwritten."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, **state}, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint (plain containers and tensors only: ``weights_only`` loading).

    Raises CheckpointError for a missing, unreadable or foreign file.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding problem is a bad file
        raise CheckpointError(f"checkpoint {str(p)!r} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{str(p)!r} is not a heterog agent checkpoint")
    if state.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {str(p)!r} has format version {state.get('version')}, "
                              f"this code reads version {VERSION}")
    return state


def export_policy(state: dict[str, Any], path: str | Path, provenance: dict[str, Any]) -> Path:
    """Write only the policy of ``state`` (config and weights, as fp32 tensors) with ``provenance`` (how
    it was trained), for shipping: what ``agents.planner`` loads to plan or fine-tune, without the
    optimizer, RNG and per-graph state that resuming a run needs (a few hundred kB instead of MBs)."""
    slim = {"policy_config": dict(state["policy_config"]),
            "policy_state": {k: v.detach().clone().float() if v.is_floating_point() else v.detach().clone()
                             for k, v in state["policy_state"].items()},
            "provenance": _plain(provenance)}
    return save_checkpoint(path, slim)


def checkpoint_head(state: dict[str, Any]) -> str:
    """The policy head a checkpoint records: ``"fixed"`` (M + 4 actions for one M) or ``"tokens"``
    (device tokens, any cluster up to its device count). Checkpoints without the entry are fixed."""
    return str(state["policy_config"].get("head", "fixed"))


def check_fits(state: dict[str, Any], n_devices: int, op_feature_dim: int | None = None,
               device_feature_dim: int = DEVICE_FEATURE_DIM, source: str = "checkpoint") -> None:
    """Refuse a checkpoint whose policy was built for another action space or feature layout, naming
    both sizes. A fixed-head checkpoint fits clusters of exactly its device count; a tokens-head one any
    cluster of at most its device count. ``op_feature_dim``: what the current features have (None: the
    size of the checkpoint's head's layout for ``n_devices``)."""
    config = state["policy_config"]
    want = n_devices + N_DP_ACTIONS
    have = int(config["n_actions"])
    head = checkpoint_head(state)
    if op_feature_dim is None or head == "tokens":
        op_feature_dim = envs_op_feature_dim(n_devices, "per-device" if head == "fixed" else "device-free")
    if head == "tokens":
        if not 1 <= n_devices <= have - N_DP_ACTIONS:
            raise CheckpointError(f"{source} is a device-token policy for clusters of at most "
                                  f"{have - N_DP_ACTIONS} devices; this cluster has {n_devices} devices")
    elif have != want:
        raise CheckpointError(f"{source} is for an action space of {have} actions ({have - N_DP_ACTIONS} devices); "
                              f"this cluster needs {want} actions ({n_devices} devices) (a fixed-head policy "
                              f"fits one cluster size; agent.head=tokens fits any)")
    for name, expected in (("op_feature_dim", op_feature_dim), ("device_feature_dim", device_feature_dim)):
        if int(config[name]) != expected:
            raise CheckpointError(f"{source} has {name}={config[name]}, the current features have {expected} "
                                  f"(the feature layout changed)")


def policy_from_checkpoint(state: dict[str, Any], state_actions: bool = False) -> StrategyPolicy:
    """The policy stored in a checkpoint, with its weights (parameters the checkpoint predates, the
    plan-level heads, keep their initial values). ``state_actions``: with the state actions
    (``PolicyConfig.state_actions``) even where the checkpoint's policy lacks them: their offsets then start
    untrained (``agents.networks.plan.STATE_PRIOR``), so its greedy plans stay what they were."""
    config = dict(state["policy_config"])
    if state_actions and not config.get("state_actions", False):
        if config.get("autoregressive", False):
            raise CheckpointError("an autoregressive policy cannot gain the state actions (its action embedding "
                                  "has one row per action); train one with them")
        config["state_actions"] = True
    policy = StrategyPolicy.from_config(config)
    policy.load_state_dict(state["policy_state"])
    return policy


def ties_blocks(state: dict[str, Any]) -> bool:
    """Whether the checkpoint's policy was trained with ``tie_blocks`` (its own samples give each coupled
    block one decision), from its trainer settings (a trainer checkpoint's, or an exported policy's
    provenance); False for checkpoints from before the setting."""
    settings = state.get("settings") or state.get("provenance", {}).get("settings") or {}
    return bool(settings.get("tie_blocks", False))


def trainer_state(trainer: TrainerView) -> dict[str, Any]:
    """Everything a resumed run needs: weights, optimizer, per-graph baselines/pools/best plans, RNG
    states, counters and settings (plain types and tensors only)."""
    return {
        "policy_config": trainer.policy.config,
        "policy_state": trainer.policy.state_dict(),
        "optimizer_state": trainer.optimizer.state_dict(),
        "settings": asdict(trainer.settings),
        "tasks": {t.key: {"name": t.name, **trainer.states[t.key].to_dict()} for t in trainer.tasks},
        "best_strategies": {t.key: trainer.best_strategy(t).to_dict() for t in trainer.tasks
                            if trainer.states[t.key].best_actions is not None},
        "counters": {"rounds": trainer.rounds, "episodes": trainer.episodes, "n_sims": trainer.n_sims,
                     "wall_s": trainer.wall_s, "cpu_s": trainer.cpu_s},
        "rng": {"torch_generator": trainer.generator.get_state(), "torch_global": torch.get_rng_state(),
                "numpy": _plain(trainer.rng.bit_generator.state), "python": _plain(random.getstate())},
    }


def load_trainer_state(trainer: TrainerView, state: dict[str, Any]) -> None:
    """Put ``trainer`` where the run ``state`` came from stood (same tasks: states of other graphs are
    ignored), so that it continues exactly."""
    missing = missing_new_parameters(trainer.policy, state["policy_state"])
    trainer.policy.load_state_dict(state["policy_state"])
    trainer.optimizer.load_state_dict(_reindexed_optimizer_state(trainer, state["optimizer_state"], missing))
    n_groups = {t.key: t.n_groups for t in trainer.tasks}
    width = {t.key: t.inputs.n_devices if trainer.settings.extended_plans else 0 for t in trainer.tasks}
    for key, d in state["tasks"].items():
        if key in trainer.states:
            trainer.states[key] = _as_plans(TaskState.from_dict({k: v for k, v in d.items() if k != "name"}),
                                            n_groups[key], width[key])
    c = state["counters"]
    trainer.rounds, trainer.episodes, trainer.n_sims = int(c["rounds"]), int(c["episodes"]), int(c["n_sims"])
    trainer.wall_s, trainer.cpu_s = float(c["wall_s"]), float(c["cpu_s"])
    rng = state["rng"]
    trainer.generator.set_state(rng["torch_generator"])
    torch.set_rng_state(rng["torch_global"])
    trainer.rng.bit_generator.state = rng["numpy"]
    random.setstate(_python_state(rng["python"]))


def _reindexed_optimizer_state(trainer: TrainerView, saved: dict[str, Any], missing: list[str]) -> dict[str, Any]:
    """``saved`` (an optimizer state over the parameters without ``missing``) over all of the policy's
    parameters, in order; the missing ones start without optimizer state."""
    if not missing:
        return saved
    names = [name for name, _ in trainer.policy.named_parameters()]
    kept = [i for i, name in enumerate(names) if name not in missing]
    groups = saved["param_groups"]
    if len(groups) != 1 or len(groups[0]["params"]) != len(kept):
        raise CheckpointError(f"the optimizer state has {sum(len(g['params']) for g in groups)} parameters, "
                              f"the policy without its plan-level heads {len(kept)}")
    order = {old: kept[i] for i, old in enumerate(groups[0]["params"])}
    log.info("optimizer state without the plan-level heads: they start without one")
    return {"state": {order[int(i)]: v for i, v in saved["state"].items()},
            "param_groups": [{**groups[0], "params": list(range(len(names)))}]}


def _as_plans(state: TaskState, n_groups: int, row_width: int = 0) -> TaskState:
    """``state`` with its best strategy and pool as plans over ``n_groups`` groups (configs alone: one
    micro-batch, no recomputation; with ``row_width``, extended plans: rows of zeros where they have none)."""
    if state.best_actions is not None:
        state.best_actions = full_plan(state.best_actions, n_groups, row_width).tolist()
    state.pool = [(r, full_plan(a, n_groups, row_width).tolist()) for r, a in state.pool]
    return state


def _plain(obj: Any) -> Any:
    """Tuples to lists, recursively (checkpoints hold plain containers)."""
    if isinstance(obj, (tuple, list)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _python_state(state: Sequence[Any]) -> tuple[Any, ...]:
    """random.setstate wants (version, tuple of ints, gauss_next)."""
    version, internal, gauss = state
    return int(version), tuple(int(x) for x in internal), gauss
