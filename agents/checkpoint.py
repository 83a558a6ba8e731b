"""Agent checkpoints: one file with the policy (config + weights), optimizer, per-graph baselines and
best strategies, RNG states and counters, written atomically; loading refuses a checkpoint made for
another action space (another number of devices) or another feature layout."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from agents.networks import N_DP_SCHEMES, StrategyPolicy
from heterog.atomic import atomic_write_bytes
from heterog.errors import CheckpointError

FORMAT = "heterog-agent"
VERSION = 1


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


def check_fits(state: dict[str, Any], n_devices: int, op_feature_dim: int, device_feature_dim: int,
               source: str = "checkpoint") -> None:
    """Refuse a checkpoint whose policy was built for another action space or feature layout, naming
    both sizes."""
    config = state["policy_config"]
    want = n_devices + N_DP_SCHEMES
    have = int(config["n_actions"])
    if have != want:
        raise CheckpointError(f"{source} is for an action space of {have} actions ({have - N_DP_SCHEMES} devices); "
                              f"this cluster needs {want} actions ({n_devices} devices)")
    for name, expected in (("op_feature_dim", op_feature_dim), ("device_feature_dim", device_feature_dim)):
        if int(config[name]) != expected:
            raise CheckpointError(f"{source} has {name}={config[name]}, the current features have {expected} "
                                  f"(the feature layout changed)")


def policy_from_checkpoint(state: dict[str, Any]) -> StrategyPolicy:
    """The policy stored in a checkpoint, with its weights."""
    policy = StrategyPolicy.from_config(state["policy_config"])
    policy.load_state_dict(state["policy_state"])
    return policy
