"""Delta compilation (heterog.compiler.delta): a plan patched group by group is the plan compiled from
scratch, task for task, and simulates to the same iteration time and memory, on random strategy walks."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heterog.cluster import load_cluster
from heterog.compiler import Compiler, compile_strategy
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.strategy import ParallelConfig, Strategy
from tests.compiler.helpers import branches_graph
from tests.compiler.test_ps import LinkCost, ev_ps, servers

ZOO = {"tiny_mlp": 16, "tiny_transformer": 8, "tiny_cnn": 8}


def assert_same_plan(patched, scratch) -> None:
    """The two CompiledPlans have the same TaskGraph and the same layout and aggregation decisions."""
    a, b = patched.tg, scratch.tg
    for x, y in [(a.duration, b.duration), (a.lag, b.lag), (a.task_category, b.task_category),
                 (a.resident_bytes, b.resident_bytes), *zip(a.resources(), b.resources()),
                 *zip(a.dependencies(), b.dependencies()), *zip(a.memory(), b.memory()), *zip(a.frees(), b.frees()),
                 (patched.task_kind, scratch.task_kind), (patched.task_op, scratch.task_op),
                 (patched.task_device, scratch.task_device), (patched.task_prio_op, scratch.task_prio_op)]:
        np.testing.assert_array_equal(x, y)
    p, s = patched.placements, scratch.placements
    assert p.ps_device == s.ps_device
    assert p.aggregation == s.aggregation

    def layouts(placed, ids):
        return [placed.layouts[i] for i in np.asarray(ids).tolist()]

    assert layouts(p, p.op_layout) == layouts(s, s.op_layout)
    assert layouts(p, p.tensor_layout) == layouts(s, s.tensor_layout)


def config_pool(ev: Evaluator, rng: np.random.Generator, size: int = 10) -> list[ParallelConfig]:
    """Random configs: device subsets with random shares, PS (sometimes on a given device) or AllReduce."""
    m, batch = ev.cluster.n_devices, ev.graph.batch_size
    out = []
    for _ in range(size):
        k = int(rng.integers(1, min(m, batch) + 1))
        devs = sorted(rng.choice(m, size=k, replace=False).tolist())
        cuts = np.sort(rng.choice(np.arange(1, batch), size=k - 1, replace=False)) if k > 1 else np.zeros(0, int)
        shares = np.diff(np.concatenate([[0], cuts, [batch]])).tolist()
        sync = "ps" if rng.random() < 0.5 else "allreduce"
        ps = int(rng.choice(devs)) if sync == "ps" and rng.random() < 0.3 else None
        out.append(ParallelConfig(tuple(devs), tuple(shares), sync, ps))
    return out


@pytest.fixture(scope="module", params=[(g, c) for g in ZOO for c in ("paper-8gpu", "paper-12gpu")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def evaluator(request):
    graph, cluster = request.param
    return Evaluator(capture_model(graph, ZOO[graph]), load_cluster(cluster))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), actions=st.booleans())
def test_a_patched_plan_is_the_plan_compiled_from_scratch(evaluator, seed, actions):
    """A random walk (1-3 groups change per step, now and then a fresh strategy) over decoded actions or
    random configs: every step's patched plan equals the plan compiled from scratch, and simulates to the
    same iteration time and OOM under each order."""
    ev, rng = evaluator, np.random.default_rng(seed)
    g, c = ev.graph, ev.cluster
    compiler = Compiler(g, c, ev.cost, max_bases=2, delta_fraction=1.0)   # patch every change
    n_actions = c.n_devices + 4
    pool = config_pool(ev, rng)
    state = rng.integers(0, n_actions if actions else len(pool), size=ev.n_groups)
    for step in range(6):
        state = state.copy()
        if step == 3:
            state = rng.integers(0, n_actions if actions else len(pool), size=ev.n_groups)
        else:
            changed = rng.choice(ev.n_groups, size=min(int(rng.integers(1, 4)), ev.n_groups), replace=False)
            state[changed] = rng.integers(0, n_actions if actions else len(pool), size=len(changed))
        strategy = ev.strategy(state) if actions else Strategy(
            g.fingerprint, c.name, c.n_devices, g.batch_size, ev.group_of, [pool[i] for i in state.tolist()])
        patched = compiler.compile(strategy)
        scratch = compile_strategy(g, c, strategy, ev.cost)
        assert_same_plan(patched, scratch)
        for order in ("fifo", "rank", "best"):
            a, b = ev.simulate_plan(patched, order), ev.simulate_plan(scratch, order)
            assert (a.makespan, a.oom) == (b.makespan, b.oom)
            np.testing.assert_array_equal(a.peak_memory, b.peak_memory)
    assert compiler.n_full == 1                          # every step after the first was patched


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(2, 4), schedule=st.sampled_from(["1f1b", "gpipe"]))
def test_a_patched_micro_batched_plan_is_the_plan_compiled_from_scratch(evaluator, seed, k, schedule):
    """The random walk over decoded actions, every plan over k micro-batches: each patched plan (its
    schedule's barriers and slots added after the merge) equals the plan compiled from scratch."""
    ev, rng = evaluator, np.random.default_rng(seed)
    g, c = ev.graph, ev.cluster
    compiler = Compiler(g, c, ev.cost, max_bases=2, delta_fraction=1.0)
    state = rng.integers(0, c.n_devices + 4, size=ev.n_groups)
    for _ in range(4):
        state = state.copy()
        changed = rng.choice(ev.n_groups, size=min(int(rng.integers(1, 4)), ev.n_groups), replace=False)
        state[changed] = rng.integers(0, c.n_devices + 4, size=len(changed))
        strategy = ev.strategy(state).with_micro_batches(k, schedule)
        patched = compiler.compile(strategy)
        scratch = compile_strategy(g, c, strategy, ev.cost)
        assert_same_plan(patched, scratch)
        np.testing.assert_array_equal(patched.task_slot, scratch.task_slot)
        np.testing.assert_array_equal(patched.task_micro, scratch.task_micro)
        assert patched.schedule == scratch.schedule
        a, b = ev.simulate_plan(patched, "best"), ev.simulate_plan(scratch, "best")
        assert (a.makespan, a.oom) == (b.makespan, b.oom)
    assert compiler.n_full == 1 and compiler.n_patched >= 1   # none compiled again from scratch


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), k=st.sampled_from([1, 2]))
def test_a_patched_plan_with_splits_is_the_plan_compiled_from_scratch(evaluator, seed, k):
    """The random walk over actions that include splits beyond the batch (``ActionSearch(splits=True)``),
    at one or two micro-batches: each patched plan equals the plan compiled from scratch."""
    from heterog.baselines.chains import ActionSearch

    ev, rng = evaluator, np.random.default_rng(seed)
    g, c = ev.graph, ev.cluster
    search = ActionSearch(ev, splits=True)
    compiler = Compiler(g, c, ev.cost, max_bases=2, delta_fraction=1.0)
    state = rng.integers(0, search.n_actions, size=ev.n_groups)
    for _ in range(4):
        state = state.copy()
        changed = rng.choice(ev.n_groups, size=min(int(rng.integers(1, 4)), ev.n_groups), replace=False)
        state[changed] = rng.integers(0, search.n_actions, size=len(changed))
        strategy = search.strategy(state).with_micro_batches(k)
        patched = compiler.compile(strategy)
        scratch = compile_strategy(g, c, strategy, ev.cost)
        assert_same_plan(patched, scratch)
        a, b = ev.simulate_plan(patched, "best"), ev.simulate_plan(scratch, "best")
        assert (a.makespan, a.oom) == (b.makespan, b.oom)
    assert compiler.n_full == 1 and compiler.n_patched >= 1


