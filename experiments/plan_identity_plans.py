"""The plans of the plan identity reference (``experiments/plan_identity.py``): a seeded ``PlanMaker`` draws
plans of every kind for each (graph, cluster) pair, and ``generate`` compiles them and writes the reference.
Only writing the reference needs this module; checking does not:

    python -m experiments.plan_identity_plans [--seed 0] [--reference FILE]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import heterog
from experiments.plan_identity import (
    CLUSTERS,
    DATA_DIR,
    FORMAT,
    GRAPHS,
    KINDS,
    PER_PAIR,
    PLAN_FIELDS,
    REFERENCE,
    TG_COMPONENTS,
    VERSION,
    compile_plan,
    digest,
    kind_counts,
    load_graphs,
)
from heterog.strategy import ParallelConfig, Strategy


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write the plan identity reference (plans and digests)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the plans drawn")
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    args = ap.parse_args(argv)
    generate(args.seed, args.reference)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
