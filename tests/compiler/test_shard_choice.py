"""The split-option problem of heterog.compiler.shards: the costs it builds in bulk (edges alike sharing one table
of conversions, each op's options costed at once) are, entry by entry, the costs of one op option and one edge
option pair at a time, and the choice's per-edge and per-op fields (ops alike filled at once) are those of its
edges and ops one by one."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from heterog import zoo
from heterog.cluster import load_cluster
from heterog.compiler.index import output_bytes
from heterog.compiler.shard_search import FORBIDDEN
from heterog.compiler.shards import _CONV_WEIGHT, REPLICATE, _Chooser, _cls, choose_shards, split_table
from heterog.evaluate import Evaluator
from heterog.graph.capture import capture
from heterog.placement import Conversion, R, Shard, is_shard
from heterog.strategy import ParallelConfig

BATCH = 4


@pytest.fixture(scope="module")
def decoder_ctx():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    module, inputs = zoo.build("opt_350m_megatron", BATCH, **zoo.small_overrides("opt_350m_megatron"))
    graph = capture(module, inputs, optimizer="adam")
    return Evaluator(graph, load_cluster("paper-8gpu")).compiler.context


def one_edge_cost(ch: _Chooser, e: int, ku: int, kv: int) -> float:
    """An edge's conversion time for one pair of options, as the module states it."""
    c = ch.edge_conv(e, ku, kv)
    if c.collective and ch.fixed_params and ch.param[int(ch.ctx.index.e_src[e])]:
        return FORBIDDEN
    if not c.collective or ch.n < 2:
        return 0.0
    moved = float(ch.e_bytes[e]) * (ch.n - 1) / ch.n * _CONV_WEIGHT[c]
    return moved / ch.bw + (ch.n - 1) * ch.lat


def one_compute_cost(ch: _Chooser, o: int, k: int) -> float:
    f = ch.option_frac(o, k)
    cost = float(np.max(ch.full[o] * f)) + 1e-18 * float(ch.resident[o]) * float(f.max())
    partial = float(ch.ctx.index.partial_bytes[o])
    if ch.sum_s_per_byte and partial > 0:
        held = float(f.max()) if is_shard(ch.out_placement(o, k)) else 1.0
        cost += partial * held * ch.sum_s_per_byte + ch.sum_fixed_s
    return cost


CONFIGS = {
    "parameter, even over a server": ParallelConfig.split_over(range(2), (1, 1), BATCH),
    "parameter, uneven over the cluster": ParallelConfig.split_over(range(8), (1, 1, 2, 2, 1, 1, 3, 3), BATCH),
    "tensor, uneven": ParallelConfig.split_over(range(3), (1, 1, 2), BATCH, kind="tensor"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_problem_in_bulk_equals_its_costs_one_at_a_time(decoder_ctx, name):
    ctx, cfg = decoder_ctx, CONFIGS[name]
    ch = _Chooser(ctx, split_table(ctx), cfg)
    unary, src, dst, pair = ch.problem()
    gi = ctx.index
    for o in range(gi.n_ops):
        assert unary[o].tolist() == [one_compute_cost(ch, o, k) for k in ch.allowed[o]]
    edges = [e for e, (u, v) in enumerate(zip(gi.e_src.tolist(), gi.e_dst.tolist())) if ch.anchor[v] != u]
    assert len(edges) > 100 and (src[:len(edges)], dst[:len(edges)]) == (gi.e_src[edges].tolist(),
                                                                         gi.e_dst[edges].tolist())
    collectives = 0
    for i, e in enumerate(edges):
        u, v = int(gi.e_src[e]), int(gi.e_dst[e])
        want = [[one_edge_cost(ch, e, ku, kv) for kv in ch.allowed[v]] for ku in ch.allowed[u]]
        assert pair[i].tolist() == want, f"edge {e}"
        collectives += sum(0.0 < x < FORBIDDEN for row in want for x in row)
    assert collectives > 0                 # some pairs move bytes: the test compares costs, not zeros


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_choice_per_edge_equals_its_edges_one_at_a_time(decoder_ctx, name):
    ctx, cfg = decoder_ctx, CONFIGS[name]
    choice = choose_shards(ctx, cfg)
    ch = _Chooser(ctx, split_table(ctx), cfg)
    gi = ctx.index
    assert (choice.option != REPLICATE).any()
    for e, (u, v) in enumerate(zip(gi.e_src.tolist(), gi.e_dst.tolist())):
        ku, kv = int(choice.option[u]), int(choice.option[v])
        pairs, _ = ch.placements(e, ku, kv)
        free = bool(gi.e_value_free[e])
        hs = [_cls(h) for h, _ in pairs] or [0]
        ns = [_cls(n) for _, n in pairs] or [3 if free else 0]
        assert Conversion(int(choice.conv[e])) == ch.edge_conv(e, ku, kv)
        assert bool(choice.copied[e]) == (not free and any(
            h == R and isinstance(n, Shard) and (n.dim > 0 or n.sf > 1) for h, n in pairs))
        assert int(choice.have[e]) == (2 if 2 in hs else 1 if 1 in hs else 0)
        assert int(choice.need[e]) == min(ns)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_choice_per_op_equals_its_ops_one_at_a_time(decoder_ctx, name):
    ctx, cfg = decoder_ctx, CONFIGS[name]
    choice = choose_shards(ctx, cfg)
    table = split_table(ctx)
    ch = _Chooser(ctx, table, cfg)
    divided = 0
    for o, op in enumerate(ctx.graph.ops):
        k = int(choice.option[o])
        assert choice.frac[o].tolist() == ch.option_frac(o, k).tolist()
        assert int(choice.original[o]) == (REPLICATE if k == REPLICATE else table.original[o][k])
        want = 0.0
        if k != REPLICATE:
            outs = table.options[o][k].outputs
            sizes = np.array(output_bytes(op))
            if len(sizes) == len(outs) and sizes.sum() > 0:
                want = float(sizes[[is_shard(p) for p in outs]].sum() / sizes.sum())
            elif table.options[o][k].kind != "partial" and outs and is_shard(outs[0]):
                want = 1.0
        assert float(choice.out_split[o]) == want, f"op {o}"
        divided += 0.0 < want < 1.0 or choice.frac[o].min() < 1.0
    assert divided > 0                     # some ops are divided: the test compares shares, not ones
