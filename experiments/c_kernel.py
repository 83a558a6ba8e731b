"""The simulator's event loop as plain C against the numba kernel, on the same inputs on this machine: how
much speed the numba kernel leaves (docs/journal.md, "Simulator kernel against C"). Since the two now run
alike, the figures of ``python -m experiments.delta_bound`` are bounds at bare-C speed.

``experiments/c_kernel.c`` is ``simulator._kernel.simulate_kernel`` translated line by line; it gives
bit-identical results (tested where a C compiler is installed). The project never builds it: numba is its
compiler, and installing needs no C toolchain. This experiment compiles it with ``cc`` when there is one.

    python -m experiments.c_kernel [--tasks 50000] [--model bert_large --batch-size 48] [--repeats 15] [--json]
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.args import parser
from heterog.errors import HeterogError

SOURCE = Path(__file__).with_name("c_kernel.c")
BUILD_DIR = Path(".heterog-cache/c_kernel")
_F64 = ctypes.POINTER(ctypes.c_double)
_I64 = ctypes.POINTER(ctypes.c_int64)


def compiler() -> str | None:
    """Path of a C compiler (``cc`` or ``gcc``), or None."""
    return shutil.which("cc") or shutil.which("gcc")


def build(build_dir: Path = BUILD_DIR):
    """The C kernel as a ctypes function, compiled (``-O3 -march=native``) into ``build_dir`` once per
    source version; a HeterogError when no C compiler is installed or it fails."""
    cc = compiler()
    if cc is None:
        raise HeterogError("experiments.c_kernel needs a C compiler (cc or gcc) on PATH; none was found")
    src = SOURCE.read_bytes()
    lib = Path(build_dir) / f"c_kernel-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:        # write, then rename
            out = Path(tmp) / lib.name
            done = subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(out), str(SOURCE)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise HeterogError(f"{cc} failed on {SOURCE}:\n{done.stderr.strip()}")
            os.replace(out, lib)
    fn = ctypes.CDLL(str(lib)).simulate_kernel
    fn.restype = ctypes.c_int64
    fn.argtypes = ([ctypes.c_int64] + [_F64] * 3 + [_I64] * 10 + [ctypes.c_int64, _I64, ctypes.c_int64, ctypes.c_int]
                   + [_F64] * 4 + [_I64])
    return fn


def kernel_args(tg, priority: np.ndarray | None = None) -> tuple:
    """The arrays ``simulator.engine.simulate`` hands the numba kernel (fifo aside), in its order."""
    res_ptr, res_idx = tg.resources()
    dep_ptr, _ = tg.dependencies()
    mem_ptr, mem_res, mem_bytes = tg.memory()
    free_ptr, free_idx = tg.frees()
    succ_ptr, succ_idx = tg.successors()
    prio = tg.priority if priority is None else np.ascontiguousarray(priority, dtype=np.float64)
    return (tg.duration, tg.lag, prio, res_ptr, res_idx, dep_ptr, succ_ptr, succ_idx, mem_ptr, mem_res, mem_bytes,
            free_ptr, free_idx, tg.resident_bytes.copy())


def run_c(fn, args: tuple, fifo: bool) -> tuple:
    """The C kernel on ``kernel_args``: (start, finish, release_time, busy, peak, n_started), as the numba
    kernel returns them (output arrays allocated here, as the numba kernel allocates its own)."""
    (duration, lag, prio, res_ptr, res_idx, dep_ptr, succ_ptr, succ_idx, mem_ptr, mem_res, mem_bytes,
     free_ptr, free_idx, resident) = args
    f64 = [np.ascontiguousarray(a, dtype=np.float64) for a in (duration, lag, prio)]
    i64 = [np.ascontiguousarray(a, dtype=np.int64) for a in (res_ptr, res_idx, dep_ptr, succ_ptr, succ_idx, mem_ptr,
                                                             mem_res, mem_bytes, free_ptr, free_idx)]
    resident = np.ascontiguousarray(resident, dtype=np.int64)
    n, n_res = len(f64[0]), len(resident)
    start, finish, release, busy = np.empty(n), np.empty(n), np.empty(n), np.empty(n_res)
    peak = np.empty(n_res, dtype=np.int64)
    n_started = fn(n, *[a.ctypes.data_as(_F64) for a in f64], *[a.ctypes.data_as(_I64) for a in i64],
                   len(i64[-1]), resident.ctypes.data_as(_I64), n_res, int(bool(fifo)),
                   *[a.ctypes.data_as(_F64) for a in (start, finish, release, busy)], peak.ctypes.data_as(_I64))
    return start, finish, release, busy, peak, int(n_started)


def compare(fn, tg, fifo: bool, repeats: int = 15) -> dict:
    """Both kernels on ``tg``: equal outputs (asserted), and tasks per CPU-second of each (medians of
    ``repeats`` alternated runs, ``time.thread_time``) with C over numba."""
    from simulator import _kernel

    args = kernel_args(tg)
    ours = _kernel.simulate_kernel(*args, fifo)
    theirs = run_c(fn, args, fifo)
    if not (all(np.array_equal(a, b) for a, b in zip(ours[:5], theirs[:5])) and ours[5] == theirs[5]):
        raise AssertionError("the C kernel's schedule differs from the numba kernel's")
    times: dict[str, list[float]] = {"numba": [], "c": []}
    runs = (("numba", lambda: _kernel.simulate_kernel(*args, fifo)), ("c", lambda: run_c(fn, args, fifo)))
    for _ in range(repeats):
        for name, run in runs:
            t0 = time.thread_time()
            run()
            times[name].append(time.thread_time() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"tasks": tg.n_tasks, "fifo": fifo, "numba_tasks_per_s": tg.n_tasks / med["numba"],
            "c_tasks_per_s": tg.n_tasks / med["c"], "c_over_numba": med["numba"] / med["c"],
            "numba_ms": med["numba"] * 1e3, "c_ms": med["c"] * 1e3}


def main(argv=None) -> None:
    from simulator.bench import random_taskgraph

    p = parser("experiments.c_kernel", __doc__)
    p.add_argument("--tasks", type=int, default=50000, help="tasks of the simulator bench's random graph")
    p.add_argument("--model", default="bert_large", help="also a compiled plan of this graph ('' to skip)")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--cluster", default="paper-8gpu")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    fn = build()
    graphs = {f"random_taskgraph({a.tasks})": random_taskgraph(a.tasks, 8, 20, 0)}
    if a.model:
        from heterog.cluster import load_cluster
        from heterog.evaluate import Evaluator
        from heterog.graph.cache import capture_model

        ev = Evaluator(capture_model(a.model, a.batch_size), load_cluster(a.cluster))
        actions = np.random.default_rng(0).integers(0, ev.cluster.n_devices + 4, size=ev.n_groups)   # the bench's
        plan = ev.compile(ev.strategy(actions, "mixed"))
        graphs[f"{a.model} (batch {a.batch_size}) on {a.cluster}, mixed plan"] = plan.tg
    rows = [{"graph": name, **compare(fn, tg, fifo, a.repeats)}
            for name, tg in graphs.items() for fifo in (False, True)]
    out = {"load_average_1min": os.getloadavg()[0], "rows": rows}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"load average {out['load_average_1min']:.2f}; outputs identical in every case")
    for r in rows:
        print(f"{r['graph']:55s} fifo={r['fifo']!s:5s} numba {r['numba_tasks_per_s'] / 1e6:5.2f} M tasks/s  "
              f"C {r['c_tasks_per_s'] / 1e6:5.2f} M tasks/s  C/numba {r['c_over_numba']:.2f}")


if __name__ == "__main__":
    main()
