"""Language models near or beyond a whole cluster's GPU memory (docs/results.md, "Large language models on
paper-8gpu"): GPT-J-6B and OPT-13B trained with Adam, planned by the project's planners, the fastest plan
that fits kept and reported with what it uses, its memory per device and per host, and its time against the
compute bound and the offloading bounds.

    python -m experiments.large_models [--graphs gptj_6b:8,opt_13b:8] [--cluster paper-8gpu]
        [--planners pipeline,mcmc,agent] [--budget-s 120] [--seed 0] [--no-zero] [--out DIR] [--json]

For each graph (captured with Adam, cached under .heterog-cache/graphs): the state arithmetic (parameter,
gradient and optimizer-state bytes of the graph against the cluster's GPU and host memory), then every
planner of ``--planners`` at ``--budget-s`` (``heterog.planners.plan``, with ``sharded=True`` where the
planner takes it; one that fails is recorded with its error), and unless ``--no-zero`` the fully sharded
data-parallel plans (a group per layer, each one AllReduce config over all devices, batch shares by peak
FLOP/s, state sharded at stage 3 with shards by memory, and the same with the optimizer state offloaded
where ``ShardedState`` has an ``offload`` field), each recomputing the fewest
leading groups that fit (``heterog.baselines.pipeline.fitting``; where even recomputing every group does not
fit, that plan is reported too). The fastest candidate that fits is kept;
where none fits, the one of least peak memory over capacity and its binding device are reported.

Bounds: ``compute_bound_s`` (``heterog.bounds.compute_bound``: no plan computes faster, communication and
memory ignored), ``gpu_floor_bytes`` (the parameters, buffers and gradients, which stay on the GPUs when
every parameter's optimizer state is offloaded, the offloading the simulator prices) and what that leaves
of the GPU memory (``gpu_room_bytes``), ``flops_bound_s`` (total FLOPs over the sum of the devices'
effective FLOP/s) and, where the state exceeds the GPU memory, the least offloading any plan needs:
parameters of which the optimizer state and master weights (12 of the 16 bytes) live on the host, so that
16 (P - P_off) + 4 P_off <= GPU memory (ZeRO-Offload's accounting, gradients on the host too; the
simulator keeps each offloaded parameter's gradient on its GPU, 8 bytes, hence ``gpu_floor_bytes``);
their gradients go down and parameters come up over PCIe (8 bytes per parameter, spread over every GPU's
link, two GPUs of a server sharing its host memory bandwidth) and are stepped on the host CPUs (heterog.cost
.host, spread over every server). With a plan that offloads, the simulated busy time of its PCIe and host
resources is reported too, and the same costs computed from its configs (``plan_offload``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.args import argparse_type, model_batch_list, parser
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

GRAPHS = "gptj_6b:8,opt_13b:8"
PLANNERS = ("pipeline", "mcmc", "agent")
ADAM_BYTES_PER_PARAM = 16          # fp32 weight, gradient, exp_avg, exp_avg_sq
OFFLOADED_HOST_BYTES_PER_PARAM = 12   # optimizer state and fp32 master weight leave the GPU; the parameter stays


# ----------------------------------------------------------------------------- what the graph holds
def state_arithmetic(graph: Any, cluster: Any) -> dict:
    """Parameters of ``graph`` and the resident bytes its ops declare (parameters, gradients, optimizer
    state) against the cluster's GPU memory and host memory (bytes)."""
    params = int(sum(int(np.prod(op.output_shapes[0])) for op in graph.ops if op.kind == "param"))
    param_b = int(sum(op.param_bytes for op in graph.ops if op.kind == "param"))
    buffer_b = int(sum(op.param_bytes for op in graph.ops if op.kind == "buffer"))
    grad_b = int(sum(op.grad_bytes for op in graph.ops))
    state_b = int(sum(op.state_bytes for op in graph.ops))
    hosts = [float(cluster.host_memory_bytes(j)) for j in range(len(cluster.servers))]
    return {"params": params, "param_bytes": param_b, "buffer_bytes": buffer_b, "grad_bytes": grad_b,
            "optimizer_state_bytes": state_b, "resident_bytes": param_b + grad_b + state_b,
            "gpu_memory_bytes": float(np.sum(cluster.memory_bytes)), "host_memory_bytes": float(sum(hosts)),
            "host_memory_per_server_bytes": hosts}


