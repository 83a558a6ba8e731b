"""Plan identity: a seeded set of plans of every kind (single device, data parallel, mixed, splits, grids,
micro-batches, pipelines, recomputation, combinations), each compiled plan's digest kept once and checked.

A compiler change that must change nothing is checked task for task against the reference:

    python -m experiments.plan_identity_plans [--seed 0]                    # write the reference
    PYTHONPATH=/path/to/other/tree python experiments/plan_identity.py --check [--kinds split,grid]
        [--limit N] [--mode scratch|patched|both] [--baseline-tree DIR] [--ignore names,...]

The script imports only ``heterog`` (the Strategy file form, the compile entry point, clusters, graphs),
``simulator``, numpy and the standard library, so it runs by path against another tree. The graphs are
stored beside the reference (``--graphs capture`` captures them again from the zoo instead). A digest
covers the TaskGraph (resources; per task: resources, duration, lag, priority, deps, memory, frees,
category and name, in order) and the CompiledPlan arrays the runtime reads (``PLAN_FIELDS``), each
component hashed apart so a mismatch names what differs; a field the code no longer has is reported as
missing. With ``--baseline-tree`` (default: the tree holding this script, when another tree's heterog is
imported) the first mismatching plans are compiled there too and the first differing task is printed.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

import heterog
from heterog.strategy import Strategy

FORMAT, VERSION = "heterog-plan-identity", 1
DATA_DIR = Path(__file__).resolve().parent / "data" / "plan_identity"
REFERENCE = DATA_DIR / "reference.json.gz"
# graph key -> (zoo model, batch size, optimizer, shrink to the zoo's small overrides)
GRAPHS = {
    "tiny_mlp": ("tiny_mlp", 12, "sgd", False),
    "tiny_cnn": ("tiny_cnn", 8, "sgd", False),
    "tiny_transformer": ("tiny_transformer", 8, "sgd", False),
    "resnet50_small": ("resnet50", 8, "sgd", True),          # batch norm
    "transformer_small": ("transformer", 6, "adam", True),   # encoder-decoder, Adam state
}
CLUSTERS = ("paper-8gpu", "local-cpu-4", "mixed-a100-v100-t4")
KINDS = ("single", "dp", "mixed", "split", "grid", "micro", "pipeline", "recompute", "combo")
PER_PAIR = 9            # plans of each kind but "single" per (graph, cluster): 9 x 15 = 135
TG_COMPONENTS = ("resources", "duration", "lag", "priority", "task_resources", "deps", "memory", "frees",
                 "categories", "names")
# CompiledPlan fields the runtime and reports read (read with getattr: a renamed field is reported missing)
PLAN_FIELDS = ("task_kind", "task_op", "task_device", "task_prio_op", "dep_ptr", "dep_idx", "task_micro",
               "task_slot", "op_priority", "n_devices", "n_links", "n_micro", "schedule", "ps_device",
               "allreduce_algo")
MISSING = "missing"


# ---------------------------------------------------------------------------- digests
def _canon(value: Any) -> bytes:
    """Bytes of a value that equal values share whatever their integer or float width."""
    if value is None:
        return b"none"
    if isinstance(value, np.ndarray) or (isinstance(value, (list, tuple)) and value
                                         and all(isinstance(v, np.ndarray) for v in value)):
        arrays = [value] if isinstance(value, np.ndarray) else list(value)
        out = []
        for a in arrays:
            a = np.asarray(a)
            if a.dtype.kind in "biu":
                a = a.astype(np.int64)
            elif a.dtype.kind == "f":
                a = a.astype(np.float64)
            out.append(f"{a.dtype.str}{a.shape}".encode() + np.ascontiguousarray(a).tobytes())
        return b"|".join(out)
    if isinstance(value, dict):
        return json.dumps(sorted((str(k), v) for k, v in value.items()), default=str).encode()
    return json.dumps(value, default=str).encode()


def _h(value: Any) -> str:
    return hashlib.sha256(_canon(value)).hexdigest()[:16]


def _tg_component(tg: Any, name: str) -> Any:
    if name == "resources":
        return _canon(list(tg.resource_names)) + _canon([tg.memory_capacity_bytes, tg.resident_bytes])
    if name in ("duration", "lag", "priority"):
        return getattr(tg, name)
    if name == "task_resources":
        return list(tg.resources())
    if name == "deps":
        return list(tg.dependencies())
    if name == "memory":
        return list(tg.memory())
    if name == "frees":
        return list(tg.frees())
    if name == "categories":
        cats = list(tg.category_names)
        return [cats[c] for c in np.asarray(tg.task_category).tolist()]
    if name == "names":
        return [tg.task_name(t) for t in range(tg.n_tasks)]
    raise KeyError(name)


# fields the reference names that later code keeps elsewhere: (plan, graph) -> the value as it was
def _allreduce_algo(plan: Any, graph: Any) -> dict[int, str]:
    """Op -> AllReduce algorithm, from the per-tensor aggregation records (the last tensor of an op wins,
    as the per-op table did)."""
    from heterog.compiler.index import graph_index
    t_op = graph_index(graph).t_op
    return {int(t_op[t]): a.algorithm for t, a in sorted(plan.placements.aggregation.items())
            if a.kind == "allreduce"}


MOVED_FIELDS: dict[str, Callable[[Any, Any], Any]] = {
    "ps_device": lambda plan, graph: plan.placements.ps_device,
    "allreduce_algo": _allreduce_algo,
}
RENAMED_KINDS = {"relayout": "split"}     # task kinds by the name the reference was written with


def _field(plan: Any, name: str, graph: Any) -> Any:
    if hasattr(plan, name):
        return getattr(plan, name)
    if name in MOVED_FIELDS and hasattr(plan, "placements") and graph is not None:
        return MOVED_FIELDS[name](plan, graph)
    raise AttributeError(name)


def digest(plan: Any, graph: Any = None) -> dict[str, str]:
    """Component name -> 16-hex digest of one compiled plan (``MISSING`` where the code lacks it);
    ``graph``: the plan's graph, to read fields that moved (``MOVED_FIELDS``)."""
    out: dict[str, str] = {}
    tg = getattr(plan, "tg", None)
    for name in TG_COMPONENTS:
        try:
            out["tg." + name] = MISSING if tg is None else _h(_tg_component(tg, name))
        except (AttributeError, KeyError, TypeError):
            out["tg." + name] = MISSING
    for name in PLAN_FIELDS:
        try:
            out["plan." + name] = _h(_field(plan, name, graph))
        except AttributeError:
            out["plan." + name] = MISSING
    return out


