"""The search behind each op's split option: a min-sum labelling of the op graph, solved for the whole graph
at once, so that choices far apart agree.

Each op is a node, its options the labels; an op's own cost per label, a cost per pair of labels on each
edge. Solving the whole graph makes choices far apart agree (a Linear divided by columns feeding one divided
by rows, with the activation between them left divided: Megatron's pattern) where choosing one op at a time
given its neighbours (iterated conditional modes) stops at the first arrangement no single change improves.

Two tree passes, each decoded, then polished; the lower total cost is kept:
  * towards the sinks: for nodes in topological order, ``F[v][k] = unary[v][k] + sum over in-edges (u, v) of
    min_j (F[u][j] / out_degree(u) + pair[e][j, k])``, the best cost of v's ancestry given its label (exact
    where the graph is an in-tree, a node feeding several consumers split evenly among them); then each
    node, after all its consumers, takes the label minimising ``F[v][k]`` plus its out-edges' pair costs to
    the consumers' labels;
  * towards the sources: the same on the reversed graph (cost of v's descendants given its label, exact on
    out-trees; each node decided after all its producers, given their labels), which keeps a node read by
    many consumers (a parameter) consistent with all of them;
  * polish: sweeps of iterated conditional modes over the whole energy (unary plus every edge's pair cost)
    until no single change lowers it, at most ``sweeps`` times.
The result is never above either decoded labelling, and is a local minimum where the sweeps end before the
limit. ``solve`` runs compiled kernels over the problem laid flat; ``solve_reference`` is the same in plain
loops; tests hold the two to each other, and both to brute force on chains and trees, where the passes are
exact.

Costs are floats; forbidden pairs carry ``FORBIDDEN``, large enough to lose to any allowed labelling.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

FORBIDDEN = 1e30


def energy(labels: Sequence[int] | np.ndarray, unary: Sequence[np.ndarray], src: Sequence[int], dst: Sequence[int],
           pair: Sequence[np.ndarray]) -> float:
    """The labelling's total cost: each node's own cost at its label plus each edge's at its ends' labels."""
    total = float(sum(float(unary[v][int(k)]) for v, k in enumerate(labels)))
    return total + float(sum(float(pair[e][int(labels[u]), int(labels[v])]) for e, (u, v) in enumerate(zip(src, dst))))


def _adjacency(n: int, src: Sequence[int], dst: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    ins: list[list[int]] = [[] for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    for e, (u, v) in enumerate(zip(src, dst)):
        if not u < v:
            raise ValueError(f"edge {e} runs from node {u} to node {v}: nodes must be in topological order")
        ins[v].append(e)
        outs[u].append(e)
    return ins, outs


@njit(cache=True)
def _pair(pair: np.ndarray, poff: np.ndarray, n_lab: np.ndarray, dst: np.ndarray, e: int, j: int,
          k: int) -> float:  # pragma: no cover
    return pair[poff[e] + j * n_lab[dst[e]] + k]


@njit(cache=True)
def _tree_pass_kernel(uoff: np.ndarray, unary: np.ndarray, n_lab: np.ndarray, src: np.ndarray, dst: np.ndarray,
                      poff: np.ndarray, pair: np.ndarray, in_ptr: np.ndarray, in_idx: np.ndarray,
                      out_ptr: np.ndarray, out_idx: np.ndarray, up: bool) -> np.ndarray:  # pragma: no cover
    """One tree pass, decoded (module docstring): towards the sinks, or with ``up`` towards the sources (the
    pass on the reversed graph, its pair matrices transposed)."""
    n = n_lab.shape[0]
    forward = np.empty(unary.shape[0])
    for step in range(n):
        v = n - 1 - step if up else step
        for k in range(n_lab[v]):
            forward[uoff[v] + k] = unary[uoff[v] + k]
        ptr, idx = (out_ptr, out_idx) if up else (in_ptr, in_idx)
        for q in range(ptr[v], ptr[v + 1]):
            e = idx[q]
            u = dst[e] if up else src[e]
            deg = (in_ptr[u + 1] - in_ptr[u]) if up else (out_ptr[u + 1] - out_ptr[u])
            for k in range(n_lab[v]):
                best = np.inf
                for j in range(n_lab[u]):
                    c = forward[uoff[u] + j] / deg + (_pair(pair, poff, n_lab, dst, e, k, j) if up
                                                      else _pair(pair, poff, n_lab, dst, e, j, k))
                    if c < best:
                        best = c
                forward[uoff[v] + k] += best
        for k in range(n_lab[v]):
            forward[uoff[v] + k] = min(forward[uoff[v] + k], FORBIDDEN)
    labels = np.zeros(n, dtype=np.int64)
    f = np.empty(n_lab.max() if n else 0)
    for step in range(n):
        v = step if up else n - 1 - step
        for k in range(n_lab[v]):
            f[k] = forward[uoff[v] + k]
        ptr, idx = (in_ptr, in_idx) if up else (out_ptr, out_idx)
        for q in range(ptr[v], ptr[v + 1]):
            e = idx[q]
            for k in range(n_lab[v]):
                f[k] += (_pair(pair, poff, n_lab, dst, e, labels[src[e]], k) if up
                         else _pair(pair, poff, n_lab, dst, e, k, labels[dst[e]]))
        best_k = 0
        for k in range(1, n_lab[v]):
            if f[k] < f[best_k]:
                best_k = k
        labels[v] = best_k
    return labels


@njit(cache=True)
def _polish_kernel(labels: np.ndarray, uoff: np.ndarray, unary: np.ndarray, n_lab: np.ndarray, src: np.ndarray,
                   dst: np.ndarray, poff: np.ndarray, pair: np.ndarray, in_ptr: np.ndarray, in_idx: np.ndarray,
                   out_ptr: np.ndarray, out_idx: np.ndarray, sweeps: int) -> np.ndarray:  # pragma: no cover
    labels = labels.copy()
    n = n_lab.shape[0]
    f = np.empty(n_lab.max() if n else 0)
    for _ in range(sweeps):
        changed = False
        for v in range(n):
            if n_lab[v] < 2:
                continue
            for k in range(n_lab[v]):
                f[k] = unary[uoff[v] + k]
            for q in range(in_ptr[v], in_ptr[v + 1]):
                e = in_idx[q]
                for k in range(n_lab[v]):
                    f[k] += _pair(pair, poff, n_lab, dst, e, labels[src[e]], k)
            for q in range(out_ptr[v], out_ptr[v + 1]):
                e = out_idx[q]
                for k in range(n_lab[v]):
                    f[k] += _pair(pair, poff, n_lab, dst, e, k, labels[dst[e]])
            best_k = 0
            for k in range(1, n_lab[v]):
                if f[k] < f[best_k]:
                    best_k = k
            if f[best_k] < f[labels[v]]:
                labels[v] = best_k
                changed = True
        if not changed:
            break
    return labels


@njit(cache=True)
def _energy_kernel(labels: np.ndarray, uoff: np.ndarray, unary: np.ndarray, n_lab: np.ndarray, src: np.ndarray,
                   dst: np.ndarray, poff: np.ndarray, pair: np.ndarray) -> float:  # pragma: no cover
    own = 0.0
    for v in range(n_lab.shape[0]):
        own += unary[uoff[v] + labels[v]]
    edges = 0.0
    for e in range(src.shape[0]):
        edges += _pair(pair, poff, n_lab, dst, e, labels[src[e]], labels[dst[e]])
    return own + edges


def _csr(ends: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ptr, idx): each node's edges (those whose ``ends`` entry is the node), in increasing edge order."""
    idx = np.argsort(ends, kind="stable").astype(np.int64)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(ends, minlength=n), out=ptr[1:])
    return ptr, idx


