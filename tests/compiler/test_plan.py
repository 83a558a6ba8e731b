"""What a compilation yields (heterog.compiler.plan): task categories in the TaskGraph, the placements record,
the cache of plans kept for patching, and a Compiler whose tables start afresh compiling the same plans."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.compiler import Compiler, TaskKind, compile_strategy
from heterog.compiler.plan import Aggregation, PatchCache
from heterog.compiler.registries import Layout
from heterog.strategy import ParallelConfig
from tests.compiler.helpers import linear_graph
from tests.compiler.test_compile import FakeCost, strategy_for, two_gpu
from tests.compiler.test_delta import assert_same_plan

CATEGORY_OF_KIND = {TaskKind.PLACEHOLDER: "input", TaskKind.TRANSFER: "transfer", TaskKind.RELAYOUT: "split/concat",
                    TaskKind.CONCAT: "split/concat", TaskKind.PUSH: "ps", TaskKind.AGGREGATE: "ps",
                    TaskKind.ALLREDUCE: "allreduce"}


@pytest.mark.parametrize("configs, group_of", [
    ([ParallelConfig.of([(0, 4), (1, 4)], sync="ps")], None),
    ([ParallelConfig.of([(0, 4), (1, 4)], sync="allreduce")], None),
    ([ParallelConfig.single(0, 8), ParallelConfig.of([(0, 4), (1, 4)])], [0, 1, 0, 1, 1, 1, 1, 1]),
], ids=["ps", "allreduce", "relayout"])
def test_each_task_is_shown_in_the_category_of_its_kind_or_its_ops_phase(configs, group_of):
    g, c = linear_graph(), two_gpu()
    plan = compile_strategy(g, c, strategy_for(g, c, configs, group_of), FakeCost(c))
    names = plan.tg.category_names
    shown = [names[x] for x in plan.tg.task_category.tolist()]
    expected = [g.ops[op].phase if kind == TaskKind.COMPUTE else CATEGORY_OF_KIND[TaskKind(kind)]
                for kind, op in zip(plan.task_kind.tolist(), plan.task_op.tolist())]
    assert shown == expected
    assert {"forward", "backward", "update", "input"} <= set(shown)


def state(group_cfg, schedule: str = "1f1b", n_micro: int = 1) -> SimpleNamespace:
    """A stand-in for a PlanState: the cache reads only its placement's configs and micro-batch schedule."""
    return SimpleNamespace(placement=SimpleNamespace(group_cfg=np.asarray(group_cfg), schedule=schedule,
                                                     n_micro=n_micro))


def test_patch_cache_finds_the_closest_plan_least_recently_used_first_among_equals():
    cache = PatchCache(3)
    a, b, c = state([0, 0, 0]), state([0, 1, 1]), state([1, 0, 0])
    for key, s in ((1, a), (2, b), (3, c)):
        cache[key] = s
    assert cache.closest(state([0, 1, 0]).placement) == (1, a)        # a and b differ in one group each
    cache.touch(1)
    assert cache.closest(state([0, 1, 0]).placement) == (2, b)
    # a plan of several micro-batches is patched only from one of as many and the same schedule
    assert cache.closest(state([0, 1, 0], "gpipe", 4).placement) is None
    d = state([0, 1, 1], "gpipe", 4)
    cache[4] = d
    assert cache.closest(state([0, 1, 0], "gpipe", 4).placement) == (4, d)
    assert cache.closest(state([0, 1, 1], "1f1b", 4).placement) is None
    assert cache.closest(state([0, 1, 1], "gpipe", 2).placement) is None
    assert cache.closest(state([0, 1, 1]).placement)[1] is not d
    assert cache.closest(state([1, 0, 1]).placement) == (3, c)


def test_patch_cache_keeps_at_most_its_size_dropping_the_least_recently_used():
    cache = PatchCache(2)
    for key in (1, 2, 3):
        cache[key] = state([key])
    assert len(cache) == 2 and cache.closest(state([1]).placement)[0] == 2      # plan 1 is gone
    cache.clear()
    assert len(cache) == 0 and cache.closest(state([1]).placement) is None
    empty = PatchCache(0)
    empty[1] = state([1])
    assert len(empty) == 0


def test_patch_cache_keeps_the_last_plan_of_each_schedule_beside_the_most_recent():
    cache = PatchCache(2)
    one = state([0, 0])
    cache[1] = one
    for key in (2, 3, 4):                                   # three plans of 4 micro-batches (1F1B)
        cache[key] = state([key, 0], n_micro=4)
    # the 2 most recent, and the last plan of one micro-batch beside them; plan 2 (4 micro-batches) is gone
    assert len(cache) == 3 and cache.closest(state([0, 1]).placement) == (1, one)
    assert cache.closest(state([2, 0], n_micro=4).placement)[0] in (3, 4)
    for key, (k, schedule) in zip((5, 6, 7, 8), ((2, "1f1b"), (4, "gpipe"), (8, "1f1b"), (8, "1f1b"))):
        cache[key] = state([key, 0], schedule, k)
    # recent: 7 and 8 (8 micro-batches); beside them at most 2 other schedules' last plans, the most recent: 6, 5
    assert len(cache) == 4
    assert cache.closest(state([6, 0], "gpipe", 4).placement)[0] == 6
    assert cache.closest(state([5, 0], "1f1b", 2).placement)[0] == 5
    assert cache.closest(state([0, 0]).placement) is None and cache.closest(state([4, 0], n_micro=4).placement) is None
    cache.touch(5)                                          # used again: among the most recent
    cache[9] = state([9, 0], "1f1b", 16)
    assert cache.closest(state([5, 0], "1f1b", 2).placement)[0] == 5 and len(cache) == 4


