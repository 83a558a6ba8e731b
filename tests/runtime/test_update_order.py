"""An optimizer update written in place runs after the other readers of the value it overwrites
(``heterog.compiler.plan.overwrite_after_reads``), so that what a rank holds is the simulated peak whatever
order the simulator picks."""
from __future__ import annotations

import pytest

from heterog.cluster import load_cluster
from heterog.runtime.api import prepare, resolve_strategy
from tests.runtime.conftest import model
from tests.runtime.test_memory import TOLERANCE


def test_an_update_in_place_waits_for_the_readers_of_the_value_it_overwrites(monkeypatch) -> None:
    """tiny_mlp on one device, scheduled so that each weight's gradient and update run as soon as they can:
    without a dependency, the hidden layer's update would run before the backward op that reads its old
    weight (the input gradient), so the runtime could not write it in place and would hold the old and the
    new weight at once, 16 KB above the simulated peak, which counts the write in place. The compiler orders
    the update after every reader of the value it overwrites (``heterog.compiler.plan.overwrite_after_reads``):
    the simulated order is one the runtime runs in place, and what a rank holds is the simulated peak."""
    import numpy as np

    import simulator
    from heterog.evaluate import Evaluator
    from heterog.runtime.check import metered_dry_run
    from heterog.runtime.instructions import Compute

    m = model("tiny_mlp")
    ops = m.graph.ops
    cluster = load_cluster("local-cpu-2")
    rush = np.array([2.0 if op.phase == "update" else 1.0 if op.is_grad else 0.0 for op in ops])

    def gradients_and_updates_first(self, plan, order=None):
        return simulator.simulate(plan.tg, priority=rush[plan.task_op] + plan.task_op * 1e-6)

    monkeypatch.setattr(Evaluator, "simulate_plan", gradients_and_updates_first)
    prepared = prepare(m, cluster, resolve_strategy(m, cluster, method="single"))
    order = [ins.op for ins in prepared.lowered.ranks[0].instrs if isinstance(ins, Compute)]
    for o in order:                             # each update runs after every other reader of its parameter
        if ops[o].phase == "update" and ops[o].writes is not None:
            old = next(k for k, op in enumerate(ops) if op.name == ops[o].writes)
            readers = {e.dst for e in m.graph.edges if e.src == old} - {o}
            assert readers and all(order.index(r) < order.index(o) for r in readers)
    # the schedule does put gradients and updates first where it may: an update runs before some
    # backward op (the forced order is in effect)
    assert any(ops[a].phase == "update" and ops[b].phase == "backward" for a, b in zip(order, order[1:]))
    name = cluster.device_names[0]
    simulated = prepared.simulated_peak_memory_bytes[name]
    measured = metered_dry_run(prepared)[0][0]
    assert measured == pytest.approx(simulated, rel=TOLERANCE["single"])