def solve(unary: Sequence[np.ndarray], src: Sequence[int], dst: Sequence[int], pair: Sequence[np.ndarray],
          sweeps: int = 4) -> np.ndarray:
    """Labels (n,) (an index into each node's ``unary``) of low total cost (module docstring), by compiled
    kernels over the problem laid flat (the same result as ``solve_reference``).

    Shapes: ``unary[v]`` (L_v,); ``src``, ``dst`` (E,) with ``src[e] < dst[e]``; ``pair[e]``
    (L_src[e], L_dst[e]).
    """
    n = len(unary)
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    bad = np.nonzero(s >= d)[0]
    if len(bad):
        e = int(bad[0])
        raise ValueError(f"edge {e} runs from node {s[e]} to node {d[e]}: nodes must be in topological order")
    n_lab = np.array([len(u) for u in unary], dtype=np.int64)
    uoff = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_lab, out=uoff[1:])
    flat_unary = np.concatenate([np.asarray(u, dtype=np.float64).ravel() for u in unary]) if n else np.zeros(0)
    sizes = np.array([np.size(m) for m in pair], dtype=np.int64)
    poff = np.zeros(len(pair) + 1, dtype=np.int64)
    np.cumsum(sizes, out=poff[1:])
    flat_pair = (np.concatenate([np.asarray(m, dtype=np.float64).ravel() for m in pair]) if len(pair)
                 else np.zeros(0))
    in_ptr, in_idx = _csr(d, n)
    out_ptr, out_idx = _csr(s, n)
    args = (uoff, flat_unary, n_lab, s, d, poff, flat_pair)
    links = (in_ptr, in_idx, out_ptr, out_idx)
    found = [_polish_kernel(_tree_pass_kernel(*args, *links, up), *args, *links, int(sweeps)) for up in (False, True)]
    costs = [_energy_kernel(labels, *args) for labels in found]
    return found[0] if costs[0] <= costs[1] else found[1]


