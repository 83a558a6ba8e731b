"""How close plans get to 10% over the best data-parallel baseline, and the lower bounds that say how
close they could get (docs/results.md, "Why the data-parallel LP's 489 ms is not reachable").

For one model on one cluster, under the default order: CP-AR; the MCMC start cp-ar-ps-small, and it with
the block of groups that synchronises the most gradient bytes on one device (MCMC's block move);
lp-round (the data-parallel LP rounded to a plan); the data-parallel bounds: the LP of
``action_space_bound``, the same with the heaviest groups integral, ``release_bound`` (LP and MILP);
and the link loads of CP-AR (how far the NICs are from saturated).

    python -m experiments.gap [--model bert_large] [--batch-size 48] [--cluster paper-8gpu]
                              [--integral-groups 50] [--time-limit-s 120] [--no-lp-round]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from heterog import baselines
from heterog.baselines.chains import coupled_blocks
from heterog.baselines.mcmc import start_actions
from heterog.bounds import action_space_bound, release_bound
from heterog.cluster import load_cluster
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert_large")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--cluster", default="paper-8gpu")
    p.add_argument("--integral-groups", type=int, default=50)
    p.add_argument("--time-limit-s", type=float, default=120.0)
    p.add_argument("--no-lp-round", action="store_true")
    a = p.parse_args(argv)
    graph, cluster = capture_model(a.model, a.batch_size), load_cluster(a.cluster)
    ev = Evaluator(graph, cluster)
    m = cluster.n_devices
    ms = lambda s: f"{s * 1e3:8.1f} ms"       # noqa: E731

    cp_ar = ev.evaluate(baselines.run("cp-ar", graph, cluster, evaluator=ev))
    target = cp_ar.iteration_time_s / 1.1
    print(f"{a.model}-b{a.batch_size} on {a.cluster}: cp-ar {ms(cp_ar.iteration_time_s)} ({cp_ar.order}); "
          f"10% target {ms(target)}")
    names = [d.name for d in cluster.devices] + [link.name for link in cluster.links]
    busy = np.asarray(cp_ar.sim.busy)
    nic = [i for i, n in enumerate(names) if "nic" in n]
    print(f"  cp-ar NIC links busy {ms(busy[nic].min())} .. {ms(busy[nic].max())}; busiest GPU "
          f"{ms(busy[:m].max())}; first AllReduce starts at {ms(_first_sync(cp_ar))}")
    small = ev.evaluate(ev.strategy(start_actions(ev, "cp-ar-ps-small", np.random.default_rng(0))))
    print(f"  cp-ar-ps-small              {ms(small.iteration_time_s)} ({small.order}), "
          f"{cp_ar.iteration_time_s / small.iteration_time_s:.3f}x")
    blocks = coupled_blocks(graph, ev.group_of)
    if blocks:      # the block that synchronises the most gradient bytes, on one device (MCMC's block move)
        heavy = max(blocks, key=lambda b: b.sync_bytes)
        base = start_actions(ev, "cp-ar-ps-small", np.random.default_rng(0))
        on = [ev.evaluate(ev.strategy(np.where(np.isin(np.arange(len(base)), heavy.groups), d, base)))
              for d in range(m)]
        d = int(np.argmin([r.iteration_time_s for r in on]))
        print(f"  ... + its heaviest block ({len(heavy.groups)} groups, {heavy.sync_bytes / 1e6:.0f} MB of gradients) "
              f"on {cluster.devices[d].name}: {ms(on[d].iteration_time_s)} ({on[d].order}), "
              f"{cp_ar.iteration_time_s / on[d].iteration_time_s:.3f}x")
    if not a.no_lp_round:
        t = time.perf_counter()
        s = baselines.run("lp-round", graph, cluster, evaluator=ev, integral_groups=a.integral_groups,
                          time_limit_s=a.time_limit_s)
        r = ev.evaluate(s)
        print(f"  lp-round                    {ms(r.iteration_time_s)} ({r.order}), "
              f"{cp_ar.iteration_time_s / r.iteration_time_s:.3f}x  [{time.perf_counter() - t:.0f} s]")
    t = time.perf_counter()
    b = action_space_bound(ev, data_parallel_only=True, integral_groups=a.integral_groups,
                           time_limit_s=a.time_limit_s)
    took = time.perf_counter() - t
    print(f"  DP-only LP (action_space_bound)              {ms(b['bound_s'])}; "
          f"{a.integral_groups} heaviest groups integral {ms(b['integral_bound_s'])}  [{took:.0f} s]")
    t = time.perf_counter()
    r0 = release_bound(ev, data_parallel_only=True)
    r1 = release_bound(ev, data_parallel_only=True, integral_groups=a.integral_groups, time_limit_s=a.time_limit_s)
    r_all = release_bound(ev, data_parallel_only=False)
    print(f"  DP-only release_bound LP {ms(r0['bound_s'])} (L = {ms(r0['release_s'])}, compute bound of the "
          f"release set {ms(r0['release_bound_s'])}); {a.integral_groups} groups integral {ms(r1['bound_s'])}  "
          f"[{time.perf_counter() - t:.0f} s]")
    print(f"  all actions release_bound {ms(r_all['bound_s'])}")


def _first_sync(res) -> float:
    from heterog.compiler.tasks import TaskKind

    kinds = np.isin(res.plan.task_kind, [int(TaskKind.PUSH), int(TaskKind.ALLREDUCE)])
    return float(np.asarray(res.sim.start)[kinds].min()) if kinds.any() else float("nan")


if __name__ == "__main__":
    main()
