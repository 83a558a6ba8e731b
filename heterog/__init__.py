"""HeteroG-style planning of DNN training on heterogeneous GPU clusters.

Public API (docs/design.md section 6); torch-dependent parts are imported lazily so that planning code
stays light:
    heterog.capture(module, example_inputs, *, optimizer="sgd") -> OpGraph
    heterog.zoo.names() / heterog.zoo.build(name, batch_size)
    heterog.load_graph(path) / OpGraph.save(path)
    heterog.load_cluster(name_or_path) -> Cluster
    heterog.simulate(graph, cluster, strategy, order="best") -> PlanResult (with .sim, the SimResult)
    heterog.baselines.run(name, graph, cluster, **opts) -> Strategy
    heterog.planners.plan(method, graph, cluster, **options) -> Strategy   (every method: baselines, best-dp, agent)
    heterog.get_runner(model_fn, input_fn, device_info, config=None) -> Runner
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "capture": ("heterog.graph.capture", "capture"),
    "load_graph": ("heterog.graph.opgraph", "load_graph"),
    "OpGraph": ("heterog.graph.opgraph", "OpGraph"),
    "load_cluster": ("heterog.cluster", "load_cluster"),
    "Cluster": ("heterog.cluster", "Cluster"),
    "CostModel": ("heterog.cost", "CostModel"),
    "simulate": ("heterog.evaluate", "simulate"),
    "Evaluator": ("heterog.evaluate", "Evaluator"),
    "Strategy": ("heterog.strategy", "Strategy"),
    "ParallelConfig": ("heterog.strategy", "ParallelConfig"),
    "get_runner": ("heterog.runtime", "get_runner"),
    "zoo": ("heterog.zoo", None),
    "baselines": ("heterog.baselines", None),
    "planners": ("heterog.planners", None),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'heterog' has no attribute {name!r}")
    mod, attr = _LAZY[name]
    m = importlib.import_module(mod)
    value = m if attr is None else getattr(m, attr)
    globals()[name] = value
    return value
