"""A message's buffers held as the simulator counts them: each message matched to the transfer that carries it,
posted at that transfer's start and let go of by its sender at its end (``heterog.runtime.transfers``)."""
from __future__ import annotations

from heterog.cluster import load_cluster
from heterog.compiler.tasks import TaskKind
from heterog.evaluate import Evaluator
from heterog.runtime.api import prepare, resolve_strategy
from heterog.runtime.check import metered_dry_run
from heterog.runtime.instructions import Post, Recv, Send, Sent, sources
from heterog.runtime.transfers import transfer_tasks
from tests.runtime.conftest import model


def test_each_message_is_posted_at_its_transfers_start_and_let_go_of_at_its_end() -> None:
    m = model("tiny_mlp")
    cluster = load_cluster("local-cpu-3")
    strategy = resolve_strategy(m, cluster, method="cp-ps")
    prepared = prepare(m, cluster, strategy)
    ev = Evaluator(m.graph, cluster)
    plan = ev.compile(strategy)
    sim = ev.simulate_plan(plan)
    low = prepared.lowered
    tasks = transfer_tasks(plan, low.messages)
    assert low.messages and min(tasks) >= 0                       # every message has its transfer
    for msg, t in zip(low.messages, tasks):
        assert plan.task_kind[t] in (TaskKind.TRANSFER, TaskKind.PUSH) and plan.task_device[t] == msg.dst
        assert msg.nbytes == int(plan.tg.memory()[2][plan.tg.memory()[0][t]])   # the bytes the transfer brings
        dst, src = low.ranks[msg.dst], low.ranks[msg.src]
        post = next(k for k, ins in zip(dst.keys, dst.instrs) if isinstance(ins, Post) and ins.tag == msg.tag)
        take = min(k for k, ins in zip(dst.keys, dst.instrs) if Recv(msg.tag) in sources(ins))
        send = next(k for k, ins in zip(src.keys, src.instrs) if isinstance(ins, Send) and ins.tag == msg.tag)
        sent = next(k for k, ins in zip(src.keys, src.instrs) if isinstance(ins, Sent) and ins.tag == msg.tag)
        assert post == (float(sim.start[t]), t, -2) and send < post < take
        assert sent == (float(sim.finish[t]), t, 2) and send < sent
    # the dry run meters what each rank holds: within a few bytes of the simulated peaks (scalars)
    for (peak, _), name in zip(metered_dry_run(prepared), cluster.device_names):
        assert abs(peak - prepared.simulated_peak_memory_bytes[name]) <= 16
