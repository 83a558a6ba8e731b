"""Profiler: measure op times on the local device type and transfer times per link, fit the models of the
cost model (per op signature: the measured time at each local batch size and the line ``t = a + b *
samples`` through them; ``t = alpha + beta * bytes`` per link) and write them as a
``heterog.cost.ProfileTable``.

Ops are measured where and as they run: the model, captured at a few local batch sizes, trains as a
single-device plan on each worker in turn with instruction tracing, so each time is the op's kernel on
real tensors plus the executor's own per-op work, median over steps and devices;
ops with the same signature (repeated layers) share one fit. Links are measured between two worker
processes through the runtime's own transport (so link emulation and per-message overheads are
included), for several message sizes (interleaved), median of repeats: by streaming messages one way,
the time each holds the link (its occupancy, fitted ``alpha + beta * bytes``), and by ping-pong (half
the round trip), which adds the latency in flight: the difference of the two intercepts is stored as
the link's latency (``ProfileTable.link_latency``), which messages in flight overlap.
AllReduce is measured the same way over each device set a plan can use (all of them on small clusters,
else the whole cluster), since a collective's fixed cost is not a sum of link latencies.
"""
from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import numpy as np

from heterog.cost.profile import ProfileTable, fit_linear, op_signature
from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.runtime.api import Model, PreparedRun
    from heterog.runtime.launcher import WorkerPool

Pair: TypeAlias = tuple[int, int]                   # (rank a, rank b) of a measured device pair
Group: TypeAlias = tuple[int, ...]                  # the ranks of an AllReduce
SizeSamples: TypeAlias = dict[int, list[float]]     # message bytes -> seconds, one per sample
SizeTimes: TypeAlias = list[tuple[int, float]]      # (message bytes, seconds), sizes increasing
_Key = TypeVar("_Key", Pair, Group)

LINK_SIZES_BYTES = (1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21)
COLLECTIVE_SIZES_BYTES = (1 << 4, 1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21)
MAX_COLLECTIVE_GROUPS = 15          # every device subset up to 4 devices; beyond, only the whole cluster
HELD_OUT_SIZES_BYTES = (1 << 12, 1 << 20)
# what ``profile`` measures: steps per op round, ping-pong and collective repeats in all (``heterog fidelity``
# takes its own per-round counts, ``heterog.runtime.fidelity.ROUND_LINK_REPEATS``)
OP_STEPS, LINK_REPEATS, COLLECTIVE_REPEATS = 20, 50, 70
STREAM_MESSAGES = 8                 # messages per burst of the occupancy measurement
LATENCY_SIZES_BYTES = 1 << 14       # messages up to this size measure the latency in flight