def test_changing_one_group_moves_other_groups_ps_and_the_patch_follows():
    # 4 branches under EV-PS on 2 servers x 2 GPUs: the PS choice spreads the 4 groups over the devices.
    # Turning branch 0 to AllReduce changes the load the others see; the groups whose PS moves are
    # re-emitted too, and the patched plan is the plan compiled from scratch.
    graph, cluster = branches_graph(4, 8_000_000), servers([2, 2])
    cost = LinkCost(cluster)
    base = ev_ps(graph, cluster, 4)
    compiler = Compiler(graph, cluster, cost, delta_fraction=1.0)      # patch whatever the change
    before = compiler.compile(base).placements.ps_device
    moved = 0
    for new in (ParallelConfig.of([(d, 2) for d in range(4)], sync="allreduce"),
                ParallelConfig.single(3, graph.batch_size), ParallelConfig.of([(0, 4), (3, 4)], sync="ps")):
        configs = list(base.configs)
        configs[0] = new
        strategy = Strategy(graph.fingerprint, cluster.name, 4, graph.batch_size, base.group_of, configs)
        patched = compiler.compile(strategy)
        assert_same_plan(patched, compile_strategy(graph, cluster, strategy, cost))
        moved += sum(patched.placements.ps_device.get(gr) != before[gr] for gr in (1, 2, 3))
        compiler.bases.clear()
        compiler.compile(base)                           # start the next change from the base plan
    assert moved >= 1
    assert compiler.n_patched == 3