def kind_counts(plan: Any) -> dict[str, int]:
    """Tasks of each kind by the kind's name (``TaskKind``), or by code where the names are gone."""
    kinds = np.asarray(getattr(plan, "task_kind", np.zeros(0, dtype=np.int64)))
    try:
        from heterog.compiler import TaskKind
        name = {int(k): k.name.lower() for k in TaskKind}
    except ImportError:
        name = {}
    codes, n = np.unique(kinds, return_counts=True)
    named = (name.get(int(c), str(int(c))) for c in codes)
    return {RENAMED_KINDS.get(k, k): int(m) for k, m in zip(named, n)}


def task_rows(plan: Any) -> list[dict]:
    """One record per task (what the digest covers), to find the first task two compilations differ in."""
    tg = plan.tg
    rp, ri = tg.resources()
    dp, di = tg.dependencies()
    mp, mr, mb = tg.memory()
    fp, fi = tg.frees()
    cats = list(tg.category_names)
    arrays = {f: getattr(plan, f, None) for f in ("task_kind", "task_op", "task_device", "task_prio_op",
                                                     "task_micro", "task_slot")}
    rows = []
    for t in range(tg.n_tasks):
        row = {"resources": ri[rp[t]:rp[t + 1]].tolist(), "duration": float(tg.duration[t]),
               "lag": float(tg.lag[t]), "priority": float(tg.priority[t]), "deps": di[dp[t]:dp[t + 1]].tolist(),
               "mem": [[int(r), int(b)] for r, b in zip(mr[mp[t]:mp[t + 1]], mb[mp[t]:mp[t + 1]])],
               "frees": fi[fp[t]:fp[t + 1]].tolist(), "category": cats[int(tg.task_category[t])],
               "name": tg.task_name(t)}
        for f, a in arrays.items():
            row[f] = None if a is None else int(np.asarray(a)[t])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- graphs, clusters, compiling
