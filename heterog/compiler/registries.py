"""The tables a Compiler grows as it meets strategies: layouts and configs numbered as first seen, a
strategy's op groups, and what the parameter-server choice reads of those groups.

Ids of layouts and configs stay stable while the tables live, so plans, placements and caches can hold
them; a Compiler that drops its tables drops whatever holds their ids with them.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.index import GraphIndex
from heterog.shares import grid_micro_shares, micro_batch_shares

if TYPE_CHECKING:  # pragma: no cover
    from heterog.strategy import ParallelConfig


@dataclass(frozen=True)
class Layout:
    """One layout's entries (its op instances): entry i runs on ``devices[i]`` over ``shares[i]`` samples of
    micro-batch ``micro[i]`` (an op without a batch tensor: on each device once, over the whole batch), with
    the share ``split[i]`` of the op's dimension divided beyond the batch (1.0: whole)."""

    devices: tuple[int, ...]
    shares: tuple[int, ...]
    micro: tuple[int, ...]
    split: tuple[float, ...]


class LayoutTable:
    """Layouts (devices, batch shares, micro-batches) numbered as first seen; the first M are the single
    devices at the whole batch (layout d: device d alone). A layout's entries are its op instances: entry
    i runs on ``devices[i]`` over the next ``shares[i]`` samples of micro-batch ``micro[i]`` (entries in
    sample order, so a device appears once per micro-batch it has samples of). Flat views, rebuilt by
    ``refresh``:

    An op split beyond the batch (``heterog.compiler.shards``) runs on a layout of whole-batch entries,
    each with its share ``split`` of the op's divided dimension.

    Shapes: ``length`` (L,), ``ptr`` (L + 1,), ``dev_flat``, ``shares_flat``, ``frac_flat``, ``micro_flat``,
    ``split_flat``,
    ``prev_flat`` (the flat index of the entry before on the same device, -1 for its first), ``last_flat``
    (the entry is its device's last) (ptr[-1],); ``dev_mask`` (L, M); ``repeats`` (L,) some device has
    several entries.
    """

    def __init__(self, n_devices: int, batch_size: int) -> None:
        self.n_devices, self.batch_size = n_devices, batch_size
        self.devices: list[tuple[int, ...]] = []
        self.shares: list[tuple[int, ...]] = []
        self.micro: list[tuple[int, ...]] = []
        self.split: list[tuple[float, ...]] = []
        self._id: dict[tuple, int] = {}
        self._micro_entries: dict[int, dict[int, tuple[int, ...]]] = {}
        self._unique: dict[int, tuple[int, ...]] = {}
        self._last: dict[int, np.ndarray] = {}
        self._records: tuple[Layout, ...] = ()
        self._built = -1
        for d in range(n_devices):
            self.add((d,), (batch_size,))

    def add(self, devices: Iterable[int], shares: Iterable[int], micro: Iterable[int] | None = None,
            split: Iterable[float] | None = None) -> int:
        """The id of layout (``devices``, ``shares``, ``micro``: each entry's micro-batch, all 0 if None;
        ``split``: each entry's share of its op's divided dimension beyond the batch, all 1 if None),
        registered if new."""
        devs = tuple(int(d) for d in devices)
        key = (devs, tuple(int(s) for s in shares), (0,) * len(devs) if micro is None else tuple(int(m) for m in micro),
               None if split is None else tuple(float(f) for f in split))
        lid = self._id.get(key)
        if lid is None:
            lid = self._id[key] = len(self.devices)
            self.devices.append(key[0])
            self.shares.append(key[1])
            self.micro.append(key[2])
            self.split.append((1.0,) * len(devs) if key[3] is None else key[3])
        return lid

    def unique_devices(self, lid: int) -> tuple[int, ...]:
        """The devices of layout ``lid``, each once, in order of first entry (cached: a layout never changes)."""
        hit = self._unique.get(lid)
        if hit is None:
            hit = self._unique[lid] = tuple(dict.fromkeys(self.devices[lid]))
        return hit

    def last_entries(self, lid: int) -> np.ndarray:
        """(len(unique_devices(lid)),) local index of each device's last entry in layout ``lid`` (cached,
        read-only)."""
        hit = self._last.get(lid)
        if hit is None:
            last = {d: i for i, d in enumerate(self.devices[lid])}
            hit = self._last[lid] = np.array([last[d] for d in self.unique_devices(lid)], dtype=np.int64)
            hit.setflags(write=False)
        return hit

    def micro_entries(self, lid: int) -> dict[int, tuple[int, ...]]:
        """Micro-batch -> local index of each device's entry for it in layout ``lid``, devices in the order
        of ``unique_devices`` (a layout whose every device has an entry per micro-batch; cached)."""
        hit = self._micro_entries.get(lid)
        if hit is None:
            pos = {d: i for i, d in enumerate(self.unique_devices(lid))}
            out: dict[int, list[int]] = {}
            for j, (d, m) in enumerate(zip(self.devices[lid], self.micro[lid])):
                out.setdefault(m, [0] * len(pos))[pos[d]] = j
            hit = self._micro_entries[lid] = {m: tuple(v) for m, v in out.items()}
        return hit

    def __len__(self) -> int:
        return len(self.devices)

    def records(self) -> tuple[Layout, ...]:
        """Every layout as a ``Layout``, by id (the same tuple until a layout is added)."""
        n = len(self._records)
        if n != len(self.devices):
            self._records += tuple(map(Layout, self.devices[n:], self.shares[n:], self.micro[n:], self.split[n:]))
        return self._records

    def refresh(self) -> LayoutTable:
        """Rebuild the flat views if layouts were added since."""
        if self._built != len(self.devices):
            lengths = np.array([len(d) for d in self.devices], dtype=np.int64)
            self.length = lengths
            self.ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            self.dev_flat = np.array([d for ds in self.devices for d in ds], dtype=np.int64)
            self.shares_flat = np.array([s for ss in self.shares for s in ss], dtype=np.float64)
            self.frac_flat = np.array([s / self.batch_size for ss in self.shares for s in ss], dtype=np.float64)
            self.micro_flat = np.array([m for ms in self.micro for m in ms], dtype=np.int64)
            self.split_flat = np.array([f for fs in self.split for f in fs], dtype=np.float64)
            self.dev_mask = np.zeros((len(lengths), self.n_devices), dtype=bool)
            self.dev_mask[np.repeat(np.arange(len(lengths)), lengths), self.dev_flat] = True
            self.prev_flat = np.full(len(self.dev_flat), -1, dtype=np.int64)
            self.last_flat = np.ones(len(self.dev_flat), dtype=bool)
            self.repeats = np.zeros(len(lengths), dtype=bool)
            for lid, devs in enumerate(self.devices):
                if len(set(devs)) < len(devs):
                    self.repeats[lid] = True
                    seen: dict[int, int] = {}
                    for i, d in enumerate(devs):
                        flat = int(self.ptr[lid]) + i
                        if d in seen:
                            self.prev_flat[flat] = seen[d]
                            self.last_flat[seen[d]] = False
                        seen[d] = flat
            self._built = len(self.devices)
        return self

    def __repr__(self) -> str:
        return f"LayoutTable({len(self)} layouts over {self.n_devices} devices, batch {self.batch_size})"