def default_batch_sizes(batch_size: int) -> list[int]:
    """Local batch sizes to profile at: a quarter, a half and all of the global batch."""
    return sorted({max(1, batch_size // 4), max(1, batch_size // 2), int(batch_size)})


class OpProfiler:
    """Measures every compute op of ``model`` (a ``heterog.runtime.Model``) in situ, round after round,
    and fits per op signature and device type of ``cluster`` (this machine's devices: ``pool`` has one
    worker per device) its time at each batch size and the line ``(a, b)`` through them.

    A round trains, at each local batch size, the model (captured at that batch) as a single-device plan
    on each worker in turn (``concurrent``: on every worker at once, faster on many devices), for
    ``steps`` steps with instruction tracing. An op's time in a round is the median, over the steps
    after ``warmup``, of its compute instruction (the kernel plus the executor's own per-op work) divided
    by the device's emulated slowdown; ``fit`` keeps the median over rounds and devices of one type.
    One worker at a time is the default because it gave the better fidelity on local-cpu-2 (MAPE 5.2,
    7.1, 8.3% against 7.8, 10.9% over three and two runs; the same step on one device took 1.03x as
    long with the other busy, within the noise, so the difference is not systematic contention).
    Rounds can be interleaved with other measurements (``heterog.runtime.fidelity`` does), so that a
    change of machine load meets both alike.
    """

    def __init__(self, model: Model, cluster: Cluster, pool: WorkerPool, *, batch_sizes: Sequence[int] | None = None,
                 steps: int = 12, warmup: int = 3, concurrent: bool = False) -> None:
        from heterog import baselines
        from heterog.runtime.api import prepare

        B = model.batch_size
        sizes_b = sorted({int(b) for b in (batch_sizes or default_batch_sizes(B)) if 1 <= int(b) <= B})
        if not sizes_b:
            raise HeterogError(f"no valid batch size to profile at (global batch {B})")
        self.model, self.cluster, self.pool, self.steps, self.warmup = model, cluster, pool, steps, warmup
        self.concurrent = concurrent
        self.runs: list[tuple[int, Model, list[PreparedRun]]] = []     # (local batch, model, plan per device)
        for b in sizes_b:
            mb = model.at_batch(b)
            self.runs.append((b, mb, [prepare(mb, cluster, baselines.run("single", mb.graph, cluster, device=d))
                                      for d in range(cluster.n_devices)]))
        self.points: dict[tuple[str, str], list[tuple[int, float, int]]] = {}     # (samples, seconds, round)
        self.rounds = 0

    def round(self) -> None:
        """One pass over the batch sizes."""
        from heterog.runtime.instructions import Compute

        cluster, steps, B = self.cluster, self.steps, self.model.batch_size
        for b, mb, singles in self.runs:
            per_device = []                 # device d runs the whole step of its own plan
            for d, prepared in enumerate(singles):
                jobs = prepared.jobs([mb.example_inputs], steps, return_state=False)
                jobs[d].trace = True
                per_device.append(jobs)
            if self.concurrent:
                results = self.pool.run([jobs[d] for d, jobs in enumerate(per_device)])
            else:                           # one device at a time, the others idle
                results = [self.pool.run(jobs)[d] for d, jobs in enumerate(per_device)]
            for d, prepared in enumerate(singles):
                traces = results[d]["traces"][min(self.warmup, steps - 1):]
                slow = float(cluster.slowdown[d])
                for i, ins in enumerate(prepared.lowered.ranks[d].instrs):
                    if not isinstance(ins, Compute):
                        continue
                    op = ins.op
                    t = float(statistics.median(tr[i][2] - tr[i][1] for tr in traces)) / slow
                    x = b if mb.prog.op_has_batch[op] else B
                    key = (cluster.devices[d].type.name, op_signature(mb.graph.ops[op]))
                    self.points.setdefault(key, []).append((x, t, self.rounds))
        self.rounds += 1

    def fit(self, table: ProfileTable | None = None, rounds: Sequence[int] | None = None) -> ProfileTable:
        """Store the fits of ``rounds`` (indices from 0; default all rounds so far) in ``table`` (a new one
        by default) and return it."""
        chosen = _chosen_rounds(rounds, self.rounds, "op")
        table = table if table is not None else ProfileTable()
        for (device_type, sig), measured in self.points.items():
            pts = [(x, t) for x, t, r in measured if r in chosen]
            xs = sorted({x for x, _ in pts})
            ys = [float(np.median([t for x2, t in pts if x2 == x])) for x in xs]
            table.add_op(device_type, sig, xs, ys)
        return table


def _chosen_rounds(rounds: Sequence[int] | None, n_rounds: int, what: str) -> set[int]:
    """The set of measured rounds a fit uses (all by default); refuses rounds not measured yet."""
    if not n_rounds:
        raise HeterogError(f"no {what} measurements yet: run at least one round")
    chosen = set(range(n_rounds)) if rounds is None else {int(r) for r in rounds}
    if not chosen or not chosen <= set(range(n_rounds)):
        raise HeterogError(f"{what} rounds {sorted(chosen)} asked for, {n_rounds} measured")
    return chosen


def profile_ops(model: Model, cluster: Cluster, pool: WorkerPool, *, batch_sizes: Sequence[int] | None = None,
                steps: int = 12, warmup: int = 3, rounds: int = 3, table: ProfileTable | None = None) -> ProfileTable:
    """``rounds`` rounds of ``OpProfiler`` back to back, fitted into ``table``."""
    ops = OpProfiler(model, cluster, pool, batch_sizes=batch_sizes, steps=steps, warmup=warmup)
    for _ in range(max(1, int(rounds))):
        ops.round()
    return ops.fit(table)


# ---------------------------------------------------------------------------- links
@dataclass
class LinkMeasurement:
    """One-way times (seconds, median of repeats) per message size on one link, and the fit: the link is
    held ``alpha_s + beta_s_per_byte * bytes`` (the occupancy; from the streamed messages where measured,
    else the ping-pong line) and the message arrives ``latency_s + latency_s_per_byte * bytes`` later."""

    link: str
    sizes_bytes: list[int]
    times_s: list[float]
    alpha_s: float = 0.0
    beta_s_per_byte: float = 0.0
    held_out: list[tuple[int, float, float]] = field(default_factory=list)   # (bytes, measured, predicted)
    latency_s: float = 0.0
    latency_s_per_byte: float = 0.0
    occupancy_s: list[float] = field(default_factory=list)     # per size of sizes_bytes, where streamed

    def predict(self, nbytes: float) -> float:
        """One-way time of a message alone on the link (what a ping-pong measures)."""
        return self.alpha_s + self.beta_s_per_byte * nbytes + self.latency_s + self.latency_s_per_byte * nbytes


def _link_samples(pool: WorkerPool, cluster: Cluster, sizes_bytes: Sequence[int], repeats: int,
                  pairs: Sequence[Pair] | None, emulate: bool | None, stream: int = 0
                  ) -> tuple[dict[Pair, SizeSamples], dict[Pair, SizeSamples]]:
    """One-way times ``{(a, b): {size: [seconds, ...]}}`` of ``repeats`` ping-pongs per size and pair, and
    (with ``stream`` >= 2 messages per burst) the occupancy per message in the same form, else ``{}``."""
    from heterog.runtime.api import is_emulated
    from heterog.runtime.benchmarks import PingPongJob

    m = cluster.n_devices
    if m < 2:
        return {}, {}
    if pairs is None:
        pairs = [(a, b) for a in range(m) for b in range(a + 1, m)]
    emulate = is_emulated(cluster) if emulate is None else emulate
    links = {(a, b): (float(cluster.latency_s[a, b]), 1.0 / float(cluster.bandwidth_Bps[a, b]))
             for a in range(m) for b in range(m) if a != b}
    job = PingPongJob(list(pairs), [int(s) for s in sizes_bytes], int(repeats), bool(emulate), links,
                      stream=int(stream))
    out: dict[Pair, SizeSamples] = {}
    streams: dict[Pair, SizeSamples] = {}
    for res in pool.run([job] * m):
        for key, rows in res.items():
            kind, _, pair = key.rpartition(":")
            a, b = (int(x) for x in pair.split("->"))
            (streams if kind == "stream" else out)[(a, b)] = {int(size): list(samples) for size, samples in rows}
    return out, streams


def _medians(samples: dict[_Key, SizeSamples]) -> dict[_Key, SizeTimes]:
    """``{pair: {size: [seconds, ...]}}`` -> ``{pair: [(size, median seconds), ...]}`` (sizes increasing)."""
    return {pair: [(size, float(statistics.median(s))) for size, s in sorted(rows.items())]
            for pair, rows in samples.items()}


def measure_links(pool: WorkerPool, cluster: Cluster, *, sizes_bytes: Sequence[int] = LINK_SIZES_BYTES,
                  repeats: int = 7, pairs: Sequence[Pair] | None = None, emulate: bool | None = None
                  ) -> dict[Pair, SizeTimes]:
    """Ping-pong ``sizes_bytes`` between device pairs on ``pool`` (one rank per device of ``cluster``).

    Returns ``{(a, b): [(size, median one-way seconds), ...]}`` for each measured pair."""
    return _medians(_link_samples(pool, cluster, sizes_bytes, repeats, pairs, emulate)[0])


def _fit_links(table: ProfileTable, cluster: Cluster, medians: dict[Pair, SizeTimes], fit_sizes: Sequence[int],
               occupancy: dict[Pair, SizeTimes] | None = None) -> list[LinkMeasurement]:
    """Store the link model fitted to ``fit_sizes`` of each measured pair (``measure_links``' form) for
    every link on the pair's path, both directions; the other sizes are reported as held out.

    With the pair's streamed ``occupancy`` (same form): the link is held ``alpha + beta * bytes`` fitted
    to the occupancies (relative errors: the sizes span three orders of magnitude), and the latency in
    flight is ``l0 + l1 * bytes``, the part of a lone message's time (ping-pong) beyond its occupancy:
    ``l1`` the ping-pong line's slope less ``beta`` (the receiver's per-byte work, which a stream
    overlaps with the next message), ``l0`` the median over the small fit sizes (``LATENCY_SIZES_BYTES``,
    where bytes cost least and the difference is least noisy) of ping-pong less occupancy less ``l1 *
    bytes``; both at least 0. Without: the ping-pong line is the occupancy and the latency is 0. A
    path's latency and occupancy intercept are shared evenly between its links."""
    report: list[LinkMeasurement] = []
    occupancy = occupancy or {}
    for (a, b), rows in sorted(medians.items()):
        fit_rows = [(s, t) for s, t in rows if s in fit_sizes]
        alpha, beta = pingpong_line = fit_linear([s for s, _ in fit_rows], [t for _, t in fit_rows])
        latency, latency_per_byte = 0.0, 0.0
        occ: list[float] = []
        if (a, b) in occupancy:
            occ_of = {s: t for s, t in occupancy[(a, b)] if s in fit_sizes}
            occ = [occ_of[s] for s, _ in fit_rows]
            alpha, beta = fit_linear([s for s, _ in fit_rows], np.maximum(occ, 1e-9), relative=True)
            alpha = max(alpha, 0.0)
            latency_per_byte = max(pingpong_line[1] - beta, 0.0)
            gap = [(s, t - occ_of[s] - latency_per_byte * s) for s, t in fit_rows]
            small = [g for s, g in gap if s <= LATENCY_SIZES_BYTES] or [gap[0][1]]
            latency = max(float(np.median(small)), 0.0)
        for x, y in ((a, b), (b, a)):
            path = cluster.path(x, y)
            for link_id in path:
                table.set_link(cluster.links[link_id].name, alpha / len(path), beta, latency / len(path),
                               latency_per_byte)
            meas = LinkMeasurement(" + ".join(cluster.links[k].name for k in path), [s for s, _ in fit_rows],
                                   [t for _, t in fit_rows], alpha, beta, latency_s=latency,
                                   latency_s_per_byte=latency_per_byte, occupancy_s=occ)
            meas.held_out = [(s, t, meas.predict(s)) for s, t in rows if s not in fit_sizes]
            report.append(meas)
    return report


def profile_links(pool: WorkerPool, cluster: Cluster, table: ProfileTable | None = None, *,
                  sizes_bytes: Sequence[int] = LINK_SIZES_BYTES, held_out_bytes: Sequence[int] = (),
                  repeats: int = 7, emulate: bool | None = None, stream: int = STREAM_MESSAGES
                  ) -> tuple[ProfileTable, list[LinkMeasurement]]:
    """Fit every link of ``cluster`` from streamed and ping-pong measurements (``_fit_links``; ``stream``
    below 2: ping-pong only) and store the fits by link name. A pair's measurement applies to both
    directions and to each link on the path. ``held_out_bytes`` are measured too but left out of the
    fit, and reported with their predictions (``LinkMeasurement.held_out``)."""
    table = table if table is not None else ProfileTable()
    fit_sizes = [int(s) for s in sizes_bytes]
    all_sizes = sorted(set(fit_sizes) | {int(s) for s in held_out_bytes})
    pings, streams = _link_samples(pool, cluster, all_sizes, repeats, None, emulate, stream)
    return table, _fit_links(table, cluster, _medians(pings), fit_sizes, _medians(streams))


def collective_groups(n_devices: int) -> list[tuple[int, ...]]:
    """Device sets whose AllReduce the profiler measures: every subset of two or more devices when there
    are at most ``MAX_COLLECTIVE_GROUPS`` of them, else the whole cluster."""
    subsets = [c for k in range(2, n_devices + 1) for c in itertools.combinations(range(n_devices), k)]
    return subsets if len(subsets) <= MAX_COLLECTIVE_GROUPS else [tuple(range(n_devices))]


def _collective_samples(pool: WorkerPool, cluster: Cluster, groups: Sequence[Group], sizes: Sequence[int],
                        repeats: int, emulate: bool) -> dict[Group, SizeSamples]:
    """Per-AllReduce times ``{group: {size: [seconds, ...]}}`` of ``repeats`` AllReduces (one at a time)
    per size and group."""
    from heterog.cost import CostModel
    from heterog.runtime.benchmarks import CollectiveJob

    nominal = CostModel(cluster)                 # the emulation enforces the nominal ring time
    emulated = [[float(t) for t in nominal.allreduce_times(g, np.array(sizes, dtype=np.float64))[0]]
                if emulate else [0.0] * len(sizes) for g in groups]
    job = CollectiveJob(list(groups), list(sizes), int(repeats), bool(emulate), emulated)
    out: dict[Group, SizeSamples] = {}
    for res in pool.run([job] * cluster.n_devices):
        for key, rows in res.items():
            out[tuple(int(x) for x in key.split(","))] = {int(size): list(s) for size, s in rows}
    return out


def _fit_collectives(table: ProfileTable, cluster: Cluster, samples: dict[Group, SizeSamples]
                     ) -> dict[Group, SizeTimes]:
    """Store each group's AllReduce fit over the means of its samples; returns the means."""
    raw = {g: [(size, float(statistics.fmean(s))) for size, s in rows.items()] for g, rows in samples.items()}
    for g, rows in raw.items():
        table.add_collective("allreduce", [cluster.devices[d].name for d in g], [s for s, _ in rows],
                             [t for _, t in rows])
    return raw


def profile_collectives(pool: WorkerPool, cluster: Cluster, table: ProfileTable | None = None, *,
                        sizes_bytes: Sequence[int] = COLLECTIVE_SIZES_BYTES, repeats: int = 9,
                        groups: Sequence[tuple[int, ...]] | None = None, emulate: bool | None = None
                        ) -> tuple[ProfileTable, dict[tuple[int, ...], list[tuple[int, float]]]]:
    """Fit ``alpha + beta * bytes`` for AllReduce over each device set of ``groups`` (default
    ``collective_groups``), measured through the runtime's transport (with link emulation where the
    cluster is emulated), and store the fits in ``table.collectives``. A size's time is the mean of its
    samples, not the median: a step adds up many AllReduces whose latency is heavy-tailed on a loaded
    host (a few ms now and then, when a thread waits for a core, against a median of well under one),
    so what a step pays follows the mean. Returns the table and the raw means
    ``{group: [(bytes, seconds), ...]}``."""
    from heterog.runtime.api import is_emulated

    table = table if table is not None else ProfileTable()
    m = cluster.n_devices
    if m < 2:
        return table, {}
    groups = [tuple(int(d) for d in g) for g in (groups if groups is not None else collective_groups(m))]
    emulate = is_emulated(cluster) if emulate is None else emulate
    samples = _collective_samples(pool, cluster, groups, [int(s) for s in sizes_bytes], repeats, emulate)
    return table, _fit_collectives(table, cluster, samples)


class CommProfiler:
    """Links (streamed and ping-pong) and AllReduce (one at a time) of ``cluster`` measured round after
    round on ``pool``, like ``OpProfiler``, so that the rounds can be interleaved with other
    measurements. ``fit`` uses the samples of the chosen rounds, by default all (links: median per
    size, collectives: mean per size, as ``profile_links`` and ``profile_collectives``).
    ``link_repeats`` and ``collective_repeats`` are per round; ``stream`` messages per burst measure the
    links' occupancy (``STREAM_MESSAGES``; below 2: ping-pong only, no latency in flight)."""

    def __init__(self, pool: WorkerPool, cluster: Cluster, *, link_repeats: int = 5, collective_repeats: int = 5,
                 stream: int = STREAM_MESSAGES) -> None:
        from heterog.runtime.api import is_emulated

        self.pool, self.cluster = pool, cluster
        self.link_repeats, self.collective_repeats = int(link_repeats), int(collective_repeats)
        self.stream = int(stream)
        self.emulate = is_emulated(cluster)
        self.groups = collective_groups(cluster.n_devices) if cluster.n_devices > 1 else []
        # (links, collectives, occupancy) per round
        self.by_round: list[tuple[dict[Pair, SizeSamples], dict[Group, SizeSamples], dict[Pair, SizeSamples]]] = []

    @property
    def rounds(self) -> int:
        return len(self.by_round)

    def pooled(self, rounds: Sequence[int] | None = None
               ) -> tuple[dict[Pair, SizeSamples], dict[Group, SizeSamples], dict[Pair, SizeSamples]]:
        """Samples of ``rounds`` (default all) pooled: ``({(a, b): {size: [s, ...]}}, {group: {size: [s, ...]}},
        {(a, b): {size: [occupancy s, ...]}})``."""
        links: dict[Pair, SizeSamples] = {}
        colls: dict[Group, SizeSamples] = {}
        occupancy: dict[Pair, SizeSamples] = {}
        for r in sorted(_chosen_rounds(rounds, self.rounds, "link or collective")):
            round_links, round_colls, round_occupancy = self.by_round[r]
            _pool_into(links, round_links)
            _pool_into(colls, round_colls)
            _pool_into(occupancy, round_occupancy)
        return links, colls, occupancy

    @property
    def links(self) -> dict[Pair, SizeSamples]:
        """Link samples of all rounds: ``{(a, b): {size: [seconds, ...]}}``."""
        return self.pooled()[0]

    @property
    def collectives(self) -> dict[Group, SizeSamples]:
        """AllReduce samples of all rounds: ``{group: {size: [seconds, ...]}}``."""
        return self.pooled()[1]

    def round(self) -> None:
        links, occupancy = _link_samples(self.pool, self.cluster, LINK_SIZES_BYTES, self.link_repeats, None,
                                         self.emulate, self.stream)
        colls = _collective_samples(self.pool, self.cluster, self.groups, COLLECTIVE_SIZES_BYTES,
                                    self.collective_repeats, self.emulate) if self.groups else {}
        self.by_round.append((links, colls, occupancy))

    def fit(self, table: ProfileTable | None = None, rounds: Sequence[int] | None = None) -> ProfileTable:
        """Store the fits of ``rounds`` (indices from 0; default all rounds so far) in ``table``."""
        links, colls, occupancy = self.pooled(rounds)
        table = table if table is not None else ProfileTable()
        _fit_links(table, self.cluster, _medians(links), LINK_SIZES_BYTES, _medians(occupancy))
        _fit_collectives(table, self.cluster, colls)
        return table


def _pool_into(into: dict[_Key, SizeSamples], new: dict[_Key, SizeSamples]) -> None:
    """Add the samples of ``new`` to those of ``into`` (per key and size)."""
    for key, rows in new.items():
        for size, samples in rows.items():
            into.setdefault(key, {}).setdefault(size, []).extend(samples)


def per_round(total: int, rounds: int) -> int:
    """Repeats per round so that ``rounds`` rounds make at least ``total``."""
    return max(1, -(-int(total) // max(1, int(rounds))))


def profile(model: Model, cluster: Cluster, pool: WorkerPool, *, batch_sizes: Sequence[int] | None = None,
            steps: int = OP_STEPS, rounds: int = 5, link_repeats: int = LINK_REPEATS,
            collective_repeats: int = COLLECTIVE_REPEATS) -> ProfileTable:
    """The profile table the cost model reads: op times measured in situ on ``pool`` (``OpProfiler``),
    a fit for every link of ``cluster`` and for AllReduce over device sets (``CommProfiler``), in
    ``rounds`` interleaved rounds (``link_repeats`` and ``collective_repeats`` are totals)."""
    ops = OpProfiler(model, cluster, pool, batch_sizes=batch_sizes, steps=steps)
    comm = CommProfiler(pool, cluster, link_repeats=per_round(link_repeats, rounds),
                        collective_repeats=per_round(collective_repeats, rounds))
    for _ in range(max(1, int(rounds))):
        ops.round()
        comm.round()
    return comm.fit(ops.fit())
