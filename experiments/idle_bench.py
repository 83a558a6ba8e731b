"""How much slower a CPU worker computes right after it was idle (docs/journal.md, "Compute after an idle
gap"): one process, one torch thread, a chain of small transformer-block ops (LayerNorm, Linear, ReLU,
Linear on a (16, 32, 64) activation, as in experiments/models/decoder_tied.py) run ``--ops`` times in a
row after sleeping ``gap`` ms; per gap, the median time of each position in the chain over ``--reps``
repetitions. A plan's worker waits for messages between its ops; the profile times ops back to back.

    python -m experiments.idle_bench [--gaps-ms 0,1,5,20] [--ops 30] [--reps 60] [--json]
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from experiments.args import parser


def measure(gaps_ms: list[float], ops: int = 30, reps: int = 60, warmup: int = 500) -> dict[float, list[float]]:
    """Per gap (ms): the median microseconds of the 1st, 2nd, ... op after the gap."""
    torch.manual_seed(0)
    x = torch.randn(16, 32, 64)
    norm, up, down = torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def step(y: torch.Tensor) -> torch.Tensor:
        return down(torch.relu(up(norm(y))))

    out = {}
    with torch.no_grad():
        for _ in range(warmup):
            step(x)
        for gap in gaps_ms:
            per = [[] for _ in range(ops)]
            for _ in range(reps):
                if gap > 0:
                    time.sleep(gap / 1e3)
                y = x
                for k in range(ops):
                    t0 = time.perf_counter()
                    y = step(y)
                    per[k].append(time.perf_counter() - t0)
            out[gap] = [statistics.median(p) * 1e6 for p in per]
    return out


def main(argv=None) -> None:
    p = parser("experiments.idle_bench", __doc__)
    p.add_argument("--gaps-ms", default="0,1,5,20")
    p.add_argument("--ops", type=int, default=30)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = measure([float(g) for g in a.gaps_ms.split(",")], a.ops, a.reps)
    finally:
        torch.set_num_threads(threads)
    if a.json:
        print(json.dumps({str(g): v for g, v in res.items()}, indent=1))
        return
    steady = statistics.median(res[min(res)][a.ops // 2:])
    for gap, med in res.items():
        extra = sum(max(m - steady, 0.0) for m in med[:a.ops // 2])
        print(f"gap {gap:5.1f} ms: first ops {' '.join(f'{m:5.0f}' for m in med[:8])} us ... last "
              f"{med[-1]:5.0f} us; excess over the first half {extra:6.0f} us")


if __name__ == "__main__":
    main()
