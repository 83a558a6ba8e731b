"""Which ATen calls draw random values, and which of them a replica can draw exactly as single-device
training does (``heterog.runtime.rng`` says how it draws them)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# samplers whose number of draws depends on the values they are given
VALUE_DEPENDENT = frozenset({"poisson", "binomial", "_standard_gamma", "_sample_dirichlet", "multinomial",
                             "randperm", "_dirichlet_grad"})


def is_random(target: Any) -> bool:
    """True for an ATen op that may draw from a random generator."""
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def draws(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """True when a call of ``target`` draws random values: a random op, unless its dropout probability is
    the constant 0 (``p``, ``dropout_p``) or it is told it is not training (``train=False``), as attention
    kernels and dropout are when dropout is off."""
    if not is_random(target):
        return False
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    for i, arg in enumerate(schema.arguments):
        default = arg.default_value if arg.has_default_value() else None
        value = args[i] if i < len(args) else kwargs.get(arg.name, default)
        if arg.name in ("p", "dropout_p") and isinstance(value, (int, float)) and value == 0:
            return False
        if arg.name == "train" and value is False:
            return False
    return True


def inexact_reason(target_name: str) -> str | None:
    """Why a random op cannot give every replica single-device training's values, or None."""
    packet = target_name.split("::")[-1].split(".")[0].rstrip("_")
    if packet in VALUE_DEPENDENT:
        return (f"{packet} draws a number of values that depends on its inputs, so a replica (whose other "
                "samples' rows are zeros) draws other values than single-device training")
    return None
