"""The plan identity reference: a sample of its plans of every kind compiles to the digests stored, a
changed plan does not, and a field the code lacks is reported missing."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

import heterog
from experiments import plan_identity as pi
from heterog.cost import CostModel
from heterog.strategy import ParallelConfig

PER_KIND = 4          # the first plans of each kind (9 kinds), spread over graphs and clusters by the seed


@pytest.fixture(scope="module")
def reference() -> dict:
    return pi.load_reference(pi.REFERENCE)


@pytest.fixture(scope="module")
def graphs(reference: dict) -> dict:
    return pi.load_graphs("stored", reference["graphs"])


def _sample(reference: dict) -> list[dict]:
    by_kind: dict[str, list[dict]] = {}
    for p in reference["plans"]:
        by_kind.setdefault(p["kind"], []).append(p)
    # the first, last and two middle plans of each kind: different graphs and clusters
    out = []
    for plans in by_kind.values():
        n = len(plans)
        out += [plans[i] for i in sorted({0, n // 3, 2 * n // 3, n - 1})[:PER_KIND]]
    return out


def test_the_reference_covers_every_kind_with_enough_plans(reference: dict) -> None:
    kinds = [p["kind"] for p in reference["plans"]]
    assert len(kinds) >= 1000
    for kind in pi.KINDS:
        assert kinds.count(kind) >= 120, kind
    assert set(reference["components"]) == set(reference["plans"][0]["digest"])


def test_a_sample_of_every_kind_compiles_to_the_stored_digests(reference: dict, graphs: dict) -> None:
    sample = _sample(reference)
    assert {p["kind"] for p in sample} == set(pi.KINDS)
    for rec in sample:
        graph, cluster = graphs[rec["graph"]], heterog.load_cluster(rec["cluster"])
        plan = pi.compile_plan(graph, cluster, CostModel(cluster), pi.strategy_of(rec, graph))
        assert pi.compare(rec, plan, set(), graph) == [], (rec["id"], rec["kind"])
        assert pi.kind_counts(plan) == rec["counts"]


def test_a_patching_compiler_gives_the_stored_digests(reference: dict, graphs: dict) -> None:
    recs = [p for p in reference["plans"] if p["graph"] == "tiny_cnn" and p["cluster"] == "paper-8gpu"][::6]
    graph, cluster = graphs["tiny_cnn"], heterog.load_cluster("paper-8gpu")
    cost = CostModel(cluster)
    compiler = pi.patching_compiler(graph, cluster, cost)
    for rec in recs:
        plan = pi.compile_plan(graph, cluster, cost, pi.strategy_of(rec, graph), compiler)
        assert pi.compare(rec, plan, set(), graph) == [], rec["id"]


def test_a_plan_moved_to_another_device_has_another_digest(reference: dict, graphs: dict) -> None:
    rec = next(p for p in reference["plans"] if p["kind"] == "single" and p["cluster"] == "paper-8gpu")
    graph, cluster = graphs[rec["graph"]], heterog.load_cluster(rec["cluster"])
    s = pi.strategy_of(rec, graph)
    moved_to = (s.configs[0].devices[0] + 1) % cluster.n_devices
    moved = replace(s, configs=[ParallelConfig.single(moved_to, s.batch_size)] * s.n_groups)
    plan = pi.compile_plan(graph, cluster, CostModel(cluster), moved)
    problems = pi.compare(rec, plan, set(), graph)
    assert "plan.task_device differs" in problems
    assert "tg.resources differs" in problems                 # the parameters are resident elsewhere
    assert problems[-1].endswith("count deltas by kind: none")    # the same tasks, on another device


def test_a_field_the_code_lacks_is_reported_missing(reference: dict, graphs: dict) -> None:
    rec = reference["plans"][0]
    graph, cluster = graphs[rec["graph"]], heterog.load_cluster(rec["cluster"])
    plan = pi.compile_plan(graph, cluster, CostModel(cluster), pi.strategy_of(rec, graph))
    renamed = SimpleNamespace(**{k: v for k, v in vars(plan).items() if k != "task_slot"})
    problems = pi.compare(rec, renamed, set(), graph)
    assert problems[0].startswith("plan.task_slot: this code has no such field")
    assert len(problems) == 2                                 # that, and the task counts (equal)
    assert pi.compare(rec, renamed, {"task_slot"}, graph) == []


def test_the_digest_ignores_integer_width_but_not_values() -> None:
    import numpy as np

    assert pi._h(np.arange(4, dtype=np.int32)) == pi._h(np.arange(4, dtype=np.int64))
    assert pi._h(np.arange(4)) != pi._h(np.arange(1, 5))
    assert pi._h(None) != pi._h(np.zeros(0, dtype=np.int64))
