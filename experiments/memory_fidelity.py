"""Simulated against measured peak memory per device, over conformance models and plan kinds on local-cpu-2
and local-cpu-3, with what each side holds at its peak (``--diff``) to find the terms that differ.

Run: ``PYTHONPATH=. python -m experiments.memory_fidelity [--models bert,mlp] [--plans single,ev-ar] [--diff]
[--workers]``. Memory does not depend on timing: the measured peak is the runtime's ``LiveBytes`` of one
step of every rank's program, run in this process (``heterog.runtime.check.metered_dry_run``), which is
what each worker meters (``--workers`` runs the plans on worker processes as well and reports both).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from typing import Any

import numpy as np

from heterog import baselines
from heterog.baselines.expert import op_layers
from heterog.cluster import Cluster, load_cluster
from heterog.compiler import TaskKind
from heterog.evaluate import Evaluator
from heterog.runtime.api import Model, load_model, prepare
from heterog.runtime.check import metered_dry_run
from heterog.strategy import ParallelConfig, Strategy

MODELS = {"bert": ("tests/runtime/transformers_models.py:build_bert", 12),
          "bn-cnn": ("tests/runtime/conformance_models.py:build_batchnorm_cnn", 6),
          "mlp": ("tiny_mlp", 6),
          "transformer": ("tiny_transformer", 6),
          "decoder": ("tests/runtime/conformance_models.py:build_tied_decoder", 6)}
PLANS = ("single", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "mp-split", "split", "grid", "micro", "recompute",
         "pipeline", "random:0", "random:1")
CLUSTERS = {"local-cpu-2": "local-cpu-2:slowdown=1,2", "local-cpu-3": "local-cpu-3:slowdown=1,2,3",
            "local-cpu-4": "local-cpu-4:slowdown=1,2,3,4"}


def _mp_split(ev: Evaluator) -> Strategy:
    m, g = ev.cluster.n_devices, ev.n_groups
    s = ev.strategy(np.minimum(np.arange(g) * m // max(g, 1), m - 1).astype(np.int64), method="mp-split")
    return s


def _splits(s: Strategy, n_devices: int, seed: int, grid: bool) -> Strategy:
    """Every other group divided beyond the batch over all devices (weights 1..n), or with ``grid`` on a
    2-D grid (two groups of half the devices, the batch split 1:1 between them; four devices or more)."""
    from heterog.errors import StrategyError

    rng = np.random.default_rng(seed)
    devs = tuple(range(n_devices))
    configs = list(s.configs)
    for g in range(0, len(configs), 2):
        kind = ("parameter", "attribute")[int(rng.integers(2))]
        if grid:
            if n_devices < 4:
                raise StrategyError("a grid needs four devices")
            h = n_devices // 2
            configs[g] = ParallelConfig.split_grid([devs[:h], devs[h:2 * h]], list(range(1, h + 1)),
                                                   (s.batch_size // 2, s.batch_size - s.batch_size // 2), kind)
        else:
            configs[g] = ParallelConfig.split_over(devs, tuple(range(1, n_devices + 1)), s.batch_size, kind=kind)
    return dataclasses.replace(s, configs=configs, method="grid" if grid else "split")


def _recompute(s: Strategy, ev: Evaluator) -> Strategy:
    layers, _ = op_layers(ev.graph)
    first = [int(np.nonzero(layers == k)[0][0]) for k in range(int(layers.max()) + 1)]
    by_layer = dataclasses.replace(s, group_of=layers, configs=[s.configs[s.group_of[o]] for o in first])
    return dataclasses.replace(by_layer.with_recompute(tuple(range(len(first)))), method="recompute")


def plan_of(name: str, ev: Evaluator) -> Strategy:
    """The plan called ``name`` (``PLANS``) for ``ev``'s graph and cluster."""
    base, _, seed = name.partition(":")
    if base == "mp-split":
        return _mp_split(ev)
    if base in ("split", "grid"):
        return _splits(baselines.run("ev-ar", ev.graph, ev.cluster, evaluator=ev), ev.cluster.n_devices, 0,
                       base == "grid")
    if base == "micro":
        s = baselines.run("ev-ar", ev.graph, ev.cluster, evaluator=ev)
        b = s.batch_size
        return dataclasses.replace(s, micro_batches=(b // 2, b - b // 2), method="micro")
    if base == "recompute":
        return _recompute(_mp_split(ev), ev)
    if base == "pipeline":
        return baselines.run("pipeline", ev.graph, ev.cluster, evaluator=ev, budget_s=0.5)
    opts: dict[str, Any] = {"seed": int(seed)} if seed else {}
    s = baselines.run(base, ev.graph, ev.cluster, evaluator=ev, **opts)
    s.method = name
    return s


def simulated_at_peak(ev: Evaluator, strategy: Strategy) -> list[dict[str, int]]:
    """Per device: what the simulator holds at its peak, as 'kind op[/micro]' -> bytes (resident included)."""
    plan = ev.compile(strategy)
    res = ev.simulate_plan(plan)
    mem_ptr, mem_res, mem_bytes = res._mem_ptr, res._mem_res, res._mem_bytes
    owner = np.repeat(np.arange(len(mem_ptr) - 1), np.diff(mem_ptr))
    names = [op.name for op in ev.graph.ops]
    out = []
    for d in range(ev.cluster.n_devices):
        on = mem_res == d
        entries, tasks, nbytes = np.nonzero(on)[0], owner[on], mem_bytes[on]
        release = res.entry_release_time()[on]
        events = sorted([(float(res.start[t]), 1, int(j), int(b)) for j, t, b in zip(entries, tasks, nbytes)]
                        + [(float(r), 0, int(j), -int(b)) for j, r, b in zip(entries, release, nbytes)
                           if np.isfinite(r)])
        live: dict[int, int] = {}
        level = best = int(res._resident_bytes[d])
        snap: dict[int, int] = {}
        for _, _, j, b in events:
            if b > 0:
                live[j] = b
            else:
                live.pop(j, None)
            level += b
            if level > best:
                best, snap = level, {}
                for k, v in live.items():
                    snap[int(owner[k])] = snap.get(int(owner[k]), 0) + v
        held = {"resident (params, grads, state)": int(res._resident_bytes[d])}
        for t, b in snap.items():
            kind = TaskKind(int(plan.task_kind[t])).name
            op = int(plan.task_op[t])
            key = f"{kind} {names[op] if op >= 0 else '-'}" + (f"/{int(plan.task_micro[t])}"
                                                              if plan.task_micro is not None else "")
            held[key] = held.get(key, 0) + b
        assert best == int(res.peak_memory[d]), (best, int(res.peak_memory[d]))
        out.append(held)
    return out


def measure(model: Model, cluster: Cluster, name: str, diff: bool = False) -> dict[str, Any]:
    ev = Evaluator(model.graph, cluster)
    s = plan_of(name, ev)
    prepared = prepare(model, cluster, s, check=False)
    meters = metered_dry_run(prepared)
    names = cluster.device_names
    sim = prepared.simulated_peak_memory_bytes
    rec: dict[str, Any] = {"plan": name, "simulated": [sim[n] for n in names],
                           "measured": [int(m.peak) for m in meters]}
    rec["error"] = [(a - b) / b if b else (0.0 if a == 0 else float("inf"))
                    for a, b in zip(rec["simulated"], rec["measured"])]
    if diff:
        rec["sim_at_peak"] = simulated_at_peak(ev, s)
        rec["measured_at_peak"] = [{str(k): v for k, v in m.at_peak.items() if v} for m in meters]
        rec["by_op"] = [_by_op(model, sim_d, m.at_peak) for sim_d, m in zip(rec["sim_at_peak"], meters)]
    return rec


def _by_op(model: Model, sim: dict[str, int], meas: dict[Any, int]) -> dict[str, list[Any]]:
    """Per op: [simulated bytes, measured bytes, the simulated task kinds, the measured table entries]."""
    prog = model.prog
    op_of = {n: model.graph.ops[i].name for i, nodes in enumerate(prog.op_nodes) for n in nodes}
    op_of.update({n: n for n in prog.placeholders})
    out: dict[str, list[Any]] = {}
    for k, v in sim.items():
        kind, _, rest = k.partition(" ")
        op = "resident" if kind == "resident" else rest.split("/")[0]
        row = out.setdefault(op, [0, 0, set(), set()])
        row[0] += v
        row[2].add(kind)
    for entry, v in meas.items():
        fields = entry if isinstance(entry, tuple) else (getattr(entry, "node", None),) + tuple(
            getattr(entry, "key", ()))
        names = [x for x in fields if isinstance(x, str)]
        if isinstance(entry, tuple) and entry and entry[0] == "persist":
            op = "resident"
        else:
            op = next((op_of[n.split("@")[0].removesuffix("~r")] for n in names
                       if n.split("@")[0].removesuffix("~r") in op_of), "?")
        row = out.setdefault(op, [0, 0, set(), set()])
        row[1] += v
        row[3].add(type(entry).__name__ if not isinstance(entry, tuple) or entry[0] != "persist" else "persist")
    return out


def _print_diff(rec: dict[str, Any], top: int = 14) -> None:
    for d, ops in enumerate(rec["by_op"]):
        sim, meas = sum(r[0] for r in ops.values()), sum(r[1] for r in ops.values())
        print(f"  device {d}: simulated {sim} measured {meas}  (by op, simulated - measured)")
        for op, (a, b, ks, ms) in sorted(ops.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:top]:
            if a != b:
                print(f"    {a - b:>+9} {op:28} sim {a:>9} {','.join(sorted(ks)):22} "
                      f"meas {b:>9} {','.join(sorted(ms))}")


def fmt(xs: list[int]) -> str:
    return " / ".join(f"{x / 1e6:.3f}" for x in xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--clusters", default="local-cpu-2,local-cpu-3")
    ap.add_argument("--diff", action="store_true", help="print what each side holds at its peak")
    ap.add_argument("--json", default=None, help="write the records here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    records = []
    print(f"{'model':12} {'cluster':12} {'plan':10} {'simulated MB':>28} {'measured MB':>28} errors %")
    for mname in args.models.split(","):
        ref, batch = MODELS[mname]
        model = load_model(ref, batch)
        for cname in args.clusters.split(","):
            cluster = load_cluster(CLUSTERS[cname])
            for p in args.plans.split(","):
                try:
                    rec = measure(model, cluster, p, args.diff)
                except Exception as exc:  # noqa: BLE001 - a plan kind a model cannot take is reported, not fatal
                    print(f"{mname:12} {cname:12} {p:10} skipped: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                rec.update(model=mname, cluster=cname)
                records.append(rec)
                print(f"{mname:12} {cname:12} {p:10} {fmt(rec['simulated']):>28} {fmt(rec['measured']):>28} "
                      + " ".join(f"{100 * e:+.1f}" for e in rec["error"]))
                if args.diff:
                    _print_diff(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    worst = max((abs(e) for r in records for e in r["error"] if np.isfinite(e)), default=0.0)
    print(f"worst error {100 * worst:.1f}% over {len(records)} plans")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
