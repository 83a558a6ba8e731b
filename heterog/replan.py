"""Re-planning within a budget of seconds, for a cluster whose devices changed (a worker lost, a device
back): what an elastic run does before it resumes from its last checkpoint.

``replan(graph, cluster, method, budget_s)`` plans with one planner, or with ``auto``: the planners that fit
the budget, fastest first, keeping the best simulated plan (``AUTO_PLANNERS``):

  1. the data-parallel baselines and single (a few evaluations each), and expert placement;
  2. the shipped policy's zero-shot plan (``agent`` with budget 0), when the agent is installed and its
     policy fits the cluster;
  3. the searches, each given a share of what is left of the budget (pipeline, then MCMC with the rest).

A planner starts only while budget is left (the first always does); one that fails is recorded with its
reason and skipped. The
agent as a chosen method plans zero-shot. The candidates come back ordered by simulated time (plans that
run out of memory last), so that a caller can fall back to the next when the first cannot run.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import Strategy

FAST_PLANNERS = ("ev-ar", "cp-ar", "ev-ps", "cp-ps", "single", "expert")
ZERO_SHOT = "agent"
SEARCHES = (("pipeline", 0.3), ("mcmc", 0.8))        # (planner, share of the budget left when it starts)
AUTO_PLANNERS = (*FAST_PLANNERS, ZERO_SHOT, *(name for name, _ in SEARCHES))
MIN_SEARCH_S = 0.2                                    # a search is not started with less budget than this
MARGIN = 0.1            # share of the budget kept back from the searches for what they do after their own budget


@dataclass
class Replan:
    """The outcome of ``replan``: the plans found, best first, and what each planner did."""

    method: str                                       # what was asked ("auto" or a planner)
    budget_s: float
    seconds: float                                    # wall clock of the whole re-plan
    candidates: list[Strategy] = field(default_factory=list)    # by (OOM, simulated time)
    tried: list[dict[str, Any]] = field(default_factory=list)   # per planner: method, seconds, time, oom or error

    @property
    def best(self) -> Strategy:
        return self.candidates[0]

    def record(self) -> dict[str, Any]:
        return {"method": self.method, "budget_s": self.budget_s, "seconds": self.seconds,
                "chosen": self.best.method if self.candidates else None, "tried": self.tried}


def warm_up(method: str = "auto") -> None:
    """Load now what a re-plan with ``method`` would load on first use (the agent's package and policy), so
    that the re-plan, when it comes, spends its budget planning. Nothing happens when the agent is absent."""
    from heterog import planners

    if method in ("auto", ZERO_SHOT) and ZERO_SHOT in planners.names():
        try:
            planners.get(ZERO_SHOT)
        except HeterogError:
            pass


def replan(graph: OpGraph, cluster: Cluster, method: str = "auto", budget_s: float = 5.0, *, seed: int = 0,
           runs: Callable[[Strategy], str | None] | None = None) -> Replan:
    """Plans for ``graph`` on ``cluster`` within about ``budget_s`` seconds (module docstring). ``runs``: says
    why a plan cannot run (None: it can); such plans are left out. HeterogError when no plan is found."""
    from heterog import planners
    from heterog.evaluate import Evaluator

    if not budget_s > 0:
        raise HeterogError(f"the re-planning budget must be positive, got {budget_s} s")
    if method != "auto":
        planners.get(method)                        # an unknown method fails here, naming the known ones
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    ev = Evaluator(graph, cluster)
    out = Replan(method, float(budget_s), 0.0)
    found: list[tuple[tuple[bool, float], int, Strategy]] = []

    def attempt(name: str, **options: Any) -> None:
        t = time.perf_counter()
        entry: dict[str, Any] = {"method": name}
        try:
            s = planners.plan(name, evaluator=ev, seed=seed, progress=False, **options)
            reason = runs(s) if runs is not None else None
            it, oom = ev.iteration_time(s)
            entry.update(iteration_time_s=it, oom=oom)
            if reason is None:
                found.append(((oom, it), len(found), s))
            else:
                entry["refused"] = reason
        except HeterogError as exc:
            entry["error"] = str(exc).splitlines()[0]
        entry["seconds"] = time.perf_counter() - t
        out.tried.append(entry)

    if method == "auto":
        for k, name in enumerate(FAST_PLANNERS):
            if k == 0 or time.perf_counter() < deadline:        # the first always: a run needs a plan
                attempt(name)
        if time.perf_counter() < deadline and ZERO_SHOT in planners.names():
            attempt(ZERO_SHOT, budget_s=0)
        for name, share in SEARCHES:
            left = deadline - MARGIN * budget_s - time.perf_counter()
            if left >= MIN_SEARCH_S:
                attempt(name, budget_s=left * share)
    elif method == ZERO_SHOT:
        attempt(method, budget_s=0)
    else:
        attempt(method, budget_s=budget_s if "budget_s" in planners.get(method).options else None)
    out.seconds = time.perf_counter() - t0
    out.candidates = [s for _, _, s in sorted(found, key=lambda x: (x[0], x[1]))]
    if not out.candidates:
        why = "; ".join(f"{e['method']}: {e.get('error') or e.get('refused')}" for e in out.tried) or "no planner ran"
        raise HeterogError(f"re-planning for {cluster.name!r} found no plan that runs within {budget_s:g} s ({why})")
    return out
