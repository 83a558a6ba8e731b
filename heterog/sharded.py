"""Sharded data-parallel state (ZeRO stages 1-3, FSDP) and offloading it to the host (ZeRO-Offload) as a
plan choice: ``ShardedState``, the record a ``ParallelConfig`` carries, and ``state_weights``, the shard
weights of its replicas.

Semantics: docs/design.md, "Sharded state" and "Offloading". Stage 1 shards the optimizer state over the
group's replicas, stage 2 the gradients too (reduce-scatter instead of AllReduce), stage 3 the parameters
too (all-gathered before their use in forward and again in backward). Replica i holds ``weights[i] /
sum(weights)`` of every sharded tensor of the group. ``offload="optimizer"`` keeps each replica's part of
the optimizer state in its server's host memory and steps it on the host CPU; stage 0 (nothing sharded:
each replica offloads the whole state) and a config of one device (ZeRO-Offload on one GPU) exist only
with it. ``offload="parameters"`` (stage 3) keeps the parameter shards there too: copied up before each
gather, stepped and kept on the host (ZeRO-Infinity's parameter offload to CPU memory). The runtime runs
every stage and both offloads (``heterog.runtime.state_lowering``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterog.errors import StrategyError
from heterog.shares import split_weights

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster import Cluster

STAGES = (0, 1, 2, 3)
SHARD_BY = ("even", "memory", "speed")
# where each replica's part of the state lives: "none" on its GPU; "optimizer": the optimizer state (with
# the fp32 master parameters and gradients the host step needs) in host memory, stepped on the host CPU;
# "parameters": that and, at stage 3, the parameter shards too (copied up before each gather)
OFFLOADS = ("none", "optimizer", "parameters")


@dataclass(frozen=True)
class ShardedState:
    """ZeRO ``stage`` (0: nothing sharded, 1: optimizer state, 2: and gradients, 3: and parameters) with
    integer shard ``weights``, one per replica of the config that carries it, in its device order, and
    where the state lives (``offload``, one of ``OFFLOADS``; stage 0 needs an offload)."""

    stage: int
    weights: tuple[int, ...]
    offload: str = "none"

    def __post_init__(self) -> None:
        if int(self.stage) not in STAGES:
            raise StrategyError(f"sharded state stage {self.stage} is not one of {list(STAGES)}")
        if not self.weights or any(int(w) <= 0 for w in self.weights):
            raise StrategyError(f"sharded state needs a positive weight per replica, got {list(self.weights)}")
        if self.offload not in OFFLOADS:
            raise StrategyError(f"unknown offload {self.offload!r} (choose from {', '.join(OFFLOADS)})")
        if int(self.stage) == 0 and self.offload == "none":
            raise StrategyError("sharded state stage 0 shards nothing and offloads nothing: give an offload "
                                "('optimizer') or leave the config unsharded")
        if self.offload == "parameters" and int(self.stage) != 3:
            raise StrategyError(f"offloading parameters needs stage 3 (parameters in shards), got stage "
                                f"{self.stage}")

    @property
    def offloads(self) -> bool:
        """Whether any of the state lives in host memory."""
        return self.offload != "none"

    @property
    def fractions(self) -> np.ndarray:
        """(n,) each replica's part of every sharded tensor (the weights over their sum)."""
        w = np.asarray(self.weights, dtype=np.float64)
        return w / w.sum()

    def to_dict(self) -> dict:
        d: dict = {"stage": int(self.stage), "weights": [int(w) for w in self.weights]}
        if self.offloads:
            d["offload"] = self.offload
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ShardedState:
        return cls(int(d["stage"]), tuple(int(w) for w in d["weights"]), str(d.get("offload", "none")))


def state_weights(by: str, devices: Sequence[int], cluster: Cluster | None = None) -> tuple[int, ...]:
    """Shard weights of ``devices``: ``even`` (all 1), ``memory`` (in proportion to each device's memory)
    or ``speed`` (to its peak FLOP/s), as ``heterog.shares.split_weights`` gives split weights
    (thousandths by the largest remainder, each at least 1)."""
    if by not in SHARD_BY:
        raise StrategyError(f"unknown shard sizing {by!r} (choose from {SHARD_BY})")
    devs = [int(d) for d in devices]
    if by == "even":
        return (1,) * len(devs)
    if cluster is None:
        raise StrategyError(f"shards sized by {by} need the cluster")
    values = np.asarray(cluster.memory_bytes if by == "memory" else cluster.power, dtype=np.float64)[devs]
    return tuple(split_weights(values))

