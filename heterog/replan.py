"""Re-planning within a budget of seconds, for a cluster whose devices changed (a worker lost, a device
back): what an elastic run does before it resumes from its last checkpoint.

``replan(graph, cluster, method, budget_s)`` plans with one planner, or with ``auto``: the planners whose
time fits what is left of the budget, fastest first, keeping the best simulated plan (``AUTO_PLANNERS``):

  1. the data-parallel baselines and single (a few evaluations each), and expert placement; they also
     measure what one evaluation of this graph on this cluster takes here; after the first, one starts
     only while they have used less than ``FAST_SHARE`` of the budget (on hundreds of GPUs an evaluation
     takes seconds, and the PS baselines' check of their servers alone took half of a 300 s budget);
  2. the shipped policy's zero-shot plan (``agent`` with budget 0), when the agent is installed, its
     policy fits the cluster, and the time a zero-shot plan of this graph took (``warm_up`` measures it,
     on the cluster the run started on) fits in what is left; with ``zero_shot`` (``heterog plan``'s
     portfolio, which has no measurement beforehand) also when none was measured and at least
     ``ZERO_SHOT_SHARE`` of the budget, and ``ZERO_SHOT_MIN_S``, is left (its time, about 1 s on tiny_mlp
     and 10-20 s on bert_large, cannot be bounded before it runs, so the searches keep the rest); the
     seconds it took, loading the agent's package included, are kept for the next re-plan;
  3. the searches: pipeline on a share of what is left, then MCMC (without its micro-batch step, which is
     pipeline's) on the rest, less what it does after its own budget (``MCMC_TAIL_EVALS`` evaluations);
     where that rest would not cover MCMC's tail (evaluations of seconds, on hundreds of GPUs), pipeline
     takes all that is left.

Budgets are kept by choosing what to start: a planner once started runs to its end, so a re-plan can
exceed its budget by what the estimates miss. The first planner always runs (a run needs a plan); one that
fails is recorded with its reason and skipped. The agent as a chosen method plans zero-shot. The
candidates come back ordered by simulated time (plans that run out of memory last), so that a caller can
fall back to the next when the first cannot run.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph
    from heterog.strategy import Strategy

FAST_PLANNERS = ("ev-ar", "cp-ar", "ev-ps", "cp-ps", "single", "expert")
ZERO_SHOT = "agent"
PIPELINE_SHARE = 0.4            # of what is left of the budget when pipeline starts
MCMC_TAIL_EVALS = 3             # evaluations MCMC may make past its budget: the two plans it always scores again
                                # under the evaluator's order, and the step under way (``heterog.baselines.mcmc``)
AUTO_PLANNERS = (*FAST_PLANNERS, ZERO_SHOT, "pipeline", "mcmc")
FAST_SHARE = 0.25               # of the budget the fast planners may use after the first (which compiles)
MIN_SEARCH_S = 0.2              # a search is not started with less budget than this
MARGIN = 0.1                    # share of the budget kept back for what the estimates miss
ZERO_SHOT_SHARE = 0.5           # with ``zero_shot``: an unmeasured zero-shot plan starts if this share is left
ZERO_SHOT_MIN_S = 1.0           # ... and at least these seconds (a zero-shot plan of tiny_mlp takes about 1 s)

# graph fingerprint -> seconds a zero-shot plan of it took (``warm_up``), what ``auto`` expects it to take
ZERO_SHOT_SECONDS: dict[str, float] = {}


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


def _agent_installed() -> bool:
    from heterog import planners

    if ZERO_SHOT not in planners.names():
        return False
    try:
        planners.get(ZERO_SHOT)
    except HeterogError:
        return False
    return True


def warm_up(method: str, graph: OpGraph, cluster: Cluster) -> float | None:
    """What a later re-plan with ``method`` needs from the agent, done now: its package loaded, and the
    seconds of a zero-shot plan of ``graph`` on ``cluster`` measured (``ZERO_SHOT_SECONDS``, which ``auto``
    reads to decide whether the policy's plan fits its budget). The seconds, or None (no agent, or a method
    that does not use it)."""
    from heterog import planners
    from heterog.evaluate import Evaluator

    if method not in ("auto", ZERO_SHOT) or not _agent_installed():
        return None
    t0 = time.perf_counter()
    try:
        planners.plan(ZERO_SHOT, evaluator=Evaluator(graph, cluster), budget_s=0, progress=False)
    except HeterogError:
        return None
    ZERO_SHOT_SECONDS[graph.fingerprint] = seconds = time.perf_counter() - t0
    return seconds


def replan(graph: OpGraph, cluster: Cluster, method: str = "auto", budget_s: float = 5.0, *, seed: int = 0,
           runs: Callable[[Strategy], str | None] | None = None, sync_batch_stats: bool = False,
           zero_shot: bool = False, progress: bool = False, workers: int = 1,
           ray_address: str | None = None) -> Replan:
    """Plans for ``graph`` on ``cluster`` within about ``budget_s`` seconds (module docstring). ``runs``: says
    why a plan cannot run (None: it can); such plans are left out. ``sync_batch_stats``: plans whose batch
    norms use the whole batch's statistics, evaluated so. ``zero_shot``: ``auto`` tries the policy's plan
    without a measurement of its time (module docstring). ``progress``: a bar on stderr naming the planner
    that runs. ``workers``, ``ray_address``: for the searches that fan out. HeterogError when no plan is
    found."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from heterog import planners
    from heterog.evaluate import Evaluator

    if not budget_s > 0:
        raise HeterogError(f"the re-planning budget must be positive, got {budget_s} s")
    if method != "auto":
        planners.get(method)                        # an unknown method fails here, naming the known ones
    t0 = time.perf_counter()
    deadline = t0 + budget_s * (1.0 - MARGIN)
    ev = Evaluator(graph, cluster, sync_batch_stats=sync_batch_stats)
    out = Replan(method, float(budget_s), 0.0)
    found: list[tuple[tuple[bool, float], int, Strategy]] = []

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress, transient=True)
    task = bar.add_task(f"planning {graph.name} on {cluster.name}",
                        total=len(AUTO_PLANNERS) if method == "auto" else 1)

    def attempt(name: str, **options: Any) -> None:
        t = time.perf_counter()
        entry: dict[str, Any] = {"method": name}
        bar.update(task, description=f"planning {graph.name} on {cluster.name}: {name}")
        try:
            s = planners.plan(name, evaluator=ev, seed=seed, progress=False, workers=workers,
                              ray_address=ray_address, **options)
            if sync_batch_stats:
                s = replace(s, sync_batch_stats=True, meta=dict(s.meta))
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
        bar.advance(task)

    def left() -> float:
        return deadline - time.perf_counter()

    with bar:
        if method == "auto":
            t_fast, evals = time.perf_counter(), ev.n_evaluations
            for k, name in enumerate(FAST_PLANNERS):
                if k == 0 or (left() > 0 and time.perf_counter() - t_fast < FAST_SHARE * budget_s):
                    attempt(name)                         # the first always: a run needs a plan
                if k == 0 and len(FAST_PLANNERS) > 1 and left() > 0:
                    # the first compiles from scratch (bert_large: 1.4 s against 0.1 s for the next ones,
                    # patched): timing evaluations from the second on, MCMC's tail is not overestimated
                    t_fast, evals = time.perf_counter(), ev.n_evaluations
            eval_s = (time.perf_counter() - t_fast) / max(ev.n_evaluations - evals, 1)
            expected = ZERO_SHOT_SECONDS.get(graph.fingerprint)
            unmeasured = zero_shot and expected is None and left() >= max(ZERO_SHOT_SHARE * budget_s, ZERO_SHOT_MIN_S)
            t_agent = time.perf_counter()               # loading the agent's package is part of its time
            if (unmeasured or (expected is not None and expected < left())) and _agent_installed():
                attempt(ZERO_SHOT, budget_s=0)
                out.tried[-1]["seconds"] = seconds = time.perf_counter() - t_agent
                if "error" not in out.tried[-1]:
                    ZERO_SHOT_SECONDS[graph.fingerprint] = seconds
            # pipeline takes its share, or all that is left where MCMC could not start after it
            after = left() * (1.0 - PIPELINE_SHARE) - MCMC_TAIL_EVALS * eval_s >= MIN_SEARCH_S
            share = PIPELINE_SHARE if after else 1.0
            if left() * share >= MIN_SEARCH_S:
                attempt("pipeline", budget_s=left() * share)
            chains = left() - MCMC_TAIL_EVALS * eval_s
            if chains >= MIN_SEARCH_S:
                attempt("mcmc", budget_s=chains, max_micro_batches=1)
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
