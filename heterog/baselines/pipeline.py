"""Pipeline planner in the style of Metis and AMP: contiguous stages of layers over groups of devices,
uneven layer counts by each stage's speed and memory, data parallelism inside a stage (shares even or
proportional to the devices' speed for the stage's ops), and the number of micro-batches chosen; every
candidate is simulated and the fastest that fits is kept.

The search is a pruned enumeration, time-boxed by ``budget_s``:

  stage groups   the devices in index order (neighbours share a server) cut into stages: one stage of
                 all devices (data parallelism with gradient accumulation), one stage per server, one per
                 run of devices of one type, and stages of 1, 2, 4, ... devices;
  layers         ``heterog.baselines.expert.op_layers`` split over the stages by
                 ``balanced_partition`` (the slowest stage's time is minimised, each stage within the
                 memory of its smallest device where possible); a stage's time for a layer is its
                 devices' combined throughput at the shares used;
  shares         even, or proportional to each device's time for the stage's layers;
  micro-batches  k in 1, 2, 4, ... up to the batch (even sizes), under each schedule (or ``schedule``);
  recomputation  a candidate out of memory is tried again recomputing the fewest leading layers that
                 fit (each layer is a group; ``fitting``), or, with ``sharded``, keeping sharded state
                 in its data-parallel stages, whichever is faster (``heterog.baselines.fit``).

``balance="equal"`` is the homogeneous baseline of pipeline planners: one stage per device, equal layer
counts, even micro-batches (only k and the schedule searched).

The search runs in two passes. Screening simulates each candidate as built, once (a candidate equal to
one screened before, as even and proportional shares are on devices alike, is skipped), for k = 1, 4, 2,
8, 16, ... and in the order above, until ``SCREEN_SHARE`` of the budget has passed; with ``splits``, the
candidates whose stages divide their layers' parameters come after every replicated one of those k (a
divided candidate simulates 10-20x slower: gpt2_xl on paper-8gpu, 0.5-2 s against 0.03-0.3 s), so that a
short budget screens every stage grouping and k before it. Refinement then makes
the screened candidates fit (and, with ``sharded``, tries those that fit with sharded state) in the order
of their screened times, fastest first, until the budget ends: making a candidate fit costs many
simulations, so it goes where the screen points. The result's meta lists what was chosen, how many
candidates were screened and how many fitted. The budget is a deadline once the first candidate is
simulated and fitted: nothing is simulated after it (a candidate's search for a way to fit stops there
too).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from heterog.baselines.expert import balanced_partition, group_strategy, op_layers, op_memory_bytes
from heterog.baselines.fit import fit, past
from heterog.errors import HeterogError
from heterog.shares import even_shares, proportional_shares
from heterog.strategy import MAX_MICRO_BATCHES, SCHEDULES, ParallelConfig, Strategy, most_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterator

    from heterog.cluster import Cluster
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph

MICRO_ORDER = (1, 4, 2, 8, 16, 32, 64)
# the share of the budget that screening may take before refinement starts
SCREEN_SHARE = 0.5


def plan_key(strategy: Strategy) -> tuple:
    """What makes two candidates the same plan: each group's config and op set, the micro-batches, the
    schedule where there are several, and the recomputed groups."""
    return (strategy.group_of.tobytes(), tuple(strategy.configs), strategy.micro_batches,
            strategy.schedule if strategy.n_micro > 1 else None, tuple(strategy.recompute))


def stage_groups(n_devices: int, servers: list[list[int]], types: list[str] | None = None) -> list[list[list[int]]]:
    """Ways to cut the devices (in index order) into contiguous stages: one stage of all (data parallelism,
    first so that a short search still meets it), per server, per run of one device type (``types``, each
    device's; Metis' stages on a cluster of two GPU models), and stages of 1, 2, 4, ... devices; duplicates
    dropped, in that order."""
    devs = list(range(n_devices))
    out = [[devs], servers]
    if types is not None:
        runs: list[list[int]] = []
        for d in devs:
            if runs and types[runs[-1][-1]] == types[d]:
                runs[-1].append(d)
            else:
                runs.append([d])
        out.append(runs)
    size = 1
    while size < n_devices:
        out.append([devs[i:i + size] for i in range(0, n_devices, size)])
        size *= 2
    seen, unique = set(), []
    for cut in out:
        key = tuple(tuple(s) for s in cut)
        if key not in seen:
            seen.add(key)
            unique.append(cut)
    return unique


def least_state_bytes(graph: OpGraph, cluster: Cluster, layer_of: np.ndarray, stages: list[list[int]]) -> np.ndarray:
    """(L, stages) the fewest resident bytes a layer's parameters, gradients and optimizer state may take
    on the fullest device of each stage, with the strongest sharded state ``heterog.baselines.fit``
    offers: on a stage of several devices every part in shards (stage 3; weights by memory), on one of
    one device all of it; the optimizer state on the host (offloaded) where every server of the stage
    has one, and on a stage of several devices the parameter shards too."""
    L = int(layer_of.max()) + 1
    param = np.bincount(layer_of, weights=[float(o.param_bytes) for o in graph.ops], minlength=L)
    grad = np.bincount(layer_of, weights=[float(o.grad_bytes) for o in graph.ops], minlength=L)
    state = np.bincount(layer_of, weights=[float(o.state_bytes) for o in graph.ops], minlength=L)
    mem = np.asarray(cluster.memory_bytes, dtype=np.float64)
    out = np.zeros((L, len(stages)))
    for s, devs in enumerate(stages):
        hosted = all(cluster.servers[int(cluster.server_of[d])].host is not None for d in devs)
        frac = float(mem[devs].max() / mem[devs].sum())
        out[:, s] = (grad + (0.0 if hosted and len(devs) > 1 else param) + (0.0 if hosted else state)) * frac
    return out


def stage_plan(ev: PlanEvaluator, stages: list[list[int]], proportional: bool,
               layer_of: np.ndarray, times: np.ndarray, split: bool = False,
               sharded: bool = False) -> tuple[np.ndarray, list[ParallelConfig]]:
    """(stage of each layer, config of each stage) for ``stages`` (device lists): layers balanced over
    the stages by each stage's time for them (its slowest replica at its share), each stage within its
    smallest device's memory where possible (a layer's parameters and state, and its kept activations
    at the largest share). ``split``: a stage of several devices divides its layers' parameters among
    them (a "parameter" split config, shares as the batch shares would be) instead of replicating them,
    so a layer's parameters and state count at the largest share too. ``sharded``: where no split keeps
    the whole state and activations within memory, the layers are balanced within memory counting their
    state as the strongest sharded state holds it (``least_state_bytes``), with the kept activations,
    then without them (recomputation drops most), so that ``fit`` can make the plan fit; the memory
    limit is dropped only where even that does not fit."""
    graph, cluster = ev.graph, ev.cluster
    B = graph.batch_size
    L = int(layer_of.max()) + 1
    layer_dev = np.zeros((L, cluster.n_devices))
    np.add.at(layer_dev, layer_of, times)                                   # (L, M) full-batch seconds
    held, transient = op_memory_bytes(graph)
    resident = np.bincount(layer_of, weights=graph.resident_bytes, minlength=L)
    kept = np.bincount(layer_of, weights=held, minlength=L) - resident      # activations kept for backward
    configs, cost, cap, largest = [], np.zeros((L, len(stages))), np.zeros(len(stages)), 0.0
    for s, devs in enumerate(stages):
        speed = 1.0 / np.maximum(layer_dev[:, devs].sum(axis=0), 1e-12)     # each device's rate on all layers
        shares = proportional_shares(B, speed) if proportional and len(devs) > 1 else even_shares(B, len(devs))
        pairs = [(d, b) for d, b in zip(devs, shares) if b > 0]
        if split and len(pairs) > 1:
            configs.append(ParallelConfig.split_over([d for d, _ in pairs], [b for _, b in pairs], B))
        else:
            configs.append(ParallelConfig.of(pairs, sync="allreduce"))
        frac = np.array([b / B for _, b in pairs])
        used = [d for d, _ in pairs]
        cost[:, s] = np.max(layer_dev[:, used] * frac[None, :], axis=1)     # the slowest replica
        cap[s] = float(np.min(cluster.memory_bytes[used])) - float(transient.max(initial=0.0))
        largest = max(largest, float(frac.max()))
    held = (resident + kept) * largest if split else resident + kept * largest
    if not sharded or split:
        return balanced_partition(cost, held, cap), configs
    least = least_state_bytes(graph, cluster, layer_of, stages)
    for estimate in (np.broadcast_to(held[:, None], cost.shape), least + kept[:, None] * largest, least):
        stage_of = _partition_within(cost, estimate, cap)
        if stage_of is not None:
            return stage_of, configs
    return balanced_partition(cost, held, cap), configs


def _partition_within(cost: np.ndarray, held: np.ndarray, cap: np.ndarray) -> np.ndarray | None:
    """``balanced_partition`` of layers whose bytes on each stage are ``held`` (L, stages), the memory of
    each stage within ``cap``; None where no split keeps every stage within it. The bytes a stage holds
    are its own column's: the partition runs on the largest column and is checked on each."""
    stage_of = balanced_partition(cost, held.max(axis=1), cap)
    used = np.array([held[stage_of == k, k].sum() for k in range(cost.shape[1])])
    if (used <= cap).all():
        return stage_of
    return None