def load_graphs(source: str, keys: Iterable[str]) -> dict[str, Any]:
    """The graphs stored beside the reference (``source="stored"``) or captured again from the zoo."""
    graphs = {}
    for key in keys:
        model, batch, optimizer, small = GRAPHS[key]
        path = DATA_DIR / "graphs" / f"{key}.json.gz"
        if source == "stored":
            graphs[key] = heterog.load_graph(path)
            continue
        from heterog import zoo
        module, inputs = zoo.build(model, batch, device="meta", **(zoo.small_overrides(model) if small else {}))
        graphs[key] = heterog.capture(module, inputs, optimizer=optimizer, name=key)
    return graphs


def compile_plan(graph: Any, cluster: Any, cost: Any, strategy: Strategy, compiler: Any = None) -> Any:
    """The compiled plan of ``strategy`` from scratch (``compile_strategy``) or by ``compiler`` (patching)."""
    if compiler is not None:
        return compiler.compile(strategy)
    from heterog.compiler import compile_strategy
    return compile_strategy(graph, cluster, strategy, cost)


def patching_compiler(graph: Any, cluster: Any, cost: Any) -> Any:
    """A compiler that patches each plan from the last ones it compiled wherever it can."""
    from heterog.compiler import Compiler
    try:
        return Compiler(graph, cluster, cost, max_bases=4, delta_fraction=1.0)
    except TypeError:
        return Compiler(graph, cluster, cost)


def strategy_of(record: dict, graph: Any) -> Strategy:
    d = dict(record["strategy"])
    d["graph_fingerprint"] = graph.fingerprint      # a changed fingerprint is reported apart, not here
    return Strategy.from_dict(d, source=f"plan {record['id']}")


# ---------------------------------------------------------------------------- checking
def load_reference(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"error: no reference file {path} (write it with python -m experiments.plan_identity_plans)")
    with gzip.open(path, "rt") as f:
        ref = json.load(f)
    if ref.get("format") != FORMAT:
        raise SystemExit(f"error: {path} is not a plan identity reference")
    return ref


def select(ref: dict, kinds: list[str] | None, limit: int | None) -> list[dict]:
    plans = [p for p in ref["plans"] if kinds is None or p["kind"] in kinds]
    if limit is not None:            # the first ``limit`` of each kind, so every kind stays covered
        seen: Counter = Counter()
        plans = [p for p in plans if (seen.update([p["kind"]]) or seen[p["kind"]] <= limit)]
    return plans


def compare(record: dict, plan: Any, ignore: set[str], graph: Any = None) -> list[str]:
    """What differs between a stored plan and this compilation of it (empty: identical)."""
    problems = []
    now = digest(plan, graph)
    for comp, want in record["digest"].items():
        if comp in ignore or comp.split(".", 1)[-1] in ignore:
            continue
        got = now.get(comp, MISSING)
        if got == MISSING and want != MISSING:
            problems.append(f"{comp}: this code has no such field (renamed? pass --ignore {comp})")
        elif got != want:
            problems.append(f"{comp} differs")
    if problems:
        n_now = int(plan.tg.n_tasks) if hasattr(plan, "tg") else -1
        counts = kind_counts(plan)
        delta = {k: counts.get(k, 0) - record["counts"].get(k, 0) for k in set(counts) | set(record["counts"])}
        problems.append(f"tasks {record['n_tasks']} -> {n_now}; count deltas by kind: "
                        f"{ {k: v for k, v in sorted(delta.items()) if v} or 'none'}")
    return problems