def offload_bounds(graph: Any, cluster: Any, arithmetic: dict) -> dict:
    """The least offloading any plan of ``graph`` needs on ``cluster`` (module docstring): parameters
    offloaded, PCIe seconds and host optimizer-step seconds, each spread evenly over every link and host."""
    from heterog.cost.host import host_optimizer_step_s, pcie_time_s

    over = arithmetic["resident_bytes"] - arithmetic["gpu_memory_bytes"]
    p_off = max(0.0, over / OFFLOADED_HOST_BYTES_PER_PARAM)
    # what the GPUs hold with every parameter's optimizer state offloaded (the offloading the simulator
    # prices): the parameters, buffers and gradients, and what that leaves for everything else
    floor = float(arithmetic.get("param_bytes", 0) + arithmetic.get("buffer_bytes", 0)
                  + arithmetic.get("grad_bytes", 0))
    out: dict = {"state_over_gpu_memory_bytes": float(over), "offloaded_params_at_least": p_off,
                 "pcie_bound_s": 0.0, "host_step_bound_s": 0.0, "host_memory_need_bytes": 0.0,
                 "gpu_floor_bytes": floor, "gpu_room_bytes": float(arithmetic["gpu_memory_bytes"]) - floor}
    if p_off <= 0:
        return out
    m, n_servers = cluster.n_devices, len(cluster.servers)
    per_server = np.bincount(cluster.server_of, minlength=n_servers)
    # each GPU moves 8 bytes per offloaded parameter of its 1/m share; the GPUs of a server transfer at once
    out["pcie_bound_s"] = max(pcie_time_s(cluster, d, 8.0 * p_off / m, int(per_server[cluster.server_of[d]]))
                              for d in range(m))
    out["host_step_bound_s"] = max(host_optimizer_step_s(cluster, j, p_off / m, "adam", int(per_server[j]))
                                   for j in range(n_servers) if per_server[j])
    out["host_memory_need_bytes"] = p_off * ADAM_BYTES_PER_PARAM
    return out


def plan_offload(graph: Any, cluster: Any, strategy: Any) -> dict:
    """What a plan's offloading costs, from its configs: parameters each device offloads (its shard of every
    parameter of a group whose ``sharded.offload`` is not "none"), the PCIe seconds of moving their
    gradients down and parameters up (8 bytes each, the offloading GPUs of a server at once) and the host
    Adam step of each server (``heterog.cost.host``); the busiest of each."""
    from heterog.cost.host import host_optimizer_step_s, pcie_time_s

    per_device = np.zeros(cluster.n_devices)
    for i, op in enumerate(graph.ops):
        cfg = strategy.configs[int(strategy.group_of[i])]
        st = cfg.sharded
        if op.kind != "param" or st is None or getattr(st, "offload", "none") == "none":
            continue
        per_device[list(cfg.devices)] += float(np.prod(op.output_shapes[0])) * st.fractions
    on = per_device > 0
    sharing = np.bincount(cluster.server_of[on], minlength=len(cluster.servers))
    pcie = [pcie_time_s(cluster, d, 8.0 * per_device[d], int(sharing[cluster.server_of[d]]))
            for d in np.nonzero(on)[0]]
    step = [host_optimizer_step_s(cluster, j, float(per_device[cluster.server_of == j].max()), "adam",
                                  int(sharing[j])) for j in np.nonzero(sharing)[0]]
    return {"offloaded_params": per_device.tolist(), "pcie_s": max(pcie, default=0.0),
            "host_step_s": max(step, default=0.0)}


# ----------------------------------------------------------------------------- candidates
def sharded_dp(ev: Any, offload: str = "none") -> Any:
    """A group per layer (``block_layers``: embeddings, each block, the head), each one AllReduce
    data-parallel config over all devices (batch shares by peak FLOP/s), its state sharded at stage 3 with
    shards by memory, and offloaded (``offload``) where ShardedState can."""
    from heterog.baselines.expert import block_layers
    from heterog.sharded import ShardedState, state_weights
    from heterog.shares import proportional_shares
    from heterog.strategy import ParallelConfig, Strategy

    cluster, graph = ev.cluster, ev.graph
    devices = tuple(range(cluster.n_devices))
    shares = tuple(proportional_shares(graph.batch_size, np.asarray(cluster.power, dtype=np.float64)))
    weights = state_weights("memory", devices, cluster)
    extra = {} if offload == "none" else {"offload": offload}
    state = ShardedState(3, weights, **extra)        # TypeError before ShardedState has an offload field
    kept = [(d, s) for d, s in zip(devices, shares) if s > 0]
    if len(kept) < len(devices):
        state = ShardedState(3, tuple(weights[d] for d, _ in kept), **extra)
    cfg = ParallelConfig(tuple(d for d, _ in kept), tuple(s for _, s in kept), sharded=state)
    layer_of, n_blocks = block_layers(graph)          # a group per layer, so that recomputation checkpoints
    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, graph.batch_size, layer_of,
                    [cfg] * (n_blocks + 2), method="zero3-dp" + ("" if offload == "none" else f"-offload-{offload}"))