def test_the_same_strategy_again_is_the_same_plan_and_a_new_grouping_starts_afresh():
    graph, cluster = branches_graph(3, 64), load_cluster("paper-8gpu")
    ev = Evaluator(graph, cluster)
    s = ev.strategy(np.zeros(ev.n_groups, dtype=np.int64))
    p1 = ev.compile(s)
    assert ev.compile(ev.strategy(np.zeros(ev.n_groups, dtype=np.int64))) is p1
    one = Strategy(graph.fingerprint, cluster.name, 8, graph.batch_size, np.zeros(graph.n_ops, dtype=np.int64),
                   [ParallelConfig.single(0, graph.batch_size)])
    p2 = ev.compile(one)                                # another grouping: compiled from scratch
    assert_same_plan(p2, compile_strategy(graph, cluster, one, ev.cost))
    assert ev.compiler.n_patched == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_old=st.integers(0, 40), n_new=st.integers(0, 12))
def test_the_compiled_merge_equals_its_reference(seed, n_old, n_new):
    """Random old tasks (sorted distinct order keys) with some owners dropped, random new tasks and
    dependencies (duplicates included): merge_kernel and merge_reference agree on everything."""
    from heterog.compiler.delta import merge_kernel, merge_reference
    from heterog.compiler.tasks import Tasks

    rng = np.random.default_rng(seed)
    n_owners = 6
    keys = rng.choice(10 * (n_old + n_new) + 10, size=n_old + n_new, replace=False)
    old_keys, new_keys = np.sort(keys[:n_old]), rng.permutation(keys[n_old:])

    def tasks(order: np.ndarray) -> Tasks:
        n = len(order)
        ints = np.stack([order, rng.integers(0, n_owners, n)] + [rng.integers(-1, 9, n) for _ in range(5)])
        res_len = rng.integers(0, 3, n)
        ptr = np.concatenate([[0], np.cumsum(res_len)]).astype(np.int64)
        return Tasks(ints.astype(np.int64), rng.random((3, n)), ptr, rng.integers(0, 9, ptr[-1]).astype(np.int64))

    def deps(task_ids: np.ndarray, earlier: np.ndarray, k: int, sort: bool) -> tuple:
        if not len(task_ids) or not len(earlier):
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        t = rng.choice(task_ids, size=k)
        o = rng.choice(earlier, size=k)
        owner = rng.integers(0, n_owners, k)
        if sort:
            s = np.lexsort((o, t))
            t, o, owner = t[s], o[s], owner[s]
        return t.astype(np.int64), o.astype(np.int64), owner.astype(np.int64)

    old, new = tasks(old_keys), tasks(new_keys)
    drop = rng.random(n_owners) < 0.4
    old_deps = deps(np.arange(n_old), np.arange(n_old), 3 * n_old, True)
    new_deps = deps(np.arange(n_old, n_old + n_new), np.arange(n_old + n_new), 3 * n_new, False)
    # dependencies of kept owners point at kept tasks only (as in a plan); new ones at kept or new tasks
    kept_task = np.concatenate([~drop[old.owner], np.ones(n_new, dtype=bool)])
    keep_old = ~drop[old_deps[2]] & kept_task[old_deps[0]] & kept_task[old_deps[1]]
    old_deps = tuple(x[keep_old | drop[old_deps[2]]] for x in old_deps)
    ok = kept_task[new_deps[1]]
    new_deps = tuple(x[ok] for x in new_deps)
    a, b = merge_kernel(old, old_deps, drop, new, new_deps), merge_reference(old, old_deps, drop, new, new_deps)
    for name in ("dep_task", "dep_on", "dep_owner", "dep_ptr", "dep_idx", "new_of"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for name in ("ints", "floats", "res_ptr", "res_idx"):
        np.testing.assert_array_equal(getattr(a.tasks, name), getattr(b.tasks, name), err_msg=name)
    assert np.all(np.diff(a.tasks.order) > 0)
