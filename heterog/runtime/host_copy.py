"""Copies between a rank's device and host memory (offloaded state, ``heterog.runtime.state_lowering``): on a
GPU through pinned host memory and asynchronous, on CPU workers (one memory) a copy all the same."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Landing:
    """A copy to pinned host memory in flight on a GPU: ``tensor`` holds it once ``event`` has completed."""

    tensor: torch.Tensor
    event: Any


def to_host(v: torch.Tensor, wait: bool = True) -> Any:
    """A copy of ``v`` in host memory: on a GPU into pinned memory, asynchronous (``wait``: finished here;
    else a ``Landing``, finished where first read); on a CPU worker a copy all the same."""
    if v.device.type != "cuda":
        return v.clone()
    out = torch.empty_like(v, device="cpu", pin_memory=True)
    out.copy_(v, non_blocking=True)
    landing = Landing(out, torch.cuda.Event())
    landing.event.record()
    if wait:
        landing.event.synchronize()
        return out
    return landing


def to_device(v: torch.Tensor, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of host value ``v`` in ``device``'s memory (in ``into``, where given): on a GPU from pinned
    memory (``v`` staged there first unless it is pinned), asynchronous on the current stream, which orders
    its readers after it."""
    if device.type != "cuda":
        return v.clone() if into is None else into.copy_(v)
    v = v if v.is_pinned() else v.pin_memory()
    return v.to(device, non_blocking=True) if into is None else into.copy_(v, non_blocking=True)
