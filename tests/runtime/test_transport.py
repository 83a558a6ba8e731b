"""The runtime's CPU AllReduce (a direct exchange of point-to-point messages): every member gets the
same bits, the sum in member order, also with collectives of overlapping groups in flight together."""
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
        from heterog.runtime.executor import Transport, _NullStatus

        handles = [dist.new_group(list(g)) for g in GROUPS]
        tr = Transport(device, self.emulate, _NullStatus())
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
