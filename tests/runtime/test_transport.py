"""The runtime's CPU transport: the AllReduce (a direct exchange of point-to-point messages) gives every
member the same bits, the sum in member order, also with collectives of overlapping groups in flight
together; every direction between two ranks has a channel (gloo process group) of its own."""
from __future__ import annotations

import torch
import torch.distributed as dist

GROUPS = [(0, 1, 2), (0, 2), (1, 2)]
ROUNDS = 3


def _contribution(rank: int, group: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * group + k)
    return torch.randn(257, generator=g) * 10 ** (rank - 1)        # magnitudes differ: order matters


class _AllReduceJob:
    """Runs on every rank of the pool (picklable): starts ``ROUNDS`` AllReduces on each of its groups,
    interleaved, finishes them in reverse order and returns ``{(group, round): sum}``."""

    def __init__(self, emulate: bool) -> None:
        self.emulate = emulate

    def __call__(self, rank: int, device) -> dict:
        from heterog.runtime.transport import NullStatus, Transport

        handles = [dist.new_group(list(g)) for g in GROUPS]
        tr = Transport(device, self.emulate, NullStatus(), rank)
        out = {}
        try:
            pending = [((gi, k), tr.allreduce(_contribution(rank, gi, k), gi, handles[gi], list(members), rank, 0.0))
                       for k in range(ROUNDS) for gi, members in enumerate(GROUPS) if rank in members]
            for key, p in reversed(pending):
                out[key] = tr.finish(p).clone()
            tr.flush()
        finally:
            for h in handles:
                dist.destroy_process_group(h)
        return out


def test_cpu_allreduce_gives_every_member_the_same_sum_in_member_order(pool3) -> None:
    for emulate in (False, True):
        results = pool3.run([_AllReduceJob(emulate)] * 3)
        for gi, members in enumerate(GROUPS):
            for k in range(ROUNDS):
                want = _contribution(members[0], gi, k)
                for m in members[1:]:
                    want = want + _contribution(m, gi, k)
                for m in members:
                    got = results[m][(gi, k)]
                    assert torch.equal(got, want), (emulate, gi, k, m)
                for r in set(range(3)) - set(members):
                    assert (gi, k) not in results[r]


def test_emulated_message_frame_keeps_the_payload_aligned() -> None:
    from heterog.runtime.transport import _HEADER_BYTES, _frame, _unframe

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    msg = _frame(12.5, t)
    assert msg.dtype == torch.uint8 and msg.numel() == _HEADER_BYTES + 48
    buf = torch.empty_like(msg)                  # a fresh receive buffer, as ``Transport.post`` makes
    buf.copy_(msg)
    stamp, payload = _unframe(buf, (3, 4), torch.float32)
    assert stamp == 12.5 and torch.equal(payload, t)
    assert payload.data_ptr() % 64 == 0 and payload.data_ptr() == buf.data_ptr() + _HEADER_BYTES
    stamp, empty = _unframe(_frame(3.0, torch.empty(0, 5)), (0, 5), torch.float32)
    assert stamp == 3.0 and empty.shape == (0, 5)
    one = torch.full((1,), 2.5).as_strided((1, 1), (0, 0))      # one sample of an expanded value: stride 0
    assert one.is_contiguous()
    stamp, payload = _unframe(_frame(1.0, one), (1, 1), torch.float32)
    assert stamp == 1.0 and torch.equal(payload, one)


def test_an_emulated_payload_is_held_alone_by_its_receiver() -> None:
    """The payload is no view of the receive buffer: once the buffer is dropped the receiver may write into
    it (a PS adds its workers' gradients into the first one it holds), as into a message received unframed."""
    from heterog.runtime.memory import exclusive
    from heterog.runtime.transport import _HEADER_BYTES, _frame, _unframe

    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        t = torch.arange(12).to(dtype).reshape(3, 4)
        buf = _frame(0.5, t)
        _, payload = _unframe(buf, (3, 4), dtype)
        assert payload._base is None and not exclusive(payload)         # the buffer still holds the storage
        del buf
        assert exclusive(payload) and torch.equal(payload, t)
        assert payload.untyped_storage().nbytes() == _HEADER_BYTES + 12 * dtype.itemsize


class _ChannelJob:
    """Runs on every rank: the members of each channel this rank belongs to, whether a second call
    returns the same channels, and what a crossing exchange delivers (every rank sends to every other
    at once; the tag names the sender)."""

    def __call__(self, rank: int, device) -> dict:
        from heterog.runtime.transport import NullStatus, Transport, p2p_channels

        channels = p2p_channels(device)
        members = {pair: dist.get_process_group_ranks(g) for pair, g in channels.items() if rank in pair}
        tr = Transport(device, False, NullStatus(), rank)
        peers = [r for r in range(dist.get_world_size()) if r != rank]
        for src in peers:
            tr.post(100 + src, src, (3,), torch.float32)
        for dst in peers:
            tr.send(torch.full((3,), 10.0 * rank + dst), dst, 100 + rank, 0.0, 0.0)
        got = {src: tr.take(100 + src).tolist() for src in peers}
        tr.flush()
        return {"pairs": sorted(channels), "members": members, "same": p2p_channels(device) is channels,
                "got": got}


def test_every_direction_has_its_own_channel(pool3) -> None:
    results = pool3.run([_ChannelJob()] * 3)
    want_pairs = [(a, b) for a in range(3) for b in range(3) if a != b]
    for rank, res in enumerate(results):
        assert res["pairs"] == want_pairs
        assert res["same"]
        assert res["members"] == {(a, b): [min(a, b), max(a, b)] for a, b in want_pairs if rank in (a, b)}
        assert res["got"] == {src: [10.0 * src + rank] * 3 for src in range(3) if src != rank}


def test_a_rank_waiting_for_its_message_to_be_delivered_names_the_receiver() -> None:
    """A ``Sent`` waits for the receiver to take the message: the rank's status names that peer meanwhile, so
    that a hung receiver is the one blamed, not the sender stuck behind it (a rank shown computing was named
    the culprit when its peer was stopped)."""
    from heterog.runtime.transport import Status, Transport

    shared = [0] * 6
    seen = []

    class Work:
        def wait(self) -> None:
            seen.append(shared[2])

    tr = Transport(torch.device("cpu"), False, Status(shared, 0), 0)
    t = torch.zeros(3)
    tr.messages_out[7] = [(Work(), t, t, 1)]
    shared[2] = -1
    tr.release(7)
    assert seen == [1] and shared[2] == -1 and 7 not in tr.messages_out
