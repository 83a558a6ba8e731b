"""Plan identity: a seeded set of plans of every kind (single device, data parallel, mixed, splits, grids,
micro-batches, pipelines, recomputation, combinations), each compiled plan's digest kept once and checked.

A compiler change that must change nothing is checked task for task against the reference:

    PYTHONPATH=$PWD python experiments/plan_identity.py --generate          # write the reference
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import heterog
from heterog.strategy import ParallelConfig, Strategy

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


# ---------------------------------------------------------------------------- generating plans
class PlanMaker:
    """Random plans of each kind for one (graph, cluster), drawn from ``rng``."""

    def __init__(self, graph: Any, cluster: Any, rng: np.random.Generator) -> None:
        from heterog.baselines.expert import op_layers
        from heterog.shares import even_shares, proportional_shares, split_weights

        self.graph, self.cluster, self.rng = graph, cluster, rng
        self.M, self.B = cluster.n_devices, graph.batch_size
        self.power = np.asarray(cluster.power, dtype=np.float64)
        self.servers = [np.nonzero(cluster.server_of == s)[0].tolist() for s in np.unique(cluster.server_of)]
        self.group_of = heterog.baselines.run("single", graph, cluster).group_of
        self.G = int(self.group_of.max()) + 1
        self.layer_of = op_layers(graph)[0]
        self.even, self.prop, self.weights = even_shares, proportional_shares, split_weights

    def strategy(self, configs: list, group_of: np.ndarray | None = None, method: str = "", **kw: Any) -> Strategy:
        return Strategy(self.graph.fingerprint, self.cluster.name, self.M, self.B,
                        self.group_of if group_of is None else group_of, configs, method=method, **kw)

    def devices(self, low: int = 1) -> list[int]:
        """All devices, one server's, or a random subset of at least ``low``."""
        r = self.rng.random()
        servers = [s for s in self.servers if len(s) >= low]
        if r < 0.3:
            return list(range(self.M))
        if r < 0.55 and servers:
            return list(servers[int(self.rng.integers(len(servers)))])
        k = int(self.rng.integers(max(low, 1), self.M + 1))
        return sorted(int(d) for d in self.rng.choice(self.M, size=k, replace=False))

    def dp(self) -> ParallelConfig:
        devs = self.devices(2)
        shares = self.prop(self.B, self.power[devs]) if self.rng.random() < 0.5 else self.even(self.B, len(devs))
        if self.rng.random() < 0.5:
            cfg = ParallelConfig.of(list(zip(devs, shares)), sync="ps")
            if self.rng.random() < 0.5:      # a named PS device, else the compiler's choice
                cfg = ParallelConfig(cfg.devices, cfg.shares, "ps", int(self.rng.choice(cfg.devices)))
            return cfg
        algo = str(self.rng.choice(["auto", "auto", "ring", "hierarchical"]))
        return ParallelConfig.of(list(zip(devs, shares)), allreduce=algo)

    def single(self) -> ParallelConfig:
        return ParallelConfig.single(int(self.rng.integers(self.M)), self.B)

    def split(self) -> ParallelConfig:
        devs = self.devices(2)
        if len(devs) < 2:
            devs = [0, 1]
        w = self.weights(self.power[devs]) if self.rng.random() < 0.5 else [1] * len(devs)
        kind = "attribute" if self.rng.random() < 0.35 else "parameter"
        return ParallelConfig.split_over(devs, w, self.B, kind)

    def grid(self) -> ParallelConfig:
        pairs = [(r, s) for r in (2, 3, 4) for s in (2, 3, 4) if r * s <= self.M and r <= self.B]
        r, s = pairs[int(self.rng.integers(len(pairs)))]
        order = list(range(self.M)) if self.rng.random() < 0.5 else self.rng.permutation(self.M).tolist()
        groups = [order[i * s:(i + 1) * s] for i in range(r)]
        w = self.weights(self.power[groups[0]]) if self.rng.random() < 0.5 else [1] * s
        first = [self.power[g].sum() for g in groups]
        shares = self.prop(self.B, first) if self.rng.random() < 0.5 else self.even(self.B, r)
        if min(shares) < 1:
            shares = self.even(self.B, r)
        kind = "attribute" if self.rng.random() < 0.3 else "parameter"
        return ParallelConfig.split_grid(groups, w, shares, kind)

    def walk(self, makers: list[Callable[[], ParallelConfig]], n: int, switch: float,
             pool_size: int = 3) -> list[ParallelConfig]:
        """A random walk over ``n`` groups: each group keeps the last config or, with probability ``switch``,
        takes another from a pool of up to ``pool_size`` configs drawn from ``makers`` (few distinct split
        configs keep a plan quick to compile)."""
        pool = [makers[int(self.rng.integers(len(makers)))]() for _ in range(int(self.rng.integers(1, pool_size + 1)))]
        configs: list[ParallelConfig] = []
        for _ in range(n):
            if not configs or self.rng.random() < switch:
                configs.append(pool[int(self.rng.integers(len(pool)))])
            else:
                configs.append(configs[-1])
        return configs

    def with_micro(self, s: Strategy) -> Strategy:
        from heterog.strategy import SCHEDULES, most_micro_batches
        top = min(most_micro_batches(s), 8)
        if top < 2:
            return s
        k = int(self.rng.integers(2, top + 1))
        schedule = str(self.rng.choice(SCHEDULES))
        if self.rng.random() < 0.3 and all(c.grid == 1 for c in s.configs):   # uneven micro-batch sizes
            cuts = np.sort(self.rng.choice(np.arange(1, self.B), size=k - 1, replace=False))
            sizes = np.diff(np.concatenate([[0], cuts, [self.B]])).tolist()
            return replace(s, micro_batches=tuple(int(x) for x in sizes), schedule=schedule, meta=dict(s.meta))
        return s.with_micro_batches(k, schedule)

    def with_recompute(self, s: Strategy) -> Strategy:
        ok = [g for g, c in enumerate(s.configs) if c.split is None]
        if not ok:
            return s
        r = self.rng.random()
        if r < 0.3:
            chosen = ok
        elif r < 0.6:
            chosen = ok[:int(self.rng.integers(1, len(ok) + 1))]
        else:
            chosen = [g for g in ok if self.rng.random() < 0.4] or ok[:1]
        return s.with_recompute(chosen)

    def priorities(self) -> np.ndarray:
        return self.rng.permutation(self.graph.n_ops).astype(np.float64)

    def pipeline(self) -> Strategy:
        L = int(self.layer_of.max()) + 1
        S = int(self.rng.integers(2, max(3, min(L, self.M, 4) + 1)))
        S = min(S, L, self.M)
        if self.rng.random() < 0.4 and len(self.servers) >= S:
            stages = self.servers[:S] if self.rng.random() < 0.5 else [[s[0]] for s in self.servers[:S]]
        else:
            cut = np.sort(self.rng.choice(np.arange(1, self.M), size=S - 1, replace=False))
            stages = [list(range(a, b)) for a, b in zip(np.r_[0, cut], np.r_[cut, self.M])]
            if self.rng.random() < 0.5:
                stages = [[st[0]] for st in stages]
        configs = []
        for devs in stages:
            if len(devs) == 1:
                configs.append(ParallelConfig.single(devs[0], self.B))
            elif self.rng.random() < 0.2:
                configs.append(ParallelConfig.split_over(devs, [1] * len(devs), self.B))
            else:
                even = self.rng.random() < 0.5
                shares = self.even(self.B, len(devs)) if even else self.prop(self.B, self.power[devs])
                configs.append(ParallelConfig.of(list(zip(devs, shares))))
        bounds = np.sort(self.rng.choice(np.arange(1, L), size=S - 1, replace=False))
        stage_of_layer = np.searchsorted(bounds, np.arange(L), side="right")
        s = self.strategy([configs[int(stage_of_layer[layer])] for layer in range(L)], group_of=self.layer_of,
                          method="pipeline")
        return self.with_micro(s) if self.rng.random() < 0.85 else s

    def make(self, kind: str, layers: bool = False) -> Strategy:
        """A plan of ``kind``; ``layers``: over one group per layer (``op_layers``) instead of the default
        grouping, so a group holds its layer's forward and backward ops and recomputing it has effect."""
        if layers:
            kept = self.group_of, self.G
            self.group_of, self.G = self.layer_of, int(self.layer_of.max()) + 1
            try:
                return self.make(kind)
            finally:
                self.group_of, self.G = kept
        rng, G = self.rng, self.G
        if kind == "dp":
            return self.strategy([self.dp()] * G, method=kind)
        if kind == "mixed":
            configs = self.walk([self.single, self.dp], G, float(rng.choice([0.05, 0.2, 0.5])), pool_size=6)
            return self.strategy(configs, method=kind, priorities=self.priorities() if rng.random() < 0.3 else None)
        if kind in ("split", "grid"):
            base = self.walk([self.single, self.dp], G, 0.05)
            sub = self.walk([self.split if kind == "split" else self.grid], G, 0.1)
            lo = int(rng.integers(0, G))
            hi = G if rng.random() < 0.3 else int(rng.integers(lo + 1, G + 1))
            if rng.random() < 0.3:
                lo = 0
            return self.strategy(base[:lo] + sub[lo:hi] + base[hi:], method=kind)
        if kind == "micro":
            return self.with_micro(self.make(str(rng.choice(["dp", "mixed", "single_any"]))))
        if kind == "single_any":
            return self.strategy([self.single()] * G, method="single")
        if kind == "pipeline":
            return self.pipeline()
        if kind == "recompute":
            base = self.make(str(rng.choice(["dp", "mixed", "pipeline", "micro"])), layers=rng.random() < 0.8)
            return self.with_recompute(base)
        if kind in ("combo", "combo_layers"):
            makers = [self.single, self.dp, self.split, self.grid]
            if kind == "combo" and rng.random() < 0.5:
                return self.make("combo_layers", layers=True)
            s = self.pipeline() if rng.random() < 0.25 else \
                self.strategy(self.walk(makers, G, float(rng.choice([0.05, 0.2]))), method="combo")
            if rng.random() < 0.7:
                s = self.with_micro(s)
            if rng.random() < 0.6:
                s = self.with_recompute(s)
            if rng.random() < 0.3:
                s = replace(s, priorities=self.priorities(), meta=dict(s.meta))
            return s
        raise ValueError(f"unknown plan kind {kind!r}")


