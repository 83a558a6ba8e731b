"""The profiler's benchmarks, run on the workers: link ping-pong and streaming, and AllReduce bursts."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from heterog.runtime.transport import _F64, NullStatus, Transport


@dataclass
class PingPongJob:
    """Link profiling: ``pairs`` of ranks bounce messages of each size ``repeats`` times; with ``stream``
    >= 2 they also send bursts of ``stream`` messages one way (see ``pingpong``)."""

    pairs: list[tuple[int, int]]
    sizes: list[int]
    repeats: int
    emulate: bool
    links: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)   # (lat, s/byte)
    name: str = "pingpong"
    stream: int = 0


@dataclass
class CollectiveJob:
    """Collective profiling: bursts of ``burst`` AllReduces of each size (bytes of float32) over each of
    ``groups``, ``repeats`` times; ``emulated_s[k][j]`` is the nominal time the emulation enforces for
    group k, size j.

    One AllReduce at a time (``burst`` 1) is the default: a plan's AllReduces start as their gradients
    become ready, apart from each other, so each pays a lone collective's latency, which back-to-back
    ones overlap. On local-cpu-2 (tiny_cnn, 8 plans, 12 rounds) the ev-ar plan was simulated 15-23%
    short with bursts of four, 6-16% with lone AllReduces; fidelity MAPE 9.7-12.9% -> 6.9-7.4%."""

    groups: list[tuple[int, ...]]
    sizes: list[int]
    repeats: int
    emulate: bool
    emulated_s: list[list[float]] = field(default_factory=list)
    burst: int = 1
    name: str = "collectives"


def pingpong(job: PingPongJob, rank: int, device: torch.device) -> dict[str, list[tuple[int, list[float]]]]:
    """One-way times (half round trips) per (pair, size) through the runtime's transport, under the key
    ``"a->b"``. Sizes are interleaved within each repeat, so that a change of machine load affects all
    sizes alike.

    With ``job.stream = K >= 2``, also the time a message holds the link when messages follow each other
    (key ``"stream:a->b"``): a sends a burst of K messages, then a single one, each burst answered by a
    1-byte acknowledgement once all of it has arrived; ``(T_K - T_1) / (K - 1)`` is the time each further
    message adds, paired within the repeat so that the acknowledgement and the wake-up cancel out."""
    tr = Transport(device, job.emulate, NullStatus(), rank)
    out: dict[str, list[tuple[int, list[float]]]] = {}
    tag = 0
    bursts = (job.stream, 1) if job.stream >= 2 else ()
    ack = torch.zeros(1, dtype=torch.uint8, device=device)

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        tr.flush()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for a, b in job.pairs:
        dist.barrier()
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        lat, spb = job.links.get((rank, peer), (0.0, 0.0))
        payload = {size: torch.zeros(size, dtype=torch.uint8, device=device) for size in job.sizes}
        samples: dict[int, list[float]] = {size: [] for size in job.sizes}
        gaps: dict[int, list[float]] = {size: [] for size in job.sizes}
        for rep in range(job.repeats + 1):            # the first round warms up
            for size, x in payload.items():
                if rank == a:
                    def bounce(x: torch.Tensor = x, tag: int = tag) -> None:
                        tr.post(tag + 1, peer, (size,), torch.uint8)
                        tr.send(x, peer, tag, lat, spb)
                        tr.take(tag + 1)
                    t = timed(bounce)
                    if rep:
                        samples[size].append(t / 2)
                else:
                    tr.post(tag, peer, (size,), torch.uint8)
                    tr.take(tag)
                    tr.send(x, peer, tag + 1, lat, spb)
                    tr.flush()
                tag += 2
                took: dict[int, float] = {}
                for k in bursts:
                    if rank == a:
                        def burst(x: torch.Tensor = x, tag: int = tag, k: int = k) -> None:
                            tr.post(tag + k, peer, (1,), torch.uint8)
                            for i in range(k):
                                tr.send(x, peer, tag + i, lat, spb)
                            tr.take(tag + k)
                        took[k] = timed(burst)
                    else:
                        for i in range(k):
                            tr.post(tag + i, peer, (size,), torch.uint8)
                        for i in range(k):
                            tr.take(tag + i)
                        tr.send(ack, peer, tag + k, lat, spb)
                        tr.flush()
                    tag += k + 1
                if rep and bursts and rank == a:
                    gaps[size].append((took[job.stream] - took[1]) / (job.stream - 1))
        if rank == a:
            out[f"{a}->{b}"] = [(size, samples[size]) for size in job.sizes]
            if bursts:
                out[f"stream:{a}->{b}"] = [(size, gaps[size]) for size in job.sizes]
    return out


def collectives(job: CollectiveJob, rank: int, device: torch.device) -> dict[str, list[tuple[int, list[float]]]]:
    """Times of AllReduce through the runtime's transport per (group, size), as a plan's step uses it: a
    burst of ``job.burst`` (default one) started back to back, then waited for; a sample is the burst's
    time over its length, i.e. how long each holds the group. Each burst starts
    after a barrier of the group and is timed by the slowest member. Sizes are interleaved."""
    tr = Transport(device, job.emulate, NullStatus(), rank)
    handles = [dist.new_group(list(g)) for g in job.groups]
    out: dict[str, list[tuple[int, list[float]]]] = {}
    try:
        for k, (members, group) in enumerate(zip(job.groups, handles)):
            dist.barrier()
            if rank not in members:
                continue
            ranks = list(members)
            payload = {size: torch.zeros(max(1, size // 4), dtype=torch.float32, device=device) for size in job.sizes}
            samples: dict[int, list[float]] = {size: [] for size in job.sizes}
            emulated = job.emulated_s[k] if job.emulated_s else [0.0] * len(job.sizes)
            for rep in range(job.repeats + 1):           # the first round warms up
                for j, (size, x) in enumerate(payload.items()):
                    dist.barrier(group=group)
                    xs = [x.clone() for _ in range(job.burst)]
                    t0 = time.perf_counter()
                    for p in [tr.allreduce(y, k, group, ranks, rank, emulated[j]) for y in xs]:
                        tr.finish(p)
                    tr.flush()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    took = torch.tensor([(time.perf_counter() - t0) / job.burst], dtype=_F64, device=device)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
                    if rep:
                        samples[size].append(float(took.item()))
            if rank == ranks[0]:
                out[",".join(str(m) for m in ranks)] = [(size, samples[size]) for size in job.sizes]
    finally:
        for g in handles:
            dist.destroy_process_group(g)
    return out


# ---------------------------------------------------------------------------- process entry
