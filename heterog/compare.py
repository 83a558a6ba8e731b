"""Compare planners on one graph and cluster: plan with each method, simulate, and report like the HeteroG
paper (Table 1: time per iteration and speed-ups; Table 2: action breakdown), with CSV, JSON, Gantt, trace."""
from __future__ import annotations

import csv
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from heterog.errors import HeterogError
from heterog.strategy import (
    DP_ACTION_NAMES,
    ParallelConfig,
    Strategy,
    action_name,
    even_shares,
    proportional_shares,
)

DP_BASELINES = ("ev-ps", "ev-ar", "cp-ps", "cp-ar")
AGENT = "agent"
# options each planner understands (all registered planners ignore unknown options; the agent does not)
BUDGETED = ("mcmc", "pesto-ilp", "os-dpos", AGENT)
PARALLEL = ("mcmc", AGENT)          # searches that fan out to Ray workers (workers, ray_address)


# ----------------------------------------------------------------------------- methods
def known_methods() -> list[str]:
    """Registered planners plus the learning agent."""
    from heterog import baselines

    return baselines.names() + [AGENT]


def default_methods() -> list[str]:
    """Every registered planner (the agent only when asked for: it trains)."""
    from heterog import baselines

    return baselines.names()


def parse_methods(methods: str | Sequence[str] | None) -> list[str]:
    """``"a,b,c"`` or a list -> validated method names (duplicates dropped); None -> ``default_methods()``."""
    if methods is None:
        return default_methods()
    names = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if str(m).strip()]
    if not names:
        raise HeterogError("no methods given (e.g. --methods cp-ar,dpos,mcmc)")
    known = known_methods()
    bad = [m for m in names if m not in known]
    if bad:
        raise HeterogError(f"unknown method{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
                           f"known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def agent_planner():
    """The learning agent's ``plan`` function, or a HeterogError when the agents package is missing."""
    try:
        from agents.planner import plan as agent_plan
    except ModuleNotFoundError as exc:
        if exc.name in ("agents", "agents.planner"):
            raise HeterogError("agent planner not available (module agents.planner is missing)") from None
        raise
    return agent_plan


def plan(method: str, graph, cluster, *, evaluator=None, budget_s: float = 60.0, seed: int = 0,
         checkpoint: str | None = None, episodes: int | None = None, workers: int = 1,
         ray_address: str | None = None) -> Strategy:
    """The strategy of ``method`` (a registered planner or "agent") with ``search_time_s`` in its meta.

    ``budget_s`` goes to the searches (mcmc, pesto-ilp, os-dpos, agent), ``seed`` to every planner that
    draws random numbers; ``checkpoint`` and ``episodes`` to the agent only; ``workers`` and
    ``ray_address`` to the searches that fan out to Ray workers (``PARALLEL``; ``heterog.parallel``).
    """
    from heterog import baselines
    from heterog.evaluate import Evaluator

    if budget_s is not None and budget_s <= 0:
        raise HeterogError(f"budget must be positive, got {budget_s} s")
    ev = evaluator if evaluator is not None else Evaluator(graph, cluster)
    if method != AGENT:
        if checkpoint is not None or episodes is not None:
            raise HeterogError(f"--agent/--episodes apply to the agent only, not to method {method!r}")
        fan_out = {"workers": workers, "ray_address": ray_address} if method in PARALLEL else {}
        return baselines.run(method, graph, cluster, evaluator=ev, budget_s=budget_s, seed=seed, **fan_out)
    agent_plan = agent_planner()
    t0 = time.perf_counter()
    strategy = agent_plan(ev, checkpoint=checkpoint, episodes=episodes, budget_s=budget_s, seed=seed,
                          workers=workers, ray_address=ray_address)
    strategy.method = AGENT
    strategy.meta.setdefault("search_time_s", time.perf_counter() - t0)
    return strategy


# ----------------------------------------------------------------------------- action breakdown
def config_action(config: ParallelConfig, cluster, batch_size: int) -> str:
    """The action type a config corresponds to: ``mp:<device>`` for one device, one of the four DP
    actions (all devices, even or power-proportional shares, PS or AllReduce), else ``dp-other``."""
    m = cluster.n_devices
    if config.n_replicas == 1:
        return f"mp:{config.devices[0]}"
    if config.devices == tuple(range(m)):
        sync = "ps" if config.sync == "ps" else "ar"
        if list(config.shares) == even_shares(batch_size, m):
            return f"dp-even-{sync}"
        if list(config.shares) == proportional_shares(batch_size, cluster.power):
            return f"dp-prop-{sync}"
    return "dp-other"


def action_columns(cluster) -> list[str]:
    return [f"mp:{d}" for d in range(cluster.n_devices)] + list(DP_ACTION_NAMES) + ["dp-other"]


def action_breakdown(strategy: Strategy, graph, cluster) -> dict[str, float]:
    """Share of the graph's compute ops under each action type (Table 2 of the HeteroG paper). Plans
    decoded from actions (``meta["actions"]``) use them; other plans are classified by ``config_action``."""
    compute = np.nonzero(graph.is_compute)[0]
    actions = strategy.meta.get("actions")
    if actions is not None and len(actions) == strategy.n_groups:     # decoded from actions: exact names
        kinds = [action_name(int(a), cluster.n_devices) for a in actions]
    else:
        kinds = [config_action(c, cluster, graph.batch_size) for c in strategy.configs]
    counts = dict.fromkeys(action_columns(cluster), 0)
    for g in strategy.group_of[compute].tolist():
        counts[kinds[g]] += 1
    total = max(len(compute), 1)
    return {k: v / total for k, v in counts.items()}


# ----------------------------------------------------------------------------- comparison
@dataclass
class MethodResult:
    """One planner's strategy, its simulated result and its JSON record."""

    method: str
    strategy: Strategy
    result: object          # PlanResult
    record: dict


@dataclass
class Comparison:
    """Results of several planners on one graph and cluster."""

    graph: object
    cluster: object
    results: list[MethodResult] = field(default_factory=list)
    budget_s: float = 0.0
    seed: int = 0
    lower_bound_s: float | None = None      # no plan is faster (heterog.bounds.compute_bound)

    def records(self) -> list[dict]:
        return [r.record for r in self.results]

    def best(self) -> MethodResult:
        """The fastest plan that fits in memory (the fastest of all if every plan is out of memory)."""
        return min(self.results, key=lambda r: (r.result.oom, r.result.iteration_time_s))

    def document(self) -> dict:
        """The ``compare --json`` document."""
        return {"graph": self.graph.name, "batch_size": self.graph.batch_size, "cluster": self.cluster.name,
                "budget_s": self.budget_s, "seed": self.seed, "best": self.best().method if self.results else None,
                "lower_bound_s": self.lower_bound_s, "records": self.records()}


def _scalar_meta(meta: dict) -> dict:
    return {k: v for k, v in meta.items()
            if isinstance(v, (bool, int, float, str)) and k != "search_time_s"}


def compare(graph, cluster, methods: Sequence[str], *, budget_s: float = 60.0, seed: int = 0,
            evaluator=None, agent_checkpoint: str | None = None, agent_episodes: int | None = None,
            progress: bool = True, workers: int = 1, ray_address: str | None = None) -> Comparison:
    """Plan ``graph`` on ``cluster`` with each method and simulate the plans under the evaluator's order
    (by default ``best``: each plan keeps the faster of rank-contention and FIFO; records say which).

    ``lower_bound_s`` is the compute lower bound no plan beats (``heterog.bounds``).
    Each record carries method, iteration_time_s, oom, peak_memory_bytes (device -> bytes),
    compute_time_s, comm_time_s, overlap_ratio, search_time_s, the action breakdown and the planner's
    scalar statistics (e.g. mcmc's evals_per_s). Progress goes to stderr. ``workers`` and ``ray_address``
    go to the searches that fan out (``plan``).
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from heterog.evaluate import Evaluator

    methods = parse_methods(list(methods))
    if AGENT in methods:
        agent_planner()                                  # fail before spending time on the others
    if budget_s <= 0:
        raise HeterogError(f"budget must be positive, got {budget_s} s")
    from heterog.bounds import compute_bound

    ev = evaluator if evaluator is not None else Evaluator(graph, cluster)
    out = Comparison(graph, cluster, budget_s=float(budget_s), seed=int(seed),
                     lower_bound_s=compute_bound(graph, cluster, ev.cost))
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, disable=not progress, transient=True) as bar:
        task = bar.add_task(f"{graph.name} on {cluster.name}", total=len(methods))
        for name in methods:
            bar.update(task, description=f"{graph.name} on {cluster.name}: {name}")
            ckpt = agent_checkpoint if name == AGENT else None
            eps = agent_episodes if name == AGENT else None
            strategy = plan(name, graph, cluster, evaluator=ev, budget_s=budget_s, seed=seed,
                            checkpoint=ckpt, episodes=eps, workers=workers, ray_address=ray_address)
            res = ev.evaluate(strategy, method=name)
            res.search_time_s = float(strategy.meta.get("search_time_s", 0.0))
            rec = {**res.record(), "graph": graph.name, "batch_size": graph.batch_size, "cluster": cluster.name,
                   "action_breakdown": action_breakdown(strategy, graph, cluster),
                   "stats": _scalar_meta(strategy.meta)}
            out.results.append(MethodResult(name, strategy, res, rec))
            bar.advance(task)
    return out


# ----------------------------------------------------------------------------- tables
def _speedup(t_base: float, t: float) -> str:
    return f"{(t_base / t - 1.0) * 100:+.1f}%" if t > 0 else "-"


def table1_markdown(comp: Comparison) -> str:
    """Time per iteration and speed-up over each DP baseline, (T_baseline / T_method - 1)."""
    base = {r.method: r.result for r in comp.results if r.method in DP_BASELINES}
    dp_cols = [m for m in DP_BASELINES if m in base]
    head = ["method", "iteration (ms)", "order", "OOM", "search (s)"] + [f"speed-up vs {m.upper()}" for m in dp_cols]
    lines = [(f"Table 1: {comp.graph.name} (batch {comp.graph.batch_size}) on {comp.cluster.name}: time per "
             f"iteration and speed-up over the data-parallel baselines (T_baseline / T_method - 1; "
             f"a baseline that runs out of memory is marked OOM)."), "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in comp.results:
        res = r.result
        cells = [r.method, f"{res.iteration_time_s * 1e3:.1f}", res.order, "OOM" if res.oom else "",
                 f"{res.search_time_s:.1f}"]
        cells += [_speedup(base[m].iteration_time_s, res.iteration_time_s) + (" (OOM)" if base[m].oom else "")
                  for m in dp_cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table2_markdown(comp: Comparison) -> str:
    """Share of compute ops per action type in each plan (MP per device, the four DP actions, other splits)."""
    cols = action_columns(comp.cluster)
    names = comp.cluster.device_names
    label = {f"mp:{d}": f"MP {names[d]}" for d in range(comp.cluster.n_devices)}
    label.update({"dp-even-ps": "DP-EV-PS", "dp-even-ar": "DP-EV-AR", "dp-prop-ps": "DP-CP-PS",
                  "dp-prop-ar": "DP-CP-AR", "dp-other": "DP other"})
    lines = [f"Table 2: {comp.graph.name} on {comp.cluster.name}: share of compute ops per action type.", "",
             "| method | " + " | ".join(label[c] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in comp.results:
        share = r.record["action_breakdown"]
        lines.append(f"| {r.method} | " + " | ".join(f"{share[c] * 100:.1f}%" if share[c] else "" for c in cols)
                     + " |")
    return "\n".join(lines) + "\n"


def csv_text(comp: Comparison) -> str:
    """One row per method: the record's scalar fields, max peak memory and OOM devices."""
    cols = ["method", "graph", "batch_size", "cluster", "iteration_time_s", "order", "oom", "compute_time_s",
            "comm_time_s",
            "overlap_ratio", "search_time_s", "n_tasks", "max_peak_memory_bytes", "oom_devices"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in comp.results:
        rec = r.record
        peak, cap = rec["peak_memory_bytes"], rec["memory_capacity_bytes"]
        row = {**rec, "max_peak_memory_bytes": max(peak.values(), default=0.0),
               "oom_devices": ";".join(d for d in peak if peak[d] > cap[d])}
        w.writerow([row[c] for c in cols])
    return buf.getvalue()


def text_table(comp: Comparison) -> str:
    """A plain-text table for the terminal (the CLI's ``format_table`` plus the best plan)."""
    from heterog.cli import format_table

    best = comp.best()
    return (format_table(comp.records()) + f"\nbest: {best.method} "
            f"{best.result.iteration_time_s * 1e3:.2f} ms{' (OOM)' if best.result.oom else ''}")


def write_report(comp: Comparison, out_dir: str | Path) -> dict[str, Path]:
    """Write comparison.json, comparison.csv, report.md (Tables 1 and 2), and for the best plan
    best_strategy.json, best_gantt.png and best_trace.json (Chrome trace). Every file is written to a
    temporary name and renamed. Returns the paths by kind."""
    import simulator
    from heterog.atomic import atomic_write, atomic_write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    best = comp.best()
    paths = {"json": out / "comparison.json", "csv": out / "comparison.csv", "report": out / "report.md",
             "strategy": out / "best_strategy.json", "gantt": out / "best_gantt.png",
             "trace": out / "best_trace.json"}
    atomic_write_json(paths["json"], comp.document())
    atomic_write(paths["csv"], lambda f: f.write(csv_text(comp)))
    report = (f"# {comp.graph.name} (batch {comp.graph.batch_size}) on {comp.cluster.name}\n\n"
              f"Budget {comp.budget_s:g} s per search, seed {comp.seed}. Best plan: **{best.method}** "
              f"({best.result.iteration_time_s * 1e3:.1f} ms per iteration)."
              + (f" No plan can be faster than {comp.lower_bound_s * 1e3:.1f} ms (the computation alone, "
                 f"perfectly balanced: heterog/bounds.py)." if comp.lower_bound_s is not None else "")
              + "\n\n"
              + table1_markdown(comp) + "\n" + table2_markdown(comp))
    atomic_write(paths["report"], lambda f: f.write(report))
    best.strategy.save(paths["strategy"])
    res = best.result
    title = f"{comp.graph.name} on {comp.cluster.name}: {best.method} ({res.iteration_time_s * 1e3:.1f} ms)"
    simulator.plot_gantt(res.plan.tg, res.sim, paths["gantt"], title=title)
    simulator.write_chrome_trace(res.plan.tg, res.sim, paths["trace"])
    return paths
