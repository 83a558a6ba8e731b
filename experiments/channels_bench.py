"""Crossing sends on one gloo pair vs one process group per direction (``heterog.runtime.executor.p2p_channels``).

Two processes send ``messages`` 4 KB messages to each other at once, with a little compute in between,
``steps`` times; prints per-send times (median, mean, p99, max) and per-step times for both layouts.
Run: ``python -m experiments.channels_bench [--steps N] [--messages K]``.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np


def _worker(rank: int, per_direction: bool, steps: int, messages: int, port: int, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    send_g = recv_g = None
    if per_direction:
        g01, g10 = dist.new_group([0, 1]), dist.new_group([0, 1])
        send_g, recv_g = (g01, g10) if rank == 0 else (g10, g01)
    x, msg = torch.randn(256, 256), torch.randn(1024)
    sends, step_times = [], []
    for _ in range(steps):
        bufs = [torch.empty(1024) for _ in range(messages)]
        recvs = [dist.irecv(b, src=peer, tag=k, group=recv_g) for k, b in enumerate(bufs)]
        dist.barrier()
        t0 = time.perf_counter()
        works = []
        for k in range(messages):
            a = time.perf_counter()
            works.append(dist.isend(msg, dst=peer, tag=k, group=send_g))
            sends.append(time.perf_counter() - a)
            x @ x
        for w in recvs + works:
            w.wait()
        step_times.append(time.perf_counter() - t0)
    q.put((rank, np.array(sends) * 1e3, np.array(step_times) * 1e3))
    dist.destroy_process_group()


def measure(per_direction: bool, steps: int = 300, messages: int = 5, port: int = 29531) -> dict:
    """Per-send and per-step milliseconds of both ranks pooled."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, per_direction, steps, messages, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = [q.get() for _ in procs]
    for p in procs:
        p.join()
    sends = np.concatenate([o[1] for o in out])
    step_ms = np.concatenate([o[2] for o in out])
    return {"send_median_ms": float(np.median(sends)), "send_mean_ms": float(sends.mean()),
            "send_p99_ms": float(np.percentile(sends, 99)), "send_max_ms": float(sends.max()),
            "step_mean_ms": float(step_ms.mean())}


def main(argv: list[str] | None = None) -> int:
    from experiments.args import parser

    ap = parser("experiments.channels_bench", __doc__)
    ap.add_argument("--steps", type=int, default=300, help="steps per layout and round")
    ap.add_argument("--messages", type=int, default=5, help="messages each way per step")
    ap.add_argument("--port", type=int, default=29531, help="first rendezvous port (one per round)")
    args = ap.parse_args(argv)
    for i, per_direction in enumerate((False, True, False, True)):
        r = measure(per_direction, args.steps, args.messages, port=args.port + i)
        print(("per direction" if per_direction else "one pair     "),
              " ".join(f"{k} {v:.3f}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
