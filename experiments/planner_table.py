"""The planner table over the whole plan space: every planner at one search budget with splits, micro-batches
and sharded state allowed wherever it takes them, the agent from its shipped checkpoint at the same budget
and zero-shot, on the six models and four clusters the search is held to (docs/results.md, "The planner
table over the whole plan space").

    python -m experiments.planner_table --budget-s 60 --out results/planner_table     # run (resumes)
        [--models bert_large:48,...] [--clusters paper-8gpu,...] [--planners mcmc,pipeline,...] [--jobs 1]
    python -m experiments.planner_table --out results/planner_table --render [--json]  # tables only

Each (model, cluster) case plans with every planner in one process (one ``Evaluator``) and is saved as
``<model>-b<batch>-<cluster>.json`` after each planner (written, then renamed; a planner a case holds is
not run again unless named by ``--rerun``). A planner that fails is a row with its reason. The rendering
gives, per cluster, each planner's simulated time (ms per iteration; OOM marked), the fastest plan that
fits, the agent's time over the fastest other planner's, the agent's best seed and what its search added
to it (``agents.planner``'s seeds), and the zero-shot plan's time over the best data-parallel plan that
fits; then the counts the search is held to: the agent fastest (within 0.5%), the agent faster than every
other planner by 2% or more, zero-shot never slower than the best data-parallel plan that fits and within
10% of the fastest plan; and which plans the agent's plan actions hold (``action_round_trip``: each
encoded in the extended actions and decoded back).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

from experiments.args import argparse_type, model_batch_list, parser
from heterog.errors import HeterogError
from heterog.reporting import Column, Table

MODELS = "bert_large:48,xlnet_large:24,gpt2:8,vgg19:192,nasnet:192,gpt2_xl:8"
ADAM = frozenset({"gpt2_xl"})                 # graphs captured with Adam (the rest with SGD)
CLUSTERS = "paper-8gpu,paper-12gpu,mixed-h100-a100-l4,mixed-a100-v100-t4"
DP = ("ev-ps", "ev-ar", "cp-ps", "cp-ar")
FAST = ("single", *DP, "expert", "dpos")
SEARCHES = ("os-dpos", "pesto-ilp", "pipeline", "mcmc")
AGENT, ZERO_SHOT = "agent", "agent-0s"
PLANNERS = (*FAST, *SEARCHES, AGENT, ZERO_SHOT)
# the plan space each planner takes beyond the batch: splits beyond the batch, sharded state
WHOLE_SPACE = {"splits": True, "sharded": True}
FASTEST_WITHIN, AHEAD_BY, ZERO_SHOT_WITHIN = 0.005, 0.02, 0.10


def planner_options(name: str, budget_s: float, seed: int, checkpoint: str | None = None
                    ) -> tuple[str, dict[str, Any]]:
    """(registry method, options) of a column: the planner's budget and seed where it takes them, and every
    option of ``WHOLE_SPACE`` it has; ``agent-0s`` is the agent with budget 0 (zero-shot); ``checkpoint``: the
    agent's (both columns; None: the shipped one)."""
    from heterog.planners import get

    method = AGENT if name == ZERO_SHOT else name
    planner = get(method)
    opts: dict[str, Any] = {k: v for k, v in WHOLE_SPACE.items() if k in planner.own_options}
    if "budget_s" in planner.options:
        opts["budget_s"] = 0.0 if name == ZERO_SHOT else float(budget_s)
    if "seed" in planner.options:
        opts["seed"] = int(seed)
    if "progress" in planner.options:
        opts["progress"] = False
    if checkpoint is not None and "checkpoint" in planner.options:
        opts["checkpoint"] = checkpoint
    return method, opts


def action_round_trip(ev: Any, strategy: Any) -> str:
    """Whether the agent's plan actions hold ``strategy``: "ok" when its encoding (``envs.actions.encode_plan``,
    the extended actions, over the evaluator's groups) decodes to the same config of every op, the same
    recomputed ops and micro-batches; else what differs or why it has no encoding."""
    import numpy as np

    from envs.actions import encode_plan, plan_strategy

    splits = ev.graph.splits is not None
    try:
        action = encode_plan(strategy, ev.cluster, splits, states=True, group_of=ev.group_of)
        back = plan_strategy(ev, action, states=True, splits=splits, extended=True)
    except HeterogError as exc:
        return f"{type(exc).__name__}: {exc}"
    ops = range(len(strategy.group_of))
    if [back.op_config(o) for o in ops] != [strategy.op_config(o) for o in ops]:
        return "decodes to other configs"
    if not np.array_equal(np.isin(back.group_of, back.recompute), np.isin(strategy.group_of, strategy.recompute)):
        return "decodes to other recomputed ops"
    if back.micro != strategy.micro or (strategy.n_micro > 1 and back.schedule != strategy.schedule):
        return "decodes to other micro-batches"
    return "ok"