def candidates(ev: Any, planners: list[str], budget_s: float, seed: int, zero: bool) -> list[tuple[str, Any]]:
    """(label, Strategy or the error text) of every planner, then the sharded data-parallel plans."""
    from heterog.baselines.pipeline import fitting
    from heterog.planners import get, plan

    out: list[tuple[str, Any]] = []
    for name in planners:
        quiet = {"progress": False} if "progress" in get(name).options else {}
        if "sharded" in get(name).own_options:       # planners that may keep sharded state are let to
            quiet["sharded"] = True
        t0 = time.perf_counter()
        try:
            s = plan(name, evaluator=ev, budget_s=budget_s, seed=seed, **quiet)
        except (HeterogError, MemoryError) as exc:      # a planner that cannot plan this graph is a row
            s = f"{type(exc).__name__}: {exc}"
        print(f"  {name}: planned in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        out.append((name, s))
    if zero:
        for offload in ("none", "optimizer", "parameters"):
            try:
                s = sharded_dp(ev, offload)
            except TypeError:                             # no offloading in this version of ShardedState
                continue
            except HeterogError as exc:
                out.append((f"zero3-dp-{offload}", f"{type(exc).__name__}: {exc}"))
                continue
            fitted, _, oom = fitting(ev, s)
            out.append((fitted.method, fitted))
            if oom and not fitted.recompute:      # recomputing every group does not fit either: still its peak
                every = s.with_recompute([g for g, c in enumerate(s.configs) if c.split is None])
                every.method = f"{s.method}+recompute"
                out.append((every.method, every))
    return out


# ----------------------------------------------------------------------------- one plan, measured
def uses(strategy: Any) -> dict:
    """What a plan uses: per distinct config its groups, devices, shares, sync, sharded state (stage,
    weights, offload), split; and micro-batches, schedule and recomputed groups."""
    configs: dict[int, dict] = {}
    for g, cfg in enumerate(strategy.configs):
        rec = configs.setdefault(id(cfg), {"groups": 0, "devices": list(cfg.devices), "shares": list(cfg.shares),
                                           "sync": cfg.sync, "split": cfg.split, "grid": int(cfg.grid)})
        rec["groups"] += 1
        st = getattr(cfg, "sharded", None)
        if st is not None:
            rec["sharded_stage"] = int(st.stage)
            rec["shard_weights"] = [int(w) for w in st.weights]
            rec["offload"] = str(getattr(st, "offload", "none"))
    merged: dict[str, dict] = {}                          # equal configs held by distinct objects, once
    for rec in configs.values():
        key = json.dumps({k: v for k, v in rec.items() if k != "groups"}, sort_keys=True)
        if key in merged:
            merged[key]["groups"] += rec["groups"]
        else:
            merged[key] = rec
    n = max(1, strategy.n_groups)
    stages = [c.get("sharded_stage", 0) for c in merged.values()]
    return {"n_groups": strategy.n_groups, "micro_batches": list(strategy.micro), "schedule": strategy.schedule,
            "recomputed_groups": len(strategy.recompute),
            "sharded_groups": sum(c["groups"] for c in merged.values() if "sharded_stage" in c) / n,
            "max_sharded_stage": max(stages) if stages else 0,
            "offloaded_groups": sum(c["groups"] for c in merged.values() if c.get("offload", "none") != "none") / n,
            "split_groups": sum(c["groups"] for c in merged.values() if c["split"] is not None) / n,
            "configs": sorted(merged.values(), key=lambda c: -c["groups"])}


def measure(ev: Any, label: str, strategy: Any) -> dict:
    """Simulated time, OOM, GPU peak memory against capacity per device, host memory per server and the
    busiest PCIe and host resources (where the plan has them)."""
    res = ev.evaluate(strategy, method=label)
    sim = res.sim
    names = list(sim.resource_names) if sim is not None else []
    peaks = np.asarray(sim.peak_memory, dtype=np.float64) if sim is not None else np.zeros(0)
    busy = np.asarray(sim.busy, dtype=np.float64) if sim is not None else np.zeros(0)
    cluster = ev.cluster
    host = {n.split(":", 1)[1]: float(peaks[i]) for i, n in enumerate(names) if n.startswith("host:")}
    fill = {d: res.peak_memory_bytes[d] / res.memory_capacity_bytes[d] for d in res.peak_memory_bytes}
    binding = max(fill, key=lambda d: fill[d])
    pcie = {n: float(busy[i]) for i, n in enumerate(names) if n.startswith("pcie")}
    host_busy = {n: float(busy[i]) for i, n in enumerate(names) if n.startswith("host:")}
    top = np.argsort(-busy, kind="stable")[:4]           # what bounds the step: the busiest resources
    return {"label": label, "iteration_time_s": float(res.iteration_time_s), "oom": bool(res.oom),
            "peak_memory_bytes": dict(res.peak_memory_bytes), "memory_capacity_bytes": dict(res.memory_capacity_bytes),
            "binding_device": binding, "binding_fill": float(fill[binding]),
            "host_memory_bytes": host,
            "host_capacity_bytes": {s.name: float(cluster.host_memory_bytes(j)) for j, s in enumerate(cluster.servers)},
            "busiest_pcie_s": max(pcie.values()) if pcie else 0.0,
            "busiest_host_s": max(host_busy.values()) if host_busy else 0.0,
            "busiest": [(names[i], float(busy[i])) for i in top.tolist()],
            "offload": plan_offload(ev.graph, cluster, strategy),
            "compute_time_s": float(res.compute_time_s), "comm_time_s": float(res.comm_time_s),
            "search_time_s": float(strategy.meta.get("search_time_s", 0.0)), "uses": uses(strategy)}


def run_graph(model: str, batch: int, cluster_ref: str, planners: list[str], budget_s: float, seed: int,
              zero: bool) -> dict:
    """The record of one graph on one cluster (module docstring)."""
    from heterog.bounds import compute_bound
    from heterog.cli.args import resolve_graph
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator

    t0 = time.perf_counter()
    graph = resolve_graph(model, batch, optimizer="adam")
    capture_s = time.perf_counter() - t0
    cluster = load_cluster(cluster_ref)
    arithmetic = state_arithmetic(graph, cluster)
    ev = Evaluator(graph, cluster)
    eff_flops = float(sum(d.type.effective_flops for d in cluster.devices))
    flops = float(np.sum(graph.flops[graph.is_compute]))
    rows = []
    for label, s in candidates(ev, planners, budget_s, seed, zero):
        rows.append({"label": label, "error": s} if isinstance(s, str) else measure(ev, label, s))
    measured = [r for r in rows if "error" not in r]
    fits = [r for r in measured if not r["oom"]]
    best = min(fits, key=lambda r: r["iteration_time_s"]) if fits else None
    least = min(measured, key=lambda r: r["binding_fill"]) if measured else None
    return {"graph": f"{model}-b{batch}", "cluster": cluster.name, "n_ops": graph.n_ops,
            "graph_load_s": capture_s, "capture_time_s": graph.meta.get("capture_time_s"),
            "flops": flops, "arithmetic": arithmetic, "compute_bound_s": compute_bound(graph, cluster, ev.cost),
            "flops_bound_s": flops / eff_flops, "offload": offload_bounds(graph, cluster, arithmetic),
            "budget_s": budget_s, "candidates": rows, "best": best["label"] if best else None,
            "least_memory": least["label"] if least and not best else None}


# ----------------------------------------------------------------------------- tables
def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def table(records: list[dict]) -> Table:
    """One row per candidate: time, fits, peak over capacity of the binding device, what it uses."""
    t = Table([Column("graph", align="left"), Column("plan", align="left"), Column("s/iter"), Column("fits"),
               Column("binding device (peak/cap GB)", align="left"), Column("uses", align="left"),
               Column("host GB (max server)"), Column("x compute bound")])
    for rec in records:
        for r in rec["candidates"]:
            if "error" in r:
                t.add(rec["graph"], r["label"], "-", "-", "-", r["error"][:80], "-", "-")
                continue
            u = r["uses"]
            d = r["binding_device"]
            what = (f"{u['n_groups']} groups, stage {u['max_sharded_stage']} on {u['sharded_groups']:.0%}, "
                    f"offload {u['offloaded_groups']:.0%}, split {u['split_groups']:.0%}, "
                    f"{len(u['micro_batches'])} micro-batches, {u['recomputed_groups']} recomputed")
            host = max(r["host_memory_bytes"].values()) if r["host_memory_bytes"] else 0.0
            star = " (kept)" if r["label"] == rec["best"] else ""
            t.add(rec["graph"], r["label"] + star, f"{r['iteration_time_s']:.2f}", "no" if r["oom"] else "yes",
                  f"{d} ({_gb(r['peak_memory_bytes'][d])}/{_gb(r['memory_capacity_bytes'][d])})", what,
                  _gb(host), f"{r['iteration_time_s'] / rec['compute_bound_s']:.2f}")
    return t


def summary(rec: dict) -> str:
    """The lines under the table: state against memory, bounds, the plan kept or the least memory found."""
    a, o = rec["arithmetic"], rec["offload"]
    lines = [f"{rec['graph']} on {rec['cluster']}: {a['params']:,} parameters, {rec['n_ops']} ops; parameters "
             f"+ gradients + Adam state {_gb(a['resident_bytes'])} GB ({a['resident_bytes'] / 2**30:.1f} GiB) "
             f"against {_gb(a['gpu_memory_bytes'])} GB of GPU memory and {_gb(a['host_memory_bytes'])} GB of host "
             f"memory; compute bound {rec['compute_bound_s']:.2f} s (FLOPs / effective FLOP/s "
             f"{rec['flops_bound_s']:.2f} s)."]
    if o["offloaded_params_at_least"] > 0:
        lines.append(f"  state exceeds GPU memory by {_gb(o['state_over_gpu_memory_bytes'])} GB: at least "
                     f"{o['offloaded_params_at_least'] / 1e9:.2f} B parameters offloaded ("
                     f"{_gb(o['host_memory_need_bytes'])} GB of host memory), PCIe >= {o['pcie_bound_s']:.2f} s, "
                     f"host Adam step >= {o['host_step_bound_s']:.2f} s per iteration.")
        lines.append(f"  with the optimizer state of every parameter offloaded the GPUs still hold the parameters and "
                     f"gradients, {_gb(o['gpu_floor_bytes'])} GB ({o['gpu_floor_bytes'] / a['gpu_memory_bytes']:.1%} "
                     f"of their memory), leaving {_gb(o['gpu_room_bytes'])} GB for every activation, gathered "
                     f"parameter and transient.")
    by_label = {r["label"]: r for r in rec["candidates"]}
    if rec["best"]:
        r = by_label[rec["best"]]
        lines.append(f"  kept: {r['label']}, {r['iteration_time_s']:.2f} s per iteration, "
                     f"{r['iteration_time_s'] / rec['compute_bound_s']:.2f}x the compute bound; busiest "
                     + ", ".join(f"{n} {b:.2f} s" for n, b in r.get("busiest", [])) + ".")
        po = r["offload"]
        if po["pcie_s"] > 0:
            lines.append(f"  its offloading: {sum(po['offloaded_params']) / 1e9:.2f} B parameters, PCIe "
                         f"{po['pcie_s']:.2f} s and host Adam step {po['host_step_s']:.2f} s on the busiest link "
                         f"and host (simulated busy: PCIe {r['busiest_pcie_s']:.2f} s, host "
                         f"{r['busiest_host_s']:.2f} s).")
    elif rec["least_memory"]:
        r = by_label[rec["least_memory"]]
        d = r["binding_device"]
        lines.append(f"  NO PLAN FITS: least memory {r['label']}, binding device {d} at "
                     f"{_gb(r['peak_memory_bytes'][d])} of {_gb(r['memory_capacity_bytes'][d])} GB "
                     f"({r['binding_fill']:.0%}).")
    else:
        lines.append("  NO PLAN: every planner failed.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser("experiments.large_models", __doc__)
    p.add_argument("--graphs", type=argparse_type(model_batch_list), default=model_batch_list(GRAPHS),
                   help=f"MODEL:BATCH list (default {GRAPHS})")
    p.add_argument("--cluster", default="paper-8gpu")
    p.add_argument("--planners", default=",".join(PLANNERS), help="comma-separated planners ('' for none)")
    p.add_argument("--budget-s", type=float, default=120.0, help="search budget per planner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-zero", action="store_true", help="leave out the sharded data-parallel plans")
    p.add_argument("--out", type=Path, default=None, help="folder for large_models.json and large_models.md")
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    args = p.parse_args(argv)
    planners = [s.strip() for s in args.planners.split(",") if s.strip()]
    records = []
    for model, batch in args.graphs:
        print(f"{model}:{batch} on {args.cluster}", file=sys.stderr, flush=True)
        records.append(run_graph(model, batch, args.cluster, planners, args.budget_s, args.seed, not args.no_zero))
    markdown = table(records).markdown() + "\n\n" + "\n".join(summary(r) for r in records)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "large_models.json").write_text(json.dumps(records, indent=1, default=float))
        (args.out / "large_models.md").write_text(markdown + "\n")
    print(json.dumps(records, indent=1, default=float) if args.json else markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
