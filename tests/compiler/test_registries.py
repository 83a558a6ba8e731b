"""The tables a Compiler grows (heterog.compiler.registries): layouts and configs numbered as first seen,
groupings, and what the parameter-server choice reads of a grouping."""
from __future__ import annotations

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.registries import ConfigTable, Grouping, LayoutTable, PSDemand
from heterog.strategy import ParallelConfig
from tests.compiler.helpers import linear_graph
from tests.compiler.test_compile import FakeCost, two_gpu


def test_layouts_start_with_each_device_alone_and_number_new_ones_as_first_seen():
    lay = LayoutTable(3, 8)
    assert [lay.add((d,), (8,)) for d in range(3)] == [0, 1, 2]
    assert lay.add((0, 2), (5, 3)) == 3 and lay.add((0, 2), (5, 3)) == 3 and lay.add((2, 0), (3, 5)) == 4
    lay.refresh()
    assert lay.length.tolist() == [1, 1, 1, 2, 2] and lay.ptr.tolist() == [0, 1, 2, 3, 5, 7]
    assert lay.dev_flat.tolist() == [0, 1, 2, 0, 2, 2, 0]
    assert lay.frac_flat.tolist() == [1, 1, 1, 5 / 8, 3 / 8, 3 / 8, 5 / 8]
    assert lay.dev_mask[3].tolist() == [True, False, True]


def test_configs_are_numbered_by_value_and_register_their_layouts():
    lay = LayoutTable(2, 8)
    cfg = ConfigTable(lay)
    ps = ParallelConfig.of([(0, 6), (1, 2)], sync="ps")
    assert cfg.id_of(ps) == 0 and cfg.id_of(ParallelConfig.of([(0, 6), (1, 2)], sync="ps")) == 0
    assert cfg.id_of(ParallelConfig.single(1, 8)) == 1
    assert cfg.id_of(ParallelConfig.of([(0, 6), (1, 2)], sync="ps", ps_device=1)) == 2
    cfg.refresh()
    assert cfg.n_replicas.tolist() == [2, 1, 2] and cfg.is_ps.tolist() == [True, False, True]
    assert cfg.fixed_ps.tolist() == [-1, -1, 1]
    assert [lay.devices[k] + lay.shares[k] for k in cfg.split_layout] == [(0, 1, 6, 2), (1, 8), (0, 1, 6, 2)]
    assert [lay.shares[k] for k in cfg.dup_layout] == [(8, 8), (8,), (8, 8)]


def test_grouping_and_what_each_group_pulls_from_a_ps():
    g, c = linear_graph(), two_gpu()
    ctx = CompileContext.of(g, c, FakeCost(c))
    # ops: 0 x, 1 W, 2 mm, 3 loss, 4 ones, 5 gout, 6 gW, 7 upd; W (group 1) is read by mm (group 0)
    grouping = Grouping.of(np.array([0, 1, 0, 0, 0, 0, 0, 1]), ctx.index)
    assert grouping.n_groups == 2 and grouping.same_as(np.array([0, 1, 0, 0, 0, 0, 0, 1]))
    assert not grouping.same_as(np.zeros(8, dtype=np.int64))
    demand = PSDemand(ctx, grouping)
    tensors, nbytes = demand.pulled()
    assert tensors.tolist() == [0.0, 1.0] and nbytes.tolist() == [0.0, 32.0]
    uneven = ParallelConfig.of([(0, 6), (1, 2)], sync="ps")
    need = demand.parameters_needed(uneven)
    # W's first reader mm is the first op with work, so each replica needs W after its slack alone: the
    # work before the update is 288 f + 1 s at share f (FakeCost), 217 s on device 0 and 73 s on device 1
    assert need.tolist() == [[0.0, 0.0], [0.0, 144.0]]
    assert demand.parameters_needed(ParallelConfig.of([(0, 6), (1, 2)], sync="ps")) is need


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from heterog.compiler.memory import _entries_of, entries_of_reference  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_each_instances_layout_entry_is_found_as_by_matching_every_entry(data):
    n_dev, n_micro = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    lay = LayoutTable(n_dev, 8)
    entry = st.tuples(st.integers(0, n_dev - 1), st.integers(0, n_micro - 1))
    for entries in data.draw(st.lists(st.lists(entry, min_size=1, max_size=8), max_size=6)):
        lay.add([d for d, _ in entries], [1] * len(entries), [m for _, m in entries])   # repeats allowed
    lay.refresh()
    n = data.draw(st.integers(0, 30))
    lids = np.array(data.draw(st.lists(st.integers(0, len(lay) - 1), min_size=n, max_size=n)), dtype=np.int64)
    dev = np.array(data.draw(st.lists(st.integers(0, n_dev - 1), min_size=n, max_size=n)), dtype=np.int64)
    micro = np.array(data.draw(st.lists(st.integers(-1, n_micro), min_size=n, max_size=n)), dtype=np.int64)
    got = _entries_of(lay, lids, dev, micro)
    assert got.tolist() == entries_of_reference(lay, lids, dev, micro).tolist()
