"""Shards read from partial sums and from other shards (``heterog.runtime.split_collectives``): random split
and grid plans whose divided consumers need a shard of a value the same devices hold as partial sums or as
shards along another dimension (or of other units) read it by a real ``ReduceScatter`` / ``AllToAll`` over
their group, which every member issues at the same key, and train exactly like one process over gloo; the
programs lowered for NCCL compute the same step in one process."""
from __future__ import annotations

import numpy as np
import pytest

from heterog.runtime import compare_values, prepare, run_prepared
from heterog.runtime.instructions import AllToAll, ReduceScatter
from tests.runtime.test_conformance import ATOL, POOLS, RTOL, STEPS, captured, cluster_of, reference
from tests.runtime.test_grid_conformance import cluster4, grid_plan
from tests.runtime.test_split_conformance import assert_one_step_like_one_process, split_plan

# (model, cluster, seed): plans that hit both conversions
SPLITS = [("residual_glu", "local-cpu-3", 2), ("dropout_net", "local-cpu-2", 0)]
GRID = ("dropout_net", 1)


def _rescatters(low) -> dict[type, int]:
    """How many ReduceScatter and AllToAll instructions ``low`` holds; checks that every member of each
    issues it at the same key, with the same members and layouts."""
    seen: dict[tuple, set] = {}
    for rp in low.ranks:
        for ins, key in zip(rp.instrs, rp.keys):
            if isinstance(ins, (ReduceScatter, AllToAll)):
                assert rp.rank in ins.members
                what = (type(ins), ins.key, ins.group, ins.members, ins.need, key)
                seen.setdefault(what, set()).add(rp.rank)
    for (_, _, _, members, _, _), ranks in seen.items():
        assert ranks == set(members)
    return {kind: sum(len(r) for w, r in seen.items() if w[0] is kind) for kind in (ReduceScatter, AllToAll)}


def _trains_like_one_process(name: str, prepared, pool) -> None:
    m = captured(name)
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=pool)
    ref_losses, ref_values = reference(name)
    ok, diff, bad = compare_values(m, result.values, ref_values, rtol=RTOL, atol=ATOL)
    assert ok, f"{name}: {bad[:4]} differ (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=RTOL)


@pytest.mark.parametrize("name,cluster_name,seed", SPLITS)
def test_split_plans_read_shards_by_reduce_scatter_and_all_to_all(name, cluster_name, seed, request) -> None:
    m, cluster = captured(name), cluster_of(cluster_name)
    strategy = split_plan(name, cluster_name, seed, False)
    prepared = prepare(m, cluster, strategy)
    counts = _rescatters(prepared.lowered)
    assert counts[ReduceScatter] > 0 and counts[AllToAll] > 0, counts
    _trains_like_one_process(name, prepared, request.getfixturevalue(POOLS[cluster_name]))
    nccl = prepare(m, cluster, strategy, backend="nccl", check=False)
    assert _rescatters(nccl.lowered) == counts
    assert_one_step_like_one_process(name, nccl)


def test_a_grid_reads_shards_by_collectives_inside_each_group(pool4) -> None:
    """A random grid plan with micro-batches: each group reduce-scatters and exchanges shards over its own
    devices and samples."""
    name, seed = GRID
    prepared = prepare(captured(name), cluster4(), grid_plan(name, seed, True))
    counts = _rescatters(prepared.lowered)
    assert counts[ReduceScatter] > 0 and counts[AllToAll] > 0, counts
    groups = {ins.members for rp in prepared.lowered.ranks for ins in rp.instrs
              if isinstance(ins, (ReduceScatter, AllToAll))}
    assert all(len(g) == 2 for g in groups)                # inside a group of the grid, never across
    _trains_like_one_process(name, prepared, pool4)
