"""What surviving costs (docs/results.md, "Runs that survive"): the time a checkpoint of bert_large-size
state takes when local workers write it, its share of a training step, and the time each planner takes to
re-plan bert_large for a cluster that lost a server.

    python -m experiments.checkpoint_cost [--model bert_large] [--batch-size 48] [--optimizer momentum]
        [--workers 3] [--repeats 3] [--cluster paper-8gpu] [--lose s1] [--budget-s 5] [--every 100,1000]
        [--out DIR] [--json]

1. Writing: ``--workers`` local worker processes (one process group, gloo) write the model's parameters
   and optimizer state (shapes from its captured graph, values random) as a run does
   (``heterog.runtime.checkpoint.write_checkpoint``): held whole by rank 0 (a data-parallel plan: one
   holder writes), and divided by rows among the workers (each writes its part). Seconds per checkpoint
   (each of ``--repeats``), bytes, GB/s. The checkpoints go to ``--out`` (default: a temporary directory on
   this machine's disk, removed afterwards).
2. Share of a step: the simulated iteration time of the model on ``--cluster`` under best-dp and the
   checkpoint term (``Evaluator(checkpoint_every_steps=K)``: bytes per device over the cluster's storage
   bandwidth) for each ``--every`` K; and the measured write time over K simulated steps.
3. Re-planning: the cluster less server ``--lose``; each planner of ``heterog.replan.AUTO_PLANNERS`` given
   the budget where it takes one (the agent zero-shot), its seconds and simulated iteration time, and
   ``auto`` within ``--budget-s`` after ``heterog.replan.warm_up`` on the whole cluster, as an elastic run
   does when it starts.
"""
from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.args import parser
from heterog.errors import HeterogError


@dataclass
class WriteJob:
    """A worker's part of the checkpoint-writing measurement: make its share of the state, write it
    ``repeats`` times, return the seconds of each write (a job of ``heterog.runtime.launcher.WorkerPool``)."""

    shapes: dict[str, tuple[int, ...]]
    divided: bool
    directory: str
    repeats: int
    world: int

    def __call__(self, rank: int, device: Any) -> list[float]:
        import torch

        from heterog.runtime.checkpoint import CheckpointSettings, Held, write_checkpoint

        g = torch.Generator().manual_seed(rank)
        state: dict[str, Any] = {}
        for key, shape in self.shapes.items():
            rows = shape[0] if shape else 1
            if self.divided and shape and rows >= self.world:
                lo, hi = rank * rows // self.world, (rank + 1) * rows // self.world
                chunk = torch.randn((hi - lo, *shape[1:]), generator=g)
                state[key] = Held(tuple(shape), (((lo,) + (0,) * (len(shape) - 1), chunk),))
            elif rank == 0:
                state[key] = torch.randn(shape, generator=g)
        settings = CheckpointSettings(Path(self.directory), every_steps=1, keep=1)
        times = []
        for k in range(self.repeats):
            t0 = time.perf_counter()
            marker = {"format": "measurement", "step": k} if rank == 0 else None
            write_checkpoint(settings, k + 1, state, marker, f"m{int(self.divided)}", distributed=self.world > 1)
            times.append(time.perf_counter() - t0)
        return times


