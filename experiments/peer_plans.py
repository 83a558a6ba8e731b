"""Peers' plans in our simulator next to our planners' best (docs/results.md, "Peers' plans in our
simulator"): Metis' and Sailor's best plans of Sailor's heterogeneous scenarios, imported and simulated.

    python -m experiments.peer_plans --budget-s 60 [--scenarios 4+4,8+8,16+16] [--out DIR]
        [--planners pipeline,pipeline+splits,mcmc+splits,agent,best-dp,portfolio] [--graph FILE] [--json]

Scenarios (Sailor's planner evaluation, ``experiments/data/sailor/README.md``): OPT-350M as Sailor trained it
(zoo ``opt_350m_megatron``), Adam, global batch 1024, on ``gcp-a100-v100:a100=N,v100=M`` (N nodes of 4
A100-40 and M of 4 V100-16: 4+4, 8+8, 16+16 GPUs by default; 32+96 and 128+384, hundreds of GPUs, where
only Metis' planner was run). Every plan is simulated by ``heterog.evaluate.Evaluator``
(roofline cost model, default task order); a row gives the iteration time, OOM, the peak memory of the
fullest GPU (largest peak / capacity) and what the plan is.

Peers' plans are the committed best plans (``experiments/data/sailor/peer_plans/<scenario>``):
- ``metis``: Metis' own candidate (``planner_output.metis_raw_top``, the one whose cost is the chosen plan's
  ``iter_time``) read by ``heterog.interop.read_metis`` (``metis_candidate`` names the fields as the reader
  does: ``cost``, and the search's ``gbs``); checked to give the same Strategy as Sailor's conversion of it
  (``plan_config`` read by ``read_sailor``).
- ``sailor``: ``plan_config`` read by ``read_sailor``. Sailor's plans mix tensor-parallel degrees in one
  stage (A100 replicas of tp 1 next to V100 replicas of tp 4) and divide 1024 samples over 5 or 10 replicas
  (Sailor's simulator rounds the micro-batches up); neither is a heterog Strategy, so the import is refused
  and the row notes why. ``sailor-dp`` is the nearest plan heterog can run (``data_parallel_variant``): the
  same stages and GPUs, each replica's batch share (1024 divided evenly over the stage's replicas) divided
  evenly over its GPUs, data parallel with AllReduce (a tp-4 replica's four GPUs become four replicas of a
  quarter of its share: the same samples per GPU, whole parameters on each), Sailor's count of micro-batches
  (ceil(gbs / (mbs x dp))), 1F1B.

Ours: each planner of ``PLANNERS`` with ``--budget-s`` seconds on the same graph and cluster; the agent
only where the shipped policy covers the cluster (``AGENT_MAX_GPUS``); ``portfolio`` is what ``heterog plan``
without ``--method`` runs (``heterog.replan``'s ``auto``, progress on stderr). ``best ours`` is the fastest that
fits; the ratios are its time over each peer plan's time.
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments.args import parser
from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.opgraph import OpGraph
    from heterog.interop import ForeignPlan
    from heterog.strategy import ParallelConfig, Strategy

MODEL, BATCH, OPTIMIZER = "opt_350m_megatron", 1024, "adam"
PLAN_DIR = Path(__file__).resolve().parent / "data" / "sailor" / "peer_plans"
SCENARIOS = {"4+4": (1, 1), "8+8": (2, 2), "16+16": (4, 4),     # name -> nodes of 4 A100 GPUs, of 4 V100
             "32+96": (8, 24), "128+384": (32, 96)}            # each type; the last two: hundreds of GPUs
GPUS_PER_NODE = 4
PORTFOLIO = "auto"
# label -> (method, options): our planners (heterog.planners)
PLANNERS: dict[str, tuple[str, dict[str, Any]]] = {
    "pipeline": ("pipeline", {}),
    "pipeline+splits": ("pipeline", {"splits": True}),
    "pipeline k<=64": ("pipeline", {"max_micro_batches": 64}),   # the default stops at 32 micro-batches
    "mcmc+splits": ("mcmc", {"splits": True}),
    "agent": ("agent", {"progress": False}),
    "best-dp": ("best-dp", {}),
    "portfolio": (PORTFOLIO, {}),       # ``heterog plan`` without --method: heterog.replan's auto, zero-shot on
}
AGENT_MAX_GPUS = 16          # the shipped pretrained policy's device tokens (agents.planner.PRETRAINED)


def scenario_cluster(name: str) -> str:
    """The cluster spec of scenario ``name`` (``SCENARIOS``)."""
    a100, v100 = SCENARIOS[name]
    return f"gcp-a100-v100:a100={a100},v100={v100}"


def scenario_dir(name: str) -> Path:
    a100, v100 = (n * GPUS_PER_NODE for n in SCENARIOS[name])
    return PLAN_DIR / f"opt350_a100x{a100}_v100x{v100}"


def plan_file(folder: Path, planner: str) -> Path:
    """``<planner>.json`` in ``folder``, or ``<planner>.json.gz`` (``experiments.peers.write_peer_plan``
    compresses the large ones); the plain name when neither exists, so that reading it names it."""
    packed = folder / f"{planner}.json.gz"
    return packed if packed.exists() else folder / f"{planner}.json"


def parse_scenarios(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad or not names:
        raise HeterogError(f"unknown scenarios {bad or text!r} (choose from {', '.join(SCENARIOS)})")
    return names


def parse_planners(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in PLANNERS]
    if bad:
        raise HeterogError(f"unknown planners {bad} (choose from {', '.join(PLANNERS)})")
    return names


# ----------------------------------------------------------------------------- peers' plans
def metis_candidate(wrapper: dict[str, Any]) -> dict[str, Any]:
    """Metis' raw candidate of the chosen plan in a committed ``metis.json`` (or ``.json.gz``), with the fields
    ``heterog.interop.metis`` reads: ``cost`` (Metis' estimate, as Metis keeps it: milliseconds; the file
    names it ``cost_s``) and ``gbs`` (the file's ``global_batch_size``)."""
    out = wrapper.get("planner_output", {})
    best, raw = out.get("best"), out.get("metis_raw_top", [])
    if not best:
        raise HeterogError(f"{wrapper.get('scenario')}: the Metis file has no chosen plan")
    starts = [s[0] for s in best["pipeline_list"][0]["layers_per_stage"]]
    match = [r for r in raw if math.isclose(r["cost_s"], best["iter_time"], rel_tol=1e-12)
             and r["layer_partition"][:-1] == starts]
    if len(match) != 1:
        raise HeterogError(f"{wrapper.get('scenario')}: {len(match)} of Metis' raw candidates match its chosen "
                           f"plan (iter_time {best['iter_time']})")
    cand = {k: v for k, v in match[0].items() if k != "cost_s"}
    return {**cand, "cost": match[0]["cost_s"], "gbs": int(wrapper["global_batch_size"])}


def sailor_micro_batches(d: dict[str, Any]) -> int:
    """Sailor's simulator's micro-batches of a plan: ceil(gbs / (mbs x dp of the first stage x pipelines))."""
    pipes = d["pipeline_list"]
    return math.ceil(int(d["gbs"]) / (int(d["mbs"]) * int(pipes[0]["dp"][0]) * len(pipes)))


def read_sailor_rounded(d: dict[str, Any], source: str) -> ForeignPlan:
    """A Sailor plan's stages and replicas (``read_sailor``) where gbs need not divide: read at the batch its
    simulator runs (micro-batches x mbs x dp), the real batch kept in meta ``gbs``."""
    from heterog.interop import read_sailor

    k = sailor_micro_batches(d)
    plan = read_sailor({**d, "gbs": k * int(d["mbs"]) * int(d["pipeline_list"][0]["dp"][0])
                        * len(d["pipeline_list"])}, source)
    return plan


def _config(pairs: list[tuple[int, int]]) -> ParallelConfig:
    from heterog.strategy import ParallelConfig

    if len(pairs) == 1:
        return ParallelConfig.single(*pairs[0])
    return ParallelConfig(tuple(d for d, _ in pairs), tuple(x for _, x in pairs), sync="allreduce")


def data_parallel_variant(plan: ForeignPlan, graph: OpGraph, cluster: Cluster, micro_batches: int) -> Strategy:
    """The nearest heterog Strategy of a one-pipeline plan whose stages mix tensor-parallel degrees (module
    docstring, ``sailor-dp``): the plan's stages and GPUs (placed as ``heterog.interop`` places them), the
    graph's batch divided evenly over a stage's replicas and a replica's share evenly over its GPUs, data
    parallel with AllReduce, ``micro_batches`` even micro-batches under 1F1B."""
    from heterog.baselines.expert import block_layers
    from heterog.interop.common import Placer, PlanImportError, check_layers
    from heterog.shares import even_shares
    from heterog.strategy import Strategy

    if len(plan.pipelines) != 1:
        raise PlanImportError(f"{plan.source}: {len(plan.pipelines)} pipelines; the data-parallel variant takes one")
    layer_of, L = block_layers(graph)
    pipe, B = plan.pipelines[0], graph.batch_size
    check_layers(pipe, L + 2, plan.source)
    placer = Placer(cluster)
    placer.check_counts(plan)
    stage_of_layer = np.zeros(L + 2, dtype=np.int64)
    configs = []
    for s, st in enumerate(pipe):
        replicas = [placer.take(r) for r in st.replicas]
        pairs = [(d, x) for devs, share in zip(replicas, even_shares(B, len(replicas)))
                 for d, x in zip(devs, even_shares(share, len(devs)))]
        configs.append(_config(pairs))
        stage_of_layer[list(st.layers)] = s
    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, B, stage_of_layer[layer_of], configs,
                    method="sailor-dp", meta={"source": plan.source, **plan.meta},
                    micro_batches=None if micro_batches == 1 else tuple(even_shares(B, micro_batches)),
                    schedule="1f1b")


