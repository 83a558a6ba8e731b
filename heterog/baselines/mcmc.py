"""FlexFlow-style Markov chain Monte Carlo search over per-group (M+4)-way actions, and where the graph has split
options the splits beyond the batch of ``heterog.baselines.chains.split_action_configs`` (FlexFlow's SOAP moves),
scored by the simulator
(Metropolis-Hastings from several starting plans, global best kept, time or proposal budget), with its
chains run one after another here or side by side on Ray workers (``heterog.parallel``)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.baselines.chains import BLOCK_MOVES, SHARD_MOVES, ActionSearch, Chain, ChainResult, ChainState, run_chain
from heterog.baselines.fit import past
from heterog.baselines.pipeline import with_best_micro_batches
from heterog.errors import HeterogError
from heterog.strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluator_protocol import PlanEvaluator

DEFAULT_STARTS = ("single", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "cp-ar-ps-small", "random")
# added to the default starts with ``splits`` (where the graph has options); "tp-server" on clusters of several
# servers only
SPLIT_STARTS = ("tp-even", "tp-prop", "tp-server", "tp-grid")
SMALL_GRADIENT_BYTES = 100_000
CHAIN_SEGMENTS = 8     # pieces of a chain's proposal budget that Ray workers take one at a time
SEARCH_ORDER = "fifo"   # the task order inside the loop: one simulation per proposal (see ``mcmc``)
PLACE_SHARE = 0.25      # of the budget (seconds or proposals) at most for placing the best start's blocks
FINISH_SHARE = 0.2      # of a time budget at most kept from the chains for the last steps (scoring again, ...)
FINISH_EVALS = 100      # ... or the time of this many of the starts' evaluations, where that is less


def start_actions(ev: PlanEvaluator, name: str, rng: np.random.Generator,
                  score: Callable[[np.ndarray], float] | None = None) -> np.ndarray:
    """The action vector of a starting plan: single (most powerful device), ev-ps, ev-ar, cp-ps, cp-ar, random,
    or cp-ar-ps-small: CP-AR with the groups whose gradients total under ``SMALL_GRADIENT_BYTES`` on CP-PS
    (the compiler spreads their PS over the cluster). A ring AllReduce pays 2(n-1) link latencies per
    tensor; a bias or a layer norm's gradient costs little else, and a PS push only one latency per worker
    (docs/results.md, "Bounds and the 10% target", has the measured effect). With split options (actions
    numbered as ``ActionSearch`` with ``splits`` numbers them): tp-even and tp-prop (every group divided
    over every device), and tp-server, every group divided evenly over one server's devices, the server
    whose plan ``score`` (the search's cost) finds fastest: on a cluster of one fast island and slower
    rest (mixed-h100-a100-l4) it is the plan that keeps the slow links idle, which one-group moves from
    the other starts do not reach (each step between them converts layouts); tp-grid, every group on the
    faster of the two grids of ``heterog.baselines.chains.grid_configs`` (each server a group, the batch over the
    servers)."""
    m, g = ev.cluster.n_devices, ev.n_groups
    if name == "cp-ar-ps-small":
        from heterog.compiler.index import graph_index

        gi = graph_index(ev.graph)
        agg = gi.t_needs_agg
        t_group = ev.group_of[gi.t_op[agg]]
        n = np.bincount(t_group, minlength=g)
        nbytes = np.bincount(t_group, weights=gi.t_bytes[agg], minlength=g)
        out = np.full(g, m + 3, dtype=np.int64)
        out[(n > 0) & (nbytes < SMALL_GRADIENT_BYTES)] = m + 2
        return out
    if name in SPLIT_STARTS:
        from heterog.baselines.chains import split_action_configs

        names = [n for n, _ in split_action_configs(ev.cluster, ev.graph.batch_size)]
        if ev.graph.splits is None:
            raise HeterogError(f"MCMC start {name!r} splits beyond the batch, which graph {ev.graph.name!r} "
                               f"cannot (it has no split options)")
        if name == "tp-server":
            plans = [np.full(g, m + 4 + i, dtype=np.int64) for i, n in enumerate(names) if n.startswith("tp-even:")]
            if not plans or score is None:
                raise HeterogError("MCMC start 'tp-server' needs a cluster of several servers of several devices "
                                   "and a score for its plans")
            return min(plans, key=score)
        if name == "tp-grid":
            if "tp-grid-even" not in names or score is None:
                raise HeterogError("MCMC start 'tp-grid' needs a cluster of several servers of the same number "
                                   "(at least two) of devices and a score for its plans")
            return min((np.full(g, m + 4 + names.index(n), dtype=np.int64) for n in ("tp-grid-even", "tp-grid-prop")),
                       key=score)
        return np.full(g, m + 4 + names.index(name), dtype=np.int64)
    dp = {"ev-ps": 0, "ev-ar": 1, "cp-ps": 2, "cp-ar": 3}
    if name == "single":
        return np.full(g, int(np.argmax(ev.cluster.power)), dtype=np.int64)
    if name in dp:
        return np.full(g, m + dp[name], dtype=np.int64)
    if name == "random":
        return rng.integers(0, m + 4, size=g).astype(np.int64)
    raise HeterogError(f"unknown MCMC start {name!r}; choose from {', '.join(DEFAULT_STARTS + SPLIT_STARTS)}")


def start_plan(ev: PlanEvaluator, name: str, splits: bool = False, seed: int = 0, deadline: float | None = None
               ) -> tuple[Strategy, tuple[float, bool]]:
    """The plan of start ``name`` (``start_actions``; with ``splits`` the split starts too, a start with variants
    choosing the fastest by simulation; ``seed`` draws ``random``'s), method ``name``, and its
    ``ev.iteration_time`` (the chosen variant's, not simulated again): MCMC's starts for a planner that starts
    where MCMC does (the agent's seeds). No variant after the first is simulated once ``time.perf_counter()``
    passes ``deadline``: the fastest of those simulated is chosen."""
    search = ActionSearch(ev, splits=splits)
    seen: dict[bytes, tuple[float, bool]] = {}

    def score(actions: np.ndarray) -> float:
        if seen and past(deadline):
            return float("inf")
        t, oom = seen[actions.tobytes()] = ev.iteration_time(search.strategy(actions))
        return t * search.oom_factor if oom else t

    actions = start_actions(ev, name, np.random.default_rng(seed), score)
    plan = replace(search.strategy(actions), method=name)
    known = seen.get(actions.tobytes())
    return plan, known if known is not None else ev.iteration_time(plan)


def repick_block_devices(search: ActionSearch, actions: np.ndarray, cost: float,
                         deadline: float | None = None) -> tuple[np.ndarray, float]:
    """``actions`` with every block (``search.blocks``) that runs on one device tried on each other device,
    scored by ``search`` (improvements kept, blocks in order), and its cost; no more tries once
    ``time.perf_counter()`` passes ``deadline``.

    The chains score under FIFO; which device suits a model-parallel block depends on the order (xlnet_large,
    paper-8gpu: its tied embedding and LM head on a GTX-1080Ti is the chain's best under FIFO, on a
    V100 it is 6 ms faster under the default order), so the last step picks the block's device again under
    the evaluator's order: at most (blocks on one device) x (M - 1) evaluations."""
    m = search.ev.cluster.n_devices
    for members in search.blocks:
        held = np.unique(actions[members])
        if len(held) != 1 or held[0] >= m:
            continue
        for d in range(m):
            if deadline is not None and time.perf_counter() >= deadline:
                return actions, cost
            if d != held[0]:
                cand = actions.copy()
                cand[members] = d
                c = search.cost(cand)
                if c < cost:
                    actions, cost = cand, c
    return actions, cost


def place_blocks(search: ActionSearch, actions: np.ndarray, cost: float,
                 limit: Callable[[int], bool] | None = None) -> tuple[np.ndarray, float, int]:
    """``actions`` with each block of coupled groups (``search.blocks``, most gradient bytes first) put whole
    on each device in turn, the best kept where it beats the plan so far, and its cost and the proposals
    made. ``limit(proposals)``: True stops the pass (a budget). Blocks already whole on one device are left
    to ``repick_block_devices``.

    Why: a block joins ops that pay off on one device together (``chains.coupled_blocks``); under data
    parallelism a block that aggregates a large gradient costs an AllReduce of it on every link of the ring.
    Started from the best data-parallel plan, the chains reach such a placement only by a block move that
    draws that block and a fast device together (bert_large on paper-8gpu: one proposal in about 700, for a
    10% faster plan: the tied embedding and LM head on a V100), so it is tried for every block before the
    chains run: at most (blocks) x M proposals."""
    m = search.ev.cluster.n_devices
    proposals = 0
    for b in np.argsort(-search.block_p, kind="stable").tolist():     # block_p grows with the gradient bytes
        members = search.blocks[b]
        if len(np.unique(actions[members])) == 1 and actions[members[0]] < m:
            continue
        best, best_cost = actions, cost
        for d in range(m):
            if limit is not None and limit(proposals):
                return best, best_cost, proposals
            cand = actions.copy()
            cand[members] = d
            c = search.cost(cand)
            proposals += 1
            if c < best_cost:
                best, best_cost = cand, c
        actions, cost = best, best_cost
    return actions, cost, proposals


# ----------------------------------------------------------------------------- the search
def mcmc(ev: PlanEvaluator, budget_s: float = 60.0, seed: int = 0, starts: tuple[str, ...] | list[str] = DEFAULT_STARTS,
         temperature: float = 0.005, oom_factor: float = 10.0, max_evals: int | None = None,
         order: str | None = SEARCH_ORDER, workers: int = 1, ray_address: str | None = None, keep: int = 4,
         block_moves: float = BLOCK_MOVES, max_micro_batches: int = 16, splits: bool = False,
         sharded: bool = False, shard_moves: float = SHARD_MOVES) -> Strategy:
    """Metropolis-Hastings over one (M+4)-way action per group (FlexFlow's search), or with ``splits`` also one
    of the splits beyond the batch (``ActionSearch.split_names``; the chains then also start from
    ``SPLIT_STARTS``). Splits are off by default: they cost search time and rarely pay on the clusters measured
    (docs/results.md, "Splits beyond the batch"). With ``sharded`` the AllReduce data-parallel actions also keep
    sharded state (stage 1, 2 or 3; shards even, by memory or by speed; the optimizer state on the GPUs or
    offloaded to the host, and a single-device action offloading alone, where the servers have hosts;
    ``ActionSearch``): a share
    ``shard_moves`` of the proposals sets or clears one group's, and the last step may fit the plan by sharded
    state as well as by recomputation (``heterog.baselines.fit.fit``). Off by default: at the same budget it
    pays where memory binds (plans that fit only with it) and costs proposals elsewhere (docs/results.md,
    "Sharded state in the planners").

    Cost = simulated iteration time under task order ``order`` (``SEARCH_ORDER``, FIFO: one simulation per
    proposal where the evaluator's ``best`` runs three; None: the evaluator's), x ``oom_factor`` if out of
    memory; beta = 1 / (``temperature`` x the best starting cost): a plan ``temperature`` slower is accepted
    with probability 1/e. A share ``block_moves`` of the proposals moves a block of groups joined by the graph's
    heaviest tensors to one action (``chains.coupled_blocks``). One chain starts from each plan in ``starts``,
    worst first (``run_chain``), and one more from the best of them with its blocks placed whole on their best
    devices (``place_blocks``, at most a share ``PLACE_SHARE`` of the budget), named ``<start>+blocks``, where
    that is faster. With a time budget the chains end before its end by the time of ``FINISH_EVALS`` of the
    starts' evaluations, at most ``FINISH_SHARE`` of the budget, each chain getting an equal share of the
    chains' time left per worker when it starts (time a chain leaves goes to the next ones), and the last
    steps below stop trying more where their time has run out (scoring again and the blocks' devices half of
    what the chains leave, the micro-batches, which also make a plan fit, the rest of the budget): the search
    returns within its budget plus the step under way (one plan scored, or one number of micro-batches
    fitted); with ``max_evals`` (a
    budget in proposals, cached or not) each gets an equal share and the search is deterministic for a seed,
    whatever the number of workers. ``workers`` > 1 or ``ray_address`` run the chains on Ray workers
    (``heterog.baselines.ray_search``); the chains draw from their own seeded generators, so where they run
    does not change what they find. A proposal budget
    goes to the workers in ``CHAIN_SEGMENTS`` segments per chain, taken by whichever worker is free. Each
    chain returns its ``keep`` best plans; when ``order`` is not the evaluator's, those are scored again under
    the evaluator's order, the chains' best and the best start first, then the rest by their cost under
    ``order`` (all of them with a proposal budget: then the plan is never worse than the best start under
    the evaluator's order), and the best is returned, after
    ``repick_block_devices``; last, the number of micro-batches (up to ``max_micro_batches``; 1: none),
    their schedule and the groups recomputed (where only recomputation fits) are chosen for it
    (``pipeline.with_best_micro_batches``).
    """
    from heterog.baselines.ray_search import SearchWorker
    from heterog.parallel import EvaluatorSpec, RayPool, make_pool

    t0 = time.perf_counter()
    simulated0 = getattr(ev, "simulate_s", None)     # an Evaluator keeps its event-loop seconds; the protocol need not
    rng = np.random.default_rng(seed)
    search = ActionSearch(ev, oom_factor, order, splits, sharded)
    by_proposals = max_evals is not None
    total = float(max_evals) if max_evals is not None else float(budget_s)

    if splits and tuple(starts) == DEFAULT_STARTS and ev.graph.splits is not None:
        servers = [n for n in search.split_names if n.startswith("tp-even:")]
        starts = DEFAULT_STARTS + tuple(n for n in SPLIT_STARTS if (n != "tp-server" or servers) and
                                        (n != "tp-grid" or "tp-grid-even" in search.split_names))
    cands = {name: start_actions(ev, name, rng, search.cost) for name in dict.fromkeys(starts)}
    start_cost = {name: search.cost(a) for name, a in cands.items()}
    best_name = min(start_cost, key=lambda k: (start_cost[k], list(start_cost).index(k)))
    # the best start with its coupled blocks placed whole on their best devices: one more start, if it is faster
    t_place = time.perf_counter()
    placed, placed_cost, place_proposals = place_blocks(
        search, cands[best_name], start_cost[best_name],
        (lambda n: n >= PLACE_SHARE * total) if by_proposals else
        (lambda n: time.perf_counter() - t_place >= PLACE_SHARE * total))
    if placed_cost < start_cost[best_name]:
        best_name = f"{best_name}+blocks"
        cands[best_name], start_cost[best_name] = placed, placed_cost
    beta = 1.0 / (temperature * start_cost[best_name])
    names = sorted(cands, key=lambda k: (-start_cost[k], list(cands).index(k)))
    chains = [Chain(i, name, cands[name], start_cost[name], start_cost[best_name], beta, 0.0, by_proposals,
                    seed, keep, block_moves, shard_moves) for i, name in enumerate(names)]
    results: list[ChainResult] = []
    deadline = None if by_proposals else t0 + total
    finish_s = min(FINISH_SHARE * total, FINISH_EVALS * search.eval_time_s / max(search.n_evals, 1))
    chains_end = t0 + total - finish_s
    # scoring again and the blocks' devices take the first half of the last steps' time, the micro-batches
    # (which also make a plan fit) the rest
    rescored_by = None if deadline is None else deadline - finish_s / 2
    with make_pool(workers, ray_address, SearchWorker) as pool:
        ray_pool = pool if isinstance(pool, RayPool) else None        # chains run on Ray workers, else here
        remote = ray_pool is not None
        key = pool.register(EvaluatorSpec.of(ev), oom_factor=oom_factor, order=order, splits=splits,
                            sharded=sharded) if remote else ""
        t_chains, evals_before = time.perf_counter(), search.n_evals
        pending: dict[Any, Chain] = {}                                 # submitted job -> its chain
        todo: list[tuple[Chain, ChainState | None]] = [(c, None) for c in chains]
        while todo or pending:
            while todo and len(pending) < pool.n_workers:
                chain, state = todo[0]
                if state is None:       # a chain's start fixes its budget
                    if by_proposals:
                        share = (total - len(start_cost) - place_proposals) / len(chains)
                    else:   # the chains' time left, over the chains each worker still has to run
                        share = max(chains_end - time.perf_counter(), 0.0) / math.ceil(len(todo) / pool.n_workers)
                    chain = Chain(**{**chain.__dict__, "budget": share})
                todo.pop(0)
                if ray_pool is not None:
                    # a proposal budget is handed out in segments, so that no worker idles while another
                    # runs the last long chain (a segment goes on exactly where the chain stopped)
                    segment = math.ceil(chain.budget / CHAIN_SEGMENTS) if by_proposals else None
                    pending[ray_pool.submit("run_chain", key, (chain, state, segment))] = chain
                else:
                    results.append(run_chain(search, chain))
            if ray_pool is not None and pending:
                done, result = ray_pool.wait_any(list(pending))
                chain = pending.pop(done)
                if result.state is not None:
                    todo.append((chain, result.state))
                else:
                    results.append(result)
        chains_s = time.perf_counter() - t_chains
    results.sort(key=lambda r: r.index)
    chain_evals = sum(r.n_evals for r in results) if remote else search.n_evals - evals_before

    # the starts and every chain's best plans; scored again under the evaluator's order if the chains used another
    plans = {a.tobytes(): (start_cost[n], a) for n, a in cands.items()}
    for r in results:
        for c, a in r.best:
            plans.setdefault(a.tobytes(), (c, a))
    final = search
    if order not in (None, ev.order):
        final = ActionSearch(ev, oom_factor, splits=splits, sharded=sharded)
        kept = sorted(plans.values(), key=lambda v: v[0])[:keep * max(len(results), 1)]
        queue = [kept[0], (start_cost[best_name], cands[best_name]), *kept[1:],       # best_name: the best start
                 *sorted(((start_cost[n], a) for n, a in cands.items()), key=lambda v: v[0])]
        plans = {}
        for i, (_, a) in enumerate(queue):      # the most promising first, the rest as long as the budget lasts
            if i >= 2 and rescored_by is not None and time.perf_counter() >= rescored_by:
                break
            plans.setdefault(a.tobytes(), (final.cost(a), a))
    best_cost, best = min(plans.values(), key=lambda v: v[0])
    evals_before = final.n_evals
    best, best_cost = repick_block_devices(final, best, best_cost, rescored_by)
    repick_evals = final.n_evals - evals_before
    final_start = {n: plans[a.tobytes()][0] for n, a in cands.items() if a.tobytes() in plans}
    best_name = min(final_start, key=lambda k: (final_start[k], list(final_start).index(k)))
    elapsed = time.perf_counter() - t0
    simulated = None if simulated0 is None or remote else ev.simulate_s - simulated0     # type: ignore[attr-defined]
    n_evals = search.n_evals + (sum(r.n_evals for r in results) if remote else 0)
    eval_s = search.eval_time_s + (sum(r.eval_time_s for r in results) if remote else 0.0)
    strategy = search.strategy(best)
    if max_micro_batches > 1:
        strategy = with_best_micro_batches(ev, strategy, max_micro_batches, oom_factor,
                                           ("sharded", "recompute") if sharded else ("recompute",), deadline)
    strategy.meta.update({
        "evals_per_s": n_evals / elapsed if elapsed > 0 else 0.0,
        "sim_evals_per_s": n_evals / eval_s if eval_s > 0 else 0.0,
        # the evaluations per second if all but the simulator's event loop were free (None: not timed here)
        "simulation_only_evals_per_s": None if not simulated else n_evals / simulated,
        "n_evals": n_evals, "chain_evals_per_s": chain_evals / chains_s if chains_s > 0 else 0.0,
        "proposals": sum(r.proposals for r in results),
        "accepted": sum(r.accepted for r in results), "blocks": len(search.blocks),
        "block_repick_evals": repick_evals, "block_place_proposals": place_proposals, "workers": pool.n_workers,
        "order": order or ev.order, "micro_batches": strategy.n_micro, "recomputed_groups": len(strategy.recompute),
        "sharded_groups": sum(c.sharded is not None for c in strategy.configs),
        "best_cost_s": best_cost, "best_start": best_name, "best_start_cost_s": final_start[best_name],
        "chains": [{"start": r.name, "start_cost_s": start_cost[r.name], "best_cost_s": r.best_cost,
                    "proposals": r.proposals, "wall_s": r.wall_s} for r in results]})
    return strategy
