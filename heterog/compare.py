"""Compare planners on one graph and cluster: plan with each method, simulate, and report like the HeteroG
paper (Table 1: time per iteration and speed-ups; Table 2: action breakdown), with CSV, JSON, Gantt, trace."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.actions import action_name
from heterog.errors import HeterogError
from heterog.planners import default_methods, names, parse_methods, plan
from heterog.reporting import action_columns, csv_text, table1_markdown, table2_markdown
from heterog.shares import even_shares, proportional_shares
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.evaluate import Evaluator, PlanResult
    from heterog.graph.opgraph import OpGraph

AGENT = "agent"                 # the learning agent's method name (a plugin of heterog.planners)
known_methods = names           # planner registry (heterog.planners), re-exported for scripts that used it here


# ----------------------------------------------------------------------------- action breakdown
def config_action(config: ParallelConfig, cluster: Cluster, batch_size: int) -> str:
    """The action type a config corresponds to: ``mp:<device>`` for one device, one of the four DP
    actions (all devices, even or power-proportional shares, PS or AllReduce), else ``dp-other``; ``split`` for
    a split beyond the batch."""
    m = cluster.n_devices
    if config.split is not None:
        return "split"
    if config.n_replicas == 1:
        return f"mp:{config.devices[0]}"
    if config.devices == tuple(range(m)):
        sync = "ps" if config.sync == "ps" else "ar"
        if list(config.shares) == even_shares(batch_size, m):
            return f"dp-even-{sync}"
        if list(config.shares) == proportional_shares(batch_size, cluster.power):
            return f"dp-prop-{sync}"
    return "dp-other"


def action_breakdown(strategy: Strategy, graph: OpGraph, cluster: Cluster) -> dict[str, float]:
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
    result: PlanResult
    record: dict[str, Any]


@dataclass
class Comparison:
    """Results of several planners on one graph and cluster."""

    graph: OpGraph
    cluster: Cluster
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


def compare(graph: OpGraph, cluster: Cluster, methods: Sequence[str], *, budget_s: float = 60.0, seed: int = 0,
            evaluator: Evaluator | None = None, agent_checkpoint: str | None = None, agent_episodes: int | None = None,
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

    from heterog import planners
    from heterog.evaluate import Evaluator

    methods = parse_methods(list(methods))
    for name in methods:
        planners.get(name)                               # a plugin that fails to load fails before the others run
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


# ----------------------------------------------------------------------------- files
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
    if res.plan is None or res.sim is None:
        raise HeterogError(f"the result of {best.method} carries no compiled plan and simulation to draw")
    title = f"{comp.graph.name} on {comp.cluster.name}: {best.method} ({res.iteration_time_s * 1e3:.1f} ms)"
    simulator.plot_gantt(res.plan.tg, res.sim, paths["gantt"], title=title)
    simulator.write_chrome_trace(res.plan.tg, res.sim, paths["trace"])
    return paths


__all__ = ["AGENT", "Comparison", "MethodResult", "action_breakdown", "compare", "config_action", "csv_text",
           "default_methods", "known_methods", "parse_methods", "plan", "table1_markdown", "table2_markdown",
           "write_report"]
