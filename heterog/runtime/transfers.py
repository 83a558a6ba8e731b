"""When a message's and a collective's buffers are held, from the simulated schedule: the receiver posts its
receive buffer when the simulated transfer starts and the sender lets go of what it sent when the transfer
ends (``Post``, ``Sent``), and a rank finishes a collective when the plan's collective ends (``Finish``), which
is what the simulator counts (``heterog.compiler.memory``: a transfer allocates the value it brings at its
start and a collective lands its result at its end; what either reads is released when it ends); and a
value re-laid out from messages is put together where the plan's join of it starts (``joins_at``).

A message (``Message``: sender, receiver, the key after its producer) is matched to the compiled plan's
transfer that carries it: a TRANSFER or PUSH task to the receiver that depends on the producer's task (the
task of the message's key) directly or through a re-layout or landing; among several, one not yet used
first, then one of the message's bytes, then a direct one, then the lowest task id.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.tasks import TaskKind
from heterog.runtime.instructions import (
    AllGather,
    AllReduce,
    AllToAll,
    Assemble,
    Finish,
    Instruction,
    Post,
    Recv,
    ReduceScatter,
    Sent,
    Stash,
    sources,
)

if TYPE_CHECKING:  # pragma: no cover
    from heterog.compiler import CompiledPlan
    from heterog.runtime.instructions import Message

_MOVES = (int(TaskKind.TRANSFER), int(TaskKind.PUSH))
_COLLECTIVES = (int(TaskKind.COLLECTIVE), int(TaskKind.ALLREDUCE))
_VIA = (int(TaskKind.RELAYOUT), int(TaskKind.CONCAT))


def _successors(plan: CompiledPlan) -> dict[int, list[int]]:
    succ: dict[int, list[int]] = defaultdict(list)
    deps = np.diff(plan.dep_ptr)
    for t, d in zip(np.repeat(np.arange(plan.n_tasks), deps).tolist(), plan.dep_idx.tolist()):
        succ[int(d)].append(int(t))
    return succ


def transfer_tasks(plan: CompiledPlan, messages: Sequence[Message],
                   succ: dict[int, list[int]] | None = None) -> list[int]:
    """Per message, the task of the plan that carries it (-1: none found)."""
    kind, dev = plan.task_kind, plan.task_device
    succ = _successors(plan) if succ is None else succ
    mem_ptr, _, mem_bytes = plan.tg.memory()
    nbytes = np.add.reduceat(np.append(mem_bytes, 0), mem_ptr[:-1]) * (np.diff(mem_ptr) > 0)
    used: set[int] = set()
    out = []
    for msg in messages:
        p = int(msg.key[1]) if len(msg.key) > 1 and isinstance(msg.key[1], (int, np.integer)) else -1
        if not 0 <= p < plan.n_tasks:
            out.append(-1)
            continue
        near = {t for t in succ[p] if kind[t] in _MOVES and dev[t] == msg.dst}
        cand = near | {t for u in succ[p] if kind[u] in _VIA for t in succ[u] if kind[t] in _MOVES
                       and dev[t] == msg.dst}
        if not cand:
            out.append(-1)
            continue
        best = min(cand, key=lambda t: (t in used, int(nbytes[t]) != msg.nbytes, t not in near, t))
        used.add(best)
        out.append(best)
    return out


def buffer_keys(plan: CompiledPlan, start: np.ndarray, finish: np.ndarray | None, messages: Sequence[Message],
                items: Sequence[Sequence[list]], in_order: bool, carried: Sequence[int]
                ) -> tuple[list[tuple], list[tuple | None]]:
    """Per message (``messages``, tagged; ``items``: per rank its [key, seq, instruction], messages named by
    their index in ``messages``; ``finish``: the simulated end of each task, None: none known): the key at which
    the receiver posts its receive (the transfer's start; its send's key where no transfer is found, where
    ``finish`` is None, or where that would not come before the take) and the key at which the sender lets go
    of it (the transfer's end; None where no transfer is found or ``finish`` is None). ``in_order`` (NCCL, which
    matches a pair's messages in order, not by tag): a receive is posted no later than any later message of
    its pair."""
    if finish is None:
        return [msg.key for msg in messages], [None] * len(messages)
    take_key: dict[int, tuple] = {}
    for rank_items in items:
        for key, _, ins in rank_items:
            for src in sources(ins):
                if isinstance(src, Recv) and (src.tag not in take_key or key < take_key[src.tag]):
                    take_key[src.tag] = key
    post: list[tuple] = []
    sent: list[tuple | None] = []
    for i, (msg, t) in enumerate(zip(messages, carried)):
        at = (float(start[t]), t, -2) if t >= 0 else msg.key
        take = take_key.get(i)
        post.append(at if msg.key < at and (take is None or at < take) else msg.key)
        end = (float(finish[t]), t, 2) if t >= 0 else None
        sent.append(end if end is not None and msg.key < end else None)
    if in_order:                      # a post no later than those of the pair's later messages
        later: dict[tuple[int, int], tuple] = {}
        for i in sorted(range(len(messages)), key=lambda i: messages[i].tag, reverse=True):
            pair = (messages[i].src, messages[i].dst)
            if pair in later and later[pair] < post[i]:
                post[i] = later[pair]
            later[pair] = post[i]
    return post, sent


def finishes(plan: CompiledPlan, finish: np.ndarray | None, items: Sequence[Sequence[list]]
             ) -> list[tuple[int, tuple, Finish]]:
    """(rank, key, instruction) of a ``Finish`` per collective a rank starts (``items``: per rank its [key, seq,
    instruction]) whose simulated collective ends before the rank first reads its result: the collective of
    the plan that the instruction's key names (an AllReduce of partial results) or that follows the task it
    names (the producer of the contribution), the earliest to end; the rank then holds the result from that
    end, as the simulator does, not the contribution until the result is first read."""
    if finish is None:
        return []
    kind = plan.task_kind
    after: dict[int, list[int]] = defaultdict(list)
    coll = np.nonzero(np.isin(kind, _COLLECTIVES))[0]
    for c in coll.tolist():
        after[c].append(c)
        for d in plan.dep_idx[plan.dep_ptr[c]:plan.dep_ptr[c + 1]].tolist():
            after[int(d)].append(c)
    out = []
    for r, rank_items in enumerate(items):
        first: dict[tuple, tuple] = {}
        for key, _, ins in rank_items:
            for src in sources(ins):
                if isinstance(src, Stash) and (src.key not in first or key < first[src.key]):
                    first[src.key] = key
        for key, _, ins in rank_items:
            if not isinstance(ins, (AllReduce, AllGather, ReduceScatter, AllToAll)) or len(key) < 2:
                continue
            cand = after.get(int(key[1]), []) if isinstance(key[1], (int, np.integer)) else []
            if not cand:
                continue
            c = min(cand, key=lambda c: (float(finish[c]), c))
            end = (float(finish[c]), c, 2)
            if key < end and (ins.key not in first or end < first[ins.key]):
                out.append((r, end, Finish(ins.key)))
    return out


def joins_at(plan: CompiledPlan, start: np.ndarray, items: Sequence[Sequence[list]], succ: dict[int, list[int]],
             carried: Sequence[int]) -> None:
    """Each value re-laid out from messages (an ``Assemble`` of a ``("r", ...)`` key with received pieces, the
    others this rank's own values) keyed no later than the start of the plan's join of it on its rank's
    device (the one RELAYOUT or CONCAT task after the transfers that carry its pieces), where the simulator
    allocates it, rather than before its first reader (``items``: per rank its [key, seq, instruction],
    messages named by their index; ``succ``: each task's dependents; ``carried``: each message's transfer,
    ``transfer_tasks``)."""
    for r, rank_items in enumerate(items):
        for item in rank_items:
            ins = item[2]
            if not isinstance(ins, Assemble) or ins.key[0] != "r" or \
                    any(isinstance(p.source, Stash) for p in ins.pieces):
                continue
            moved = [carried[p.source.tag] for p in ins.pieces if isinstance(p.source, Recv)]
            joins = {u for t in moved if t >= 0 for u in succ[t]
                     if plan.task_kind[u] in _VIA and plan.task_device[u] == r}
            if moved and len(joins) == 1:
                u = joins.pop()
                item[0] = min(item[0], (float(start[u]), u, -1))


def held_until(plan: CompiledPlan, start: np.ndarray, finish: np.ndarray | None, messages: Sequence[Message],
               items: Sequence[Sequence[list]], post: bool, in_order: bool) -> list[tuple[int, tuple, Instruction]]:
    """(rank, key, instruction) of the ``Post`` of each message (``post``: in the step), the ``Sent`` of each
    message whose transfer is found and the ``Finish`` of each collective (``buffer_keys``, ``finishes``), the
    values re-laid out from messages keyed at their joins first (``joins_at``, in ``items``). The posts come
    in tag order, so that posts given one key (a pair's, moved forward together) run in it."""
    succ = _successors(plan)
    carried = transfer_tasks(plan, messages, succ)
    joins_at(plan, start, items, succ, carried)
    posts, ends = buffer_keys(plan, start, finish, messages, items, in_order, carried)
    out: list[tuple[int, tuple, Instruction]] = [
        (m.dst, at, Post(m.tag)) for m, at in sorted(zip(messages, posts), key=lambda ma: ma[0].tag)] if post else []
    out += [(m.src, end, Sent(m.tag)) for m, end in zip(messages, ends) if end is not None]
    return out + finishes(plan, finish, items)
