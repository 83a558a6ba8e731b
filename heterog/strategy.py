"""The plan model: a ParallelConfig per group of ops (replicas, shares, sync, splits beyond the batch) and the
Strategy that holds them for one graph and cluster (micro-batches, schedule, recomputation), checked when
built and (de)serialised as a versioned JSON file.

Where the rest lives: share arithmetic in ``heterog.shares``, the per-group action and its decoding in
``heterog.actions``, op grouping in ``heterog.graph.grouping``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from heterog.errors import StrategyError
from heterog.sharded import ShardedState
from heterog.shares import even_shares

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster
    from heterog.graph.opgraph import OpGraph

SYNC_METHODS = ("ps", "allreduce")
# the order of micro-batch tasks (docs/design.md, "Micro-batches"): GPipe runs every forward of a device
# before its backwards; 1F1B keeps at most S - s micro-batches in flight on a device at pipeline position s
SCHEDULES = ("gpipe", "1f1b")
MAX_MICRO_BATCHES = 256     # Megatron-style plans of large global batches run 128 (Sailor's validation plans)
STRATEGY_VERSION = 8         # 2: micro-batches and their schedule; 3: groups recomputed; 4: splits beyond the batch;
#                              5: splits over a grid (batch x beyond the batch); 6: sharded state (ZeRO stages);
#                              7: state offloaded to the host (``"offload"`` in ``"sharded"``); 8: synchronized
#                              batch statistics (``"sync_batch_stats"``, of the plan or of a config)
# a config's split beyond the batch (docs/design.md, "Splits beyond the batch"): "parameter" divides the
# parameters of its ops (and what computes with them) among the devices, "attribute" divides only what
# carries no parameter (sequence, spatial, heads of activations), parameters stay whole on every device;
# "tensor" is Megatron's tensor parallelism: a parameter is held divided or whole and always read as held
# (never gathered), the activations between its readers divided or partial as their ops need
SPLIT_KINDS = ("parameter", "attribute", "tensor")
ALLREDUCE_ALGOS = ("auto", "ring", "hierarchical")


@dataclass(frozen=True)
class ParallelConfig:
    """Where a group runs: replicas as (device, batch share) and how partial gradients are aggregated.

    A single-device config is model parallelism on that device. Shares are integer sample counts;
    replicas named twice on one device are merged into one replica with the combined share.
    ``ps_device=None`` lets the compiler pick the PS that finishes aggregation first. ``split`` divides the
    ops beyond the batch among the devices (``split_over``), ``grid`` > 1 among each of that many groups of
    them, the batch over the groups (``split_grid``). ``sharded`` keeps an AllReduce data-parallel group's
    optimizer state (and gradients, and parameters) as shards over its replicas, and may offload it to the
    host, a one-device group's too (``heterog.sharded``). ``sync_batch_stats``: the group's batch norms use
    the statistics of the whole batch (``heterog.compiler.sync_stats``), not each replica's.
    """

    devices: tuple[int, ...]
    shares: tuple[int, ...]
    sync: str = "allreduce"
    ps_device: int | None = None
    allreduce: str = "auto"
    split: str | None = None
    split_shares: tuple[int, ...] = ()
    grid: int = 1
    sharded: ShardedState | None = None
    sync_batch_stats: bool = False

    def __post_init__(self) -> None:
        if self.split is not None:
            self._check_split()
        elif int(self.grid) != 1:
            raise StrategyError(f"grid={self.grid} needs a split config (split='parameter' or "
                                f"'attribute')")
        if len(self.devices) != len(self.shares) or not self.devices:
            raise StrategyError(f"ParallelConfig needs one share per device, got devices {list(self.devices)} "
                                f"and shares {list(self.shares)}")
        if len(set(self.devices)) != len(self.devices):
            raise StrategyError(f"ParallelConfig lists a device twice: {list(self.devices)} (use ParallelConfig.of)")
        if any(int(s) <= 0 for s in self.shares):
            raise StrategyError(f"ParallelConfig shares must be positive sample counts, got {list(self.shares)}")
        if self.sync not in SYNC_METHODS:
            raise StrategyError(f"unknown sync method {self.sync!r} (choose from {SYNC_METHODS})")
        if self.allreduce not in ALLREDUCE_ALGOS:
            raise StrategyError(f"unknown allreduce algorithm {self.allreduce!r} (choose from {ALLREDUCE_ALGOS})")
        if self.ps_device is not None and self.ps_device not in self.devices:
            raise StrategyError(f"PS device {self.ps_device} is not one of the replica devices {list(self.devices)}")
        if self.sharded is not None:
            self._check_sharded()

    def _check_sharded(self) -> None:
        assert self.sharded is not None
        st = self.sharded
        one = len(self.devices) == 1 and self.split is None      # offloading alone: one device's whole state
        if one and st.offloads and int(st.stage) <= 2:
            pass
        elif one and st.offloads:
            raise StrategyError(f"stage {st.stage} on one device shards nothing: offloading ({st.offload}) from "
                                f"device {self.devices[0]} takes stage 0, 1 or 2")
        elif self.sync != "allreduce" or self.split is not None or len(self.devices) < 2:
            raise StrategyError(f"sharded state (stage {st.stage}) needs an AllReduce data-parallel config "
                                f"of 2+ replicas, got sync={self.sync!r}, split={self.split!r}, devices "
                                f"{list(self.devices)}")
        if len(self.sharded.weights) != len(self.devices):
            raise StrategyError(f"sharded state needs one shard weight per replica: devices {list(self.devices)}, "
                                f"weights {list(self.sharded.weights)}")

    def _check_split(self) -> None:
        if self.split not in SPLIT_KINDS:
            raise StrategyError(f"unknown split {self.split!r} (choose from {SPLIT_KINDS})")
        if len(self.split_shares) != len(self.devices) or any(int(w) <= 0 for w in self.split_shares):
            raise StrategyError(f"a split config needs one positive split share per device, got devices "
                                f"{list(self.devices)} and split shares {list(self.split_shares)}")
        g = int(self.grid)
        if g < 1 or len(self.devices) % g:
            raise StrategyError(f"a split config's {len(self.devices)} devices do not form {g} groups of equal size")
        size = len(self.devices) // g
        for r in range(g):
            rows = self.shares[r * size:(r + 1) * size]
            if len(set(rows)) != 1:
                raise StrategyError(f"every device of a split group runs that group's whole batch share: shares "
                                    f"must be equal within a group, got {list(rows)}")
            if tuple(self.split_shares[r * size:(r + 1) * size]) != tuple(self.split_shares[:size]):
                raise StrategyError(f"the groups of a split grid divide alike: split shares "
                                    f"{list(self.split_shares)} differ between groups of {size} devices")

    @classmethod
    def split_over(cls, devices: Sequence[int], weights: Sequence[int], batch_size: int,
                   kind: str = "parameter") -> "ParallelConfig":
        """The group's ops divided beyond the batch among ``devices`` (each runs the whole batch): each op's
        split dimension in integer shares proportional to ``weights`` (``heterog.shares.split_shares_of``)."""
        devs = tuple(int(d) for d in devices)
        return cls(devs, (int(batch_size),) * len(devs), split=kind, split_shares=tuple(int(w) for w in weights))

    @classmethod
    def split_grid(cls, groups: Sequence[Sequence[int]], weights: Sequence[int], batch_shares: Sequence[int],
                   kind: str = "parameter") -> "ParallelConfig":
        """A 2-D split: the batch divided over ``groups`` (``batch_shares`` samples each, like data-parallel
        replicas) and, inside each group, the ops divided beyond the batch among its devices in proportion to
        ``weights`` (one per position in a group, the same in every group: the k-th devices of the groups
        hold the same shards, and their partial results are summed over the groups)."""
        rows = [tuple(int(d) for d in g) for g in groups]
        if not rows or len({len(r) for r in rows}) != 1 or len(weights) != len(rows[0]):
            raise StrategyError(f"a split grid needs groups of equal size and one weight per position, got groups "
                                f"{[list(r) for r in rows]} and weights {list(weights)}")
        if len(batch_shares) != len(rows):
            raise StrategyError(f"a split grid needs one batch share per group, got {list(batch_shares)} for "
                                f"{len(rows)} groups")
        devs = tuple(d for r in rows for d in r)
        shares = tuple(int(b) for b, r in zip(batch_shares, rows) for _ in r)
        return cls(devs, shares, split=kind, split_shares=tuple(int(w) for _ in rows for w in weights),
                   grid=len(rows))

    @property
    def group_size(self) -> int:
        """Devices per group of a split config (all of them unless it is a grid)."""
        return len(self.devices) // int(self.grid)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """A split config's groups of devices (one group unless it is a grid)."""
        k = self.group_size
        return tuple(self.devices[i:i + k] for i in range(0, len(self.devices), k))

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]], sync: str = "allreduce", ps_device: int | None = None,
           allreduce: str = "auto") -> "ParallelConfig":
        """Build from (device, share) pairs, merging replicas on the same device and dropping zero shares."""
        merged: dict[int, int] = {}
        for d, s in pairs:
            if int(s) < 0:
                raise StrategyError(f"negative batch share {s} for device {d}")
            if int(s) > 0:
                merged[int(d)] = merged.get(int(d), 0) + int(s)
        devs = tuple(sorted(merged))
        return cls(devs, tuple(merged[d] for d in devs), sync, ps_device, allreduce)

    @classmethod
    def single(cls, device: int, batch_size: int) -> "ParallelConfig":
        return cls((int(device),), (int(batch_size),))

    @property
    def n_replicas(self) -> int:
        return len(self.devices)

    @property
    def batch_size(self) -> int:
        if self.split is not None:
            return int(sum(self.shares[::self.group_size]))
        return int(sum(self.shares))

    def to_dict(self) -> dict:
        d: dict = {"devices": list(self.devices), "shares": list(self.shares), "sync": self.sync,
             "ps_device": self.ps_device, "allreduce": self.allreduce}
        if self.split is not None:
            d["split"], d["split_shares"] = self.split, list(self.split_shares)
            if self.grid > 1:
                d["grid"] = int(self.grid)
        if self.sharded is not None:
            d["sharded"] = self.sharded.to_dict()
        if self.sync_batch_stats:
            d["sync_batch_stats"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        return cls(tuple(int(x) for x in d["devices"]), tuple(int(x) for x in d["shares"]),
                   d.get("sync", "allreduce"), d.get("ps_device"), d.get("allreduce", "auto"),
                   d.get("split"), tuple(int(x) for x in d.get("split_shares", ())), int(d.get("grid", 1)),
                   None if d.get("sharded") is None else ShardedState.from_dict(d["sharded"]),
                   bool(d.get("sync_batch_stats", False)))


def check_micro_batches(sizes: Sequence[int], batch_size: int) -> tuple[int, ...]:
    """``sizes`` as a tuple of positive micro-batch sizes summing to ``batch_size``, or a StrategyError."""
    out = tuple(int(x) for x in sizes)
    if not out or any(x <= 0 for x in out) or sum(out) != int(batch_size):
        raise StrategyError(f"micro-batch sizes must be positive and sum to the batch {batch_size}, got {list(out)}")
    if len(out) > MAX_MICRO_BATCHES:
        raise StrategyError(f"{len(out)} micro-batches; at most {MAX_MICRO_BATCHES} are supported")
    return out


def most_micro_batches(strategy: "Strategy") -> int:
    """The most micro-batches ``strategy`` can run: its batch, or fewer where a grid's every group must get a
    sample of each (``heterog.shares.grid_micro_shares``)."""
    return min([strategy.batch_size] + [strategy.batch_size // c.grid for c in strategy.configs if c.grid > 1])



@dataclass
class Strategy:
    """One ParallelConfig per group of a graph, for one cluster.

    ``priorities`` optionally fixes the execution order of ops (higher first), e.g. DPOS's order;
    without it the scheduler ranks tasks itself. ``micro_batches`` are the sizes of the micro-batches the
    global batch is cut into, in sample order (None: one micro-batch); every group's batch shares apply
    within each, and ``schedule`` (``SCHEDULES``) orders their tasks. ``recompute`` are the groups whose
    forward activations are freed after the forward and recomputed before their backward (sorted ids).
    ``sync_batch_stats``: every group's batch norms use the statistics of the whole batch
    (``heterog.compiler.sync_stats``; a config may ask it for its own group).
    """

    graph_fingerprint: str
    cluster_name: str
    n_devices: int
    batch_size: int
    group_of: np.ndarray
    configs: list[ParallelConfig]
    method: str = ""
    priorities: np.ndarray | None = None
    meta: dict = field(default_factory=dict)
    micro_batches: tuple[int, ...] | None = None
    schedule: str = "1f1b"
    recompute: tuple[int, ...] = ()
    sync_batch_stats: bool = False

    def __post_init__(self) -> None:
        self.group_of = np.asarray(self.group_of, dtype=np.int64)
        self.recompute = tuple(sorted({int(g) for g in self.recompute}))
        if self.recompute and not 0 <= self.recompute[0] <= self.recompute[-1] < len(self.configs):
            raise StrategyError(f"recomputed groups must lie in 0..{len(self.configs) - 1}, got "
                                f"{list(self.recompute)}")
        if self.micro_batches is not None:
            self.micro_batches = check_micro_batches(self.micro_batches, self.batch_size)
        if self.schedule not in SCHEDULES:
            raise StrategyError(f"unknown micro-batch schedule {self.schedule!r} (choose from {SCHEDULES})")
        if self.group_of.size and (self.group_of.min() < 0 or self.group_of.max() >= len(self.configs)):
            raise StrategyError(f"group ids must lie in 0..{len(self.configs) - 1}, "
                                f"got {self.group_of.min()}..{self.group_of.max()}")
        split_recomputed = [g for g in self.recompute if self.configs[g].split is not None]
        if split_recomputed:
            raise StrategyError(f"groups {split_recomputed} are split beyond the batch: such groups are not recomputed")
        ids = np.fromiter(map(id, self.configs), dtype=np.int64, count=len(self.configs))
        for g in np.sort(np.unique(ids, return_index=True)[1]).tolist():   # each distinct config object once
            cfg = self.configs[g]
            if cfg.batch_size != self.batch_size:
                raise StrategyError(f"group {g}: shares {list(cfg.shares)} sum to {cfg.batch_size}, "
                                    f"global batch is {self.batch_size}")
            bad = [d for d in cfg.devices if not 0 <= d < self.n_devices]
            if bad:
                raise StrategyError(f"group {g}: devices {bad} do not exist (cluster has {self.n_devices})")

    @property
    def n_groups(self) -> int:
        return len(self.configs)

    @property
    def micro(self) -> tuple[int, ...]:
        """The micro-batch sizes, ``(batch_size,)`` for a plan of one micro-batch."""
        return self.micro_batches if self.micro_batches is not None else (int(self.batch_size),)

    @property
    def n_micro(self) -> int:
        return len(self.micro)

    def with_micro_batches(self, k: int, schedule: str | None = None) -> "Strategy":
        """This strategy over ``k`` micro-batches of even sizes (1: one), under ``schedule`` (None: its own)."""
        if not 1 <= int(k) <= min(self.batch_size, MAX_MICRO_BATCHES):
            raise StrategyError(f"{k} micro-batches for a batch of {self.batch_size}: give 1.."
                                f"{min(self.batch_size, MAX_MICRO_BATCHES)}")
        return replace(self, micro_batches=None if int(k) == 1 else tuple(even_shares(self.batch_size, int(k))),
                       schedule=schedule or self.schedule, meta=dict(self.meta))

    def with_recompute(self, groups: Sequence[int] | np.ndarray) -> "Strategy":
        """This strategy recomputing the forward activations of ``groups`` (and no other group's)."""
        return replace(self, recompute=tuple(int(g) for g in np.asarray(groups, dtype=np.int64).ravel()),
                       meta=dict(self.meta))

    def check_fits(self, graph: "OpGraph", cluster: "Cluster") -> None:
        """Refuse a strategy made for another graph or cluster, with a message naming both."""
        if self.graph_fingerprint != graph.fingerprint:
            raise StrategyError(f"strategy is for graph {self.graph_fingerprint}, not for graph "
                                f"{graph.name!r} ({graph.fingerprint})")
        if self.cluster_name != cluster.name or self.n_devices != cluster.n_devices:
            raise StrategyError(f"strategy is for cluster {self.cluster_name!r} ({self.n_devices} devices), "
                                f"not for {cluster.name!r} ({cluster.n_devices} devices)")
        if len(self.group_of) != graph.n_ops:
            raise StrategyError(f"strategy covers {len(self.group_of)} ops, graph has {graph.n_ops}")
        if self.batch_size != graph.batch_size:
            raise StrategyError(f"strategy is for batch {self.batch_size}, graph has batch {graph.batch_size}")

    def op_config(self, op: int) -> ParallelConfig:
        return self.configs[int(self.group_of[op])]

    def to_dict(self, configs: bool = True) -> dict:
        """The strategy file's fields (``configs=False``: without ``group_of`` and ``configs``)."""
        return {
            "format": "heterog-strategy", "version": STRATEGY_VERSION,
            "graph_fingerprint": self.graph_fingerprint, "cluster": self.cluster_name,
            "n_devices": self.n_devices, "batch_size": self.batch_size, "method": self.method,
            **({"group_of": self.group_of.tolist(), "configs": [c.to_dict() for c in self.configs]} if configs else {}),
            "priorities": None if self.priorities is None else np.asarray(self.priorities).tolist(),
            "meta": self.meta,
            "micro_batches": None if self.micro_batches is None else list(self.micro_batches),
            "schedule": self.schedule, "recompute": list(self.recompute),
            **({"sync_batch_stats": True} if self.sync_batch_stats else {}),
        }

    def plan_key(self) -> str:
        """What the plan is, without its name and notes (``method``, ``meta``): two strategies of one key compile
        to the same tasks, so they simulate alike."""
        objects = {id(c): c for c in self.configs}
        index = {c: i for i, c in enumerate(dict.fromkeys(objects.values()))}      # each config once, by value
        at = {i: index[c] for i, c in objects.items()}
        of_group = np.array([at[id(c)] for c in self.configs], dtype=np.int64)
        d = {**self.to_dict(configs=False), "configs": [c.to_dict() for c in index],   # groups' configs and ops
             "groups": hashlib.sha256(of_group.tobytes() + b"|" + self.group_of.tobytes()).hexdigest()}
        del d["method"], d["meta"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "Strategy":
        if not isinstance(d, dict) or d.get("format") != "heterog-strategy":
            raise StrategyError(f"{source}: not a heterog strategy file")
        version = d.get("version", 1)
        if version not in range(1, STRATEGY_VERSION + 1):
            raise StrategyError(f"{source}: strategy file version {version!r} is not one this version reads "
                                f"(1..{STRATEGY_VERSION})")
        try:
            pr = d.get("priorities")
            micro = d.get("micro_batches")              # version 1 files: one micro-batch
            recompute = tuple(int(g) for g in d.get("recompute", ()))   # version 1 and 2: none
            return cls(d["graph_fingerprint"], d["cluster"], int(d["n_devices"]), int(d["batch_size"]),
                       np.asarray(d["group_of"], dtype=np.int64),
                       [ParallelConfig.from_dict(c) for c in d["configs"]], d.get("method", ""),
                       None if pr is None else np.asarray(pr, dtype=np.float64), d.get("meta", {}),
                       None if micro is None else tuple(int(x) for x in micro), d.get("schedule", "1f1b"),
                       recompute, bool(d.get("sync_batch_stats", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise StrategyError(f"{source}: malformed strategy file ({type(exc).__name__}: {exc})") from None

    def save(self, path: str | Path) -> Path:
        from heterog.atomic import atomic_write_json

        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Strategy":
        from heterog.atomic import read_json_file

        return cls.from_dict(read_json_file(path, "strategy file", StrategyError), source=repr(str(path)))
