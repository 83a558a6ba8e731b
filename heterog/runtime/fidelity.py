"""Simulator fidelity: run several different plans for real and in the simulator with profiled costs,
and report how far apart they are (MAPE of simulated vs measured iteration time, Kendall tau of their
rankings, per-plan pairs, measured vs simulated peak memory per device) with a scatter plot.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.cost.profile import ProfileTable
from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluate import Evaluator
    from heterog.runtime.api import PreparedRun
    from heterog.runtime.launcher import WorkerPool
    from heterog.runtime.profiler import CommProfiler, OpProfiler
    from heterog.strategy import Strategy

log = logging.getLogger(__name__)

DEFAULT_PROFILE_DIR = ".heterog-cache/profiles"
# rounds over all plans: a plan's error is the median of its per-round errors, whose noise on a small shared
# host is large (docs/results.md, "Simulator fidelity", has the measured spread)
ROUNDS = 10
# samples per profiling round of each link size (ping-pong and stream) and each AllReduce size. Plan round j
# is simulated with the samples of the two profiling rounds around it, so these numbers, not a total spread
# over the rounds, set the noise of a round's simulated time. AllReduce times are heavy-tailed: with the 6 per
# round that a total of 70 over 12 rounds gave, the simulated ev-ar step of tiny_cnn moved by 15-22%
# (coefficient of variation) from round to round while the measured one moved by 6-11%; with 40, by 6-10%,
# and MAPE over the same plan runs fell from 8.1-10.3% to 5.7-9.2% (4 runs; 20 link samples instead of 5: 6.9-8.2%)
ROUND_LINK_REPEATS, ROUND_COLLECTIVE_REPEATS = 5, 40
# planners tried in this order; "mp-split" and "random:<seed>" are built here
PLAN_ORDER = ("single", "ev-ps", "ev-ar", "mp-split", "cp-ps", "cp-ar", "expert", "dpos", "random:0",
              "random:1", "mp-alternate", "random:2", "random:3", "random:4", "random:5")


@dataclass
class PlanPair:
    """One plan measured for real and simulated with the profiled costs.

    With per-round numbers (``measured_all_s[j]`` measured in round j, ``simulated_all_s[j]`` simulated
    with the profile measured around round j), ``error`` is the median over rounds of the paired relative
    errors, so that a change of machine speed during the experiment, which moves the plan and its
    profile alike, cancels out; otherwise it is the relative error of ``simulated_s`` vs ``measured_s``.

    Memory (device name -> bytes): ``measured_peak_memory_bytes`` is the most a worker held over the
    rounds (``RunResult``, ``heterog.runtime.memory.LiveBytes``), ``simulated_peak_memory_bytes`` the
    simulator's peak for the plan."""

    plan: str
    measured_s: float
    simulated_s: float
    measured_all_s: list[float] = field(default_factory=list)      # per round: median iteration time
    simulated_all_s: list[float] = field(default_factory=list)     # per round: with that round's profile
    measured_peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    simulated_peak_memory_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def error(self) -> float:
        if self.measured_all_s and len(self.simulated_all_s) == len(self.measured_all_s):
            return float(np.median([(s - m) / m for m, s in zip(self.measured_all_s, self.simulated_all_s)]))
        return (self.simulated_s - self.measured_s) / self.measured_s

    def record(self) -> dict[str, Any]:
        return {"plan": self.plan, "measured_s": self.measured_s, "simulated_s": self.simulated_s,
                "error": self.error, "measured_all_s": self.measured_all_s,
                "simulated_all_s": self.simulated_all_s,
                "measured_peak_memory_bytes": self.measured_peak_memory_bytes,
                "simulated_peak_memory_bytes": self.simulated_peak_memory_bytes,
                "peak_memory_error": self.memory_errors()}

    def memory_errors(self) -> dict[str, float]:
        """Per device that holds anything: (simulated - measured) / measured peak memory."""
        return {d: (self.simulated_peak_memory_bytes.get(d, 0) - m) / m
                for d, m in self.measured_peak_memory_bytes.items() if m > 0}


def mape(pairs: Sequence[PlanPair]) -> float:
    """Mean absolute percentage error of simulated vs measured, in percent."""
    return float(100.0 * np.mean([abs(p.error) for p in pairs])) if pairs else math.nan


def memory_mape(pairs: Sequence[PlanPair]) -> float:
    """Mean absolute percentage error of simulated vs measured peak memory over plans and devices that
    hold anything (NaN without memory numbers)."""
    errs = [abs(e) for p in pairs for e in p.memory_errors().values()]
    return float(100.0 * np.mean(errs)) if errs else math.nan