def peer_plans(name: str, graph: OpGraph, cluster: Cluster) -> list[tuple[str, Strategy | None, str]]:
    """(label, Strategy or None, note) of each peer plan of scenario ``name`` (module docstring)."""
    from heterog.atomic import read_json
    from heterog.interop import PlanImportError, read_metis, read_sailor, to_strategy

    folder = scenario_dir(name)
    metis_file, sailor_file = plan_file(folder, "metis"), plan_file(folder, "sailor")
    metis = read_json(metis_file)
    s_metis = to_strategy(read_metis(metis_candidate(metis), str(metis_file)), graph, cluster)
    via_sailor = to_strategy(read_sailor(metis["plan_config"], str(metis_file)), graph, cluster)
    same = (s_metis.configs == via_sailor.configs and s_metis.micro == via_sailor.micro
            and bool(np.array_equal(s_metis.group_of, via_sailor.group_of)))
    s_metis.method = "metis"
    out: list[tuple[str, Strategy | None, str]] = [
        ("metis", s_metis, f"Metis' estimate {metis['planner_predicted_s']:.2f} s, Sailor's simulator "
                           f"{metis['sailor_simulated_s']:.2f} s; "
                           + ("same plan as Sailor's conversion" if same else "DIFFERS from Sailor's conversion"))]
    if not sailor_file.exists():                 # scenarios only Metis' planner was run on
        out.append(("sailor", None, "not planned: Sailor's planner was not run on this scenario"))
        return out
    sailor = read_json(sailor_file)
    peer_note = (f"Sailor's estimate {sailor['planner_predicted_s']:.2f} s, its simulator "
                 f"{sailor['sailor_simulated_s']:.2f} s")
    try:
        s = to_strategy(read_sailor(sailor["plan_config"], str(sailor_file)), graph, cluster)
        s.method = "sailor"
        out.append(("sailor", s, peer_note))
    except PlanImportError as exc:
        tps = sorted({int(r[1]) for st in sailor["plan_config"]["pipeline_list"][0]["tmp_per_stage"] for r in st})
        mixed = f"; a stage mixes tp degrees {tps}, which no heterog config expresses" if len(tps) > 1 else ""
        out.append(("sailor", None, f"not importable: {str(exc).split(': ', 1)[-1]}{mixed}"))
        if not mixed and "divisible" not in str(exc):
            return out
        k = sailor_micro_batches(sailor["plan_config"])
        plan = read_sailor_rounded(sailor["plan_config"], str(sailor_file))
        out.append(("sailor-dp", data_parallel_variant(plan, graph, cluster, k),
                    f"{peer_note}; tp replicas as data parallel, {k} micro-batches"))
    return out


