"""Replicas composed: a plan that repeats one slice of the cluster r times is simulated on that slice.

A plan *repeats* ``r`` times when the servers its configs use fall into ``r`` slices that are alike server by
server (devices of the same type and slowdown in the same places, the same links, host and storage: a
server's ``server_signatures``) and, under every config and in every micro-batch, the rows of the batch that
slice ``j`` holds are held by the images on slice ``j``'s servers of the devices that hold slice 0's rows, in
the same order and numbers (``heterog.shares.micro_batch_shares`` gives each replica its share of each
micro-batch). Servers that hold one row under two configs are joined into a part no row leaves; the parts of
each kind are dealt to the slices (in blocks of their order of first use, else in turn) and the deal is
checked row by row. Then a value moves between devices of two slices only through a collective over a
config's devices, which spans every slice alike; every other task of a slice runs on that slice's devices
and links. Each slice therefore runs the same tasks, and the simulator gives each the same timeline (it
breaks ties between tasks that want one resource, and two slices' tasks want none in common but the
collectives, which hold every slice's links at once): one slice, simulated with each collective priced over
the whole device set and holding the slice's part of its links (``SliceCost``), gives the iteration time,
each device's memory peak (its image's in slice 0), the busy times and the comm time exactly.
``tests/test_compose.py`` checks this against the whole simulation on random plans.

Which plans: every config data-parallel by AllReduce (no parameter server, nothing split beyond the batch,
no sharded state), at least two replicas of every config in each slice in every micro-batch (a slice of one
replica would have no collective of its own to price), and a graph without ops that couple samples (which
gather the batch to one device). Configs may lie on different devices (a pipeline of data-parallel stages)
where a value read under a config of other devices is read row by row (``rows_only_between_device_sets``)
or only for its shape, by a reader whose holder lies in its own slice, alike in every slice
(``shape_reads_between_device_sets``). Anything else is simulated whole (``find_repetition`` gives None).
Devices of servers that no config uses stay idle (no memory, no work).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import reduce
from itertools import product
from math import gcd
from typing import TYPE_CHECKING, Sequence

import numpy as np

from heterog.compiler.emit import shape_holders
from heterog.compiler.index import graph_index
from heterog.cost import CostModel
from heterog.errors import HeterogError
from heterog.shares import micro_batch_shares
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph


def server_signatures(cluster: Cluster) -> list[tuple]:
    """Per server, what makes two servers interchangeable: its devices' types and slowdowns in order, its
    intra-server kind, its links' bandwidths and latencies in order, NIC, host and storage."""
    links = {link.name: link for link in cluster.links}
    out = []
    for s in cluster.servers:
        devs = [cluster.devices[d] for d in s.devices]
        own = [links[f"{a.name}->{b.name}"] for a in devs for b in devs if a is not b]
        own += [links[f"{s.name}/{k}"] for k in ("nic-out", "nic-in") if f"{s.name}/{k}" in links]
        out.append((tuple((d.type, d.slowdown) for d in devs), s.intra,
                    tuple((x.bandwidth_Bps, x.latency_s) for x in own), s.host, s.storage_bandwidth_Bps))
    return out


@dataclass(frozen=True)
class Repetition:
    """A plan that repeats one slice ``copies`` times: ``images[j, i]`` is the device of the whole cluster that
    slice device ``i`` stands for in slice ``j`` (slice 0: the slice's own devices); ``cluster`` is the slice (the
    servers of slice 0, whole) and ``strategy`` the plan on it (batch ``B / copies``)."""

    copies: int
    images: np.ndarray
    cluster: Cluster
    strategy: Strategy
    sets: dict[tuple[int, ...], tuple[int, ...] | None]
    """The device sets of the slice's collectives (each config's devices, its replicas with samples, each
    micro-batch's) -> the devices of the whole cluster the collective spans, in its order; None where two differ."""

    def on(self, strategy: Strategy) -> Repetition:
        """This repetition for ``strategy``, a plan of the same configs, groups and micro-batches (another op order,
        recomputation or schedule): its ``strategy`` the slice's part of it."""
        mine = self.strategy
        return replace(self, strategy=replace(strategy, cluster_name=mine.cluster_name, n_devices=mine.n_devices,
                                              batch_size=mine.batch_size, configs=list(mine.configs),
                                              micro_batches=mine.micro_batches, meta=dict(strategy.meta)))

    @property
    def key(self) -> tuple:
        """What a slice evaluator is kept by: the slice's devices and their images."""
        return self.copies, self.images.tobytes(), tuple(sorted(self.sets.items()))


