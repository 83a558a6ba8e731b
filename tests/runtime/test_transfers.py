"""A message's buffers held as the simulator counts them: each message matched to the transfer that carries it,
posted at that transfer's start and let go of by its sender at its end (``heterog.runtime.transfers``)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from heterog.cluster import load_cluster
from heterog.compiler.tasks import TaskKind
from heterog.evaluate import Evaluator
from heterog.runtime.api import prepare, resolve_strategy
from heterog.runtime.check import metered_dry_run
from heterog.runtime.instructions import Message, Post, Recv, Send, Sent, sources
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


class _Memory:
    def __init__(self, nbytes: list[int]) -> None:
        self.nbytes = nbytes

    def memory(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ptr = np.concatenate([[0], np.cumsum([1 if b else 0 for b in self.nbytes])])
        return ptr, np.zeros(int(ptr[-1]), dtype=np.int64), np.array([b for b in self.nbytes if b], dtype=np.int64)


def test_two_messages_of_one_producer_each_find_their_own_transfer() -> None:
    # task 0: the producer on device 0; 1: a transfer of its whole value to device 1 (48 B); 2: a re-layout
    # cut of it; 3: the transfer of the cut's piece to device 1 (24 B), later in the plan
    kind = np.array([TaskKind.COMPUTE, TaskKind.TRANSFER, TaskKind.RELAYOUT, TaskKind.TRANSFER])
    deps = [[], [0], [0], [2]]
    plan = SimpleNamespace(task_kind=kind, task_device=np.array([0, 1, 0, 1]), n_tasks=4,
                           dep_ptr=np.concatenate([[0], np.cumsum([len(d) for d in deps])]),
                           dep_idx=np.array([d for ds in deps for d in ds], dtype=np.int64),
                           tg=_Memory([48, 48, 0, 24]))
    whole = Message(0, 1, (0.0, 0, 1), (12,), torch.float32, 0)
    piece = Message(0, 1, (0.0, 0, 1), (6,), torch.float32, 1)
    assert transfer_tasks(plan, [whole, piece]) == [1, 3]      # not both on the direct transfer
    assert transfer_tasks(plan, [piece, whole]) == [3, 1]      # by bytes, whichever comes first