# ----------------------------------------------------------------------------- describing and scoring
def _short(type_name: str) -> str:
    return type_name.split("-")[0]


def describe_config(cfg: ParallelConfig, cluster: Cluster) -> str:
    """``4xA100+4xV100 dp8 tp1 [A100 205, V100 51]``: GPUs by type, replicas, split degree, samples per
    GPU by type (one number where all are equal)."""
    types = [_short(cluster.devices[d].type.name) for d in cfg.devices]
    gpus = "+".join(f"{n}x{t}" for t, n in Counter(types).items())
    dp = cfg.grid if cfg.split is not None else cfg.n_replicas
    tp = cfg.group_size if cfg.split is not None else 1
    per: dict[str, set[int]] = {}
    for t, x in zip(types, cfg.shares):
        per.setdefault(t, set()).add(int(x))
    every = {x for v in per.values() for x in v}
    shares = str(every.pop()) if len(every) == 1 else ", ".join(
        f"{t} {'/'.join(map(str, sorted(v)))}" for t, v in per.items())
    split = f" {cfg.split}" if cfg.split is not None and tp > 1 else ""
    return f"{gpus} dp{dp} tp{tp}{split} [{shares}]"


def describe(strategy: Strategy, graph: OpGraph, cluster: Cluster) -> str:
    """Stages (runs of layers under one config, ``block_layers`` numbering; a layer under several configs
    names the one holding most of its ops), micro-batches and recomputed groups."""
    from heterog.baselines.expert import block_layers

    layer_of, L = block_layers(graph)
    main = []
    mixed = 0
    for layer in range(L + 2):
        groups, counts = np.unique(strategy.group_of[layer_of == layer], return_counts=True)
        cfgs = {strategy.configs[int(g)] for g in groups}
        mixed += len(cfgs) > 1
        main.append(strategy.configs[int(groups[int(np.argmax(counts))])])
    runs: list[list[int]] = []
    for layer, cfg in enumerate(main):
        if runs and main[runs[-1][-1]] == cfg:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    stages = "; ".join(f"L{r[0]}-{r[-1]}: {describe_config(main[r[0]], cluster)}" for r in runs)
    extra = f"; {mixed} layers under several layouts" if mixed else ""
    rec = f", recompute {len(strategy.recompute)}/{strategy.n_groups} groups" if strategy.recompute else ""
    return (f"{len(runs)} stage{'s' if len(runs) > 1 else ''}: {stages}{extra} | {strategy.n_micro} micro-batches "
            f"{strategy.schedule}{rec}")