def solve_reference(unary: Sequence[np.ndarray], src: Sequence[int], dst: Sequence[int],
                    pair: Sequence[np.ndarray], sweeps: int = 4) -> list[int]:
    """``solve`` in plain Python loops over labels (the reference the vectorised one is held to)."""
    n = len(unary)
    ins, outs = _adjacency(n, src, dst)

    def tree_pass(un: Sequence[Sequence[float]] | Sequence[np.ndarray], s_: Sequence[int], d_: Sequence[int],
                  pr: Sequence[Sequence[Sequence[float]]] | Sequence[np.ndarray], ins_: list[list[int]],
                  outs_: list[list[int]]) -> list[int]:
        forward: list[list[float]] = []
        for v in range(n):
            f = [float(x) for x in un[v]]
            for e in ins_[v]:
                u = s_[e]
                for k in range(len(f)):
                    f[k] += min(forward[u][j] / len(outs_[u]) + float(pr[e][j][k]) for j in range(len(forward[u])))
            forward.append([min(x, FORBIDDEN) for x in f])
        labels = [0] * n
        for v in range(n - 1, -1, -1):
            f = list(forward[v])
            for e in outs_[v]:
                for k in range(len(f)):
                    f[k] += float(pr[e][k][labels[d_[e]]])
            labels[v] = min(range(len(f)), key=lambda k: (f[k], k))
        return labels

    def polish(labels: list[int]) -> list[int]:
        labels = list(labels)
        for _ in range(sweeps):
            changed = False
            for v in range(n):
                if len(unary[v]) < 2:
                    continue
                f = [float(x) for x in unary[v]]
                for k in range(len(f)):
                    for e in ins[v]:
                        f[k] += float(pair[e][labels[src[e]]][k])
                    for e in outs[v]:
                        f[k] += float(pair[e][k][labels[dst[e]]])
                k = min(range(len(f)), key=lambda j: (f[j], j))
                if f[k] < f[labels[v]]:
                    labels[v], changed = k, True
            if not changed:
                break
        return labels

    down = tree_pass(unary, src, dst, pair, ins, outs)
    transposed = [[[float(m[j][k]) for j in range(len(m))] for k in range(len(m[0]))] for m in pair]
    up = tree_pass(unary[::-1], [n - 1 - v for v in dst], [n - 1 - u for u in src], transposed, outs[::-1],
                   ins[::-1])[::-1]
    best = [polish(x) for x in (down, up)]
    costs = [energy(x, unary, src, dst, pair) for x in best]
    return best[0] if costs[0] <= costs[1] else best[1]