def check(ref: dict, plans: list[dict], graphs: dict[str, Any], mode: str,
          ignore: set[str]) -> tuple[dict, list[tuple[dict, list[str]]]]:
    from heterog.cost import CostModel

    stats: dict = defaultdict(lambda: Counter())
    bad: list[tuple[dict, list[str]]] = []
    by_pair: dict = defaultdict(list)
    for p in plans:
        by_pair[(p["graph"], p["cluster"])].append(p)
    modes = ["scratch", "patched"] if mode == "both" else [mode]
    total = len(plans) * len(modes)
    with _progress(total) as advance:
        for (gkey, cname), records in by_pair.items():
            graph, cluster = graphs[gkey], heterog.load_cluster(cname)
            cost = CostModel(cluster)
            for m in modes:
                compiler = patching_compiler(graph, cluster, cost) if m == "patched" else None
                for rec in records:
                    stats[rec["kind"]]["checked"] += 1
                    try:
                        plan = compile_plan(graph, cluster, cost, strategy_of(rec, graph), compiler)
                        problems = compare(rec, plan, ignore, graph)
                    except Exception as exc:     # noqa: BLE001 - a plan the code no longer compiles is a mismatch
                        problems = [f"compile failed: {type(exc).__name__}: {exc}"]
                    if problems:
                        stats[rec["kind"]]["mismatched"] += 1
                        bad.append(({**rec, "mode": m}, problems))
                    else:
                        stats[rec["kind"]]["matched"] += 1
                    advance()
    return stats, bad