def score(ev: Evaluator, strategy: Strategy) -> dict[str, Any]:
    """The simulated iteration time, OOM and the fullest GPU's peak memory of ``strategy``."""
    r = ev.evaluate(strategy)
    fullest = max(r.peak_memory_bytes, key=lambda d: r.peak_memory_bytes[d] / r.memory_capacity_bytes[d])
    return {"iteration_time_s": float(r.iteration_time_s), "oom": bool(r.oom), "fullest_gpu": fullest,
            "peak_memory_bytes": int(r.peak_memory_bytes[fullest]),
            "memory_capacity_bytes": int(r.memory_capacity_bytes[fullest]),
            "plan": describe(strategy, ev.graph, ev.cluster)}


# ----------------------------------------------------------------------------- the experiment
def run_scenario(name: str, graph: OpGraph, budget_s: float, planners: list[str],
                 out_dir: Path | None = None) -> dict[str, Any]:
    """Every peer plan and every planner of ``planners`` on scenario ``name``: rows, the best of ours and
    the ratios (module docstring); strategies saved under ``out_dir/<name>/`` when given."""
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.planners import plan
    from heterog.replan import replan

    cluster = load_cluster(scenario_cluster(name))
    rows: list[dict[str, Any]] = []
    saved: dict[str, Strategy] = {}
    for label, strategy, note in peer_plans(name, graph, cluster):
        row: dict[str, Any] = {"scenario": name, "planner": label, "peer": True, "note": note}
        if strategy is not None:
            row.update(score(Evaluator(graph, cluster), strategy))
            saved[label] = strategy
        rows.append(row)
        print(f"{name} {label}: {row.get('iteration_time_s', 'n/a')}", file=sys.stderr)
    for label in planners:
        method, options = PLANNERS[label]
        row = {"scenario": name, "planner": label, "peer": False, "budget_s": budget_s}
        if method == "agent" and cluster.n_devices > AGENT_MAX_GPUS:
            row["note"] = f"not run: the shipped policy covers at most {AGENT_MAX_GPUS} GPUs, this cluster has " \
                          f"{cluster.n_devices}"
            rows.append(row)
            continue
        ev = Evaluator(graph, cluster)
        t0 = time.perf_counter()
        if method == PORTFOLIO:
            found = replan(graph, cluster, PORTFOLIO, budget_s, zero_shot=True, progress=True)
            strategy = found.best
            row["note"] = f"chose {strategy.method}; " + ", ".join(
                f"{e['method']} {e['seconds']:.0f} s" for e in found.tried)
        else:
            budget = {} if method == "best-dp" else {"budget_s": budget_s}
            strategy = plan(method, evaluator=ev, **budget, **options)
            row["evaluations"] = ev.n_evaluations
        row["search_s"] = time.perf_counter() - t0
        row.update(score(Evaluator(graph, cluster), strategy))
        if method == "best-dp":
            row["note"] = f"picked {strategy.method}"
        saved[label] = strategy
        rows.append(row)
        print(f"{name} {label}: {row['iteration_time_s']:.3f} s oom={row['oom']} ({row['search_s']:.0f} s)",
              file=sys.stderr)
    if out_dir is not None:
        folder = Path(out_dir) / name
        folder.mkdir(parents=True, exist_ok=True)
        for label, strategy in saved.items():
            strategy.save(folder / f"{label.replace('+', '-')}.strategy.json")
    return {"scenario": name, "cluster": cluster.name, "graph": f"{graph.name}-b{graph.batch_size}",
            "rows": rows, **summarise(rows)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``best_ours``: our fastest planner whose plan fits (None if none does); ``ours_over_peer``: its time
    over each simulated peer plan's."""
    ours = [r for r in rows if not r["peer"] and "iteration_time_s" in r and not r["oom"]]
    best = min(ours, key=lambda r: r["iteration_time_s"]) if ours else None
    ratios = {r["planner"]: best["iteration_time_s"] / r["iteration_time_s"]
              for r in rows if best and r["peer"] and "iteration_time_s" in r}
    return {"best_ours": best["planner"] if best else None, "ours_over_peer": ratios}


def table(results: list[dict[str, Any]]) -> str:
    """The results as one Markdown table (times in seconds, memory in GiB of the fullest GPU)."""
    lines = ["| scenario | planner | iteration (s) | OOM | peak / capacity (GiB) | plan |", "|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            if "iteration_time_s" in r:
                t = f"{r['iteration_time_s']:.2f}"
                mem = f"{r['peak_memory_bytes'] / 2**30:.1f} / {r['memory_capacity_bytes'] / 2**30:.0f}"
                oom, what = ("yes" if r["oom"] else "no"), r["plan"]
            else:
                t, mem, oom, what = "-", "-", "-", r.get("note", "")
            who = f"{r['planner']} (peer)" if r["peer"] else r["planner"]
            lines.append(f"| {res['scenario']} | {who} | {t} | {oom} | {mem} | {what} |")
    lines.append("")
    for res in results:
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in res["ours_over_peer"].items())
        lines.append(f"{res['scenario']}: best of ours {res['best_ours']}; ours / peer time: {ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from heterog.atomic import atomic_write_json
    from heterog.cli.args import resolve_graph

    p = parser("experiments.peer_plans", __doc__)
    p.add_argument("--budget-s", type=float, default=60.0, help="search budget of each planner (s)")
    p.add_argument("--scenarios", default="4+4,8+8,16+16", help=f"of {', '.join(SCENARIOS)}")
    p.add_argument("--planners", default=",".join(PLANNERS), help=f"of {', '.join(PLANNERS)}")
    p.add_argument("--graph", default=MODEL, help=f"graph file or zoo model (default {MODEL} at batch {BATCH}, "
                                                  f"{OPTIMIZER})")
    p.add_argument("--out", default=None, help="folder for peer_plans.json and the strategies")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    try:
        scenarios, planners = parse_scenarios(args.scenarios), parse_planners(args.planners)
        if args.budget_s <= 0:
            raise HeterogError(f"--budget-s must be positive, got {args.budget_s}")
        graph = resolve_graph(args.graph, BATCH, optimizer=OPTIMIZER)
        results = [run_scenario(s, graph, args.budget_s, planners, args.out) for s in scenarios]
    except HeterogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        atomic_write_json(Path(args.out) / "peer_plans.json", {"budget_s": args.budget_s, "results": results})
    if args.json:
        import json

        print(json.dumps(results, indent=1))
    else:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
