"""The arithmetic of synchronized batch statistics (``heterog.runtime.sync_stats`` lowers them): an
instance's count and per-channel sums, and a batch norm's forward and backward from the whole batch's sums,
for the batch-norm overloads the capture records."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from heterog.compiler.sync_stats import FORWARD_TARGETS
from heterog.runtime.kernel import NodeCall, Ref, target_name

STATS_NODE = "~batch-stats"          # the name the whole batch's sums take among an instance's values


def _channels(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """(the dims summed over, the shape that broadcasts a per-channel value) of a batch-norm input."""
    dims = [d for d in range(x.dim()) if d != 1]
    shape = [1] * x.dim()
    shape[1] = x.shape[1]
    return dims, shape


def local_sums(target: str, args: Sequence[Any], weight: float) -> torch.Tensor:
    """``[count, sums (C), sums (C)]`` (float64) of one instance of a batch norm op called with ``args``: the
    input's sum and sum of squares (forward), or the gradient's sum and its product with the centred input
    (backward); the sums times ``weight`` (squares: ``weight ** 2``), the count as is."""
    if target in FORWARD_TARGETS:
        x = args[0].double()
        dims, _ = _channels(x)
        first, second = x.sum(dims) * weight, (x * x).sum(dims) * weight * weight
    else:
        dy, x, mean = args[0].double(), args[1].double(), args[5].double()
        dims, shape = _channels(x)
        first, second = dy.sum(dims) * weight, (dy * (x - mean.view(shape))).sum(dims) * weight
    count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64, device=x.device)
    return torch.cat([count, first, second])


def synced_forward(stats: torch.Tensor, overload: str, x: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, *rest: Any) -> tuple[torch.Tensor, ...]:
    """A batch norm's forward over the whole batch whose sums are ``stats`` (``local_sums``), for the overload
    ``overload`` (functional: also the new running statistics; in place: written into them)."""
    with_running = overload != "aten._native_batch_norm_legit.no_stats"
    running_mean, running_var = (rest[0], rest[1]) if with_running else (None, None)
    training, momentum, eps = rest[-3:] if with_running else rest
    c = x.shape[1]
    dims, shape = _channels(x)
    if not training:
        assert running_mean is not None and running_var is not None
        mean, var = running_mean.double(), running_var.double()
    else:
        n = stats[0]
        mean = stats[1:c + 1] / n
        var = (stats[c + 1:] / n - mean * mean).clamp_min(0.0)
    invstd = torch.rsqrt(var + eps)
    out = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    save_mean, save_invstd = mean.to(x.dtype), invstd.to(x.dtype)
    if not training or running_mean is None or running_var is None:
        return out, save_mean, save_invstd
    n = stats[0]
    new_mean = ((1 - momentum) * running_mean.double() + momentum * mean).to(running_mean.dtype)
    new_var = ((1 - momentum) * running_var.double() + momentum * var * n / (n - 1)).to(running_var.dtype)
    if overload == "aten._native_batch_norm_legit_functional.default":
        return out, save_mean, save_invstd, new_mean, new_var
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, save_mean, save_invstd


def synced_backward(stats: torch.Tensor, scale: float, dy: torch.Tensor, x: torch.Tensor,
                    weight: torch.Tensor | None, running_mean: Any, running_var: Any, save_mean: torch.Tensor,
                    save_invstd: torch.Tensor, train: bool, eps: float, output_mask: Sequence[bool]
                    ) -> tuple[torch.Tensor | None, ...]:
    """``native_batch_norm_backward`` with the whole batch's sums ``stats`` (``local_sums``; ``scale``: the
    instance's gradient convention, ``(b / B) ** e``): the input gradient from the batch's sums, the weight
    and bias gradients from the instance's own samples."""
    c = x.shape[1]
    dims, shape = _channels(x)
    n = stats[0]
    xmu = x - save_mean.view(shape)
    w = weight.view(shape) if weight is not None else 1.0
    mean_dy = (stats[1:c + 1] * scale / n).to(x.dtype).view(shape)
    mean_dy_xmu = (stats[c + 1:] * scale / n).to(x.dtype).view(shape)
    invstd = save_invstd.view(shape)
    grad_input = (dy - mean_dy - xmu * invstd * invstd * mean_dy_xmu) * invstd * w if output_mask[0] else None
    grad_weight = (dy * xmu * invstd).sum(dims) if output_mask[1] else None
    grad_bias = dy.sum(dims) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def synced_call(call: NodeCall, scale: float) -> NodeCall:
    """The batch-norm node ``call`` reading the whole batch's sums (``STATS_NODE``) as its first argument."""
    if call.target.removeprefix("op:").replace("::", ".").startswith("aten.native_batch_norm_backward"):
        return NodeCall(call.name, target_name(synced_backward), (Ref(STATS_NODE), scale, *call.args), call.kwargs)
    overload = "aten." + call.target.removeprefix("op:aten::")
    return NodeCall(call.name, target_name(synced_forward), (Ref(STATS_NODE), overload, *call.args), call.kwargs)