def fitting(ev: PlanEvaluator, strategy: Strategy, ways: tuple[str, ...] = ("recompute",),
            improve: bool = False, deadline: float | None = None, known: tuple[float, bool] | None = None
            ) -> tuple[Strategy, float, bool]:
    """(plan, time, OOM) of ``strategy`` made to fit by ``heterog.baselines.fit.fit`` with ``ways`` (by
    default recomputing the fewest leading groups that fit, where it recomputes nothing yet; with
    "sharded" also sharded state, and ``improve``: kept where it is faster even though the plan fits;
    nothing simulated after ``strategy`` itself once ``deadline`` has passed; ``known``: ``strategy``'s
    simulated result, where the caller has it); the plan records the way in ``meta["fit"]``."""
    found = fit(ev, strategy, ways, improve, deadline, known)
    return found.strategy, found.time_s, found.oom


def with_best_micro_batches(ev: PlanEvaluator, strategy: Strategy, max_micro_batches: int,
                            oom_factor: float = 10.0, ways: tuple[str, ...] = ("recompute",),
                            deadline: float | None = None) -> Strategy:
    """``strategy`` over the number of micro-batches (1, 2, 4, ... up to ``max_micro_batches`` and the batch,
    or what its grids allow, ``most_micro_batches``; even sizes, each schedule) that simulates fastest,
    out-of-memory plans costing ``oom_factor`` times their time, each recomputing the fewest leading groups
    that fit where only that fits (``fitting`` with ``ways``); ``strategy`` itself when none beats it. Nothing
    is simulated once ``time.perf_counter()`` passes ``deadline``, but for ``strategy`` itself: a search for a
    way to fit stops there too."""
    best, t, oom = fitting(ev, strategy, ways, deadline=deadline)
    best_cost = t * (oom_factor if oom else 1.0)
    k = 2
    while k <= min(most_micro_batches(strategy), max_micro_batches):
        for schedule in SCHEDULES:
            if past(deadline):
                return best
            s, t, oom = fitting(ev, strategy.with_micro_batches(k, schedule), ways, deadline=deadline)
            c = t * (oom_factor if oom else 1.0)
            if c < best_cost:
                best, best_cost = s, c
        k *= 2
    return best