def composable_configs(configs: Sequence[ParallelConfig]) -> bool:
    """Whether the configs may form a repetition: each data-parallel by AllReduce over two or more replicas, with
    nothing split beyond the batch and no sharded state."""
    return all(c.split is None and c.sharded is None and c.sync == "allreduce" and c.ps_device is None
               and c.n_replicas >= 2 for c in configs)


def shape_reads_between_device_sets(graph: OpGraph, strategy: Strategy) -> list[tuple[ParallelConfig, ParallelConfig]]:
    """The (producer's, reader's) configs of every value read only for its shape under a config of other devices
    (the backward's seed reading the loss in another stage): the reader waits for one holder's copy
    (``heterog.compiler.emit.shape_holders``), which must lie in its own slice."""
    gi = graph_index(graph)
    on = np.asarray(strategy.group_of)
    pairs = {(strategy.configs[int(on[u])], strategy.configs[int(on[v])])
             for u, v in zip(gi.e_src[gi.e_value_free].tolist(), gi.e_dst[gi.e_value_free].tolist())}
    return [(a, b) for a, b in pairs if set(a.devices) != set(b.devices)]


def rows_only_between_device_sets(graph: OpGraph, strategy: Strategy) -> bool:
    """Whether every value read under a config of other devices than its producer's is read row by row (a batch
    value read by a batch op): then each row moves from the one replica that holds it. A value read whole there
    (a tied weight, a non-batch result) is fetched from one of its holders, and among holders alike the compiler
    takes the lowest device id, which is one slice's for every slice (the whole plan is then no repetition)."""
    gi = graph_index(graph)
    sets: dict[frozenset[int], int] = {}
    of_group = np.array([sets.setdefault(frozenset(c.devices), len(sets)) for c in strategy.configs], dtype=np.int64)
    if len(sets) == 1:
        return True
    on = of_group[strategy.group_of]
    cross = (on[gi.e_src] != on[gi.e_dst]) & ~gi.e_value_free
    return bool(np.all(gi.e_batch[cross] & gi.has_batch[gi.e_dst[cross]]))


def _holders(config: ParallelConfig, micro: tuple[int, ...]) -> np.ndarray:
    """(B,) the device that holds each row of the batch under ``config``, micro-batch after micro-batch."""
    per = micro_batch_shares(config.shares, micro)
    return np.concatenate([np.repeat(np.asarray(config.devices, dtype=np.int64), s) for s in per])


