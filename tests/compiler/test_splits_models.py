"""Splits beyond the batch on the models of the suites (small zoo models and Hugging Face families): every
plan of split actions compiles and simulates, with invariants that hold whatever the options chosen."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from heterog import zoo
from heterog.baselines.chains import ActionSearch
from heterog.cluster import load_cluster
from heterog.compiler import TaskKind
from heterog.compiler.plan import resident_bytes
from heterog.evaluate import Evaluator
from heterog.graph.capture import capture
from tests.runtime import transformers_models as tm

MODELS = {**{name: (lambda name=name: zoo.build(name, 8, **zoo.small_overrides(name)))
             for name in ("tiny_mlp", "tiny_cnn", "tiny_transformer", "big_embedding")},
          **{f"hf_{name}": (lambda b=b: b(8)) for name, b in {**tm.EQUIVALENCE_MODELS, **tm.BATCH_NORM_MODELS}.items()}}
_GRAPHS: dict[str, object] = {}


def graph_of(name: str):
    if name not in _GRAPHS:
        logger = logging.getLogger("heterog.graph.capture")       # quiet FLOP estimates, for this capture only
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            torch.manual_seed(0)
            module, inputs = MODELS[name]()
            _GRAPHS[name] = capture(module, inputs, optimizer="adam")
        finally:
            logger.setLevel(level)
    return _GRAPHS[name]


# each model on one of the two clusters, in turn (HETEROG_DIVIDED_ALL=1: on both)
CASES = [(n, c) for i, n in enumerate(sorted(MODELS)) for k, c in enumerate(("local-cpu-3", "paper-8gpu"))
         if os.environ.get("HETEROG_DIVIDED_ALL") == "1" or (i + k) % 2 == 0]


@pytest.mark.parametrize("name,cluster", CASES)
def test_random_split_plans_compile_and_simulate_with_their_invariants(name, cluster):
    """Every split action over all groups, and random mixes of every action, at one and two micro-batches:
    each simulates; at one micro-batch a divided instance takes at most its op's whole time on its device,
    and under a split over
    every device the parameters' resident bytes over all devices add up to the whole model's (each held
    once, in shares), with no device holding more than a replicated copy."""
    g = graph_of(name)
    assert g.splits is not None
    c = load_cluster(cluster)
    ev = Evaluator(g, c)
    search = ActionSearch(ev, splits=True)
    m = c.n_devices
    rng = np.random.default_rng(0)
    plans = [np.full(ev.n_groups, m + 4 + a) for a in range(len(search.split_names))]
    plans += [rng.integers(0, search.n_actions, size=ev.n_groups) for _ in range(2)]
    full = ev.cost.full_batch_times(g)
    gi = ev.compiler.context.index
    for i, actions in enumerate(plans):
        for k, schedule in ((1, "1f1b"), (2, "1f1b"), (2, "gpipe")):
            s = search.strategy(actions).with_micro_batches(k, schedule)
            res = ev.evaluate(s)
            assert np.isfinite(res.iteration_time_s) and res.iteration_time_s > 0
            plan = res.plan
            if k > 1:
                continue
            comp = plan.task_kind == TaskKind.COMPUTE
            assert np.all(plan.tg.duration[comp] <= full[plan.task_op[comp], plan.task_device[comp]] * (1 + 1e-9))
            if i == 0:                                  # tp-even over every device
                st = ev.compiler.compile_state(s)
                held = resident_bytes(ev.compiler.context, ev.compiler.layouts, st.placement.op_lay,
                                      st.placement.out_split)
                whole = float(gi.resident_bytes.sum())
                divided = gi.resident_bytes * st.placement.out_split
                assert held.sum() == pytest.approx(whole * m - divided.sum() * (m - 1), rel=1e-9)
                assert np.all(held <= whole * (1 + 1e-9))