def run_case(model: str, batch: int, cluster_name: str, planners: list[str], budget_s: float, seed: int,
             path: str, rerun: tuple[str, ...] = (), checkpoint: str | None = None) -> str:
    """Plan one (model, cluster) with every planner the case document at ``path`` lacks (and again those of
    ``rerun``), saving the document after each planner; ``checkpoint``: the agent's (None: the shipped one)."""
    from heterog.atomic import atomic_write_json
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model
    from heterog.planners import plan

    file = Path(path)
    doc = json.loads(file.read_text()) if file.exists() else {
        "graph": model, "batch_size": batch, "cluster": cluster_name, "budget_s": budget_s, "seed": seed,
        "records": []}
    if checkpoint is not None:
        doc["agent_checkpoint"] = checkpoint
    todo = [p for p in planners if p in rerun or p not in {r["planner"] for r in doc["records"]}]
    if not todo:
        return path
    graph = capture_model(model, batch, "adam" if model in ADAM else "sgd")
    ev = Evaluator(graph, load_cluster(cluster_name))
    doc["n_ops"] = graph.n_ops
    for name in todo:
        method, opts = planner_options(name, budget_s, seed, checkpoint)
        t0 = time.perf_counter()
        try:
            strategy = plan(method, evaluator=ev, **opts)
            res = ev.evaluate(strategy, method=name, detail=False)
            rec = {"planner": name, "method": strategy.method, "iteration_time_s": res.iteration_time_s,
                   "oom": bool(res.oom), "n_micro": strategy.n_micro, "search_time_s": time.perf_counter() - t0,
                   "split_groups": sum(c.split is not None for c in strategy.configs),
                   "actions": action_round_trip(ev, strategy), "strategy": strategy.to_dict(),
                   "stats": {k: v for k, v in strategy.meta.items() if isinstance(v, (int, float, str, bool))}}
            if "seeds" in strategy.meta:                   # the agent's seeds (planner -> s, OOM negative)
                rec["seeds"] = strategy.meta["seeds"]
        except (HeterogError, MemoryError) as exc:        # a planner that cannot plan this case is a row
            rec = {"planner": name, "error": f"{type(exc).__name__}: {exc}", "search_time_s": time.perf_counter() - t0}
        print(f"  {model}:{batch} on {cluster_name}, {name}: "
              + (f"{rec['iteration_time_s'] * 1e3:.1f} ms{' OOM' if rec['oom'] else ''}" if "error" not in rec
                 else rec["error"][:120]) + f" ({rec['search_time_s']:.0f} s)", file=sys.stderr, flush=True)
        doc["records"] = [r for r in doc["records"] if r["planner"] != name] + [rec]
        atomic_write_json(file, doc)
    return path


def _run_case(case: tuple) -> str:
    return run_case(*case)


def case_path(out: Path, model: str, batch: int, cluster: str) -> Path:
    return out / f"{model}-b{batch}-{cluster}.json"


# ----------------------------------------------------------------------------- the verdict of one case
def verdict(case: dict) -> dict[str, Any]:
    """What one case says of the agent: the fastest plan that fits (planner, s), the agent's and zero-shot's
    ratio to it, the best data-parallel plan that fits, and the held-to flags (None where a plan is missing)."""
    fit = {r["planner"]: r["iteration_time_s"] for r in case["records"] if "error" not in r and not r["oom"]}
    out: dict[str, Any] = {"graph": f"{case['graph']}:{case['batch_size']}", "cluster": case["cluster"]}
    if not fit:
        return out
    fastest = min(fit, key=fit.__getitem__)
    out.update(fastest=fastest, fastest_s=fit[fastest])
    others = [t for p, t in fit.items() if p not in (AGENT, ZERO_SHOT)]
    dps = [fit[p] for p in DP if p in fit]
    if AGENT in fit:
        agent = fit[AGENT]
        out["agent_over_fastest"] = agent / fit[fastest]
        out["agent_fastest"] = agent <= fit[fastest] * (1 + FASTEST_WITHIN)
        out["agent_ahead"] = bool(others) and agent * (1 + AHEAD_BY) <= min(others)
        if others:
            out["agent_over_others"] = agent / min(others)
    if ZERO_SHOT in fit:
        zero = fit[ZERO_SHOT]
        out["zero_over_fastest"] = zero / fit[fastest]
        out["zero_within"] = zero <= fit[fastest] * (1 + ZERO_SHOT_WITHIN)
        if dps:
            out["zero_over_best_dp"] = zero / min(dps)
            out["zero_not_slower_than_dp"] = zero <= min(dps)
    return out


def _ms(rec: dict | None) -> str:
    if rec is None:
        return "-"
    if "error" in rec:
        return "error"
    return f"{rec['iteration_time_s'] * 1e3:.1f}{' OOM' if rec['oom'] else ''}"


def _seed_cells(rec: dict | None) -> tuple[str, str]:
    """The agent's best seed (planner, ms) and what its search added (the seed's time over the plan's, minus
    1), or dashes for a plan without seeds."""
    stats = (rec or {}).get("stats", {})
    if "best_seed" not in stats:
        return "-", "-"
    return f"{stats['best_seed']} {stats['best_seed_s'] * 1e3:.1f}", f"{stats['agent_added']:+.1%}"


