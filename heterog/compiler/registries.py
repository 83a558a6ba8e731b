"""The tables a Compiler grows as it meets strategies: layouts and configs numbered as first seen, a
strategy's op groups, and what the parameter-server choice reads of those groups.

Ids of layouts and configs stay stable while the tables live, so plans, placements and caches can hold
them; a Compiler that drops its tables drops whatever holds their ids with them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.index import GraphIndex

if TYPE_CHECKING:  # pragma: no cover
    from heterog.strategy import ParallelConfig


class LayoutTable:
    """Layouts (devices, batch shares) numbered as first seen; the first M are the single devices at the
    whole batch (layout d: device d alone). Flat views, rebuilt by ``refresh``:

    Shapes: ``length`` (L,), ``ptr`` (L + 1,), ``dev_flat``, ``shares_flat``, ``frac_flat`` (ptr[-1],),
    ``dev_mask`` (L, M).
    """

    def __init__(self, n_devices: int, batch_size: int) -> None:
        self.n_devices, self.batch_size = n_devices, batch_size
        self.devices: list[tuple[int, ...]] = []
        self.shares: list[tuple[int, ...]] = []
        self._id: dict[tuple, int] = {}
        self._built = -1
        for d in range(n_devices):
            self.add((d,), (batch_size,))

    def add(self, devices: Iterable[int], shares: Iterable[int]) -> int:
        """The id of layout (``devices``, ``shares``), registered if new."""
        key = (tuple(int(d) for d in devices), tuple(int(s) for s in shares))
        lid = self._id.get(key)
        if lid is None:
            lid = self._id[key] = len(self.devices)
            self.devices.append(key[0])
            self.shares.append(key[1])
        return lid

    def __len__(self) -> int:
        return len(self.devices)

    def refresh(self) -> LayoutTable:
        """Rebuild the flat views if layouts were added since."""
        if self._built != len(self.devices):
            lengths = np.array([len(d) for d in self.devices], dtype=np.int64)
            self.length = lengths
            self.ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            self.dev_flat = np.array([d for ds in self.devices for d in ds], dtype=np.int64)
            self.shares_flat = np.array([s for ss in self.shares for s in ss], dtype=np.float64)
            self.frac_flat = np.array([s / self.batch_size for ss in self.shares for s in ss], dtype=np.float64)
            self.dev_mask = np.zeros((len(lengths), self.n_devices), dtype=bool)
            self.dev_mask[np.repeat(np.arange(len(lengths)), lengths), self.dev_flat] = True
            self._built = len(self.devices)
        return self

    def __repr__(self) -> str:
        return f"LayoutTable({len(self)} layouts over {self.n_devices} devices, batch {self.batch_size})"


class ConfigTable:
    """ParallelConfigs numbered as first seen (by value), with per-config arrays, rebuilt by ``refresh``:
    ``n_replicas``, ``is_ps`` (PS sync over several replicas), ``fixed_ps`` (the given PS device, -1: the
    compiler's choice), ``split_layout`` / ``dup_layout`` (layout of batch ops / of duplicated ops, ids of
    ``layouts``, which it registers)."""

    def __init__(self, layouts: LayoutTable) -> None:
        self.layouts = layouts
        self.configs: list[ParallelConfig] = []
        self._id: dict[ParallelConfig, int] = {}
        self._rows: list[tuple[int, bool, int, int, int]] = []
        self._built = -1

    def id_of(self, config: ParallelConfig) -> int:
        """The id of ``config``, registered (with its layouts) if new."""
        cid = self._id.get(config)
        if cid is None:
            cid = self._id[config] = len(self.configs)
            self.configs.append(config)
            B = self.layouts.batch_size
            self._rows.append((config.n_replicas, config.sync == "ps" and config.n_replicas > 1,
                               -1 if config.ps_device is None else int(config.ps_device),
                               self.layouts.add(config.devices, config.shares),
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
