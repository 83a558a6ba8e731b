"""Recomputation in the simulator: which ops a recomputed group runs again, when, what it costs in time
and what it saves in memory, exactly on hand-computed cases; invariants on random plans."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.baselines.pipeline import fitting
from heterog.compiler import TaskKind
from heterog.errors import StrategyError
from heterog.evaluate import Evaluator
from heterog.strategy import STRATEGY_VERSION, ParallelConfig, Strategy
from tests.compiler.helpers import pipeline_graph
from tests.compiler.test_compile import FakeCost, strategy_for, two_gpu
from tests.compiler.test_micro_batches import PB, RESIDENT, NoComm, stages_of

S = 4                           # layers of the pipeline graph
U = 8 * 16 * 4                  # one activation of the whole batch: 8 samples x 16 floats


def two_blocks():
    """The 4-layer pipeline graph on one device in two groups of two layers (0-1 and 2-3, the loss with
    the last): layer i's backward reads its input h_{i-1}, so a group's first layer's output is read by
    its own group's backward, and the last layer's output by the loss gradient (also in the last group)."""
    g, c = pipeline_graph(S), two_gpu(n=1)
    return g, c, strategy_for(g, c, [ParallelConfig.single(0, 8)] * 2, stages_of(g) // 2)


def run(strategy, graph, cluster, order: str = "fifo"):
    return Evaluator(graph, cluster, NoComm(cluster), order=order).evaluate(strategy)


def activations(res) -> float:
    return res.peak_memory_bytes["s0/gpu0"] - S * RESIDENT


def task_of(res, graph, name: str, kind: TaskKind) -> int:
    op = [i for i, o in enumerate(graph.ops) if o.name == name][0]
    (t,) = np.nonzero((res.plan.task_op == op) & (res.plan.task_kind == kind))[0]
    return int(t)


# ------------------------------------------------------------------------------- exact timelines and memory
def test_recomputing_both_groups_runs_their_inner_forwards_again_when_the_backward_reaches_them():
    g, c, plain = two_blocks()
    base, rc = run(plain, g, c), run(plain.with_recompute([0, 1]), g, c)
    kinds = rc.plan.task_kind
    # recomputed: h0 (read by layer 1's backward, group 0), h2 (layer 3's, group 1), h3 (the loss gradient);
    # h1 is read by group 1's backward: group 0 keeps it, as a checkpoint keeps its segment's output
    assert sorted(g.ops[o].name for o in rc.plan.task_op[kinds == TaskKind.RECOMPUTE]) == ["f0", "f2", "f3"]
    # each forward takes 4 s: 32 s of work, plus 3 forwards again
    assert base.iteration_time_s == pytest.approx(32.0) and rc.iteration_time_s == pytest.approx(44.0)
    # group 1 recomputes once the loss is done (16 s): its trigger waits for the loss gradient's other input;
    # group 0 when layer 2's input gradient arrives: 16 + 8 (f2, f3 again) + 4 (bx3) + 4 (bx2) = 32 s
    assert rc.sim.start[task_of(rc, g, "f2", TaskKind.RECOMPUTE)] == pytest.approx(16.0)
    assert rc.sim.start[task_of(rc, g, "f0", TaskKind.RECOMPUTE)] == pytest.approx(32.0)
    # every backward reader reads the recomputed copy; the forward ones the first
    r_f0, f0 = task_of(rc, g, "f0", TaskKind.RECOMPUTE), task_of(rc, g, "f0", TaskKind.COMPUTE)
    readers = {g.ops[rc.plan.task_op[t]].name for t in range(rc.plan.n_tasks)
               if r_f0 in rc.plan.dep_idx[rc.plan.dep_ptr[t]:rc.plan.dep_ptr[t + 1]]}
    deps = [rc.plan.dep_idx[rc.plan.dep_ptr[t]:rc.plan.dep_ptr[t + 1]] for t in range(rc.plan.n_tasks)]
    first = {g.ops[rc.plan.task_op[t]].name for t in range(rc.plan.n_tasks)
             if rc.plan.task_kind[t] == TaskKind.COMPUTE and f0 in deps[t]}
    assert readers == {"bx1", "bw1"} and first == {"f1"}
    # FIFO peaks, at the first weight gradient (bw3 allocates it: PB). Without: x, h0, h1, h2 kept, the loss
    # gradient g3 and the input gradient g2 (h3 went after gout; the loss's 4 B stay to the step's end, as the
    # runtime keeps the loss to report it): 6 U + PB + 4. With: h0 goes after its forward reader and the
    # backward rebuilds h2 next to x, h1: 5 U + PB + 4
    assert activations(base) == 6 * U + PB + 4 and activations(rc) == 5 * U + PB + 4


def test_gradient_accumulation_with_recomputation():
    # 4 micro-batches of 2 samples (u = U / 4 per activation) under 1F1B, one forward then its backward:
    # the batch's inputs are loaded at the start; the peak is at micro-batch 1's first weight gradient: the
    # four layers' gradients accumulated from micro-batch 0 and the one bw3 makes (5 PB), micro-batch 1's
    # x, h0, h1, h2 and g3, the inputs of micro-batches 2 and 3 (7 u), the two micro-batches' loss partials (kept
    # to the step's end) and the seed (12 B).
    # Recomputation rebuilds h2 next to the kept h1 and does not keep h0: u less
    g, c, plain = two_blocks()
    acc = plain.with_micro_batches(4)
    base, rc = run(acc, g, c), run(acc.with_recompute([0, 1]), g, c)
    u = U // 4
    assert activations(base) == 5 * PB + 7 * u + 12 and activations(rc) == 5 * PB + 6 * u + 12
    assert base.iteration_time_s == pytest.approx(32.0) and rc.iteration_time_s == pytest.approx(44.0)
    assert np.sum(rc.plan.task_kind == TaskKind.RECOMPUTE) == 3 * 4


def test_recomputing_one_group_leaves_the_others_activations():
    g, c, plain = two_blocks()
    rc = run(plain.with_recompute([1]), g, c)
    assert sorted(g.ops[o].name for o in rc.plan.task_op[rc.plan.task_kind == TaskKind.RECOMPUTE]) == ["f2", "f3"]
    assert rc.iteration_time_s == pytest.approx(40.0)


def test_a_group_of_one_layer_recomputes_nothing():
    # layer i's backward reads layer i's input, which the group before makes: nothing inside the group to rebuild
    g, c = pipeline_graph(S), two_gpu(n=1)
    layers = strategy_for(g, c, [ParallelConfig.single(0, 8)] * S, stages_of(g))
    plan = Evaluator(g, c, NoComm(c)).compile(layers.with_recompute([0, 1, 2]))
    assert not np.any(plan.task_kind == TaskKind.RECOMPUTE) and plan.placements.op_recompute is None


# ------------------------------------------------------------------------------- strategy files
def test_strategy_files_keep_the_recomputed_groups_and_older_files_load_without(tmp_path):
    g, c, plain = two_blocks()
    s = plain.with_recompute([1, 0, 1])
    assert s.recompute == (0, 1)
    back = Strategy.load(s.save(tmp_path / "s.json"))
    assert back.recompute == (0, 1)
    d = s.to_dict()
    assert d["version"] == STRATEGY_VERSION
    del d["recompute"]
    d["version"] = 2
    assert Strategy.from_dict(d).recompute == ()


def test_recomputing_a_group_that_does_not_exist_is_refused():
    g, c, plain = two_blocks()
    with pytest.raises(StrategyError, match="recomputed groups"):
        plain.with_recompute([2])


# ------------------------------------------------------------------------------- invariants
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_recomputed_plans_run_each_recomputed_instance_after_its_forward(data):
    g, c = pipeline_graph(4, batch=12), two_gpu(n=3)
    group_of = stages_of(g) // 2
    configs = []
    for _ in range(2):
        devs = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
        shares = [12 - (len(devs) - 1)] + [1] * (len(devs) - 1)
        configs.append(ParallelConfig.of(list(zip(devs, shares)), sync=data.draw(st.sampled_from(["ps", "allreduce"]))))
    k = data.draw(st.integers(1, 4))
    s = strategy_for(g, c, configs, group_of).with_micro_batches(k, data.draw(st.sampled_from(["gpipe", "1f1b"])))
    s = s.with_recompute(data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=2)))
    res = Evaluator(g, c, FakeCost(c)).evaluate(s)
    plan, sim = res.plan, res.sim
    assert np.all(plan.dep_idx < np.repeat(np.arange(plan.n_tasks), np.diff(plan.dep_ptr)))
    rec = np.nonzero(plan.task_kind == TaskKind.RECOMPUTE)[0]
    assert len(rec)
    fwd = {(int(plan.task_op[t]), int(plan.task_device[t]), int(plan.task_micro[t])): t
           for t in np.nonzero(plan.task_kind == TaskKind.COMPUTE)[0].tolist()}
    for r in rec.tolist():
        x = fwd[(int(plan.task_op[r]), int(plan.task_device[r]), int(plan.task_micro[r]))]
        assert plan.tg.duration[r] == plan.tg.duration[x]
        assert sim.start[r] >= sim.finish[x]
        assert plan.placements.op_recompute[plan.task_op[r]]


def test_planners_recompute_the_fewest_leading_groups_that_fit():
    # activations peak at 6 U + PB + 4 without recomputation (FIFO, above: beside the first weight gradient),
    # next to the 4 layers' weights: a device of 4 RESIDENT + PB + 5.5 U is too small. Recomputing group 0 alone
    # frees h0 after f1: 5 U + PB + 4, which fits, at 32 s + 4 s for f0 again (both groups: 44 s)
    g = pipeline_graph(S)
    c = two_gpu(memory=f"{4 * RESIDENT + PB + 11 * U // 2} B", n=1)
    plain = strategy_for(g, c, [ParallelConfig.single(0, 8)] * 2, stages_of(g) // 2)
    ev = Evaluator(g, c, NoComm(c), order="fifo")
    assert ev.iteration_time(plain)[1]
    chosen, t, oom = fitting(ev, plain)
    assert chosen.recompute == (0,) and not oom and t == pytest.approx(36.0)
    assert activations(ev.evaluate(chosen)) == 5 * U + PB + 4
    roomy = Evaluator(g, two_gpu(n=1), NoComm(two_gpu(n=1)), order="fifo")
    assert fitting(roomy, dataclasses.replace(plain, cluster_name=roomy.cluster.name))[0].recompute == ()


def test_recomputation_is_the_same_under_sgd_and_adam():
    """The optimizer's state placeholders (captured among the forward ops) do not end the forward: a
    transformer captured with Adam recomputes exactly the ops it recomputes when captured with SGD."""
    import heterog
    from heterog.baselines.expert import op_layers
    from heterog.compiler.context import CompileContext
    from heterog.compiler.place import recomputed_ops
    from heterog.graph.grouping import attach_params_to_grads

    recomputed = {}
    for opt in ("sgd", "adam"):
        module, inputs = heterog.zoo.build("tiny_transformer", 4)
        g = heterog.capture(module, inputs, optimizer=opt)
        c = two_gpu(n=1)
        layer = attach_params_to_grads(g, np.asarray(op_layers(g)[0], dtype=np.int64))
        out = recomputed_ops(CompileContext.of(g, c, FakeCost(c)), layer, tuple(range(int(layer.max()) + 1)))
        assert out is not None
        recomputed[opt] = sorted(g.ops[i].name for i in np.nonzero(out)[0])
    assert len(recomputed["sgd"]) > 10
    assert recomputed["adam"] == recomputed["sgd"]