def entry_rows(devices: Sequence[int], shares: Sequence[int], micro: Sequence[int],
               groups: Sequence[Sequence[int]] = ()) -> list[tuple[int, int]]:
    """(first, end) sample, within its micro-batch, of each entry (device, share, micro-batch) of a layout:
    consecutive entries of a micro-batch take consecutive samples, except that the devices of one group of a
    split config (``groups``) run the same samples (one group: the whole micro-batch on every device)."""
    block = {int(d): k for k, g in enumerate(groups) for d in g}
    rows: dict[tuple[int, object], tuple[int, int]] = {}
    top: dict[int, int] = {}
    out = []
    for j, (d, s, m) in enumerate(zip(devices, shares, micro)):
        b = (int(m), block.get(int(d), ("entry", j)))
        if b not in rows:
            lo = top.get(int(m), 0)
            rows[b] = (lo, lo + int(s))
            top[int(m)] = lo + int(s)
        out.append(rows[b])
    return out


class ConfigTable:
    """ParallelConfigs numbered as first seen (by value, with the plan's micro-batch sizes), with
    per-config arrays, rebuilt by ``refresh``: ``n_replicas`` (devices with samples), ``is_ps`` (PS sync
    over several replicas),
    ``fixed_ps`` (the given PS device, -1: the compiler's choice), ``split_layout`` / ``dup_layout``
    (layout of batch ops, one entry per replica and micro-batch / of duplicated ops, ids of ``layouts``,
    which it registers)."""

    def __init__(self, layouts: LayoutTable) -> None:
        self.layouts = layouts
        self.configs: list[ParallelConfig] = []
        self._id: dict[tuple[ParallelConfig, tuple[int, ...] | None], int] = {}
        self._rows: list[tuple[int, bool, int, int, int]] = []
        self._built = -1

    def id_of(self, config: ParallelConfig, micro: tuple[int, ...] | None = None) -> int:
        """The id of ``config`` in a plan of micro-batches ``micro`` (None: one), registered (with its
        layouts) if new."""
        if micro is not None and len(micro) == 1:
            micro = None
        cid = self._id.get((config, micro))
        if cid is None:
            B = self.layouts.batch_size
            if micro is None:
                split = self.layouts.add(config.devices, config.shares)
            elif config.split is not None:     # split beyond the batch: every device of a group runs its share
                groups = config.groups         # of each micro-batch (one group: the whole micro-batch)
                per = grid_micro_shares(config.shares[::config.group_size], micro)       # (refuses before
                split = self.layouts.add(*zip(*[(d, s, m) for m, shares in enumerate(per)  # registering)
                                                for g, s in zip(groups, shares) for d in g]))
            else:
                entries = [(d, s, m) for m, shares in enumerate(micro_batch_shares(config.shares, micro))
                           for d, s in zip(config.devices, shares) if s > 0]
                split = self.layouts.add(*zip(*entries))
            # replicas: the devices with samples (with micro-batches, a replica of a small share may get none)
            # a split config runs one whole-batch replica divided among its devices: nothing to aggregate
            n = 1 if config.split is not None else len(self.layouts.unique_devices(split))
            cid = self._id[(config, micro)] = len(self.configs)
            self.configs.append(config)
            self._rows.append((n, config.sync == "ps" and n > 1,
                               -1 if config.ps_device is None else int(config.ps_device), split,
                               self.layouts.add(config.devices, (B,) * config.n_replicas)))
        return cid

    def __len__(self) -> int:
        return len(self.configs)

    def refresh(self) -> ConfigTable:
        """Rebuild the per-config arrays if configs were added since."""
        if self._built != len(self._rows):
            cols = list(zip(*self._rows))
            self.n_replicas = np.array(cols[0], dtype=np.int64)
            self.is_ps = np.array(cols[1], dtype=bool)
            self.fixed_ps = np.array(cols[2], dtype=np.int64)
            self.split_layout = np.array(cols[3], dtype=np.int64)
            self.dup_layout = np.array(cols[4], dtype=np.int64)
            self._built = len(self._rows)
        return self

    def __repr__(self) -> str:
        return f"ConfigTable({len(self)} configs, {len(self.layouts)} layouts)"


