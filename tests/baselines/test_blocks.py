"""Block moves: the groups joined by a graph's heaviest tensors, and chains that move them together."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.baselines.chains import Block, Chain, block_weights, coupled_blocks, run_chain
from tests.baselines.helpers import compute_dag, layered_graph

# op:      0 -100B- 1 -100B- 2 -10B- 3 -60B- 4 -10B- 5        every op 1 FLOP
EDGES = [(0, 1, 100), (1, 2, 100), (2, 3, 10), (3, 4, 60), (4, 5, 10)]


def test_blocks_are_components_over_heavy_edges():
    g = compute_dag(6, EDGES)
    ident = np.arange(6)
    as_lists = lambda blocks: [b.groups.tolist() for b in blocks]          # noqa: E731
    assert as_lists(coupled_blocks(g, ident, (0.5,), 1.0)) == [[0, 1, 2], [3, 4]]     # edges >= 50 B
    assert as_lists(coupled_blocks(g, ident, (0.9,), 1.0)) == [[0, 1, 2]]             # edges >= 90 B
    assert as_lists(coupled_blocks(g, ident, (0.9, 0.5), 1.0)) == [[0, 1, 2], [3, 4]]  # each block once
    # [0, 1, 2] holds 3 of the 6 FLOPs, [3, 4] 2 of 6: a block is a small part of the work
    assert as_lists(coupled_blocks(g, ident, (0.5,), 0.4)) == [[3, 4]]
    assert coupled_blocks(g, ident, (0.5,), 0.3) == []
    # edges inside a group couple nothing; blocks are of groups
    grouped = coupled_blocks(g, np.array([0, 0, 1, 1, 2, 2]), (0.5,), 1.0)
    assert as_lists(grouped) == [[0, 1, 2]]        # 1->2 joins groups 0, 1; 3->4 joins groups 1, 2
    assert coupled_blocks(g, np.array([0, 0, 0, 1, 1, 1]), (0.9,), 1.0) == []   # both 100 B edges inside group 0


def test_a_layer_is_a_block_with_its_gradient():
    g = layered_graph(2, 1 << 20)                    # the parameter edges (1 MiB) are the heaviest
    names = [[g.ops[i].name for i in b.groups] for b in coupled_blocks(g, np.arange(g.n_ops), (0.5,), 1.0)]
    assert names == [["W0", "f0", "w0", "u0"], ["W1", "f1", "w1", "g1", "u1"]]
    blocks = coupled_blocks(g, np.arange(g.n_ops), (0.5,), 1.0)
    assert [b.sync_bytes for b in blocks] == [1 << 20, 1 << 20]
    assert [g.ops[b.leader].name for b in blocks] == ["w0", "w1"]     # each led by its weight gradient's op
    assert [b.leader for b in coupled_blocks(compute_dag(6, EDGES), np.arange(6), (0.5,), 1.0)] == [0, 3]  # none: first


def test_block_weights_half_even_half_by_gradient_bytes():
    blocks = [Block(np.array([0, 1]), 0.0, 0), Block(np.array([2, 3]), 300.0, 2), Block(np.array([4, 5]), 100.0, 4)]
    np.testing.assert_allclose(block_weights(blocks), [0.5 / 3, 0.5 / 3 + 0.375, 0.5 / 3 + 0.125])
    np.testing.assert_allclose(block_weights(blocks[:1]), [1.0])          # no gradients: even
    assert block_weights([]).shape == (0,)


@dataclass
class ValleySearch:
    """Six groups, two devices (six actions). Every plan costs 1 + 0.1 per group changed from the start
    (all groups on action 5), except the one that puts the block [0, 1, 2] on device 0: 0.5. No single-group
    move leads there without climbing first."""

    blocks: list
    block_p: np.ndarray = field(default_factory=lambda: np.ones(1))
    ev: object = field(default_factory=lambda: SimpleNamespace(cluster=SimpleNamespace(n_devices=2)))
    n_evals: int = 0
    eval_time_s: float = 0.0
    seen: list = field(default_factory=list)
    n_actions: int = 6
    n_base: int = 6
    base_of: np.ndarray = field(default_factory=lambda: np.arange(6))
    sharded_actions: list = field(default_factory=list)

    def cost(self, a: np.ndarray) -> float:
        self.n_evals += 1
        self.seen.append(a.copy())
        if (a[:3] == 0).all() and (a[3:] == 5).all():
            return 0.5
        return 1.0 + 0.1 * float((a != 5).sum())


def chain(block_moves: float, budget: int = 300) -> Chain:
    return Chain(0, "start", np.full(6, 5), 1.0, 1.0, 1e4, budget, True, 0, block_moves=block_moves)


def test_block_moves_cross_the_valley_single_moves_do_not():
    single = run_chain(ValleySearch([np.array([0, 1, 2])]), chain(0.0))
    assert single.best_cost == 1.0
    search = ValleySearch([np.array([0, 1, 2])])
    found = run_chain(search, chain(0.2))
    assert found.best_cost == 0.5
    assert found.best[0][1].tolist() == [0, 0, 0, 5, 5, 5]


def test_a_block_move_sets_every_member_to_one_new_action():
    search = ValleySearch([np.array([1, 3])])
    run_chain(search, chain(1.0, budget=60))
    assert len(search.seen) >= 30               # no gain: the chain stops after half its budget
    for a in search.seen:                       # nothing is accepted (beta is huge): each is one move from the start
        assert a[1] == a[3] != 5
        assert (np.delete(a, [1, 3]) == 5).all()


@dataclass
class DeviceSearch:
    """Three devices: the block [0, 1] costs 3, 1, 2 on devices 0, 1, 2; anything else costs 5."""

    blocks: list
    ev: object = field(default_factory=lambda: SimpleNamespace(cluster=SimpleNamespace(n_devices=3)))
    n_evals: int = 0

    def cost(self, a: np.ndarray) -> float:
        self.n_evals += 1
        return {0: 3.0, 1: 1.0, 2: 2.0}[int(a[0])] if a[0] == a[1] and a[0] < 3 else 5.0


def test_repick_moves_a_one_device_block_to_its_best_device():
    from heterog.baselines.mcmc import repick_block_devices

    search = DeviceSearch([np.array([0, 1])])
    actions, cost = repick_block_devices(search, np.array([0, 0, 4]), 3.0)
    assert actions.tolist() == [1, 1, 4] and cost == 1.0 and search.n_evals == 2
    # a block under data parallelism (action >= M) or split over devices is left alone
    for start in ([3, 3, 4], [0, 2, 4]):
        search = DeviceSearch([np.array([0, 1])])
        actions, cost = repick_block_devices(search, np.array(start), 5.0)
        assert actions.tolist() == start and search.n_evals == 0


@settings(max_examples=25, deadline=None)
@given(segment=st.integers(1, 50), block_moves=st.sampled_from([0.0, 0.3]), beta=st.sampled_from([3.0, 1e4]))
def test_a_chain_cut_into_segments_is_the_same_chain(segment, block_moves, beta):
    """Ray workers take a chain's proposal budget in segments: resumed from its state, a chain draws the
    same proposals and accepts the same ones as when it runs in one go."""
    def make() -> Chain:
        return Chain(0, "start", np.full(6, 5), 1.0, 1.0, beta, 120, True, 7, block_moves=block_moves)

    whole_search = ValleySearch([np.array([0, 1, 2])])
    whole = run_chain(whole_search, make())
    assert whole.state is None
    cut_search = ValleySearch([np.array([0, 1, 2])])
    part, pieces = run_chain(cut_search, make(), segment=segment), 1
    while part.state is not None:
        assert part.proposals == pieces * segment
        part, pieces = run_chain(cut_search, make(), part.state, segment), pieces + 1
    assert [a.tolist() for a in cut_search.seen] == [a.tolist() for a in whole_search.seen]
    assert [(c, a.tolist()) for c, a in part.best] == [(c, a.tolist()) for c, a in whole.best]
    assert (part.proposals, part.accepted, part.n_evals) == (whole.proposals, whole.accepted, whole.n_evals)
    assert pieces == -(-whole.proposals // segment)


@dataclass
class PlacementSearch:
    """Three devices, six groups, blocks [0, 1] and [2, 3] (the second synchronises more gradient bytes, so
    it comes first). A plan costs 10, less 4 if block [2, 3] is whole on device 2, less 1 (device 0) or 2
    (device 1) if block [0, 1] is whole there."""

    blocks: list = field(default_factory=lambda: [np.array([0, 1]), np.array([2, 3])])
    block_p: np.ndarray = field(default_factory=lambda: np.array([0.3, 0.7]))
    ev: object = field(default_factory=lambda: SimpleNamespace(cluster=SimpleNamespace(n_devices=3)))
    seen: list = field(default_factory=list)

    def cost(self, a: np.ndarray) -> float:
        self.seen.append(a.copy())
        c = 10.0 - (4.0 if a[2] == a[3] == 2 else 0.0)
        return c - {0: 1.0, 1: 2.0}.get(int(a[0]), 0.0) * float(a[0] == a[1])


def test_place_blocks_puts_each_block_on_its_best_device_heaviest_first():
    from heterog.baselines.mcmc import place_blocks

    search = PlacementSearch()
    start = np.full(6, 4)                                  # every group data parallel (action M + 1)
    actions, cost, proposals = place_blocks(search, start, 10.0)
    assert actions.tolist() == [1, 1, 2, 2, 4, 4] and cost == 4.0 and proposals == 6
    assert [a[2:4].tolist() for a in search.seen[:3]] == [[0, 0], [1, 1], [2, 2]]   # block [2, 3] first
    assert start.tolist() == [4] * 6                       # the start is not changed in place
    # a budget of 4 proposals: block [2, 3] is placed, block [0, 1] tried on device 0 only
    actions, cost, proposals = place_blocks(PlacementSearch(), start, 10.0, lambda n: n >= 4)
    assert actions.tolist() == [0, 0, 2, 2, 4, 4] and cost == 5.0 and proposals == 4
    # a block already whole on one device is left to repick_block_devices; nothing better: the plan kept
    search = PlacementSearch()
    actions, cost, proposals = place_blocks(search, np.array([0, 0, 2, 2, 4, 4]), 5.0)
    assert actions.tolist() == [0, 0, 2, 2, 4, 4] and cost == 5.0 and proposals == 0
