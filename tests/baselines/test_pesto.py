"""Pesto: coarsening is cycle-free and reaches its target; CP-SAT finds the brute-force optimum of a
tiny instance; the planner expands a feasible, in-memory plan."""
from __future__ import annotations

from itertools import permutations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.baselines import pesto as P


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 40))
    p = draw(st.floats(0.0, 0.5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    src, dst = np.triu_indices(n, 1)
    keep = rng.random(len(src)) < p
    perm = rng.permutation(n)                                 # node ids not in topological order
    return n, perm[src[keep]], perm[dst[keep]], rng.integers(1, 100, keep.sum()).astype(float), \
        rng.random(n), draw(st.integers(1, 45))


@settings(max_examples=60, deadline=None)
@given(random_dags())
def test_coarsening_is_acyclic_topologically_numbered_and_reaches_the_target(dag):
    n, src, dst, nbytes, weight, target = dag
    cluster_of = P.coarsen(n, src, dst, nbytes, weight, target)
    k = int(cluster_of.max()) + 1
    assert k == min(n, target)
    assert sorted(set(cluster_of.tolist())) == list(range(k))
    cs, cd = cluster_of[src], cluster_of[dst]
    # numbered in a topological order of the coarse graph: every edge goes forward, so no cycle
    assert np.all(cs <= cd)
    P.heights(k, *P.quotient_edges(cluster_of, src, dst, nbytes)[:2])    # raises on a cycle


def test_merge_round_refuses_crossed_pairs_that_would_close_a_cycle():
    # a -> b, c -> d, a -> d, c -> b: merging (a, b) and (c, d) together would give X <-> Y
    qs, qd = np.array([0, 2, 0, 2]), np.array([1, 3, 3, 1])
    pairs = P.merge_round(4, qs, qd, np.array([10.0, 9.0, 1.0, 1.0]), np.ones((4, 1)), 4, np.array([np.inf]))
    assert pairs == [(0, 1)]


def test_coarsening_merges_the_largest_tensors_first():
    # chain 0 -> 1 -> 2 -> 3 with the big tensor on 1 -> 2: one merge to 3 nodes takes it
    cluster_of = P.coarsen(4, np.array([0, 1, 2]), np.array([1, 2, 3]), np.array([1.0, 50.0, 2.0]),
                           np.ones(4), 3)
    assert cluster_of.tolist() == [0, 1, 1, 2]


def brute_force(prob: P.ScheduleProblem) -> int:
    """Optimal makespan by enumeration: every placement within memory, every order of compute and
    transfer tasks consistent with precedence, each task appended at the earliest time its inputs and
    resources allow (every semi-active schedule arises from such an order; an optimal one is semi-active)."""
    K, M, E = prob.n_tasks, prob.n_devices, len(prob.edge_src)
    best = None
    for placement in np.ndindex(*([M] * K)):
        dev = np.array(placement)
        if any(prob.memory[dev == d].sum() > prob.capacity[d] for d in range(M)):
            continue
        tasks = [("c", i) for i in range(K)]
        crossing = [k for k in range(E) if prob.transfer[k, dev[prob.edge_src[k]], dev[prob.edge_dst[k]]] > 0]
        tasks += [("t", k) for k in crossing]
        deps: dict = {t: [] for t in tasks}
        for k in range(E):
            i, j = int(prob.edge_src[k]), int(prob.edge_dst[k])
            if k in crossing:
                deps[("t", k)].append(("c", i))
                deps[("c", j)].append(("t", k))
            else:
                deps[("c", j)].append(("c", i))
        for perm in permutations(tasks):
            pos = {t: p for p, t in enumerate(perm)}
            if any(pos[d] > pos[t] for t in tasks for d in deps[t]):
                continue
            end: dict = {}
            free: dict = {}
            for t in perm:
                kind, x = t
                if kind == "c":
                    res, dur = [("dev", int(dev[x]))], int(prob.duration[x, dev[x]])
                else:
                    a, b = int(dev[prob.edge_src[x]]), int(dev[prob.edge_dst[x]])
                    res, dur = [("link", link) for link in prob.pair_links[a][b]], int(prob.transfer[x, a, b])
                s = max([0] + [end[d] for d in deps[t]] + [free.get(r, 0) for r in res])
                end[t] = s + dur
                for r in res:
                    free[r] = s + dur
            best = max(end.values()) if best is None else min(best, max(end.values()))
    return int(best)


def tiny_instance() -> P.ScheduleProblem:
    # fork-join 0 -> {1, 2} -> 3 on a fast and a slow device; transfers cost 1 unit each way
    duration = np.array([[2, 3], [4, 5], [5, 6], [1, 2]])
    src, dst = np.array([0, 0, 1, 2]), np.array([1, 2, 3, 3])
    transfer = np.full((4, 2, 2), 1)
    transfer[:, 0, 0] = transfer[:, 1, 1] = 0
    return P.ScheduleProblem(duration, src, dst, transfer, [[(), (0,)], [(1,), ()]], np.ones(4, np.int64),
                             np.array([4, 4]))


def test_cpsat_finds_the_brute_force_optimum():
    prob = tiny_instance()
    optimum = brute_force(prob)
    sol = P.solve_cpsat(prob, time_limit_s=20, workers=1)
    assert sol.status == "OPTIMAL"
    # all on dev0 takes 12; 1 on dev1: 0 [0, 2], send [2, 3], 1 [3, 8], send [8, 9], 3 [9, 10] (2 runs [2, 7])
    assert sol.makespan == optimum == 10
    # the solution is a valid schedule of that makespan
    replay = P.list_schedule(prob, sol.device, np.lexsort((np.arange(4), sol.start)))
    assert replay.makespan <= sol.makespan


def test_cpsat_respects_memory_and_the_hint():
    prob = tiny_instance()
    prob.capacity[:] = [1, 3]                       # dev0 holds one task
    sol = P.solve_cpsat(prob, time_limit_s=20, workers=1, hint=P.list_schedule(prob, np.array([1, 1, 1, 1]),
                                                                               np.arange(4)))
    assert sol.status == "OPTIMAL" and sol.makespan == brute_force(prob)
    assert np.sum(sol.device == 0) <= 1