def generate(seed: int, out: Path) -> None:
    from heterog.cost import CostModel

    t0 = time.perf_counter()
    (DATA_DIR / "graphs").mkdir(parents=True, exist_ok=True)
    graphs = load_graphs("capture", GRAPHS)
    for key, g in graphs.items():
        g.save(DATA_DIR / "graphs" / f"{key}.json.gz")
    graphs = load_graphs("stored", GRAPHS)           # the plans are of the graphs as stored
    plans: list[dict] = []
    rejected: Counter = Counter()
    compile_s: Counter = Counter()
    rng = np.random.default_rng(seed)
    for key, graph in graphs.items():
        for cname in CLUSTERS:
            cluster = heterog.load_cluster(cname)
            cost = CostModel(cluster)
            maker = PlanMaker(graph, cluster, rng)
            todo = [("single", maker.strategy([ParallelConfig.single(d, maker.B)] * maker.G, method="single"))
                    for d in range(maker.M)]
            for kind in KINDS[1:]:
                made, tries = 0, 0
                while made < PER_PAIR and tries < 20 * PER_PAIR:
                    tries += 1
                    try:
                        s = maker.make(kind)
                        compile_plan(graph, cluster, cost, s)
                    except Exception as exc:     # noqa: BLE001 - a draw the compiler refuses is drawn again
                        rejected[f"{kind}: {type(exc).__name__}: {str(exc)[:80]}"] += 1
                        continue
                    todo.append((kind, s))
                    made += 1
            for kind, s in todo:
                t1 = time.perf_counter()
                plan = compile_plan(graph, cluster, cost, s)
                compile_s[kind] += time.perf_counter() - t1
                d = s.to_dict()
                d.pop("graph_fingerprint")
                plans.append({"id": len(plans), "graph": key, "cluster": cname, "kind": kind, "strategy": d,
                              "n_tasks": int(plan.tg.n_tasks), "counts": kind_counts(plan),
                              "digest": digest(plan, graph)})
            print(f"{key} on {cname}: {len(plans)} plans so far ({time.perf_counter() - t0:.0f} s)", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                            text=True).stdout.strip()
    ref = {"format": FORMAT, "version": VERSION, "seed": seed, "commit": commit,
           "graphs": {k: {"model": v[0], "batch_size": v[1], "optimizer": v[2], "small": v[3],
                          "fingerprint": graphs[k].fingerprint, "n_ops": graphs[k].n_ops} for k, v in GRAPHS.items()},
           "clusters": list(CLUSTERS), "components": ["tg." + c for c in TG_COMPONENTS] +
           ["plan." + f for f in PLAN_FIELDS], "plans": plans}
    tmp = out.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(ref, f, separators=(",", ":"))
    os.replace(tmp, out)
    by_kind = Counter(p["kind"] for p in plans)
    print(f"wrote {len(plans)} plans to {out} ({out.stat().st_size / 1e6:.2f} MB) in "
          f"{time.perf_counter() - t0:.0f} s: " + ", ".join(f"{k} {by_kind[k]}" for k in KINDS))
    print("compile seconds by kind: " + ", ".join(f"{k} {compile_s[k]:.1f}" for k in KINDS))
    for reason, n in rejected.most_common(10):
        print(f"  redrawn {n}x: {reason}")


# ---------------------------------------------------------------------------- checking
def load_reference(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"error: no reference file {path} (run --generate first)")
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
    what.add_argument("--generate", action="store_true", help="write the reference (plans and digests)")
    what.add_argument("--check", action="store_true", help="compile the stored plans and compare digests")
    what.add_argument("--dump", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dump-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    ap.add_argument("--seed", type=int, default=0, help="seed of the plans drawn (--generate)")
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
    if args.generate:
        generate(args.seed, args.reference)
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