@dataclass(frozen=True)
class Grouping:
    """A strategy's op groups: ``op_group`` (n_ops,), and the group of each tensor's producer (n_tensors,)."""

    op_group: np.ndarray
    t_group: np.ndarray
    n_groups: int

    @classmethod
    def of(cls, op_group: np.ndarray, index: GraphIndex) -> Grouping:
        """The grouping that puts op ``o`` in group ``op_group[o]``."""
        return cls(op_group, op_group[index.t_op], int(op_group.max()) + 1 if len(op_group) else 0)

    def same_as(self, op_group: np.ndarray) -> bool:
        """Whether ``op_group`` groups the ops as this grouping does."""
        return self.op_group is op_group or np.array_equal(self.op_group, op_group)


class PSDemand:
    """What the parameter-server choice (``heterog.compiler.ps``) reads of one grouping: the tensors and
    bytes each group's batch ops pull from a PS, and by when each replica of a config needs them; each
    computed on first use."""

    MAX_CONFIGS = 256                        # parameter needs kept; then the cache starts afresh

    def __init__(self, context: CompileContext, grouping: Grouping) -> None:
        self.context, self.grouping = context, grouping
        self._pulled: tuple[np.ndarray, np.ndarray] | None = None
        self._need: dict[ParallelConfig, np.ndarray] = {}

    def pulled(self) -> tuple[np.ndarray, np.ndarray]:
        """(G,) tensors and (G,) bytes each group's batch ops pull from a PS."""
        if self._pulled is None:
            g, gi = self.grouping, self.context.index
            self._pulled = (np.bincount(g.t_group[gi.t_pulled], minlength=g.n_groups).astype(np.float64),
                            np.bincount(g.t_group[gi.t_pulled], weights=gi.t_bytes[gi.t_pulled], minlength=g.n_groups))
        return self._pulled

    def parameters_needed(self, config: ParallelConfig) -> np.ndarray:
        """(G, M) estimated time by which each replica device of ``config`` needs each group's pulled
        parameters if the group ran under it: its forward and backward work before their first reader (op
        ids are topological), at its batch share, one op after another, plus its slack (the busiest
        replica's work minus its own); 0 where the group pulls nothing."""
        hit = self._need.get(config)
        if hit is not None:
            return hit
        ctx, g = self.context, self.grouping
        gi = ctx.index
        full = ctx.cost.full_batch_times(ctx.graph)
        work = gi.is_compute & ~gi.post_agg
        need = np.zeros((g.n_groups, full.shape[1]))
        e = np.nonzero(~gi.e_value_free & gi.has_batch[gi.e_dst])[0]
        first_reader = np.full(gi.n_tensors, np.iinfo(np.int64).max)
        np.minimum.at(first_reader, gi.e_tensor[e], gi.e_dst[e])
        pul = np.nonzero(gi.t_pulled & (first_reader < gi.n_ops))[0]
        op_s = [np.where(work, full[:, d] * np.where(gi.has_batch, share / ctx.batch_size, 1.0), 0.0)
                for d, share in zip(config.devices, config.shares)]
        longest = max(float(t.sum()) for t in op_s)
        for d, t in zip(config.devices, op_s):
            before = np.cumsum(t) - t
            at = np.full(g.n_groups, np.inf)
            np.minimum.at(at, g.t_group[pul], before[first_reader[pul]] + longest - float(t.sum()))
            need[:, d] = np.where(np.isinf(at), need[:, d], at)
        if len(self._need) > self.MAX_CONFIGS:
            self._need.clear()
        self._need[config] = need
        return need
