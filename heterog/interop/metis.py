"""Metis' plans, as Sailor's copy of Metis' planner makes them (``sailor/Planner/baselines/Metis``),
read into a ``ForeignPlan``.

Metis' search keeps, for every candidate, the tuple ``(node_sequence, device_groups, strategies, batches,
layer_partition, num_repartition, cost, rank_map)`` (``MetisPlanner.cost_het_cluster``) and prints it
unnamed; the file read here is a JSON object of those fields by name, plus the global batch ``gbs`` of the
search (``InterStagePlan.gbs``):
  node_sequence    GPU types in rank order (ranks of one type are contiguous; ``A100_40``, ``A100-40``)
  device_groups    GPUs per stage, over consecutive ranks
  strategies       ``[dp, tp]`` per stage, dp x tp = the stage's GPUs; replica i of a stage is its ranks
                   i*tp .. (i+1)*tp - 1
  batches          micro-batches per iteration (each replica runs gbs / batches / dp samples of each)
  layer_partition  stage boundaries over layers 0..L+1 (stage s holds layer_partition[s] .. [s+1] - 1)
  rank_map         per stage, the GPU type of each of its ranks (``_get_device_placement``)
  cost             Metis' estimated iteration time (ms, as its cost model keeps it); num_repartition: load-
                   balancer retries (both meta)
"""
from __future__ import annotations

from typing import Any

from heterog.interop.common import ForeignPlan, PlanImportError, Stage, need, plan_gpu_name, positive_int

FIELDS = ("node_sequence", "device_groups", "strategies", "batches", "layer_partition", "rank_map", "gbs")


def read_metis(d: Any, source: str = "<metis plan>") -> ForeignPlan:
    """A Metis plan dict (module docstring) as a ForeignPlan; PlanImportError naming ``source`` and what is
    wrong."""
    try:
        need(isinstance(d, dict), "not a JSON object")
        for key in FIELDS:
            need(key in d, f"no {key!r}")
        groups, strategies, bounds, rank_map = d["device_groups"], d["strategies"], d["layer_partition"], d["rank_map"]
        need(isinstance(groups, list) and groups, "device_groups must list the GPUs of each stage")
        S = len(groups)
        need(isinstance(strategies, list) and len(strategies) == S,
             f"strategies has {len(strategies) if isinstance(strategies, list) else 'no'} entries for {S} stages")
        need(isinstance(rank_map, list) and len(rank_map) == S,
             f"rank_map has {len(rank_map) if isinstance(rank_map, list) else 'no'} entries for {S} stages")
        need(isinstance(bounds, list) and len(bounds) == S + 1 and all(isinstance(x, int) for x in bounds),
             f"layer_partition must hold {S + 1} stage boundaries, got {bounds!r}")
        gbs, batches = positive_int(d["gbs"], "gbs"), positive_int(d["batches"], "batches")
        order = [plan_gpu_name(t) for t in d["node_sequence"]]
        stages = []
        for s in range(S):
            n = positive_int(groups[s], f"stage {s}: device_groups")
            pair = strategies[s]
            need(isinstance(pair, (list, tuple)) and len(pair) == 2, f"stage {s}: a strategy is [dp, tp], got {pair!r}")
            dp, tp = positive_int(pair[0], f"stage {s}: dp"), positive_int(pair[1], f"stage {s}: tp")
            need(dp * tp == n, f"stage {s}: dp {dp} x tp {tp} != its {n} GPUs")
            need(gbs % (batches * dp) == 0, f"stage {s}: gbs {gbs} is not divisible by {batches} micro-batches x "
                                            f"dp {dp}")
            types = [plan_gpu_name(t) for t in rank_map[s]] if isinstance(rank_map[s], list) else []
            need(len(types) == n, f"stage {s}: rank_map names {len(types)} GPUs, device_groups {n}")
            unknown = sorted(set(types) - set(order))
            need(not unknown, f"stage {s}: rank_map names GPU types {unknown} not in node_sequence {order}")
            need(bounds[s + 1] > bounds[s], f"stage {s}: empty layer range {bounds[s]}..{bounds[s + 1] - 1}")
            stages.append(Stage(tuple(range(bounds[s], bounds[s + 1])),
                                tuple(tuple(types[i * tp:(i + 1) * tp]) for i in range(dp))))
    except PlanImportError as exc:
        raise PlanImportError(f"{source}: {exc}") from None
    meta = {"node_sequence": order, "batches": batches}
    for key in ("cost", "num_repartition"):
        if key in d:
            meta[key] = d[key]
    return ForeignPlan("metis", (tuple(stages),), gbs, batches, meta)
