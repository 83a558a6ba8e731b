"""Simulated against measured peak memory per device (docs/results.md, "Memory fidelity"): models trained for
real on local CPU workers under every plan kind, each worker's peak of the bytes it holds
(``heterog.runtime.memory.LiveBytes``) beside the simulator's peak for the same plan.

    python -m experiments.memory_fidelity --models tiny_mlp:6,tiny_transformer:6 \\
        [--plans single,ev-ar,cp-ps,split,micro,recompute,zero1,zero2,zero3,offload,random:0]
        [--clusters local-cpu-2,local-cpu-3] [--optimizer adam] [--metered] [--json]

A model is a zoo name or ``file.py:build`` with its batch after the last colon. Plan kinds: ``single`` (one
device), ``ev-ar``, ``cp-ps`` (the baselines), ``split`` (every group divided along parameters over every
device, even), ``micro`` (ev-ar over 3 micro-batches, 1F1B), ``recompute`` (ev-ar by layers, every layer that
can recomputed), ``zero1``-``zero3`` (ev-ar with every group's state in shards of even weights at that stage),
``offload`` (ev-ar, stage 2, optimizer state on the host), ``random:SEED``. The clusters get a host side
(``host=Xeon-Gold-6148``) so that plans may offload. Per (model, plan, cluster, device): measured and
simulated bytes and their relative error (simulated - measured) / measured, and how the bytes were measured:
``workers`` (trained for real, 2 steps, one worker per device) or, with ``--metered``, ``metered`` (each rank's
program run once in this process and metered as its worker meters it: ``heterog.runtime.check.metered_dry_run``,
exact for every plan without a parameter server; plans with one are still trained by the workers, which hold
besides the 64-byte headers of the emulated messages they receive).
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np

from experiments.args import parser, print_rows
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

PLANS = ("single", "ev-ar", "cp-ps", "split", "micro", "recompute", "zero1", "zero2", "zero3", "offload", "random:0")
HOST = "Xeon-Gold-6148"


def model_spec(spec: str) -> tuple[str, int]:
    """``"tiny_mlp:6"`` or ``"path/to/file.py:build:6"`` -> (model reference, batch)."""
    ref, _, batch = spec.strip().rpartition(":")
    if not ref or not batch.isdigit() or int(batch) < 1:
        raise HeterogError(f"model {spec!r} must be MODEL:BATCH (a zoo name or file.py:build, then the batch)")
    return ref, int(batch)


def strategy_of(kind: str, m, cluster):
    """The plan of kind ``kind`` (module docstring) for captured model ``m`` on ``cluster``."""
    from heterog import baselines
    from heterog.baselines.expert import op_layers
    from heterog.compiler.place import recomputed_ops
    from heterog.evaluate import Evaluator
    from heterog.sharded import ShardedState
    from heterog.strategy import ParallelConfig

    ev = Evaluator(m.graph, cluster)
    n, B = cluster.n_devices, m.batch_size
    if kind in ("single", "ev-ar", "cp-ps"):
        return baselines.run(kind, m.graph, cluster, evaluator=ev)
    if kind.startswith("random:"):
        return baselines.run("random", m.graph, cluster, evaluator=ev, seed=int(kind.split(":")[1]))
    base = baselines.run("ev-ar", m.graph, cluster, evaluator=ev)
    if kind == "split":
        cfg = ParallelConfig.split_over(tuple(range(n)), (1,) * n, B)
        return dataclasses.replace(base, configs=[cfg] * len(base.configs))
    if kind == "micro":
        sizes = tuple(int(x) for x in np.diff(np.linspace(0, B, 4).round().astype(int)))
        return dataclasses.replace(base, micro_batches=sizes, schedule="1f1b")
    if kind == "recompute":
        layers, _ = op_layers(m.graph)
        first = [int(np.nonzero(layers == k)[0][0]) for k in range(int(layers.max()) + 1)]
        by_layer = dataclasses.replace(base, group_of=layers, configs=[base.configs[base.group_of[o]] for o in first])
        ops = recomputed_ops(ev.compiler.context, layers, tuple(range(len(first))))
        if ops is None:
            raise HeterogError(f"{m.name}: no layer has anything to recompute")
        return by_layer.with_recompute(np.unique(layers[ops]))
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "offload": 2}.get(kind)
    if stage is None:
        raise HeterogError(f"unknown plan kind {kind!r} (choose from {', '.join(PLANS)}, random:SEED)")
    held = ShardedState(stage, (1,) * n, "optimizer" if kind == "offload" else "none")
    return dataclasses.replace(base, configs=[dataclasses.replace(c, sharded=held) for c in base.configs])


def measured_peaks(prepared, pool_of, metered: bool) -> tuple[dict[str, int], str]:
    """Device name -> measured peak bytes of ``prepared`` and how they were measured (module docstring);
    ``pool_of()``: the cluster's worker pool (started on first use)."""
    from heterog.runtime import run_prepared
    from heterog.runtime.check import metered_dry_run

    if metered and prepared.lowered.n_aggregate == 0:
        names = prepared.cluster.device_names
        return {names[r]: dev for r, (dev, _) in enumerate(metered_dry_run(prepared))}, "metered"
    m = prepared.model
    return run_prepared(prepared, [m.example_inputs], 2, pool=pool_of()).measured_peak_memory_bytes, "workers"