def equal_stages(n_layers: int, n_devices: int) -> np.ndarray:
    """(n_layers,) stage of each layer: one stage per device, equal numbers of consecutive layers (the
    first stages take the rest)."""
    sizes = even_shares(n_layers, n_devices)
    return np.repeat(np.arange(n_devices), sizes)


def pipeline(ev: PlanEvaluator, budget_s: float | None = None, schedule: str | None = None,
             max_micro_batches: int = 32, balance: str = "cost", splits: bool = False,
             sharded: bool = False) -> Strategy:
    """The fastest simulated pipeline plan that fits (the fastest of all when none fits) within
    ``budget_s`` seconds of search (default 30); micro-batch counts up to ``max_micro_batches`` are searched,
    and more (doubling, up to the batch and ``MAX_MICRO_BATCHES``) while no candidate fits; ``schedule``
    orders the micro-batches (None: each of ``SCHEDULES`` is tried). ``balance="equal"`` is the homogeneous
    baseline: one stage per device with equal numbers of layers (``equal_stages``), only the micro-batches
    searched. ``splits``: where no candidate of a stage grouping with data parallelism inside its stages
    fits as screened (at that k), the grouping is also tried dividing each stage's layers' parameters among
    its devices (tensor parallelism inside a stage, ``stage_plan``), after every replicated candidate: on
    the clusters measured, divided stages pay only where memory forces them (docs/results.md, "Splits
    beyond the batch"), and the budget goes to the other candidates. Off by default. ``sharded``: a stage
    whose replicas are data parallel may keep sharded state
    (``heterog.sharded``; stage 1, 2 or 3, shards even, by memory or by speed, the optimizer state on the
    GPUs or offloaded to the host; a stage of one device may offload), its layers balanced within memory
    as that state holds them where nothing else fits (``stage_plan``): a candidate out of memory
    is made to fit by the fastest of sharded state and recomputation (``heterog.baselines.fit.fit``), and
    one that fits is also tried with its data-parallel stages sharded, kept where faster. Off by default: at
    the same budget it pays where memory binds (1.17-1.40x on language models on mixed-a100-v100-t4) and
    costs candidates elsewhere (docs/results.md, "Sharded state in the planners")."""
    if balance not in ("cost", "equal"):
        raise HeterogError(f"unknown balance {balance!r} for the pipeline planner (choose from cost, equal)")
    if schedule is not None and schedule not in SCHEDULES:
        raise HeterogError(f"unknown schedule {schedule!r} for the pipeline planner (choose from {SCHEDULES})")
    if max_micro_batches < 1:
        raise HeterogError(f"max_micro_batches must be at least 1, got {max_micro_batches}")
    graph, cluster = ev.graph, ev.cluster
    budget = 30.0 if budget_s is None else float(budget_s)
    t0 = time.perf_counter()
    layer_of, names = op_layers(graph)
    times = ev.cost.full_batch_times(graph)
    servers = [np.nonzero(cluster.server_of == j)[0].tolist() for j in np.unique(cluster.server_of).tolist()]
    B = graph.batch_size
    micro = [k for k in MICRO_ORDER if k <= min(B, max_micro_batches)]
    # beyond the cap only while nothing fits: smaller micro-batches hold fewer activations
    beyond = [k for k in (2 ** j for j in range(1, 12)) if max(micro) < k <= min(B, MAX_MICRO_BATCHES)]
    ways = ("recompute", "sharded") if sharded else ("recompute",)
    types = [dev.type.name for dev in cluster.devices]
    groupings = stage_groups(cluster.n_devices, servers, types) if balance == "cost" else \
        [[[d] for d in range(cluster.n_devices)]]
    # screening: each candidate simulated as built, in the order above, until SCREEN_SHARE of the budget
    screened: list[tuple[float, bool, Strategy]] = []
    seen: set = set()
    built: dict[tuple[int, bool, bool], tuple[np.ndarray, list[ParallelConfig]]] = {}
    replicated_fits: set[tuple[int, int]] = set()          # (k, grouping) where a replicated candidate fits

    def candidates(k: int, divided: bool) -> Iterator[tuple[int, Strategy]]:
        """The candidates of ``k`` micro-batches, each grouping's in order: with ``divided``, those whose
        stages divide their layers' parameters, for the groupings of no replicated candidate that fits."""
        for i, stages in enumerate(groupings):
            if divided and (max(map(len, stages)) == 1 or (k, i) in replicated_fits):
                continue
            for proportional in (True, False) if balance == "cost" else (False,):
                if (i, proportional, divided) not in built:
                    built[i, proportional, divided] = (
                        stage_plan(ev, stages, proportional, layer_of, times, divided, sharded)
                        if balance == "cost" else
                        (equal_stages(len(names), cluster.n_devices),
                         [ParallelConfig.single(d, B) for d in range(cluster.n_devices)]))
                stage_of_layer, configs = built[i, proportional, divided]
                # a group per layer, under its stage's config: layers are what recomputation rebuilds
                s = group_strategy(ev, layer_of, [configs[g] for g in stage_of_layer.tolist()], meta={
                    "stages": [configs[g].devices for g in np.unique(stage_of_layer).tolist()],
                    "layers_per_stage": np.bincount(stage_of_layer, minlength=len(stages)).tolist(),
                    "micro_batches": k, "shares": "proportional" if proportional else "even",
                    "stage_split": divided})
                for v in [s] if k == 1 else [s.with_micro_batches(k, sched)
                                             for sched in ((schedule,) if schedule else SCHEDULES)]:
                    yield i, v

    def screen() -> None:
        # the replicated stages at every k first, then the divided ones (each simulates 10-20x slower), then
        # micro-batches beyond the cap while nothing fits, each k replicated then divided
        passes = [(micro, False)] + ([(micro, True)] if splits else [])
        passes += [([k], divided) for k in beyond for divided in ((False, True) if splits else (False,))]
        for ks, divided in passes:
            for k in ks:
                if k in beyond and any(not oom for _, oom, _ in screened):
                    return
                for i, v in candidates(k, divided):
                    if screened and past(t0 + SCREEN_SHARE * budget):
                        return
                    key = plan_key(v)
                    if key in seen:                # even and proportional shares alike on alike devices
                        continue
                    seen.add(key)
                    t, oom = ev.iteration_time(v)
                    screened.append((float(t), bool(oom), v))
                    if not divided and not oom:
                        replicated_fits.add((k, i))

    screen()
    # refinement: the candidates in order of their screened time, each made to fit (and, with sharded state,
    # tried sharded where it fits) until the deadline; the first in full
    best: tuple | None = None
    fitted = 0
    for t, oom, v in sorted(screened, key=lambda c: c[0]):
        if oom or sharded:
            deadline = None if best is None else t0 + budget
            if past(deadline):
                break
            v, t, oom = fitting(ev, v, ways, improve=sharded, deadline=deadline, known=(t, oom))
            fitted += 1
        if best is None or (oom, t) < best[0]:
            best = ((oom, t), v)
    assert best is not None
    # a candidate never refined stands as screened (out of memory)
    out = min([best, *(((oom, t), v) for t, oom, v in screened)], key=lambda c: c[0])[1]
    out.meta.update({"candidates": len(screened), "fitted": fitted, "layers": len(names),
                     "recomputed_groups": len(out.recompute),
                     "sharded_groups": sum(c.sharded is not None for c in out.configs)})
    return out
