"""`heterog bench`: the performance targets of docs/design.md section 8, measured side by side.

Speeds are reported with the reference measured in the same run, so a noisy machine shifts both.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.shares import even_shares
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluate import Evaluator


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def run_bench(quick: bool = False) -> dict:
    """Simulator kernel throughput vs the reference; one full evaluation of bert_large on paper-8gpu, the
    evaluation of a one-group change patched from it, MCMC's evaluations per second, and the speed-up of
    the same MCMC search on 2 Ray workers (tiny_transformer and no Ray with ``quick``)."""
    import simulator
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    out: dict = {"load_average_1min_at_start": os.getloadavg()[0], "cpu_count": os.cpu_count()}
    sim = simulator.bench(n_tasks=5000 if quick else 50000)
    out.update({k: sim[k] for k in ("sim_tasks_per_s", "ref_tasks_per_s", "sim_speedup_vs_reference")})

    model, batch = ("tiny_transformer", 16) if quick else ("bert_large", 48)
    t0 = time.perf_counter()
    graph = capture_model(model, batch)
    out["graph_load_or_capture_s"] = time.perf_counter() - t0
    out["graph"] = f"{model} (batch {batch}): {graph.n_ops} ops"
    ev = Evaluator(graph, load_cluster("paper-8gpu"))
    rng = np.random.default_rng(0)
    actions = rng.integers(0, ev.cluster.n_devices + 4, size=ev.n_groups)   # a mixed MP/DP strategy
    strategy = ev.strategy(actions, "mixed")
    res = ev.evaluate(strategy)
    out["eval_tasks"] = res.n_tasks
    out["eval_ms_compile"] = _median_ms(lambda: ev.compiler.compile(strategy, patch=False), 3 if quick else 11)
    plan = ev.compile(strategy)
    out["eval_ms_rank"] = _median_ms(lambda: ev.priorities(plan, "rank-contention"), 3 if quick else 11)
    prio = ev.priorities(plan, "rank-contention")
    out["eval_ms_simulate"] = _median_ms(lambda: simulator.simulate(plan.tg, priority=prio), 3 if quick else 11)

    out["eval_ms_bert_large_paper8" if not quick else "eval_ms_quick"] = _median_ms(
        from_scratch(ev, strategy), 3 if quick else 11)
    # the same plan over 4 micro-batches (1F1B), compiled from scratch each time: 4x the op instances
    micro4 = dataclasses.replace(strategy, micro_batches=tuple(even_shares(batch, 4)), schedule="1f1b")
    out["eval_tasks_k4"] = ev.evaluate(micro4).n_tasks
    out["eval_ms_bert_large_paper8_k4" if not quick else "eval_ms_quick_k4"] = _median_ms(
        from_scratch(ev, micro4), 3 if quick else 11)
    # every group split beyond the batch evenly over every device: the option choice once, then from scratch
    split = split_everything(ev)
    t0 = time.perf_counter()
    out["eval_tasks_split"] = ev.evaluate(split).n_tasks
    out["split_choice_s" if not quick else "split_choice_s_quick"] = time.perf_counter() - t0
    out["eval_ms_bert_large_paper8_split" if not quick else "eval_ms_quick_split"] = _median_ms(
        from_scratch(ev, split), 3 if quick else 11)
    if not quick:
        out.update(scale_eval(ev, strategy, out["eval_ms_bert_large_paper8"]))
    out.update(delta_eval(ev, actions, quick))
    out.update(delta_eval(ev, actions, quick, micro_batches=4))
    out.update(search_speed(ev, quick))
    if quick:                                   # the keys of the full benchmark, not measured
        out.update(dict.fromkeys(("eval_ms_bert_large_paper8", "eval_ms_bert_large_paper8_k4",
                                  "eval_ms_bert_large_paper8_split", "eval_ms_bert_large_paper8_k32",
                                  "eval_k32_over_k1_bert_large_paper8", "eval_ms_gpt2_xl_split_paper8",
                                  "eval_ms_opt350m_128gpu",
                                  "eval_ms_delta_bert_large_paper8", "eval_ms_delta_bert_large_paper8_k4",
                                  "mcmc_evals_per_s_bert_large_paper8", "mcmc_n_evals_bert_large_paper8",
                                  "mcmc_evals_per_s_simulation_only_bert_large_paper8",
                                  "mcmc_speedup_vs_best_dp_bert_large_paper8", "search_speedup_2_workers")))
    else:
        out["order_comparison"] = order_comparison()
    out["load_average_1min_at_end"] = os.getloadavg()[0]       # > 0 means other work shared the CPUs
    return out


def from_scratch(ev: Evaluator, strategy: Strategy) -> Callable[[], object]:
    """An evaluation of ``strategy`` with no recent plan to patch: compile, rank and simulate."""
    def run() -> None:
        ev.clear_plans()
        ev.iteration_time(strategy)
    return run


def scale_eval(ev: Evaluator, strategy: Strategy, k1_ms: float) -> dict[str, Any]:
    """Evaluations whose cost grows with a plan's copies, each from scratch (median of 3 after a first one):
    ``strategy`` (bert_large on paper-8gpu, its full evaluation ``k1_ms``) over 32 micro-batches (1F1B), and
    its ratio to ``k1_ms``; gpt2_xl (batch 8, Adam) with every group divided beyond the batch evenly over
    paper-8gpu; OPT-350M (sequence 2048, batch 1024) data-parallel (EV-AR) on 32 A100 and 96 V100 GPUs of
    gcp-a100-v100, 4 a server (its first evaluation's seconds reported beside): composed from one slice of the
    cluster (``heterog.compose``; the slices it stands for in ``eval_copies_opt350m_128gpu``), simulated whole
    (``_whole``, one evaluation), and over 8 micro-batches, composed."""
    from heterog import baselines
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    out: dict[str, Any] = {}
    k32 = dataclasses.replace(strategy, micro_batches=tuple(even_shares(ev.graph.batch_size, 32)), schedule="1f1b")
    out["eval_tasks_k32"] = ev.evaluate(k32).n_tasks
    out["eval_ms_bert_large_paper8_k32"] = _median_ms(from_scratch(ev, k32), 3)
    out["eval_k32_over_k1_bert_large_paper8"] = out["eval_ms_bert_large_paper8_k32"] / k1_ms
    xl = Evaluator(capture_model("gpt2_xl", 8, "adam"), ev.cluster)
    split = split_everything(xl)
    out["eval_tasks_gpt2_xl_split"] = xl.evaluate(split).n_tasks
    out["eval_ms_gpt2_xl_split_paper8"] = _median_ms(from_scratch(xl, split), 3)
    big = Evaluator(capture_model("opt_350m", 1024), load_cluster("gcp-a100-v100:a100=8,v100=24,gpus_per_node=4"))
    dp = baselines.run("ev-ar", big.graph, big.cluster, evaluator=big)
    t0 = time.perf_counter()
    out["eval_tasks_opt350m_128gpu"] = big.evaluate(dp).n_tasks
    out["eval_s_first_opt350m_128gpu"] = time.perf_counter() - t0
    out["eval_ms_opt350m_128gpu"] = _median_ms(from_scratch(big, dp), 3)
    rep = big.repetition(dp)
    out["eval_copies_opt350m_128gpu"] = 1 if rep is None else rep[1].copies
    whole = Evaluator(big.graph, big.cluster, big.cost, compose=False)
    out["eval_ms_opt350m_128gpu_whole"] = _median_ms(from_scratch(whole, dp), 1)
    k8 = dp.with_micro_batches(8)
    out["eval_tasks_opt350m_128gpu_k8"] = whole.evaluate(k8).n_tasks
    out["eval_ms_opt350m_128gpu_k8"] = _median_ms(from_scratch(big, k8), 3)
    return out


def split_everything(ev: Evaluator) -> Strategy:
    """The strategy that divides every group's parameters evenly over every device of the cluster."""
    g, c = ev.graph, ev.cluster
    cfg = ParallelConfig.split_over(range(c.n_devices), [1] * c.n_devices, g.batch_size)
    return Strategy(g.fingerprint, c.name, c.n_devices, g.batch_size, ev.group_of, [cfg] * ev.n_groups,
                    "split-even")


def one_group_changes(actions: np.ndarray, n_devices: int, n: int, seed: int = 1) -> list[tuple[int, np.ndarray]]:
    """``n`` copies of ``actions`` (one per group, ``n_devices`` + 4 choices), each with one random group
    set to another action (group and action drawn with ``seed``): (group, actions) pairs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = actions.copy()
        g = int(rng.integers(len(a)))
        a[g] = (a[g] + 1 + rng.integers(n_devices + 3)) % (n_devices + 4)
        out.append((g, a))
    return out


def delta_eval(ev: Evaluator, actions: np.ndarray, quick: bool = False, micro_batches: int = 1) -> dict[str, Any]:
    """Evaluations of ``actions`` with one random group changed (a different one each time), each patched
    from the plan of ``actions`` (``heterog.compiler.delta``): median milliseconds under the order MCMC's
    loop uses and under the evaluator's (``best``), with the full evaluation of the same strategies beside;
    with ``micro_batches`` > 1, every plan over that many micro-batches (1F1B; keys end in ``_k4`` for 4)."""
    from heterog.baselines.mcmc import SEARCH_ORDER, ActionSearch

    search = ActionSearch(ev)
    base = search.strategy(actions).with_micro_batches(micro_batches, "1f1b")
    ev.compile(base)
    variants = [search.strategy(a).with_micro_batches(micro_batches, "1f1b")
                for _, a in one_group_changes(actions, ev.cluster.n_devices, 7 if quick else 31)]

    def median_ms(order: str | None, patch: bool) -> float:
        times = []
        for s in variants:
            ev.compiler.bases.clear()
            if patch:
                ev.compile(base)
            t0 = time.perf_counter()
            ev.iteration_time(s, order)
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))

    name = ("quick" if quick else "bert_large_paper8") + (f"_k{micro_batches}" if micro_batches > 1 else "")
    if micro_batches > 1:
        return {f"eval_ms_delta_{name}": median_ms(SEARCH_ORDER, True),
                f"eval_ms_delta_full_{name}": median_ms(SEARCH_ORDER, False)}
    return {f"eval_ms_delta_{name}": median_ms(SEARCH_ORDER, True),
            f"eval_ms_delta_full_{name}": median_ms(SEARCH_ORDER, False),
            f"eval_ms_delta_best_order_{name}": median_ms(None, True),
            "search_order": SEARCH_ORDER}


SPEEDUP_REPEATS = 3


def search_speed(ev: Evaluator, quick: bool = False, workers: int = 2) -> dict[str, Any]:
    """MCMC (default settings, seed 0) on the evaluator's graph: evaluations per second in a 30 s budget
    (3 s quick), the evaluations made, and how much faster its plan is than the best data-parallel
    baseline's (``mcmc_speedup_vs_best_dp_*``: best DP time / MCMC's, both under the evaluator's order;
    bert_large on paper-8gpu reaches 1.1 by placing its tied embedding and LM head on one device), the
    evaluations per second its simulations alone allow (``mcmc_evals_per_s_simulation_only_*``: as if all but the
    simulator's event loop cost nothing, a ceiling of the rate on this machine); and the
    evaluations per second of one search (a fixed proposal budget, so the same search) in its chains with
    ``workers`` Ray workers over one Ray worker, timed in this run (not quick): the median of
    ``SPEEDUP_REPEATS`` ratios, one and ``workers`` workers alternated."""
    from heterog import planners
    from heterog.baselines.mcmc import mcmc

    name = "quick" if quick else "bert_large_paper8"
    budget_s = 3.0 if quick else 30.0
    s = mcmc(ev, budget_s=budget_s, seed=0)
    best_dp = min(ev.iteration_time(planners.plan(n, evaluator=ev))[0] for n in ("ev-ps", "ev-ar", "cp-ps", "cp-ar"))
    out = {f"mcmc_evals_per_s_{name}": s.meta["evals_per_s"], "mcmc_chain_evals_per_s": s.meta["chain_evals_per_s"],
           f"mcmc_n_evals_{name}": s.meta["n_evals"], "mcmc_budget_s": budget_s,
           f"mcmc_speedup_vs_best_dp_{name}": best_dp / ev.iteration_time(s)[0],
           # the same evaluations with nothing but their simulations: a ceiling for this simulator on this machine
           f"mcmc_evals_per_s_simulation_only_{name}": s.meta["simulation_only_evals_per_s"]}
    if quick:
        return out
    from heterog.parallel import import_ray, init_ray

    ray = import_ray()
    if not ray.is_initialized():
        init_ray()
    address = ray.get_runtime_context().gcs_address      # both arms on Ray workers, built alike
    rates: dict[int, list[float]] = {1: [], workers: []}
    for _ in range(SPEEDUP_REPEATS):        # alternated: a slow minute of a shared host hits both alike
        for n in (1, workers):
            rates[n].append(mcmc(ev, seed=0, max_evals=2000, workers=n, ray_address=address
                                 ).meta["chain_evals_per_s"])
    ratios = [w / one for one, w in zip(rates[1], rates[workers])]
    out.update({"search_speedup_2_workers": float(np.median(ratios)), "search_speedup_2_workers_runs": ratios,
                "search_chain_evals_per_s_1_worker": float(np.median(rates[1])),
                f"search_chain_evals_per_s_{workers}_workers": float(np.median(rates[workers]))})
    return out


ORDER_MODELS = (("vgg19", 192), ("inception_v3", 192), ("transformer", 720))


def order_comparison(models: Sequence[tuple[str, int]] = ORDER_MODELS, cluster_name: str = "paper-8gpu"
                     ) -> dict[str, Any]:
    """Iteration time (s) of the four DP baselines under each task order, FIFO/order ratios (above 1: the
    order beats FIFO) averaged over the cases, and the worst case of each order against FIFO."""
    from heterog import baselines
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model
    from heterog.scheduler import ORDERS

    cluster = load_cluster(cluster_name)
    rows: list[dict[str, Any]] = []
    for model, batch in models:
        ev = Evaluator(capture_model(model, batch), cluster)
        for method in ("ev-ps", "ev-ar", "cp-ps", "cp-ar"):
            plan = ev.compile(baselines.run(method, ev.graph, cluster, evaluator=ev))
            times = {o: float(ev.simulate_plan(plan, o).makespan) for o in ORDERS}
            rows.append({"model": model, "method": method, **{f"{o}_s": t for o, t in times.items()}})
    mean_ratio = {o: float(np.mean([r["fifo_s"] / r[f"{o}_s"] for r in rows])) for o in ORDERS}
    worst = {o: float(np.min([r["fifo_s"] / r[f"{o}_s"] for r in rows])) for o in ORDERS}
    return {"rows": rows, "mean_fifo_over_order": mean_ratio, "min_fifo_over_order": worst}


PS_MODELS = (("bert_large", 48), ("vgg19", 192), ("transformer", 720))


def bytes_balanced_ps(strategy: Strategy, group_bytes: np.ndarray) -> Strategy:
    """``strategy`` with PS devices assigned by bytes alone, the reference the PS choice is measured
    against: PS groups with parameters in decreasing bytes (ties: lower group), each on its least-loaded
    replica (ties: lower device)."""
    load: dict[int, float] = {}
    configs = list(strategy.configs)
    for g in np.argsort(-group_bytes, kind="stable").tolist():
        c = configs[g]
        if c.sync != "ps" or len(c.devices) < 2 or group_bytes[g] == 0:
            continue
        d = min(c.devices, key=lambda x: (load.get(x, 0.0), x))
        load[d] = load.get(d, 0.0) + float(group_bytes[g])
        configs[g] = dataclasses.replace(c, ps_device=d)
    return dataclasses.replace(strategy, configs=configs)


def ps_choice_comparison(models: Sequence[tuple[str, int]] = PS_MODELS, cluster_name: str = "paper-8gpu"
                         ) -> dict[str, Any]:
    """Iteration time (s) of EV-PS and CP-PS under three choices of PS devices: the compiler's load-aware
    choice alone (``greedy_s``), the baseline's (that choice with its large groups checked by simulation,
    ``auto_s``) and the bytes-balanced assignment (``balanced_s``); ``auto_over_balanced`` per case and the
    worst of them."""
    from heterog import baselines
    from heterog.baselines.basic import DP_OFFSETS, uniform_actions
    from heterog.baselines.ps_refine import ps_group_bytes
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    cluster = load_cluster(cluster_name)
    rows: list[dict[str, Any]] = []
    for model, batch in models:
        ev = Evaluator(capture_model(model, batch), cluster)
        for method in ("ev-ps", "cp-ps"):
            plain = ev.strategy(uniform_actions(ev, cluster.n_devices + DP_OFFSETS[method]))
            auto = baselines.run(method, ev.graph, cluster, evaluator=ev)
            balanced = bytes_balanced_ps(plain, ps_group_bytes(ev, plain))
            t = {k: ev.iteration_time(s)[0] for k, s in (("greedy", plain), ("auto", auto), ("balanced", balanced))}
            rows.append({"model": model, "batch": batch, "method": method, **{f"{k}_s": v for k, v in t.items()},
                         "auto_over_balanced": t["auto"] / t["balanced"]})
    return {"rows": rows, "max_auto_over_balanced": max(r["auto_over_balanced"] for r in rows)}
