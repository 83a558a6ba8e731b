"""Training graphs: capture from torch, fusion of zero-cost ops, file I/O. Torch parts load lazily;
the capture function is heterog.capture / heterog.graph.capture.capture (heterog.graph.capture: its module)."""
from __future__ import annotations

import importlib
from typing import Any

from heterog.graph.opgraph import Edge, Op, OpGraph, load_graph

_LAZY = {
    "capture_fx": "heterog.graph.capture",
    "graph_from_step": "heterog.graph.capture",
    "CapturedStep": "heterog.graph.capture",
    "fuse_trivial": "heterog.graph.fusion",
    "capture_model": "heterog.graph.cache",
    "load_model_fn": "heterog.graph.modelref",
}

__all__ = ["CapturedStep", "Edge", "Op", "OpGraph", "capture_fx", "capture_model", "fuse_trivial",
           "graph_from_step", "load_graph", "load_model_fn"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'heterog.graph' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