class _progress:
    """A rich progress bar where rich is installed, else a line every 100 plans."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.bar = total, 0, None

    def __enter__(self) -> Callable[[], None]:
        try:
            from rich.progress import Progress
            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task("compiling plans", total=self.total)
        except ImportError:
            self.bar = None
        return self.advance

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.task)
        elif self.done % 100 == 0:
            print(f"  {self.done}/{self.total} plans", flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def summary(stats: dict) -> str:
    lines = [f"{'kind':<10} {'checked':>8} {'matched':>8} {'mismatched':>10}"]
    for kind in [k for k in KINDS if k in stats]:
        s = stats[kind]
        lines.append(f"{kind:<10} {s['checked']:>8} {s['matched']:>8} {s['mismatched']:>10}")
    tot = sum((stats[k] for k in stats), Counter())
    lines.append(f"{'all':<10} {tot['checked']:>8} {tot['matched']:>8} {tot['mismatched']:>10}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the first differing task
def dump_rows(ref_path: Path, plan_id: int, graph_source: str, out: Path) -> None:
    """Write the per-task records of plan ``plan_id`` compiled by the heterog on this PYTHONPATH."""
    from heterog.cost import CostModel

    rec = load_reference(ref_path)["plans"][plan_id]
    graph = load_graphs(graph_source, [rec["graph"]])[rec["graph"]]
    cluster = heterog.load_cluster(rec["cluster"])
    plan = compile_plan(graph, cluster, CostModel(cluster), strategy_of(rec, graph))
    out.write_text(json.dumps({"resources": plan.tg.resource_names, "rows": task_rows(plan)}))


def explain(rec: dict, ref_path: Path, graphs: dict[str, Any], graph_source: str, baseline: Path) -> str:
    """The first task where this code's compilation of ``rec`` differs from the baseline tree's."""
    from heterog.cost import CostModel

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": str(baseline)}
        run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump", str(rec["id"]),
                              "--dump-out", str(out), "--reference", str(ref_path), "--graphs", graph_source],
                             env=env, capture_output=True, text=True, cwd=str(baseline))
        if run.returncode != 0:
            return f"    (baseline tree {baseline} could not compile it: {run.stderr.strip()[-300:]})"
        base = json.loads(out.read_text())
    graph, cluster = graphs[rec["graph"]], heterog.load_cluster(rec["cluster"])
    plan = compile_plan(graph, cluster, CostModel(cluster), strategy_of(rec, graph))
    rows = task_rows(plan)
    if base["resources"] != list(plan.tg.resource_names):
        return f"    resources differ: {base['resources']} -> {list(plan.tg.resource_names)}"
    for t, (a, b) in enumerate(zip(base["rows"], rows)):
        fields = [f for f in a if a.get(f) != b.get(f)]
        if fields:
            return (f"    first differing task {t} ({', '.join(fields)}):\n      before {_row(a, fields)}\n"
                    f"      after  {_row(b, fields)}")
    if len(base["rows"]) != len(rows):
        n = min(len(rows), len(base["rows"]))
        return f"    the first {n} tasks agree; {len(base['rows'])} -> {len(rows)} tasks"
    return "    every task agrees field by field (what differs is outside the per-task records)"


def _row(row: dict, fields: list[str]) -> str:
    keys = ["name", "category", "task_kind", "task_op", "task_device"] + [f for f in fields if f not in
                                                                         ("name", "category")]
    return json.dumps({k: row.get(k) for k in dict.fromkeys(keys)})


def default_baseline() -> Path | None:
    """The tree holding this script, when the heterog imported is another tree's."""
    mine = Path(__file__).resolve().parents[1]
    theirs = Path(heterog.__file__).resolve().parents[1]
    return mine if mine != theirs and (mine / "heterog").is_dir() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true", help="compile the stored plans and compare digests")
    what.add_argument("--dump", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dump-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    ap.add_argument("--kinds", help=f"comma-separated kinds to check (of {', '.join(KINDS)})")
    ap.add_argument("--limit", type=int, help="check the first N plans of each kind")
    ap.add_argument("--mode", choices=("scratch", "patched", "both"), default="scratch",
                    help="compile each plan from scratch (default), by a patching Compiler, or both")
    ap.add_argument("--graphs", choices=("stored", "capture"), default="stored",
                    help="the graphs stored beside the reference, or captured again from the zoo")
    ap.add_argument("--ignore", default="", help="digest components not compared (e.g. names,categories)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a tree of the reference's code: the first mismatches are compiled there to find the "
                         "first differing task (default: this script's tree, when another heterog is imported)")
    ap.add_argument("--explain", type=int, default=3, help="mismatching plans to explain (0: none)")
    args = ap.parse_args(argv)
    if args.dump is not None:
        dump_rows(args.reference, args.dump, args.graphs, args.dump_out)
        return 0
    kinds = None if not args.kinds else args.kinds.split(",")
    unknown = sorted(set(kinds or ()) - set(KINDS))
    if unknown:
        raise SystemExit(f"error: unknown kinds {unknown} (choose from {', '.join(KINDS)})")
    t0 = time.perf_counter()
    ref = load_reference(args.reference)
    plans = select(ref, kinds, args.limit)
    graphs = load_graphs(args.graphs, sorted({p["graph"] for p in plans}))
    for key, g in graphs.items():
        if g.fingerprint != ref["graphs"][key]["fingerprint"]:
            print(f"note: graph {key} has fingerprint {g.fingerprint}, the reference's is "
                  f"{ref['graphs'][key]['fingerprint']}")
    stats, bad = check(ref, plans, graphs, args.mode, {c for c in args.ignore.split(",") if c})
    print(f"heterog from {Path(heterog.__file__).resolve().parents[1]}; reference {args.reference} "
          f"(commit {ref.get('commit', '?')[:12]}); mode {args.mode}")
    print(summary(stats))
    baseline = args.baseline_tree or default_baseline()
    for i, (rec, problems) in enumerate(bad[:20]):
        print(f"MISMATCH plan {rec['id']} ({rec['kind']}, {rec['graph']} on {rec['cluster']}, {rec['mode']}): "
              + "; ".join(problems))
        if i < args.explain and baseline is not None and not problems[0].startswith("compile failed"):
            print(explain(rec, args.reference, graphs, args.graphs, baseline))
    if len(bad) > 20:
        print(f"... and {len(bad) - 20} more mismatches")
    print(f"checked {sum(s['checked'] for s in stats.values())} compilations of {len(plans)} plans in "
          f"{time.perf_counter() - t0:.1f} s: " + ("all identical" if not bad else f"{len(bad)} differ"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
