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
limit. ``solve_reference`` is the same in plain loops; tests hold the two to each other, and both to brute
force on chains and trees, where the passes are exact.

Costs are floats; forbidden pairs carry ``FORBIDDEN``, large enough to lose to any allowed labelling.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


def _tree_pass(unary: Sequence[np.ndarray], src: Sequence[int], dst: Sequence[int], pair: Sequence[np.ndarray],
               ins: list[list[int]], outs: list[list[int]]) -> np.ndarray:
    """The pass towards the sinks, decoded (module docstring)."""
    n = len(unary)
    forward: list[np.ndarray] = [np.zeros(0)] * n
    for v in range(n):
        f = np.asarray(unary[v], dtype=np.float64).copy()
        for e in ins[v]:
            u = src[e]
            f += np.min(forward[u][:, None] / len(outs[u]) + pair[e], axis=0)
        forward[v] = np.minimum(f, FORBIDDEN)
    labels = np.zeros(n, dtype=np.int64)
    for v in range(n - 1, -1, -1):
        f = forward[v].copy()
        for e in outs[v]:
            f += pair[e][:, labels[dst[e]]]
        labels[v] = int(np.argmin(f))
    return labels


def _polish(labels: np.ndarray, unary: Sequence[np.ndarray], src: Sequence[int], dst: Sequence[int],
            pair: Sequence[np.ndarray], ins: list[list[int]], outs: list[list[int]], sweeps: int) -> np.ndarray:
    labels = labels.copy()
    for _ in range(sweeps):
        changed = False
        for v in range(len(unary)):
            if len(unary[v]) < 2:
                continue
            f = np.asarray(unary[v], dtype=np.float64).copy()
            for e in ins[v]:
                f += pair[e][labels[src[e]], :]
            for e in outs[v]:
                f += pair[e][:, labels[dst[e]]]
            k = int(np.argmin(f))
            if f[k] < f[labels[v]]:
                labels[v], changed = k, True
        if not changed:
            break
    return labels


def solve(unary: Sequence[np.ndarray], src: Sequence[int], dst: Sequence[int], pair: Sequence[np.ndarray],
          sweeps: int = 4) -> np.ndarray:
    """Labels (n,) (an index into each node's ``unary``) of low total cost (module docstring).

    Shapes: ``unary[v]`` (L_v,); ``src``, ``dst`` (E,) with ``src[e] < dst[e]``; ``pair[e]``
    (L_src[e], L_dst[e]).
    """
    n = len(unary)
    ins, outs = _adjacency(n, src, dst)
    down = _tree_pass(unary, src, dst, pair, ins, outs)
    rsrc, rdst = [n - 1 - v for v in dst], [n - 1 - u for u in src]
    up = _tree_pass(unary[::-1], rsrc, rdst, [m.T for m in pair], outs[::-1], ins[::-1])[::-1]
    best = [_polish(x, unary, src, dst, pair, ins, outs, sweeps) for x in (down, up)]
    costs = [energy(x, unary, src, dst, pair) for x in best]
    return best[int(np.argmin(costs))]


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