def tables(cases: list[dict], planners: list[str]) -> str:
    """Markdown: a table per cluster (models by planners, the fastest plan, the agent's and zero-shot's ratios)
    and the counts of the held-to criteria over every case."""
    out = []
    verdicts = []
    for cluster in dict.fromkeys(c["cluster"] for c in cases):
        tab = Table([Column("model", align="left")] + [Column(p) for p in planners]
                    + [Column("fastest", align="left"), Column("agent / best other"),
                       Column("agent's best seed", align="left"), Column("agent added"), Column("0-shot / best DP")])
        for case in (c for c in cases if c["cluster"] == cluster):
            rec = {r["planner"]: r for r in case["records"]}
            v = verdict(case)
            verdicts.append(v)
            tab.add(v["graph"], *(_ms(rec.get(p)) for p in planners), v.get("fastest", "-"),
                    f"{v['agent_over_others']:.3f}" if "agent_over_others" in v else "-", *_seed_cells(rec.get(AGENT)),
                    f"{v['zero_over_best_dp']:.3f}" if "zero_over_best_dp" in v else "-")
        out += [f"### {cluster}", "", tab.markdown(), ""]
    n = len(verdicts)

    def count(key: str) -> str:
        known = [v[key] for v in verdicts if key in v]
        return f"{sum(known)} of {len(known)}" + ("" if len(known) == n else f" ({n - len(known)} without the plan)")

    out += [f"Over {n} cases: the agent fastest (within {FASTEST_WITHIN:.1%}) in {count('agent_fastest')}; "
            f"faster than every other planner by {AHEAD_BY:.0%} or more in {count('agent_ahead')}; zero-shot "
            f"not slower than the best data-parallel plan that fits in {count('zero_not_slower_than_dp')}, "
            f"within {ZERO_SHOT_WITHIN:.0%} of the fastest plan in {count('zero_within')}.", ""]
    trips = [(c, r) for c in cases for r in c["records"] if "actions" in r]
    missed = [f"{r['planner']} on {c['graph']}:{c['batch_size']}, {c['cluster']} ({r['actions']})"
              for c, r in trips if r["actions"] != "ok"]
    out += [f"The agent's plan actions hold {len(trips) - len(missed)} of the {len(trips)} plans"
            + (f"; not: {'; '.join(missed)}." if missed else "."), ""]
    return "\n".join(out)


def load_cases(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def main(argv: list[str] | None = None) -> int:
    ap = parser("experiments.planner_table", __doc__)
    ap.add_argument("--models", type=argparse_type(model_batch_list), default=MODELS, help="MODEL:BATCH,...")
    ap.add_argument("--clusters", default=CLUSTERS)
    ap.add_argument("--planners", default=",".join(PLANNERS),
                    help=f"columns: planner names, {ZERO_SHOT} for the agent's zero-shot plan")
    ap.add_argument("--budget-s", type=float, default=60.0, help="search budget of every budgeted planner")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (one process each)")
    ap.add_argument("--out", default="results/planner_table")
    ap.add_argument("--rerun", default="", help="planners to plan again in the saved cases (e.g. agent)")
    ap.add_argument("--agent-checkpoint", default=None,
                    help="the checkpoint the agent and zero-shot start from (default: the shipped one)")
    ap.add_argument("--render", action="store_true", help="only print the tables of the saved cases")
    ap.add_argument("--json", action="store_true", help="with --render: each case's verdict as JSON")
    args = ap.parse_args(argv)
    out = Path(args.out)
    planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    rerun = tuple(p.strip() for p in args.rerun.split(",") if p.strip())
    try:
        from heterog.planners import get

        for p in (*planners, *rerun):
            get(AGENT if p == ZERO_SHOT else p)
        if args.budget_s <= 0:
            raise HeterogError(f"--budget-s must be positive, got {args.budget_s}")
        if args.jobs < 1:
            raise HeterogError(f"--jobs must be at least 1, got {args.jobs}")
        if args.agent_checkpoint is not None and not Path(args.agent_checkpoint).is_file():
            raise HeterogError(f"--agent-checkpoint {args.agent_checkpoint!r} is not a file")
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.render:
        from rich.progress import Progress

        out.mkdir(parents=True, exist_ok=True)
        todo = [(m, b, c, planners, args.budget_s, args.seed, str(case_path(out, m, b, c)), rerun,
                 args.agent_checkpoint)
                for m, b in args.models for c in args.clusters.split(",")]
        with Progress(transient=True) as bar:
            task = bar.add_task(f"{len(todo)} cases", total=len(todo))
            if args.jobs == 1:
                for case in todo:
                    run_case(*case)
                    bar.advance(task)
            else:
                with mp.get_context("spawn").Pool(args.jobs) as pool:
                    for _ in pool.imap_unordered(_run_case, todo):
                        bar.advance(task)
    cases = load_cases(out)
    if args.json:
        print(json.dumps([verdict(c) for c in cases], indent=1))
    else:
        print(tables(cases, planners))
    return 0


if __name__ == "__main__":
    sys.exit(main())
