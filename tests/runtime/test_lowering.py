"""Per-rank programs: simulated order, matched messages, collectives in the same order on every member,
and deadlock freedom (an abstract execution of all ranks always completes)."""
from __future__ import annotations

import numpy as np
import pytest

from heterog.evaluate import Evaluator
from heterog.runtime import prepare
from heterog.runtime.instructions import (
    AllGather,
    AllReduce,
    AllToAll,
    Compute,
    Post,
    Recv,
    ReduceScatter,
    Send,
    Stash,
    sources,
)
from tests.runtime.conftest import model
from tests.runtime.test_equivalence import make_strategy

COLLECTIVES = (AllReduce, AllGather, ReduceScatter, AllToAll)


def _programs(name: str, plan: str, cluster, backend: str = "gloo"):
    m = model(name)
    prepared = prepare(m, cluster, make_strategy(plan, m, cluster), backend=backend)
    return m, prepared


def _abstract_run(ranks, post_early: bool) -> bool:
    """Step the ranks in any order: a receive blocks until its send ran (and, for NCCL, until posted), a
    collective's result (allreduce, allgather) blocks until every member started it. True when every rank
    finishes."""
    sent, arrived = set(), {}
    posted: set[int] = set()
    pc = [0] * len(ranks)
    members = {}
    for rp in ranks:
        for ins in rp.instrs:
            if isinstance(ins, COLLECTIVES):
                members.setdefault(ins.key, set()).add(rp.rank)

    def ready(r, ins) -> bool:
        for src in sources(ins):
            if isinstance(src, Recv) and (src.tag not in sent or (post_early and src.tag not in posted)):
                return False
            if (isinstance(src, Stash) and src.key in members and arrived.get(src.key, set()) != members[src.key]
                    and any(isinstance(i, COLLECTIVES) and i.key == src.key for i in ranks[r].instrs)):
                return False
        return True

    progress = True
    while progress:
        progress = False
        for r, rp in enumerate(ranks):
            while pc[r] < len(rp.instrs) and ready(r, rp.instrs[pc[r]]):
                ins = rp.instrs[pc[r]]
                if isinstance(ins, Send):
                    sent.add(ins.tag)
                elif isinstance(ins, Post):
                    posted.add(ins.tag)
                elif isinstance(ins, COLLECTIVES):
                    arrived.setdefault(ins.key, set()).add(r)
                pc[r] += 1
                progress = True
    return all(pc[r] == len(rp.instrs) for r, rp in enumerate(ranks))


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("name,plan", [("tiny_transformer", "random"), ("tiny_transformer", "phase-mixed"),
                                       ("tiny_cnn", "all-mp"), ("tiny_mlp", "cp-ps")])
def test_programs_follow_the_simulated_order_and_cannot_deadlock(name, plan, backend, hetero3) -> None:
    m, prepared = _programs(name, plan, hetero3, backend=backend)
    low = prepared.lowered
    ev = Evaluator(m.graph, hetero3)
    res = ev.simulate_plan(ev.compile(prepared.strategy))
    for rp in low.ranks:
        assert rp.keys == sorted(rp.keys)
        starts = [k[0] for ins, k in zip(rp.instrs, rp.keys) if isinstance(ins, Compute)]
        assert starts == sorted(starts)            # compute in simulated start order
    # each message: one send (on its source, before any use on its destination) and one receive
    sends = {ins.tag: (rp.rank, k) for rp in low.ranks for ins, k in zip(rp.instrs, rp.keys)
             if isinstance(ins, Send)}
    uses = {}
    for rp in low.ranks:
        for ins, k in zip(rp.instrs, rp.keys):
            for src in sources(ins):
                if isinstance(src, Recv):
                    assert src.tag not in uses, "a message is consumed twice"
                    uses[src.tag] = (rp.rank, k)
    assert set(sends) == set(uses) == {msg.tag for msg in low.messages}
    for tag, (r, k) in uses.items():
        assert sends[tag][1] < k
        assert (tag, sends[tag][0]) in {(t, s) for t, s, *_ in low.ranks[r].recvs}
    # collectives: same order on every member
    for g, devs in enumerate(low.groups):
        seqs = [[ins.key for ins in low.ranks[d].instrs if isinstance(ins, COLLECTIVES) and ins.group == g]
                for d in devs]
        assert all(s == seqs[0] for s in seqs)
    assert _abstract_run(low.ranks, post_early=backend == "nccl")
    assert res.makespan == pytest.approx(prepared.simulated_iteration_time_s)


def test_nccl_programs_post_receives_in_message_order(hetero3) -> None:
    _, prepared = _programs("tiny_mlp", "random", hetero3, backend="nccl")
    low = prepared.lowered
    assert not prepared.emulate
    for rp in low.ranks:
        posts = [ins.tag for ins in rp.instrs if isinstance(ins, Post)]
        assert sorted(posts) == [t for t, *_ in rp.recvs]
        by_src: dict = {}
        for tag, src, *_ in rp.recvs:
            by_src.setdefault(src, []).append(tag)
        for src, tags in by_src.items():     # per pair, posted in the order the sender sends
            assert [t for t in posts if t in set(tags)] == sorted(tags)
    assert _abstract_run(low.ranks, post_early=True)


def test_parameters_live_where_the_plan_puts_them(hetero3) -> None:
    m, prepared = _programs("tiny_mlp", "cp-ps", hetero3)
    ps = set(prepared.lowered.ranks[0].persist) | set(prepared.lowered.ranks[1].persist) | \
        set(prepared.lowered.ranks[2].persist)
    held = [set(r.persist) for r in prepared.lowered.ranks]
    assert sum(len(h) for h in held) == len(ps), "PS: each parameter and its state live on its PS device only"
    assert ps == set(m.prog.placeholders[:len(m.params)])
    _, ar = _programs("tiny_mlp", "ev-ar", hetero3)
    assert all(set(r.persist) == ps for r in ar.lowered.ranks), "AllReduce: every replica holds the parameters"
    inputs = {r.rank: [(lo, hi) for _, i, lo, hi in r.inputs if i == 0] for r in prepared.lowered.ranks}
    assert inputs == {0: [(0, 3)], 1: [(3, 5)], 2: [(5, 6)]}       # proportional shares 3, 2, 1
    assert np.isfinite(prepared.simulated_iteration_time_s)


def test_strategies_planned_on_the_cached_graph_fit_the_runtime_model(hetero3, tmp_path) -> None:
    """`heterog plan` plans on `capture_model` graphs; `heterog run` captures the model itself: same graph."""
    from heterog import baselines
    from heterog.graph.cache import capture_model

    cached = capture_model("tiny_mlp", 6, cache_dir=tmp_path)
    m = model("tiny_mlp")
    assert cached.fingerprint == m.graph.fingerprint
    prepared = prepare(m, hetero3, baselines.run("cp-ar", cached, hetero3))
    assert prepared.lowered.n_allreduce > 0
