"""Ops that couple samples and synchronized batch statistics under sharded and offloaded state, checkpoints and
re-planning: a batch-norm CNN whose statistics are synchronized trains like one process (buffers included) with
its state in shards (stage 3) or on the host; a contrastive two-tower model with its parameters in shards
written to a checkpoint and resumed trains like one process over every step; a re-plan for a run that
synchronizes its statistics keeps them synchronized."""
from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import pytest
import torch

from heterog.cluster import load_cluster
from heterog.graph.cache import capture_model
from heterog.replan import replan
from heterog.runtime import capture_model_for_runtime, compare_values, prepare, run_prepared, train_single_process
from heterog.runtime.checkpoint import CheckpointSettings
from heterog.runtime.instructions import AllGather, BatchStats, Copy
from heterog.sharded import ShardedState
from heterog.strategy import Strategy
from tests.graph.test_coupling import Towers, towers_inputs
from tests.runtime import conformance_models as cm
from tests.runtime.test_conformance import ATOL, BATCH, LR, RTOL, STEPS, plan

CLUSTER = "local-cpu-2:slowdown=1,2:host=Xeon-Gold-6148"


@functools.cache
def captured(name: str):
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    module, inputs = (Towers(), towers_inputs(BATCH)) if name == "towers" else cm.build_batchnorm_cnn(BATCH)
    return capture_model_for_runtime(module, inputs, optimizer="momentum", lr=LR, name=name)


@functools.cache
def reference(name: str, steps: int):
    m = captured(name)
    return train_single_process(m, [m.example_inputs], steps)


def sharded(m, stage: int, offload: str, **kw) -> Strategy:
    """Data parallelism over both devices, every replicated group's state sharded at ``stage`` (``offload``:
    what lives on the host), shard weights 1 and 2."""
    base = plan(m, load_cluster(CLUSTER), "ev-ar", 0)
    configs = [dataclasses.replace(c, sharded=ShardedState(stage, (1, 2), offload)) if len(c.devices) == 2 else c
               for c in base.configs]
    return dataclasses.replace(base, configs=configs, **kw)


@pytest.mark.parametrize("stage,offload", [(3, "none"), (0, "optimizer")])
def test_synchronized_statistics_with_sharded_or_offloaded_state_train_like_one_process(stage, offload,
                                                                                      pool2) -> None:
    m = captured("batchnorm_cnn")
    prepared = prepare(m, load_cluster(CLUSTER), sharded(m, stage, offload, sync_batch_stats=True))
    instrs = [i for rp in prepared.lowered.ranks for i in rp.instrs]
    assert any(isinstance(i, BatchStats) for i in instrs)
    assert any(isinstance(i, Copy) for i in instrs) if offload != "none" else \
        any(isinstance(i, AllGather) and i.key[0].startswith("z") for i in instrs)
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=pool2)
    ref_losses, ref_values = reference("batchnorm_cnn", STEPS)
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)
    for ph, v in result.values.items():           # running statistics and momentum too
        torch.testing.assert_close(v.double(), ref_values[ph].double(), rtol=RTOL, atol=ATOL)


def test_coupled_ops_with_parameters_in_shards_resume_from_a_checkpoint_like_one_process(tmp_path, pool2) -> None:
    m = captured("towers")
    assert m.graph.coupled.any()
    prepared = prepare(m, load_cluster(CLUSTER), sharded(m, 3, "none"))
    first = run_prepared(prepared, [m.example_inputs], 2, pool=pool2, checkpoint=CheckpointSettings(tmp_path, 2))
    assert [s for s, _ in first.checkpoints] == [2]
    result = run_prepared(prepared, [m.example_inputs], 4, pool=pool2, resume=tmp_path)
    ref_losses, ref_values = reference("towers", 4)
    assert result.first_step == 2
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)


def test_a_replan_for_synchronized_statistics_keeps_them() -> None:
    graph, cluster = capture_model("tiny_mlp", 8, "sgd"), load_cluster("local-cpu-3:slowdown=1,2,3")
    found = replan(graph, cluster, "ev-ar", 1.0, sync_batch_stats=True)
    assert found.candidates and all(s.sync_batch_stats for s in found.candidates)
    assert not any(s.sync_batch_stats for s in replan(graph, cluster, "ev-ar", 1.0).candidates)