def kendall_tau(pairs: Sequence[PlanPair]) -> float:
    """Rank agreement of simulated and measured times (tau-b; 1 = same order)."""
    if len(pairs) < 2:
        return math.nan
    from scipy.stats import kendalltau

    tau = kendalltau([p.measured_s for p in pairs], [p.simulated_s for p in pairs]).statistic
    return float(tau)


def _split_strategy(ev: Evaluator, name: str) -> Strategy:
    """Model parallelism without replication: contiguous (``mp-split``) or alternating (``mp-alternate``)
    runs of groups, in op order, over the devices."""
    m, g = ev.cluster.n_devices, ev.n_groups
    if name == "mp-split":
        actions = np.minimum(np.arange(g) * m // max(g, 1), m - 1)
    else:
        actions = np.arange(g) % m
    s = ev.strategy(actions.astype(np.int64), method=name)
    s.method = name
    return s


def candidate_plans(ev: Evaluator, n: int, names: Sequence[str] = PLAN_ORDER) -> list[Strategy]:
    """The first ``n`` distinct plans (different layouts) among ``names`` for ``ev``'s graph and cluster."""
    out: list[Strategy] = []
    for s in distinct_plans(ev, names):
        if len(out) >= n:
            break
        out.append(s)
    if len(out) < n:
        raise HeterogError(f"only {len(out)} distinct plans could be made for {ev.graph.name} on "
                           f"{ev.cluster.name}; asked for {n}")
    return out


def distinct_plans(ev: Evaluator, names: Sequence[str] = PLAN_ORDER) -> Iterator[Strategy]:
    """The distinct plans (different layouts) among ``names`` for ``ev``'s graph and cluster, in order,
    made as they are asked for."""
    from heterog import baselines

    known = set(baselines.names())
    seen: set[str] = set()
    for name in names:
        base, _, seed = name.partition(":")
        if base in ("mp-split", "mp-alternate"):
            s = _split_strategy(ev, base)
        elif base in known:
            opts = {"seed": int(seed)} if seed else {}
            s = baselines.run(base, ev.graph, ev.cluster, evaluator=ev, **opts)
        else:
            continue
        s.method = name
        key = hashlib.sha1(repr(_canonical(s)).encode()).hexdigest()
        if key in seen:
            continue
        seen.add(key)
        yield s


def _canonical(s: Strategy) -> list[tuple[Any, ...]]:
    return [(c.devices, c.shares, c.sync if c.n_replicas > 1 else "", c.ps_device) for c in
            (s.configs[g] for g in s.group_of.tolist())]


def profile_path(model_ref: str, batch_size: int, cluster_name: str, directory: str | Path = DEFAULT_PROFILE_DIR
                 ) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{model_ref}-b{batch_size}-{cluster_name}")
    return Path(directory) / f"{safe}.json"


@dataclass
class FidelityReport:
    model: str
    cluster: str
    batch_size: int
    pairs: list[PlanPair]
    mape: float
    kendall_tau: float
    profile: str
    plot: str | None
    steps: int
    warmup_steps: int
    profile_time_s: float
    run_time_s: float
    link_fits: list[dict[str, Any]] = field(default_factory=list)
    line_pairs: list[PlanPair] = field(default_factory=list)   # the same runs simulated with op lines
    breakdown: list[dict[str, Any]] = field(default_factory=list)    # per plan and device: where the time goes
    plans_asked: int = 0
    failed_plans: list[dict[str, str]] = field(default_factory=list)  # {plan, error}: left out, the runtime failed

    def record(self) -> dict[str, Any]:
        worst = max(self.pairs, key=lambda p: abs(p.error)) if self.pairs else None
        of_medians = mape([PlanPair(p.plan, p.measured_s, p.simulated_s) for p in self.pairs])
        return {"model": self.model, "cluster": self.cluster, "batch_size": self.batch_size, "mape": self.mape,
                "mape_of_medians": of_medians,
                "kendall_tau": self.kendall_tau, "memory_mape": memory_mape(self.pairs),
                "pairs": [p.record() for p in self.pairs],
                "worst_plan": None if worst is None else worst.plan, "profile": self.profile, "plot": self.plot,
                "steps": self.steps, "warmup_steps": self.warmup_steps, "profile_time_s": self.profile_time_s,
                "run_time_s": self.run_time_s, "link_fits": self.link_fits,
                "op_lines": {"mape": mape(self.line_pairs), "kendall_tau": kendall_tau(self.line_pairs),
                             "simulated_s": [p.simulated_s for p in self.line_pairs]},
                "breakdown": self.breakdown, "plans_asked": self.plans_asked, "failed_plans": self.failed_plans}


# ------------------------------------------------------------------------------ where the time goes
# runtime instructions counted as communication work on the rank (posting sends and collectives,
# assembling received pieces, summing PS parts); their waiting is counted apart
_RUNTIME_COMM = ("send", "allreduce", "assemble", "aggregate", "post")


def simulated_breakdown(ev: Evaluator, strategy: Strategy) -> tuple[list[dict[str, float]], set[tuple[int, int]]]:
    """Per device, the simulated seconds of compute (and of the compute ops fed by a message: a transfer
    or a PS push is among their dependencies), of communication tasks holding the device and of idle
    time up to the makespan; and the (device, op) pairs of the fed compute ops."""
    from heterog.compiler.compile import COMM_KINDS, COMPUTE_KINDS, TaskKind

    plan = ev.compile(strategy)
    res = ev.simulate_plan(plan)
    dur, kind, dev = plan.tg.duration, plan.task_kind, plan.task_device
    res_ptr, res_idx = plan.tg.resources()
    fed_kinds = np.array([int(TaskKind.TRANSFER), int(TaskKind.PUSH)])
    fed_ops: set[tuple[int, int]] = set()
    out = [{"compute_s": 0.0, "fed_compute_s": 0.0, "comm_s": 0.0, "busy_s": 0.0} for _ in range(ev.cluster.n_devices)]
    for t in range(plan.n_tasks):
        held = res_idx[res_ptr[t]:res_ptr[t + 1]]
        for d in held[held < len(out)]:
            out[d]["busy_s"] += float(dur[t])
            if kind[t] in COMM_KINDS:
                out[d]["comm_s"] += float(dur[t])
        if kind[t] in COMPUTE_KINDS and dev[t] >= 0:
            fed = bool(np.isin(kind[plan.dep_idx[plan.dep_ptr[t]:plan.dep_ptr[t + 1]]], fed_kinds).any())
            out[dev[t]]["compute_s"] += float(dur[t])
            if fed:
                out[dev[t]]["fed_compute_s"] += float(dur[t])
                fed_ops.add((int(dev[t]), int(plan.task_op[t])))
    for d in out:
        d["idle_s"] = max(float(res.makespan) - d.pop("busy_s"), 0.0)
    return out, fed_ops


def measured_breakdown(prepared: PreparedRun, pool: WorkerPool, steps: int, warmup: int,
                       fed_ops: set[tuple[int, int]]) -> list[dict[str, float]]:
    """One traced run of ``prepared``: per rank, the median over the steps after ``warmup`` of its busy
    seconds in compute instructions (and in those of the (rank, op) pairs in ``fed_ops``), in
    communication instructions (``_RUNTIME_COMM``), and of its waiting (messages, collectives, emulated
    delays)."""
    from heterog.runtime.instructions import Compute

    jobs = prepared.jobs([prepared.model.example_inputs], steps, return_state=False)
    for job in jobs:
        job.trace = True
    results = pool.run(jobs)
    out = []
    for r, rp in enumerate(prepared.lowered.ranks):
        rows = []
        for trace in results[r]["traces"][min(warmup, steps - 1):]:
            acc = dict.fromkeys(("compute_s", "fed_compute_s", "comm_s", "wait_s"), 0.0)
            for ins, (kind, t0, t1, waited) in zip(rp.instrs, trace):
                busy = max(t1 - t0 - waited, 0.0)
                acc["wait_s"] += waited
                if isinstance(ins, Compute):            # kind "compute"
                    acc["compute_s"] += busy
                    acc["fed_compute_s"] += busy if (r, ins.op) in fed_ops else 0.0
                elif kind in _RUNTIME_COMM:
                    acc["comm_s"] += busy
            rows.append(acc)
        out.append({k: float(np.median([row[k] for row in rows])) for k in rows[0]})
    return out


def scatter_plot(pairs: Sequence[PlanPair], path: str | Path, title: str = "") -> Path:
    """Simulated vs measured iteration time per plan, with the y = x line (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from heterog.atomic import atomic_write_bytes

    ms = np.array([p.measured_s for p in pairs]) * 1e3
    ss = np.array([p.simulated_s for p in pairs]) * 1e3
    fig, ax = plt.subplots(figsize=(5.2, 4.6), dpi=120)
    hi = float(max(ms.max(), ss.max())) * 1.1 if len(pairs) else 1.0
    ax.plot([0, hi], [0, hi], color="0.5", lw=1, ls="--", label="y = x")
    ax.scatter(ms, ss, color="tab:blue", zorder=3)
    for p, x, y in zip(pairs, ms, ss):
        ax.annotate(p.plan, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured iteration time (ms)")
    ax.set_ylabel("simulated iteration time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def run_fidelity(model_ref: str, cluster_spec: str, *, n_plans: int = 8, batch_size: int | None = None,
                 steps: int = 30, warmup: int = 5, repeats: int = ROUNDS, profile_file: str | Path | None = None,
                 reprofile: bool = False, plot: str | Path | None = None, hang_timeout_s: float = 120.0,
                 plans: Sequence[str] = PLAN_ORDER, optimizer: str = "sgd", pool: WorkerPool | None = None,
                 breakdown: bool = False) -> FidelityReport:
    """Profile (or load the cached profile), then run ``n_plans`` plans for real and in the simulator with
    the profiled costs. A plan's measured time is the median over ``repeats`` rounds (each round runs every
    plan once) of its median iteration time over ``steps`` after ``warmup``.

    When profiling, rounds of op timing (``OpProfiler``) and of link and collective timing
    (``CommProfiler``) are interleaved with the rounds of plan runs (one before the first and one after
    the last), so that a change of machine speed during the experiment meets the profile and the plans
    alike: plan round j is simulated with the fit of the two profiling rounds around it, and a plan's
    error is the median of its per-round errors (``PlanPair``); how much a shared host's speed moves is
    in docs/results.md ("Simulator fidelity"). Plans are chosen and ordered with the first round's profile; the fit
    of all rounds is the one saved. Ops are simulated through their measured points (``CostModel``);
    ``line_pairs`` holds the same runs simulated with the ops' fitted lines, for comparison.
    ``pool``: running workers to use (one per device); by default a pool is started and stopped here.
    Each candidate plan (the distinct plans of ``plans``, in order) first runs one step; a plan that the
    runtime fails on is left out, logged as a warning and listed in ``failed_plans`` (with the error), its
    workers are replaced, and the next candidate is taken, so that ``n_plans`` plans that run are
    measured, or all there are (at least 2; with a ``pool`` passed in, a failure is raised instead).
    ``breakdown``: afterwards run every plan once more with instruction tracing and report, per plan and
    device, measured vs simulated compute (and compute of the ops fed by a message), communication work
    and waiting (``simulated_breakdown``, ``measured_breakdown``)."""
    from heterog.cluster import load_cluster
    from heterog.cost import CostModel
    from heterog.evaluate import Evaluator
    from heterog.runtime.api import load_model, prepare, run_prepared
    from heterog.runtime.launcher import WorkerFailure, WorkerPool
    from heterog.runtime.profiler import OP_STEPS, CommProfiler, OpProfiler

    cluster = load_cluster(cluster_spec)
    model = load_model(model_ref, batch_size, optimizer=optimizer)
    failed: list[dict[str, str]] = []
    ppath = Path(profile_file) if profile_file else profile_path(model_ref, model.batch_size, cluster.name)
    own = pool is None
    if pool is None:
        pool = WorkerPool(cluster.n_devices, "gloo", device_names=cluster.device_names, hang_timeout_s=hang_timeout_s)
    t_prof = t_run = 0.0
    try:
        t0 = time.perf_counter()
        ops: OpProfiler | None = None           # the profilers, when profiling (both or neither)
        comm: CommProfiler | None = None
        if ppath.is_file() and not reprofile:
            table = ProfileTable.load(ppath)
        else:
            ops = OpProfiler(model, cluster, pool, steps=OP_STEPS)
            comm = CommProfiler(pool, cluster, link_repeats=ROUND_LINK_REPEATS,
                                collective_repeats=ROUND_COLLECTIVE_REPEATS)
            ops.round()
            comm.round()
            table = comm.fit(ops.fit())
        ev = Evaluator(model.graph, cluster, CostModel(cluster, table))
        strategies: list[Strategy] = []
        prepared: list[PreparedRun] = []
        for s in distinct_plans(ev, plans):
            if len(strategies) >= n_plans:
                break
            prep = prepare(model, cluster, s, cost=ev.cost)
            try:                                  # one step: a plan the runtime cannot run is left out
                run_prepared(prep, [model.example_inputs], 1, warmup=0, pool=pool, return_state=False)
            except WorkerFailure as exc:
                if not own:
                    raise
                failed.append({"plan": s.method, "error": str(exc)})
                log.warning("fidelity: plan %s fails in the runtime and is left out: %s", s.method, exc)
                pool = WorkerPool(cluster.n_devices, "gloo", device_names=cluster.device_names,
                                  hang_timeout_s=hang_timeout_s)
                if ops is not None and comm is not None:
                    ops.pool = comm.pool = pool
                continue
            strategies.append(s)
            prepared.append(prep)
        if len(strategies) < min(n_plans, 2):
            raise HeterogError(f"{len(strategies)} plans of {model.name} ran on {cluster.name}, too few to compare "
                               f"(asked for {n_plans}; failed: {', '.join(f['plan'] for f in failed) or 'none'})")
        if len(strategies) < n_plans:
            log.warning("fidelity: %d plans of %d asked for (the distinct plans of %s that run: %s; failed: %s)",
                        len(strategies), n_plans, ", ".join(plans), ", ".join(s.method for s in strategies),
                        ", ".join(f["plan"] for f in failed) or "none")
        t_prof += time.perf_counter() - t0
        n_rounds = max(1, repeats)
        medians: list[list[float]] = [[] for _ in strategies]
        peaks: list[dict[str, int]] = [{} for _ in strategies]      # per plan: device -> most held
        for j in range(n_rounds + 1):          # rounds over all plans: a change of machine load hits all
            if ops is not None and comm is not None:
                t0 = time.perf_counter()
                ops.round()
                comm.round()
                t_prof += time.perf_counter() - t0
            if j == n_rounds:
                break
            t0 = time.perf_counter()
            for k, prep in enumerate(prepared):
                r = run_prepared(prep, [model.example_inputs], steps, warmup=warmup, pool=pool, return_state=False)
                medians[k].append(r.iteration_time_s)
                for d, b in r.measured_peak_memory_bytes.items():
                    peaks[k][d] = max(peaks[k].get(d, 0), b)
            t_run += time.perf_counter() - t0
        measured_parts = [measured_breakdown(prep, pool, steps, warmup, simulated_breakdown(ev, s)[1])
                          for s, prep in zip(strategies, prepared)] if breakdown else []
    finally:
        if own:
            pool.close()

    def simulate_all(tbl: ProfileTable, op_points: bool) -> list[float]:
        e = Evaluator(model.graph, cluster, CostModel(cluster, tbl, op_points=op_points))
        return [float(e.evaluate(s).iteration_time_s) for s in strategies]

    def paired(op_points: bool) -> list[PlanPair]:
        if ops is not None and comm is not None:
            # plan round j ran between profiling rounds j + 1 and j + 2 (round 0 chose the plans)
            per_round = [simulate_all(comm.fit(ops.fit(rounds=(j + 1, j + 2)), rounds=(j + 1, j + 2)), op_points)
                         for j in range(n_rounds)]
            simulated_all = [list(col) for col in zip(*per_round)]
        else:
            simulated_all = [[sim] * n_rounds for sim in simulate_all(table, op_points)]
        return [PlanPair(s.method, float(np.median(meds)), float(np.median(sims)), meds, sims, peak,
                         dict(prep.simulated_peak_memory_bytes))
                for s, sims, meds, peak, prep in zip(strategies, simulated_all, medians, peaks, prepared)]

    if ops is not None and comm is not None:
        table = comm.fit(ops.fit())
        table.save(ppath)
    pairs, line_pairs = paired(True), paired(False)
    parts = []
    final = Evaluator(model.graph, cluster, CostModel(cluster, table)) if measured_parts else None
    for s, measured in zip(strategies, measured_parts):
        assert final is not None                              # made when there are breakdowns
        simulated = simulated_breakdown(final, s)[0]          # with the saved profile (all rounds)
        parts.append({"plan": s.method, "devices": [{"device": name, "measured": a, "simulated": b} for name, a, b
                                                    in zip(cluster.device_names, measured, simulated)]})
    out_plot = Path(plot) if plot else ppath.with_name(ppath.stem + "-fidelity.png")
    title = f"{model.name} (batch {model.batch_size}) on {cluster.name}: MAPE {mape(pairs):.1f}%, " \
            f"tau {kendall_tau(pairs):.2f}"
    scatter_plot(pairs, out_plot, title)
    return FidelityReport(model_ref, cluster.name, model.batch_size, pairs, mape(pairs), kendall_tau(pairs),
                          str(ppath), str(out_plot), steps, warmup, t_prof, t_run,
                          [{"link": name, "alpha_s": a, "beta_s_per_byte": b,
                            "latency_s": table.link_latency.get(name, (0.0, 0.0))[0],
                            "latency_s_per_byte": table.link_latency.get(name, (0.0, 0.0))[1]}
                           for name, (a, b) in table.links.items()],
                          line_pairs, parts, n_plans, failed)
