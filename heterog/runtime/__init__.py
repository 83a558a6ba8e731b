"""Run plans for real: a torch.distributed executor (one process per device; gloo on CPU, NCCL on GPUs)
that reproduces single-device training under any Strategy, heterogeneity emulation for ``local-cpu-N``
clusters, a profiler that fills the cost model's profile tables, and the ``get_runner`` interface.

Pieces: ``stepprog`` (the captured step as the runtime runs it), ``scaling`` (why unequal batch shares
still give single-device results), ``lowering`` (plan -> per-rank instructions in simulated order),
``executor`` (worker side), ``launcher`` (processes, faults), ``checkpoint`` (checkpoints in
torch.distributed.checkpoint's format, resuming under any plan), ``elastic`` (runs that survive lost
workers), ``profiler``, ``fidelity``, ``api``.
"""
from __future__ import annotations

from heterog.runtime.api import (
    Model,
    PreparedRun,
    Runner,
    RunnerConfig,
    RunnerResult,
    RunResult,
    capture_model_for_runtime,
    compare_values,
    get_runner,
    load_model,
    prepare,
    run_prepared,
    train_single_process,
)
from heterog.runtime.launcher import WorkerFailure, WorkerPool

__all__ = [
    "Model", "PreparedRun", "RunResult", "Runner", "RunnerConfig", "RunnerResult", "WorkerFailure", "WorkerPool",
    "capture_model_for_runtime", "compare_values", "get_runner", "load_model", "prepare", "run_prepared",
    "train_single_process",
]
