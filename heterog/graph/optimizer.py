"""The optimizer updates a captured training step ends with: ``torch.optim``'s arithmetic written out
functionally (SGD, SGD with momentum, Adam), and their state."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from heterog.errors import HeterogError

OPTIMIZERS = ("sgd", "momentum", "adam")
STATE_SLOTS: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq", "step"),
}
SGD_MOMENTUM = 0.9
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

def init_state(optimizer: str, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Initial optimizer state for ``params``, flat in placeholder order (per parameter, per slot)."""
    check_optimizer(optimizer)
    out: list[torch.Tensor] = []
    for p in params:
        for slot in STATE_SLOTS[optimizer]:
            if slot == "step":
                out.append(torch.zeros((), dtype=torch.float32, device=p.device))
            else:
                out.append(torch.zeros_like(p, requires_grad=False))
    return out


def optimizer_update(optimizer: str, lr: float, p: torch.Tensor, g: torch.Tensor,
                     state: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One functional update of parameter ``p`` with gradient ``g``: returns (new p, new state)."""
    if optimizer == "sgd":
        return torch.add(p, g, alpha=-lr), []
    if optimizer == "momentum":
        buf = torch.add(state[0] * SGD_MOMENTUM, g)
        return torch.add(p, buf, alpha=-lr), [buf]
    m, v, step = state
    b1, b2 = ADAM_BETAS
    step = step + 1
    m = torch.lerp(m, g, 1 - b1)
    v = torch.addcmul(v * b2, g, g, value=1 - b2)
    bias_correction1 = 1 - torch.pow(b1, step)
    bias_correction2_sqrt = torch.sqrt(1 - torch.pow(b2, step))
    step_size = lr / bias_correction1
    denom = torch.sqrt(v) / bias_correction2_sqrt + ADAM_EPS
    return p - step_size * (m / denom), [m, v, step]


def check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise HeterogError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
