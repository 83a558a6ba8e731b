"""Load-aware choice of the parameter-server device of each PS group (docs/design.md, "Parameter-server
choice"): the greedy over a plan's PS groups, as a compiled kernel and its plain-Python twin.

A PS group's workers push their partial gradients to the PS device, which aggregates them and updates
the parameters; the workers pull the parameters they read in the forward pass. Choosing, for every group
on its own, the replica that would finish that group's aggregation first *if it were alone* puts every
PS on the same device and every gradient through one server's NIC. Here the groups are placed one by
one, largest first (LPT), each on the candidate (replica device) that minimises

    score(d) = busiest (phase, resource) the group touches, with the load placed so far
             + how late the forward pass gets its parameters (max'ed with the lateness so far)

Load: seconds each resource (a device, or a directed link) is held, in two phases that do not overlap in
an iteration: phase 0, gradient synchronisation (pushes w -> d for every worker w: ``n * alpha + bytes *
beta`` of the cost model on every resource of the path; aggregation on d; the plan's AllReduces on their
links), and phase 1, the pulls d -> w of the next forward pass.

Lateness: a worker needs a group's parameters when its forward pass reaches their first reader (``need``,
estimated from the op times at the worker's share, plus the worker's slack: the busiest replica's work
minus its own). Pulls are placed backwards from that time: on each resource the pulls placed so far
start at ``due``; a new pull ends at ``min(need, due over its path)`` and starts its duration earlier;
a start before 0 delays the forward pass by that much.

Ties: the smaller total transfer time, then the earlier candidate. Times are read off the cost model as
lines in the bytes (two points), so a profiled link or a slowed device counts as it is.
``choose_ps_kernel`` is the compiled loop, ``choose_ps_reference`` its plain-Python twin (a test asserts
they agree).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

from heterog.caches import DerivedCache
from heterog.compiler.index import Paths

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cost.model import CostModel

_X0, _X1 = 1.0, 1.0e6        # byte counts at which the cost model's lines are read


def _line(fn: Callable[[float], npt.ArrayLike], x0: float = _X0, x1: float = _X1) -> tuple[np.ndarray, np.ndarray]:
    """(per-item, per-byte) coefficients of ``fn(bytes)``, a cost linear in the bytes."""
    y0, y1 = np.asarray(fn(x0), dtype=np.float64), np.asarray(fn(x1), dtype=np.float64)
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


@dataclass(frozen=True)
class PSProblem:
    """Everything the greedy needs, as flat arrays (the kernel's arguments, in field order).

    Shapes (G groups, K candidates, R resources, M devices, A AllReduce events):
      order (G,) groups in placement order; need (G, M) by when each worker needs the group's parameters
      (s); amount (G, 4) [pushed tensors, pushed bytes, pulled tensors, pulled bytes];
      rep_ptr (G + 1,), rep_dev: the group's replica devices; cand_ptr (G + 1,), cand_dev (K,): its PS
      candidates; agg_coef (K, 2) aggregation time per tensor and per byte on the candidate;
      alpha, beta (M, M) transfer time per tensor and per byte; path_ptr (M * M + 1,), path_res: the
      resources a transfer src -> dst holds (row src * M + dst);
      ar_dur (A,), ar_ptr (A + 1,), ar_res: the plan's AllReduces (duration, resources held).
    """

    order: np.ndarray
    need: np.ndarray
    amount: np.ndarray
    rep_ptr: np.ndarray
    rep_dev: np.ndarray
    cand_ptr: np.ndarray
    cand_dev: np.ndarray
    agg_coef: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    path_ptr: np.ndarray
    path_res: np.ndarray
    ar_dur: np.ndarray
    ar_ptr: np.ndarray
    ar_res: np.ndarray
    n_res: int

    def args(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)


@njit(cache=True)
def _pull(g: int, d: int, due: np.ndarray, need: np.ndarray, amount: np.ndarray, rep_ptr: np.ndarray,
          rep_dev: np.ndarray, alpha: np.ndarray, beta: np.ndarray, path_ptr: np.ndarray,
          path_res: np.ndarray) -> tuple[float, float]:  # pragma: no cover
    """How late (s) the forward pass gets group g's parameters from PS d, pulls placed backwards in time
    (``due``: when each resource's next pull starts; updated, pass a copy to try); and their total time."""
    m = alpha.shape[0]
    late, total = 0.0, 0.0
    for i in range(rep_ptr[g], rep_ptr[g + 1]):
        w = rep_dev[i]
        if w == d:
            continue
        row = d * m + w
        end = need[g, w]
        for j in range(path_ptr[row], path_ptr[row + 1]):
            end = min(end, due[path_res[j]])
        dur = amount[g, 2] * alpha[d, w] + amount[g, 3] * beta[d, w]
        start = end - dur
        for j in range(path_ptr[row], path_ptr[row + 1]):
            due[path_res[j]] = start
        late = max(late, -start)
        total += dur
    return late, total


@njit(cache=True)
def _load(g: int, d: int, k: int, load: np.ndarray, amount: np.ndarray, rep_ptr: np.ndarray, rep_dev: np.ndarray,
          agg_coef: np.ndarray, alpha: np.ndarray, beta: np.ndarray, path_ptr: np.ndarray,
          path_res: np.ndarray) -> float:  # pragma: no cover
    """Add group g's pushes and aggregation (phase 0) and pulls (phase 1) with PS d (candidate k) to
    ``load`` (2, R); returns the busiest (phase, resource) it touches afterwards."""
    m = alpha.shape[0]
    busiest = 0.0
    for i in range(rep_ptr[g], rep_ptr[g + 1]):
        w = rep_dev[i]
        if w == d:
            continue
        for p in range(2):
            row = w * m + d if p == 0 else d * m + w
            dur = (amount[g, 0] * alpha[w, d] + amount[g, 1] * beta[w, d] if p == 0
                   else amount[g, 2] * alpha[d, w] + amount[g, 3] * beta[d, w])
            for j in range(path_ptr[row], path_ptr[row + 1]):
                load[p, path_res[j]] += dur
                busiest = max(busiest, load[p, path_res[j]])
    load[0, d] += amount[g, 0] * agg_coef[k, 0] + amount[g, 1] * agg_coef[k, 1]
    return max(busiest, load[0, d])


@njit(cache=True)
def choose_ps_kernel(order: np.ndarray, need: np.ndarray, amount: np.ndarray, rep_ptr: np.ndarray,
                     rep_dev: np.ndarray, cand_ptr: np.ndarray, cand_dev: np.ndarray, agg_coef: np.ndarray,
                     alpha: np.ndarray, beta: np.ndarray, path_ptr: np.ndarray, path_res: np.ndarray,
                     ar_dur: np.ndarray, ar_ptr: np.ndarray, ar_res: np.ndarray,
                     n_res: int) -> np.ndarray:  # pragma: no cover - compiled
    """Compiled greedy (module docstring; arguments: ``PSProblem``). Returns (G,) the PS device per group."""
    out = np.full(need.shape[0], -1, dtype=np.int64)
    load = np.zeros((2, n_res))
    due = np.full(n_res, np.inf)
    for a in range(ar_dur.shape[0]):                          # the plan's AllReduces hold their links
        for j in range(ar_ptr[a], ar_ptr[a + 1]):
            load[0, ar_res[j]] += ar_dur[a]
    late_so_far = 0.0
    load_try, due_try = np.empty_like(load), np.empty_like(due)      # scratch copies to try a candidate on
    for g in order:
        best_k, best_score, best_total = -1, np.inf, np.inf
        for k in range(cand_ptr[g], cand_ptr[g + 1]):
            d = cand_dev[k]
            load_try[:, :] = load
            due_try[:] = due
            busiest = _load(g, d, k, load_try, amount, rep_ptr, rep_dev, agg_coef, alpha, beta, path_ptr, path_res)
            late, total = _pull(g, d, due_try, need, amount, rep_ptr, rep_dev, alpha, beta, path_ptr, path_res)
            score = busiest + max(late, late_so_far)
            if score < best_score or (score == best_score and total < best_total):
                best_k, best_score, best_total = k, score, total
        d = cand_dev[best_k]
        _load(g, d, best_k, load, amount, rep_ptr, rep_dev, agg_coef, alpha, beta, path_ptr, path_res)
        late, _ = _pull(g, d, due, need, amount, rep_ptr, rep_dev, alpha, beta, path_ptr, path_res)
        late_so_far = max(late_so_far, late)
        out[g] = d
    return out


def choose_ps_reference(order: np.ndarray, need: np.ndarray, amount: np.ndarray, rep_ptr: np.ndarray,
                        rep_dev: np.ndarray, cand_ptr: np.ndarray, cand_dev: np.ndarray, agg_coef: np.ndarray,
                        alpha: np.ndarray, beta: np.ndarray, path_ptr: np.ndarray, path_res: np.ndarray,
                        ar_dur: np.ndarray, ar_ptr: np.ndarray, ar_res: np.ndarray, n_res: int) -> np.ndarray:
    """Plain-Python ``choose_ps_kernel`` (same arguments, same result)."""
    m = alpha.shape[0]

    def path(src: int, dst: int) -> list[int]:
        return [int(r) for r in path_res[path_ptr[src * m + dst]:path_ptr[src * m + dst + 1]]]

    def workers(g: int, d: int) -> list[int]:
        return [int(w) for w in rep_dev[rep_ptr[g]:rep_ptr[g + 1]] if w != d]

    def place(g: int, d: int, k: int, load: list[list[float]], due: list[float]) -> tuple[float, float, float]:
        """(busiest touched load, lateness, total pull time) after adding group g with PS d."""
        touched = []
        for w in workers(g, d):
            for p, (src, dst, n, b) in enumerate(((w, d, amount[g, 0], amount[g, 1]),
                                                  (d, w, amount[g, 2], amount[g, 3]))):
                for r in path(src, dst):
                    load[p][r] += n * alpha[src, dst] + b * beta[src, dst]
                    touched.append(load[p][r])
        load[0][d] += amount[g, 0] * agg_coef[k, 0] + amount[g, 1] * agg_coef[k, 1]
        touched.append(load[0][d])
        late = total = 0.0
        for w in workers(g, d):
            dur = amount[g, 2] * alpha[d, w] + amount[g, 3] * beta[d, w]
            start = min([float(need[g, w])] + [due[r] for r in path(d, w)]) - dur
            for r in path(d, w):
                due[r] = start
            late, total = max(late, -start), total + dur
        return max(touched), late, total

    out = np.full(len(need), -1, dtype=np.int64)
    load, due, late_so_far = [[0.0] * n_res, [0.0] * n_res], [np.inf] * n_res, 0.0
    for a in range(len(ar_dur)):
        for r in ar_res[ar_ptr[a]:ar_ptr[a + 1]]:
            load[0][int(r)] += float(ar_dur[a])
    for g in (int(x) for x in order):
        best: tuple[tuple[float, float], int] | None = None
        for k in range(int(cand_ptr[g]), int(cand_ptr[g + 1])):
            busiest, late, total = place(g, int(cand_dev[k]), k, [list(x) for x in load], list(due))
            key = (busiest + max(late, late_so_far), total)
            if best is None or key < best[0]:
                best = (key, k)
        assert best is not None                      # every group has a PS candidate (its own or its replicas)
        k = best[1]
        late_so_far = max(late_so_far, place(g, int(cand_dev[k]), k, load, due)[1])
        out[g] = int(cand_dev[k])
    return out


# ----------------------------------------------------------------------------- building the problem
class LinkLines(NamedTuple):
    """A cluster's transfers as lines in the bytes, read off a cost model: ``alpha`` (M, M) seconds per
    transfer and ``beta`` (M, M) seconds per byte from a device to another, and the path of each such
    transfer, without self-transfers, as CSR: ``path_ptr`` (M * M + 1,), ``path_res`` (path_ptr[-1],)."""

    alpha: np.ndarray
    beta: np.ndarray
    path_ptr: np.ndarray
    path_res: np.ndarray


AggregateKey = tuple[int, tuple[int, ...]]        # (replicas, PS candidates)
_LINK_LINES: DerivedCache[CostModel, LinkLines] = DerivedCache("LinkLines of each cost model")
_AGGREGATE_COEFS: DerivedCache[CostModel, dict[AggregateKey, np.ndarray]] = DerivedCache(
    "aggregation lines of each cost model per (replicas, PS candidates)")


def link_lines(cost: CostModel, paths: Paths) -> LinkLines:
    """The ``LinkLines`` of ``cost`` over the routes ``paths`` of its cluster (built once per cost model)."""

    def build() -> LinkLines:
        m = len(paths.host)
        src, dst = np.repeat(np.arange(m), m), np.tile(np.arange(m), m)
        a, b = _line(lambda x: cost.transfer_times(src, dst, np.full(m * m, x)))
        rlen, ridx = paths.resources(src, dst)
        keep = np.repeat(src != dst, rlen)                      # no transfer from a device to itself
        rlen = np.where(src != dst, rlen, 0)
        return LinkLines(np.ascontiguousarray(a.reshape(m, m)), np.ascontiguousarray(b.reshape(m, m)),
                         np.concatenate([[0], np.cumsum(rlen)]).astype(np.int64), ridx[keep].astype(np.int64))

    return _LINK_LINES.get(cost, build)


def aggregate_coefs(n_replicas: int, candidates: tuple[int, ...], cost: CostModel) -> np.ndarray:
    """(len(candidates), 2) aggregation time per tensor and per byte (kept per cost model)."""
    cache = _AGGREGATE_COEFS.get(cost, dict)
    key = (n_replicas, candidates)

    def aggregate_s(device: int, nbytes: float) -> float:
        """Seconds of one aggregation of ``nbytes`` on ``device``."""
        times = cost.aggregate_times(np.array([device]), np.array([nbytes]), np.array([n_replicas]))
        return float(np.asarray(times, dtype=np.float64).ravel()[0])

    if key not in cache:
        cache[key] = np.array([_line(lambda x: aggregate_s(d, x)) for d in candidates]).reshape(len(candidates), 2)
    return cache[key]


def build_problem(ps_groups: np.ndarray, replicas: list[tuple[int, ...]], fixed: dict[int, int],
                  amount: np.ndarray, need: np.ndarray, allreduces: list[tuple[float, tuple[int, ...]]],
                  cost: CostModel, paths: Paths, n_res: int) -> PSProblem:
    """The ``PSProblem`` of the plan's PS groups (``ps_groups[i]`` over ``replicas[i]``; ``fixed``: group ->
    PS device the strategy gives, still placed so that it loads what it uses), their ``amount`` (G, 4) and
    ``need`` (G, M), and the plan's AllReduces (duration, resources)."""
    alpha, beta, path_ptr, path_res = link_lines(cost, paths)
    cands = [(fixed[g],) if g in fixed else tuple(reps) for g, reps in zip(ps_groups.tolist(), replicas)]
    size = amount[:, 1] + amount[:, 3]
    return PSProblem(
        order=np.lexsort((np.arange(len(ps_groups)), -size)).astype(np.int64),         # LPT, ties by group
        need=np.ascontiguousarray(need, dtype=np.float64),
        amount=np.ascontiguousarray(amount, dtype=np.float64),
        rep_ptr=np.concatenate([[0], np.cumsum([len(r) for r in replicas])]).astype(np.int64),
        rep_dev=np.array([d for r in replicas for d in r], dtype=np.int64),
        cand_ptr=np.concatenate([[0], np.cumsum([len(c) for c in cands])]).astype(np.int64),
        cand_dev=np.array([d for c in cands for d in c], dtype=np.int64),
        agg_coef=np.ascontiguousarray(np.concatenate([aggregate_coefs(len(r), c, cost)
                                                      for r, c in zip(replicas, cands)]).reshape(-1, 2)),
        alpha=alpha, beta=beta, path_ptr=path_ptr, path_res=path_res,
        ar_dur=np.array([a[0] for a in allreduces], dtype=np.float64),
        ar_ptr=np.concatenate([[0], np.cumsum([len(a[1]) for a in allreduces])]).astype(np.int64),
        ar_res=np.array([r for a in allreduces for r in a[1]], dtype=np.int64), n_res=int(n_res))


def problem_from_configs(ps_groups: np.ndarray, group_cfg: np.ndarray, cfg_devices: dict[int, tuple[int, ...]],
                         fixed_ps: np.ndarray, amount: np.ndarray, need: np.ndarray,
                         allreduces: list[tuple[float, tuple[int, ...]]], cost: CostModel, paths: Paths,
                         n_res: int) -> PSProblem:
    """``build_problem`` for groups given by config: ``group_cfg[i]`` is the config id of ``ps_groups[i]``,
    ``cfg_devices`` its replica devices, ``fixed_ps`` (per config id) the PS device it names or -1. Built
    per config and gathered per group (the same arrays as ``build_problem``, without a loop over groups)."""
    alpha, beta, path_ptr, path_res = link_lines(cost, paths)
    used, inv = np.unique(group_cfg, return_inverse=True)
    reps = [tuple(cfg_devices[k]) for k in used.tolist()]
    cands = [(int(fixed_ps[k]),) if fixed_ps[k] >= 0 else r for k, r in zip(used.tolist(), reps)]
    coefs = [aggregate_coefs(len(r), c, cost) for r, c in zip(reps, cands)]

    def gather(rows: list, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(ptr, flat values) of each group's row, rows per used config."""
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        flat = np.concatenate([np.asarray(r, dtype=np.float64 if width else np.int64).reshape(-1, max(width, 1))
                               for r in rows])
        starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
        n = lengths[inv]
        ptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        idx = np.repeat(starts[inv], n) + (np.arange(ptr[-1]) - np.repeat(ptr[:-1], n))
        return ptr, flat[idx]

    rep_ptr, rep_dev = gather(reps, 0)
    cand_ptr, cand_dev = gather(cands, 0)
    _, agg_coef = gather(coefs, 2)
    size = amount[:, 1] + amount[:, 3]
    return PSProblem(
        order=np.lexsort((np.arange(len(ps_groups)), -size)).astype(np.int64),
        need=np.ascontiguousarray(need, dtype=np.float64),
        amount=np.ascontiguousarray(amount, dtype=np.float64),
        rep_ptr=rep_ptr, rep_dev=rep_dev.ravel(), cand_ptr=cand_ptr, cand_dev=cand_dev.ravel(),
        agg_coef=np.ascontiguousarray(agg_coef), alpha=alpha, beta=beta, path_ptr=path_ptr, path_res=path_res,
        ar_dur=np.array([a[0] for a in allreduces], dtype=np.float64),
        ar_ptr=np.concatenate([[0], np.cumsum([len(a[1]) for a in allreduces])]).astype(np.int64),
        ar_res=np.array([r for a in allreduces for r in a[1]], dtype=np.int64), n_res=int(n_res))


def choose_ps_devices(problem: PSProblem) -> np.ndarray:
    """(G,) the PS device of each group of ``problem`` (compiled greedy)."""
    return choose_ps_kernel(*problem.args())