def rows_of(models: list[tuple[str, int]], plans: list[str], clusters: list[str], optimizer: str,
            metered: bool = False) -> list[dict]:
    import contextlib

    from heterog.cluster import load_cluster
    from heterog.runtime import WorkerPool, load_model, prepare

    rows = []
    captured = {(ref, b): load_model(ref, b, optimizer=optimizer) for ref, b in models}
    for name in clusters:
        cluster = load_cluster(f"{name}:host={HOST}")
        with contextlib.ExitStack() as stack:
            pools: list[WorkerPool] = []

            def pool_of() -> WorkerPool:
                if not pools:
                    pools.append(stack.enter_context(WorkerPool(cluster.n_devices, "gloo", hang_timeout_s=120)))
                return pools[0]

            for (ref, b), m in captured.items():
                for kind in plans:
                    try:
                        prepared = prepare(m, cluster, strategy_of(kind, m, cluster))
                    except HeterogError as exc:
                        print(f"{ref} {kind} on {name}: {exc}", file=sys.stderr)
                        continue
                    measured, how = measured_peaks(prepared, pool_of, metered)
                    seen = []
                    for dev, got in measured.items():
                        sim = prepared.simulated_peak_memory_bytes.get(dev, 0)
                        if got > 0:
                            rows.append({"model": f"{m.name}:{b}", "plan": kind, "cluster": name, "device": dev,
                                         "measured_bytes": got, "simulated_bytes": sim,
                                         "error": (sim - got) / got, "measured_by": how})
                            seen.append(f"{dev} {got} / {sim} B {rows[-1]['error']:+.1%}")
                    print(f"{m.name}:{b} {kind} on {name} ({how}; measured / simulated): {', '.join(seen)}",
                          file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> Table:
    t = Table([Column("model", align="left"), Column("plan", align="left"), Column("cluster", align="left"),
               Column("device", align="left"), Column("measured B"), Column("simulated B"), Column("error"),
               Column("measured by", align="left")])
    for r in rows:
        t.add(r["model"], r["plan"], r["cluster"], r["device"], str(r["measured_bytes"]), str(r["simulated_bytes"]),
              f"{r['error']:+.1%}", r["measured_by"])
    return t


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.memory_fidelity", __doc__)
    ap.add_argument("--models", default="tiny_mlp:6,tiny_transformer:6")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--clusters", default="local-cpu-2,local-cpu-3")
    ap.add_argument("--optimizer", default="adam", choices=("sgd", "momentum", "adam"))
    ap.add_argument("--metered", action="store_true",
                    help="meter plans without a parameter server in this process instead of training them")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        models = [model_spec(s) for s in args.models.split(",") if s.strip()]
        rows = rows_of(models, [p for p in args.plans.split(",") if p], [c for c in args.clusters.split(",") if c],
                       args.optimizer, args.metered)
    except HeterogError as exc:
        print(f"python -m experiments.memory_fidelity: error: {exc}", file=sys.stderr)
        return 2
    return print_rows(rows, args.json, table)


if __name__ == "__main__":
    sys.exit(main())