def test_a_compiler_whose_tables_start_afresh_compiles_the_same_plans():
    g, c = linear_graph(), two_gpu()
    cost = FakeCost(c)
    compiler = Compiler(g, c, cost, delta_fraction=1.0)
    compiler.MAX_CONFIGS = 2                                  # start afresh past two configs
    configs = [ParallelConfig.single(0, 8), ParallelConfig.of([(0, 4), (1, 4)], sync="ps"),
               ParallelConfig.of([(0, 2), (1, 6)], sync="allreduce"), ParallelConfig.single(1, 8),
               ParallelConfig.of([(0, 5), (1, 3)], sync="ps", ps_device=1)]
    group_of = [0, 1, 0, 1, 1, 1, 1, 1]
    seen = 0
    for first, second in zip(configs, configs[1:] + configs[:1]):
        strategy = strategy_for(g, c, [first, second], group_of)
        assert_same_plan(compiler.compile(strategy), compile_strategy(g, c, strategy, cost))
        seen = max(seen, len(compiler.configs))
        assert len(compiler.configs) <= 3
    assert seen == 3 and compiler.n_full + compiler.n_patched == len(configs)


def test_placements_state_where_each_op_runs_and_how_each_partial_result_is_summed():
    g, c = linear_graph(), two_gpu()
    compiler = Compiler(g, c, FakeCost(c), max_bases=0)
    ps = compiler.compile(strategy_for(g, c, [ParallelConfig.of([(0, 5), (1, 3)], sync="ps", ps_device=1)]))
    placed = ps.placements
    assert placed.ps_device == {0: 1} and placed.op_split is None and placed.splits == ()
    assert placed.aggregation and all(a == Aggregation("ps", (1,)) for a in placed.aggregation.values())
    for o, op in enumerate(g.ops):
        layout = placed.layouts[placed.op_layout[o]]
        assert isinstance(layout, Layout) and len(layout.devices) == len(layout.shares) == len(layout.micro)
        if op.kind == "compute" and g.has_batch[o]:
            assert layout.devices == (0, 1) and layout.shares == (5, 3)
    ar = compiler.compile(strategy_for(g, c, [ParallelConfig.of([(0, 5), (1, 3)], sync="allreduce")]))
    assert ar.placements.ps_device == {}
    assert {(a.kind, a.devices) for a in ar.placements.aggregation.values()} == {("allreduce", (0, 1))}
    # no layout was added by the second plan: both read the same snapshot of the compiler's layouts
    assert ar.placements.layouts is placed.layouts


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.sampled_from([1, 2]))
def test_an_update_that_overwrites_a_parameter_runs_after_every_other_reader_of_it(seed, k):
    """Random plans (decoded actions, k micro-batches) simulated under random priorities: every op instance
    of the update that writes into the parameter or optimizer state it replaces (``memory.victims``) starts
    after every other task that reads that value from the same task has finished, so that it reads it last,
    as its write in place (the memory the simulator counts, what the runtime can do) needs."""
    import simulator
    from heterog.compiler.memory import victims

    ev = _mlp_evaluator()
    g, c = ev.graph, ev.cluster
    rng = np.random.default_rng(seed)
    strategy = ev.strategy(rng.integers(0, c.n_devices + 4, size=ev.n_groups))
    if k > 1:
        strategy = strategy.with_micro_batches(k, "1f1b")
    plan = ev.compile(strategy)
    res = simulator.simulate(plan.tg, priority=rng.random(plan.n_tasks))
    vic = victims(ev.compiler.context)
    placeholder = {op.name: i for i, op in enumerate(g.ops)}
    deps = [plan.dep_idx[plan.dep_ptr[t]:plan.dep_ptr[t + 1]] for t in range(plan.n_tasks)]
    readers: dict[int, list[int]] = {}
    for t, on in enumerate(deps):
        for d in on.tolist():
            readers.setdefault(d, []).append(t)
    checked = 0
    for u in np.nonzero((plan.task_kind == TaskKind.COMPUTE) & (plan.task_device >= 0))[0].tolist():
        op = g.ops[plan.task_op[u]]
        if op.writes is None or not vic.placeholder[plan.task_op[u]]:
            continue
        held = [d for d in deps[u].tolist() if plan.task_kind[d] == TaskKind.PLACEHOLDER
                and plan.task_op[d] == placeholder[op.writes]]
        for d in held:
            others = [x for x in readers[d] if x != u and plan.task_kind[x] != TaskKind.SYNC]
            assert all(res.start[u] >= res.finish[x] for x in others), (op.name, [g.ops[plan.task_op[x]].name
                                                                                 for x in others])
            checked += len(others)
    assert checked > 0


_EVALUATORS: dict = {}


def _mlp_evaluator():
    """tiny_mlp (batch 8) on paper-8gpu, made once."""
    if not _EVALUATORS:
        from heterog.cluster import load_cluster
        from heterog.evaluate import Evaluator
        from heterog.graph.cache import capture_model

        _EVALUATORS["mlp"] = Evaluator(capture_model("tiny_mlp", 8), load_cluster("paper-8gpu"))
    return _EVALUATORS["mlp"]