def state_shapes(graph: Any, optimizer: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every parameter and its optimizer state (``heterog.graph.optimizer.STATE_SLOTS``)."""
    from heterog.graph.optimizer import STATE_SLOTS

    out: dict[str, tuple[int, ...]] = {}
    for op in graph.ops:
        if op.kind != "param":
            continue
        shape = tuple(int(s) for s in op.output_shapes[0])
        out[f"model.{op.param}"] = shape
        for slot in STATE_SLOTS[optimizer]:
            out[f"optimizer.state.{op.param}.{slot}"] = () if slot == "step" else shape
    return out


def measure_writes(shapes: dict[str, tuple[int, ...]], workers: int, repeats: int, out: Path) -> list[dict]:
    from heterog.runtime.launcher import WorkerPool

    nbytes = 4 * sum(math.prod(s) for s in shapes.values())
    rows = []
    with WorkerPool(workers, hang_timeout_s=600.0) as pool:
        for divided in (False, True):
            directory = out / ("divided" if divided else "whole")
            results = pool.run([WriteJob(shapes, divided, str(directory), repeats, workers)] * workers)
            per_write = [max(r[k] for r in results) for k in range(repeats)]
            rows.append({"layout": "divided by rows" if divided else "whole on rank 0", "workers": workers,
                         "bytes": nbytes, "seconds": per_write,
                         "GB_per_s": [nbytes / t / 1e9 for t in per_write]})
            shutil.rmtree(directory, ignore_errors=True)
    return rows


def step_shares(graph: Any, cluster: Any, every: list[int], measured_s: float) -> dict:
    from heterog import planners
    from heterog.evaluate import Evaluator

    plan = planners.plan("best-dp", evaluator=Evaluator(graph, cluster))
    out: dict[str, Any] = {"plan": plan.method, "cluster": cluster.name}
    for k in every:
        r = Evaluator(graph, cluster, checkpoint_every_steps=k).evaluate(plan)
        step = r.iteration_time_s - r.checkpoint_time_s / k
        out.update(step_s=step, checkpoint_s=r.checkpoint_time_s,
                   checkpoint_bytes=sum(r.checkpoint_bytes.values()))
        out[f"every_{k}"] = {"simulated_share": r.checkpoint_time_s / k / step,
                             "measured_share": measured_s / k / step}
    return out


def without_server(cluster: Any, lose: str) -> Any:
    """``cluster`` less the devices of its server ``lose``."""
    from heterog.cluster.topology import subset

    names = [d.name for d in cluster.devices if cluster.servers[d.server].name != lose]
    if len(names) == cluster.n_devices:
        raise HeterogError(f"cluster {cluster.name!r} has no server {lose!r} (its servers: "
                           f"{', '.join(s.name for s in cluster.servers)})")
    return subset(cluster, names)


def replan_times(graph: Any, cluster: Any, left: Any, budget_s: float) -> dict:
    from heterog import planners
    from heterog.evaluate import Evaluator
    from heterog.replan import AUTO_PLANNERS, ZERO_SHOT, replan, warm_up

    zero_shot_s = warm_up("auto", graph, cluster)          # as an elastic run does when it starts
    rows = []
    for name in AUTO_PLANNERS:
        if name not in planners.names():
            continue
        ev = Evaluator(graph, left)
        options = {"budget_s": 0} if name == ZERO_SHOT else \
            {"budget_s": budget_s} if "budget_s" in planners.get(name).options else {}
        t0 = time.perf_counter()
        try:
            s = planners.plan(name, evaluator=ev, progress=False, **options)
        except HeterogError as exc:
            rows.append({"method": name, "error": str(exc).splitlines()[0]})
            continue
        seconds = time.perf_counter() - t0
        t, oom = ev.iteration_time(s)
        rows.append({"method": name, "seconds": seconds, "iteration_time_s": t, "oom": oom})
    auto = replan(graph, left, "auto", budget_s)
    t, oom = Evaluator(graph, left).iteration_time(auto.best)
    return {"cluster": left.name, "devices": left.n_devices, "planners": rows, "warm_up_zero_shot_s": zero_shot_s,
            "auto": {"seconds": auto.seconds, "chosen": auto.best.method, "iteration_time_s": t, "oom": oom,
                     "budget_s": budget_s, "tried": [e["method"] for e in auto.tried]}}


def main(argv: list[str] | None = None) -> int:
    p = parser("experiments.checkpoint_cost", __doc__)
    p.add_argument("--model", default="bert_large")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--optimizer", default="momentum", choices=["sgd", "momentum", "adam"])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cluster", default="paper-8gpu")
    p.add_argument("--lose", default="s1", help="the server removed before re-planning")
    p.add_argument("--budget-s", type=float, default=5.0)
    p.add_argument("--every", default="100,1000", help="checkpoint intervals in steps")
    p.add_argument("--out", default=None, help="where the checkpoints are written (default: a temporary dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import json

    from heterog.cli.args import resolve_graph
    from heterog.cluster import load_cluster

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="heterog-ckpt-"))
    try:
        cluster = load_cluster(args.cluster)
        left = without_server(cluster, args.lose)
        graph = resolve_graph(args.model, args.batch_size, optimizer=args.optimizer)
        writes = measure_writes(state_shapes(graph, args.optimizer), args.workers, args.repeats, out)
        median = sorted(writes[1]["seconds"])[len(writes[1]["seconds"]) // 2]
        report = {"model": f"{args.model}-b{args.batch_size}", "optimizer": args.optimizer, "writes": writes,
                  "shares": step_shares(graph, cluster, [int(k) for k in args.every.split(",")], median),
                  "replan": replan_times(graph, cluster, left, args.budget_s)}
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(report, indent=1) if args.json else text(report))
    return 0


def text(r: dict) -> str:
    lines = [f"{r['model']} ({r['optimizer']}):"]
    for w in r["writes"]:
        secs = ", ".join(f"{t:.2f}" for t in w["seconds"])
        rates = ", ".join(f"{x:.2f}" for x in w["GB_per_s"])
        lines.append(f"  {w['layout']} ({w['workers']} workers): {w['bytes'] / 1e9:.2f} GB in {secs} s "
                     f"({rates} GB/s)")
    s = r["shares"]
    lines.append(f"  {s['plan']} on {s['cluster']}: {s['step_s'] * 1e3:.1f} ms/step simulated; a checkpoint "
                 f"{s['checkpoint_s']:.2f} s at the storage bandwidth ({s['checkpoint_bytes'] / 1e9:.2f} GB)")
    for k, v in s.items():
        if k.startswith("every_"):
            lines.append(f"    every {k[6:]} steps: +{v['simulated_share'] * 100:.2f}% simulated, "
                         f"+{v['measured_share'] * 100:.2f}% at the measured write time")
    rp = r["replan"]
    lines.append(f"  re-planning for {rp['cluster']} ({rp['devices']} devices):")
    for row in rp["planners"]:
        if "error" in row:
            lines.append(f"    {row['method']}: {row['error']}")
        else:
            lines.append(f"    {row['method']}: {row['seconds']:.2f} s, {row['iteration_time_s'] * 1e3:.1f} ms"
                         f"{' OOM' if row['oom'] else ''}")
    a = rp["auto"]
    lines.append(f"    auto (budget {a['budget_s']:g} s): {a['seconds']:.2f} s, chose {a['chosen']}, "
                 f"{a['iteration_time_s'] * 1e3:.1f} ms{' OOM' if a['oom'] else ''} (ran {', '.join(a['tried'])})")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
