"""How fast a delta evaluation could be if the simulator resumed from the first event a change touches
(docs/results.md, "Benchmarks": why 3 ms is out of reach here).

For one-group changes of a random mixed strategy (the bench's: actions drawn with seed 0), each: the
patched compile time, the full simulation time under FIFO (the order of MCMC's loop and of the bench's
delta figure), and the share of the tasks that start at or after the earliest start, in the base's
schedule or the changed one's, of any task or dependency that the change re-emits
(``heterog.compiler.delta.dirty_units``). Under FIFO every event before that is the base's (tested), so a
resumed simulation would cost at least ``compile + share x simulate``: the bound printed per change and
as medians. (Under a static order such as rank-contention it is not: a change re-ranks every task, and
earlier decisions move.) The resumed simulation alone, ``share x simulate``, bounds a delta evaluation
with a free compiler, and its mean bounds the evaluations per second of a search whose every proposal
is one such change (``evals_per_s_at_most``). The kernel runs at the speed of its line-by-line C
translation (``python -m experiments.c_kernel``), so these are bounds at bare-C speed on the machine.

    python -m experiments.delta_bound [--model bert_large] [--batch-size 48] [--cluster paper-8gpu]
                                      [--changes 31] [--json]
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

import simulator
from experiments.args import parser
from heterog.baselines.chains import ActionSearch
from heterog.bench import one_group_changes
from heterog.compiler.delta import dirty_units


@dataclass
class Change:
    """One one-group change: its group, the patched compile and full simulation times (ms), the share of
    tasks the change's first touched event leaves to re-simulate, and the bound (ms)."""

    group: int
    compile_ms: float
    simulate_ms: float
    share_resimulated: float
    bound_ms: float

    @property
    def resimulated_ms(self) -> float:
        """The resumed simulation alone: what the change costs with a free compiler."""
        return self.share_resimulated * self.simulate_ms


def touched(state, dirty) -> np.ndarray:
    """Tasks of plan ``state`` that a change re-emits: owned by a dirty unit, or waiting on a dependency
    that one owns."""
    mask = dirty.owners[state.tasks.owner].copy()
    mask[state.dep_task[dirty.owners[state.dep_owner]]] = True
    return mask


def measure(ev, n_changes: int = 31, seed: int = 1) -> list[Change]:
    """``n_changes`` one-group changes (``heterog.bench.one_group_changes`` with ``seed``) of the bench's
    mixed strategy (actions drawn with seed 0), each patched from it."""
    c, m = ev.compiler, ev.cluster.n_devices
    actions = np.random.default_rng(0).integers(0, m + 4, size=ev.n_groups)
    search = ActionSearch(ev)

    def simulate(plan):                 # as Evaluator.iteration_time simulates FIFO
        return simulator.simulate(plan.tg, priority=ev.priorities(plan, "fifo"), fifo=True)

    c.bases.clear()
    base_state = c.compile_state(search.strategy(actions))
    base_sim = simulate(base_state.plan)
    out = []
    for g, a in one_group_changes(actions, m, n_changes, seed):
        c.bases.clear()                 # patch from the base plan only
        c.bases[id(base_state)] = base_state
        t0 = time.perf_counter()
        state = c.compile_state(search.strategy(a))
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sim = simulate(state.plan)
        simulate_s = time.perf_counter() - t0
        dirty = dirty_units(c, base_state.placement, state.placement)
        first = np.inf
        for st, res in ((base_state, base_sim), (state, sim)):
            hit = touched(st, dirty)
            if hit.any():
                first = min(first, float(res.start[hit].min()))
        share = float(np.mean(base_sim.start >= first))
        out.append(Change(g, compile_s * 1e3, simulate_s * 1e3, share, (compile_s + share * simulate_s) * 1e3))
    return out


def summary(changes: list[Change], target_ms: float = 3.0) -> dict:
    """Medians (and the least share and bound) over the changes, how many bounds (and resumed simulations
    alone) meet ``target_ms``, and the evaluations per second that the mean bound (and the mean resumed
    simulation alone) allows."""
    col = {k: np.array([getattr(ch, k) for ch in changes]) for k in
           ("compile_ms", "simulate_ms", "share_resimulated", "resimulated_ms", "bound_ms")}
    return {"changes": len(changes), **{f"median_{k}": float(np.median(v)) for k, v in col.items()},
            "min_share_resimulated": float(col["share_resimulated"].min()),
            "min_bound_ms": float(col["bound_ms"].min()),
            f"bounds_at_most_{target_ms:g}_ms": int(np.sum(col["bound_ms"] <= target_ms)),
            f"resimulations_at_most_{target_ms:g}_ms": int(np.sum(col["resimulated_ms"] <= target_ms)),
            "evals_per_s_at_most": float(1e3 / col["bound_ms"].mean()),
            "evals_per_s_at_most_free_compile": float(1e3 / col["resimulated_ms"].mean())}


def main(argv=None) -> None:
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    p = parser("experiments.delta_bound", __doc__)
    p.add_argument("--model", default="bert_large")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--cluster", default="paper-8gpu")
    p.add_argument("--changes", type=int, default=31)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    ev = Evaluator(capture_model(a.model, a.batch_size), load_cluster(a.cluster))
    ev.iteration_time(ev.strategy(np.zeros(ev.n_groups, dtype=np.int64)))     # compile the kernels first
    changes = measure(ev, a.changes)
    result = {"model": a.model, "batch_size": a.batch_size, "cluster": a.cluster, "order": "fifo",
              **summary(changes)}
    if a.json:
        print(json.dumps({**result, "per_change": [{**asdict(ch), "resimulated_ms": ch.resimulated_ms}
                                                   for ch in changes]}, indent=1))
        return
    for k, v in result.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")


if __name__ == "__main__":
    main()
