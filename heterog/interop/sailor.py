"""Sailor's plan files (eth-easl/sailor, ``plan_config_*.json``) read into a ``ForeignPlan``, and a Strategy
written back as one.

The format, as Sailor's planner writes it and its simulator reads it:
  pipeline_list  pipelines, each {"num_stages": S, "layers_per_stage": S lists of layer indices (0 the
                 embeddings, 1..L the blocks, L+1 the head), "tmp_per_stage": per stage, per data-parallel
                 replica, ``[[[gpu_type, gpus_per_node, zone], ...], tp]``, "dp": S replica counts}
  mbs, gbs       micro-batch size of a replica, global batch
  real, max_mem, red_grads, N, zone   measured iteration time (s), peak memory (bytes), ... (kept as meta)
A replica is tp GPUs: one VM entry means tp GPUs of that type; tp entries one GPU each (Sailor's
conversion of Metis plans); otherwise each entry is a node giving min(gpus_per_node, what is left) GPUs.
Sailor's simulator runs ceil(gbs / (mbs x dp of the first stage x pipelines)) micro-batches and divides a
pipeline's batch evenly over a stage's replicas; here gbs must divide exactly.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.cluster.catalog import SAILOR_NAMES
from heterog.interop.common import ForeignPlan, PlanImportError, Stage, need, plan_gpu_name, positive_int

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import ParallelConfig, Strategy

META_KEYS = ("real", "max_mem", "red_grads", "N", "zone")


def _replica(entry: Any, where: str) -> tuple[str, ...]:
    """The GPU types of one ``[[vm, ...], tp]`` entry of tmp_per_stage (see the module docstring)."""
    need(isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], (list, tuple)) and entry[0],
         f"{where}: a replica is [[[gpu_type, gpus_per_node, zone], ...], tp], got {entry!r}")
    vms, tp = entry[0], positive_int(entry[1], f"{where}: tp")
    for vm in vms:
        need(isinstance(vm, (list, tuple)) and len(vm) >= 2, f"{where}: a VM is [gpu_type, gpus_per_node, zone], "
                                                             f"got {vm!r}")
    names = [plan_gpu_name(vm[0]) for vm in vms]
    if len(vms) == 1:
        return (names[0],) * tp
    if len(vms) == tp:
        return tuple(names)
    out: list[str] = []
    for name, vm in zip(names, vms):
        out += [name] * min(positive_int(vm[1], f"{where}: gpus_per_node"), tp - len(out))
    need(len(out) == tp, f"{where}: VMs {[list(v) for v in vms]} hold fewer than tp={tp} GPUs")
    return tuple(out)


def _pipeline(d: Any, p: int) -> tuple[Stage, ...]:
    where = f"pipeline {p}"
    need(isinstance(d, dict), f"{where} is not an object")
    for key in ("num_stages", "layers_per_stage", "tmp_per_stage", "dp"):
        need(key in d, f"{where} has no {key!r}")
    S = positive_int(d["num_stages"], f"{where}: num_stages")
    for key in ("layers_per_stage", "tmp_per_stage", "dp"):
        need(isinstance(d[key], list) and len(d[key]) == S,
             f"{where}: {key} has {len(d[key]) if isinstance(d[key], list) else 'no'} entries for {S} stages")
    stages = []
    for s in range(S):
        dp = positive_int(d["dp"][s], f"{where}, stage {s}: dp")
        reps = d["tmp_per_stage"][s]
        need(isinstance(reps, list) and len(reps) == dp,
             f"{where}, stage {s}: dp is {dp} but tmp_per_stage lists {len(reps) if isinstance(reps, list) else 0} "
             f"replicas")
        layers = d["layers_per_stage"][s]
        need(isinstance(layers, list) and all(isinstance(x, int) for x in layers),
             f"{where}, stage {s}: layers must be a list of layer indices, got {layers!r}")
        stages.append(Stage(tuple(layers), tuple(_replica(r, f"{where}, stage {s}, replica {j}")
                                                 for j, r in enumerate(reps))))
    return tuple(stages)


def read_sailor(d: Any, source: str = "<sailor plan>") -> ForeignPlan:
    """A Sailor plan dict as a ForeignPlan; PlanImportError naming ``source`` and what is wrong."""
    try:
        need(isinstance(d, dict), "not a JSON object")
        for key in ("pipeline_list", "mbs", "gbs"):
            need(key in d, f"no {key!r}")
        need(isinstance(d["pipeline_list"], list) and d["pipeline_list"], "pipeline_list is empty")
        pipes = tuple(_pipeline(p, i) for i, p in enumerate(d["pipeline_list"]))
        mbs, gbs = positive_int(d["mbs"], "mbs"), positive_int(d["gbs"], "gbs")
        P = len(pipes)
        ks = {(gbs // P) // (mbs * len(pipe[0].replicas)) for pipe in pipes}
        for i, pipe in enumerate(pipes):
            per = mbs * len(pipe[0].replicas) * P
            need(gbs % per == 0, f"gbs {gbs} is not divisible by mbs {mbs} x dp {len(pipe[0].replicas)} x "
                                 f"{P} pipeline(s) (pipeline {i})")
        need(len(ks) == 1, f"pipelines need different numbers of micro-batches {sorted(ks)}")
    except PlanImportError as exc:
        raise PlanImportError(f"{source}: {exc}") from None
    meta = {k: d[k] for k in META_KEYS if k in d}
    meta["mbs"] = mbs
    return ForeignPlan("sailor", pipes, gbs, ks.pop(), meta)


def _sailor_name(type_name: str) -> str:
    back = {v: k for k, v in SAILOR_NAMES.items()}
    return back.get(type_name, type_name)


def _replicas(cfg: ParallelConfig) -> list[tuple[int, ...]]:
    return list(cfg.groups) if cfg.split is not None else [(d,) for d in cfg.devices]


def _vms(replica: tuple[int, ...], cluster: Cluster, zone: str) -> list[list[Any]]:
    """The VM entries of one replica: one per server it uses (its GPUs of that type there), or one per GPU
    where its GPUs are of several types."""
    types = [cluster.devices[d].type.name for d in replica]

    def per_node(d: int) -> int:
        server = cluster.servers[cluster.devices[d].server]
        return sum(cluster.devices[x].type.name == cluster.devices[d].type.name for x in server.devices)

    if len(set(types)) > 1:
        return [[_sailor_name(t), per_node(d), zone] for t, d in zip(types, replica)]
    servers = list(dict.fromkeys(cluster.devices[d].server for d in replica))
    first = [next(d for d in replica if cluster.devices[d].server == s) for s in servers]
    return [[_sailor_name(types[0]), per_node(d), zone] for d in first]


def write_sailor(strategy: Strategy, graph: OpGraph, cluster: Cluster, zone: str | None = None) -> dict[str, Any]:
    """``strategy`` as a Sailor plan dict of one pipeline: stages are the runs of layers under one config;
    refused (PlanImportError) where a layer's ops run under several configs, a stage's batch shares are
    uneven, a replica is split unevenly, or the micro-batches are uneven or do not divide by dp."""
    from heterog.baselines.expert import block_layers

    strategy.check_fits(graph, cluster)
    zone = zone or str(strategy.meta.get("zone", "local"))
    layer_of, L = block_layers(graph)
    cfg_of_layer: list[ParallelConfig] = []
    for layer in range(L + 2):
        cfgs = {strategy.configs[int(g)] for g in np.unique(strategy.group_of[layer_of == layer])}
        need(len(cfgs) == 1, f"layer {layer}'s ops run under {len(cfgs)} configs; a Sailor stage has one")
        cfg_of_layer.append(cfgs.pop())
    stages: list[list[int]] = []
    for layer, cfg in enumerate(cfg_of_layer):
        if stages and cfg_of_layer[stages[-1][-1]] == cfg:
            stages[-1].append(layer)
        else:
            stages.append([layer])
    tmp, dps = [], []
    for s, layers in enumerate(stages):
        cfg = cfg_of_layer[layers[0]]
        reps = _replicas(cfg)
        shares = [cfg.shares[i * len(reps[0])] for i in range(len(reps))]
        need(len(set(shares)) == 1, f"stage {s}: uneven batch shares {shares}; Sailor divides the batch evenly")
        need(cfg.split in (None, "parameter", "tensor") and len(set(cfg.split_shares)) <= 1,
             f"stage {s}: a split {cfg.split!r} with shares {list(cfg.split_shares)} is not Megatron's even "
             f"tensor parallelism")
        tmp.append([[_vms(r, cluster, zone), len(r)] for r in reps])
        dps.append(len(reps))
    micro = strategy.micro
    need(len(set(micro)) == 1, f"uneven micro-batches {list(micro)}; Sailor's are mbs x dp samples each")
    need(micro[0] % dps[0] == 0, f"micro-batches of {micro[0]} samples do not divide over dp {dps[0]}")
    pipeline = {"num_stages": len(stages), "layers_per_stage": stages, "tmp_per_stage": tmp, "dp": dps}
    return {"zone": zone, "pipeline_list": [pipeline], "mbs": micro[0] // dps[0], "gbs": strategy.batch_size}