def _device_orders(config: ParallelConfig, micro: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The device sets a collective of ``config``'s may span, in their order: its devices, its replicas with samples
    in order of first entry, each micro-batch's replicas."""
    per = [tuple(d for d, s in zip(config.devices, shares) if s > 0)
           for shares in micro_batch_shares(config.shares, micro)]
    return [tuple(config.devices), tuple(dict.fromkeys(d for o in per for d in o)), *per]


def _components(server_of: np.ndarray, holders: list[np.ndarray]) -> list[list[int]]:
    """The servers that hold one row under two configs, joined: the parts no row moves between, each as its
    servers in order of first use."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first = server_of[holders[0]]
    for h in holders:
        for a, b in set(zip(first.tolist(), server_of[h].tolist())):
            parent[root(a)] = root(b)
    comps: dict[int, list[int]] = {}
    for h in holders:
        for s in dict.fromkeys(server_of[h].tolist()):
            comps.setdefault(root(s), [])
            if s not in comps[root(s)]:
                comps[root(s)].append(s)
    return list(comps.values())


def find_repetition(graph: OpGraph, cluster: Cluster, strategy: Strategy,
                    signatures: Sequence[tuple] | None = None) -> Repetition | None:
    """The repetition of ``strategy`` on ``cluster`` in the most slices (module docstring), or None where it has
    none (then it is simulated whole). ``signatures``: ``server_signatures(cluster)``, when the caller keeps them."""
    if graph.coupled.any():
        return None
    configs = list(dict.fromkeys(strategy.configs))
    if not composable_configs(configs) or not rows_only_between_device_sets(graph, strategy):
        return None
    sig = server_signatures(cluster) if signatures is None else signatures
    if len(set(sig)) == len(sig):                         # no two servers alike
        return None
    micro = strategy.micro
    holders = [_holders(c, micro) for c in configs]
    comps = _components(cluster.server_of, holders)
    kinds: dict[tuple, list[list[int]]] = {}
    for comp in comps:
        kinds.setdefault(tuple(sig[s] for s in comp), []).append(comp)
    shapes = shape_reads_between_device_sets(graph, strategy)
    most = reduce(gcd, [len(v) for v in kinds.values()] + [int(m) for m in micro])
    for r in _divisors_desc(most):
        for deal in (lambda i, n: i // n, lambda i, n: i % r):        # in blocks, or in turn
            slice_of = {s: deal(i, len(v) // r) for v in kinds.values() for i, comp in enumerate(v) for s in comp}
            rep = _repetition(cluster, strategy, configs, holders, slice_of, sig, r, shapes)
            if rep is not None:
                return rep
    return None


def _divisors_desc(n: int) -> list[int]:
    return [r for r in range(n, 1, -1) if n % r == 0]


def _repetition(cluster: Cluster, strategy: Strategy, configs: list[ParallelConfig], holders: list[np.ndarray],
                slice_of: dict[int, int], sig: Sequence[tuple], r: int,
                shapes: Sequence[tuple[ParallelConfig, ParallelConfig]] = ()) -> Repetition | None:
    """The repetition of ``strategy`` whose slice ``j`` is the servers ``s`` of ``slice_of[s] == j``, or None where
    the slices do not repeat one another row for row, or a shape read across device sets (``shapes``) waits for
    a holder of another slice, or not alike."""
    server_of = cluster.server_of
    micro = strategy.micro
    part = tuple(int(m) // r for m in micro)
    where = np.full(len(cluster.servers), -1, dtype=np.int64)
    where[list(slice_of)] = list(slice_of.values())
    row_slice = where[server_of[holders[0]]]
    rows = [np.nonzero(row_slice == j)[0] for j in range(r)]          # each slice's rows, in order
    starts = np.cumsum((0,) + micro)
    for j in range(r):
        if np.any(np.diff(np.searchsorted(rows[j], starts)) != part):
            return None                                                # not a share of every micro-batch
    order: list[list[int]] = []                                        # each slice's servers in order of use
    for j in range(r):
        seen = dict.fromkeys(s for h in holders for s in server_of[h[rows[j]]].tolist())
        order.append(list(seen))
    if len({len(x) for x in order}) != 1 or any(sig[a] != sig[b] for row in order[1:] for a, b in zip(order[0], row)):
        return None
    image = np.full((r, cluster.n_devices), -1, dtype=np.int64)       # image[j, d]: slice j's device for d of slice 0
    for j in range(r):
        for a, b in zip(order[0], order[j]):
            image[j, cluster.servers[a].devices] = cluster.servers[b].devices
    for h in holders:
        head = h[rows[0]]
        if any(not np.array_equal(image[j, head], h[rows[j]]) for j in range(1, r)):
            return None
    if shapes:
        back = np.full(cluster.n_devices, -1, dtype=np.int64)       # each slice's device -> slice 0's it mirrors
        part_of = np.full(cluster.n_devices, -1, dtype=np.int64)    # its slice
        for j in range(r):
            ok = image[j] >= 0
            back[image[j][ok]], part_of[image[j][ok]] = np.nonzero(ok)[0], j
        for made, read in shapes:
            for ha, rb in product(_device_orders(made, micro)[:2], _device_orders(read, micro)[:2]):
                held = shape_holders(ha, rb)
                if any(part_of[h] != part_of[x] or held.get(int(back[x])) is None
                       or image[part_of[x], held[int(back[x])]] != h for x, h in held.items()):
                    return None
    kept = [d for s in sorted(order[0]) for d in cluster.servers[s].devices]
    local = np.full(cluster.n_devices, -1, dtype=np.int64)
    local[kept] = np.arange(len(kept))
    mapped: dict[ParallelConfig, ParallelConfig] = {}
    for c, h in zip(configs, holders):
        own = _slice_config(c, local[h[rows[0]]], part)
        if own is None:
            return None
        mapped[c] = own
    sets: dict[tuple[int, ...], tuple[int, ...] | None] = {}
    for c in configs:
        for key, whole in zip(_device_orders(mapped[c], part), _device_orders(c, micro)):
            sets[key] = whole if sets.get(key, whole) == whole else None
    from heterog.cluster.topology import subset

    piece = subset(cluster, [cluster.devices[d].name for d in kept], name=f"{cluster.name} (1 of {r} slices)")
    slice_strategy = replace(strategy, cluster_name=piece.name, n_devices=piece.n_devices,
                             batch_size=strategy.batch_size // r, configs=[mapped[c] for c in strategy.configs],
                             micro_batches=None if len(micro) == 1 else part, meta=dict(strategy.meta))
    return Repetition(r, image[:, kept], piece, slice_strategy, sets)


def _slice_config(config: ParallelConfig, held: np.ndarray, part: tuple[int, ...]) -> ParallelConfig | None:
    """``config`` on the slice whose rows, micro-batch after micro-batch (``part``), are held by ``held``, or None
    where no config of the slice lays them out so (a device holding two runs of rows of one micro-batch, fewer
    than two replicas of a micro-batch)."""
    devices = list(dict.fromkeys(held.tolist()))
    totals = np.bincount(held, minlength=max(devices) + 1)[devices]
    own = replace(config, devices=tuple(devices), shares=tuple(int(x) for x in totals))
    try:
        same = np.array_equal(_holders(own, part), held)
    except HeterogError:
        return None
    counts = [len(set(held[a:b].tolist())) for a, b in zip(np.cumsum((0,) + part)[:-1], np.cumsum(part))]
    return own if same and min(counts) >= 2 else None


class Unrepeated(HeterogError):
    """A collective of a slice that its repetition does not cover: a device set it did not register, or one whose
    links the slices would not hold alike (the plan is then simulated whole)."""


class SliceCost(CostModel):
    """The cost model of the slice of a repetition ``rep`` of a plan priced by ``whole``: every device, path and
    op priced as on the slice's servers; every collective over a device set of ``rep.sets`` priced over the whole
    cluster's devices it stands for (its shards repeated slice after slice), holding the slice's part of the
    links that whole collective holds, where every slice holds its own part alike (else ``Unrepeated``)."""

    def __init__(self, whole: CostModel, rep: Repetition) -> None:
        piece = rep.cluster
        super().__init__(piece, whole.profile, op_points=whole.op_points, layer_profile=whole.layer_profile,
                         layer_numbering=whole.layer_numbering, allreduce_bucket_bytes=whole.allreduce_bucket_bytes,
                         comm_blocks_compute=whole.comm_blocks_compute)
        self.whole, self.sets, self.copies = whole, rep.sets, rep.copies
        cluster = whole.cluster
        names = cluster.device_names
        self._inverse = np.full(cluster.n_devices, -1, dtype=np.int64)     # whole device -> the slice's it mirrors
        # each link of the whole cluster: the slice it lies in (-1: none) and the slice's link it mirrors
        self._slice = np.full(len(cluster.links), -1, dtype=np.int64)
        self._home = np.full(len(cluster.links), -1, dtype=np.int64)
        by_name = {link.name: link.index for link in cluster.links}
        for j in range(rep.copies):
            self._inverse[rep.images[j]] = np.arange(piece.n_devices)
            image = {d.name: names[int(rep.images[j, i])] for i, d in enumerate(piece.devices)}
            server = {s.name: cluster.servers[int(cluster.server_of[int(rep.images[j, s.devices[0]])])].name
                      for s in piece.servers}
            for link in piece.links:
                a, arrow, b = link.name.partition("->")
                if arrow:
                    name = f"{image[a]}->{image[b]}"
                else:
                    host, _, kind = link.name.rpartition("/")
                    name = f"{server[host]}/{kind}"
                self._slice[by_name[name]], self._home[by_name[name]] = j, link.index

    def _expand(self, devices: Sequence[int]) -> tuple[int, ...]:
        whole = self.sets.get(tuple(int(d) for d in devices))
        if whole is None:
            raise Unrepeated(f"no collective of the whole plan stands for one over slice devices {list(devices)}")
        return whole

    def allreduce_times(self, devices: Sequence[int], nbytes: np.ndarray,
                        algo: str = "auto") -> tuple[np.ndarray, np.ndarray]:
        return self.whole.allreduce_times(self._expand(devices), nbytes, algo)

    def allreduce_links(self, devices: Sequence[int], algo: str) -> tuple[int, ...]:
        held = np.asarray(self.whole.allreduce_links(self._expand(devices), algo), dtype=np.int64)
        where = self._slice[held]
        parts = [np.sort(self._home[held[where == j]]) for j in range(self.copies)]
        if np.any(where < 0) or any(not np.array_equal(p, parts[0]) for p in parts[1:]):
            raise Unrepeated(f"the slices would hold the links of an AllReduce over {len(held)} links unalike")
        return tuple(int(x) for x in self._home[held[where == 0]])

    def _shards(self, devices: Sequence[int], shard_bytes: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
        """The whole collective's devices and shards: each device's shard the one of the slice device it mirrors."""
        whole = self._expand(devices)
        column = {int(d): k for k, d in enumerate(devices)}
        x = np.atleast_2d(np.asarray(shard_bytes, dtype=np.float64))
        return whole, x[:, [column[int(self._inverse[w])] for w in whole]]

    def sharded_ring_times(self, devices: Sequence[int], shard_bytes: np.ndarray) -> np.ndarray:
        return self.whole.sharded_ring_times(*self._shards(devices, shard_bytes))

    def alltoall_times(self, devices: Sequence[int], shard_bytes: np.ndarray) -> np.ndarray:
        return self.whole.alltoall_times(*self._shards(devices, shard_bytes))
