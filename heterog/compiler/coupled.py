"""Where the ops that couple samples run (``heterog.graph.coupling``): once over the whole batch.

A coupled op (a B x B similarity, a loss over all pairs) must see every sample at once. Under a config whose
every instance already does (one device, or a split beyond the batch over one group of devices, without
micro-batches) it stays where its group puts it. Otherwise it runs as one instance over the whole batch on
one device of its group's config, the one with the largest batch share (the first of them; the first device
of a split config): layout ``d`` of the ``LayoutTable``. Everything else follows from the layouts: the
pieces of the values it reads are gathered to that device by the ordinary re-layout (split, transfers,
concatenation), and the values it makes (the gradients of the embeddings in backward) are cut back to the
replicas the same way, so the cost of gathering is in the plan's tasks; it has no partial results (one
instance), and it is never recomputed. With several micro-batches it waits for every micro-batch's
forward, so a plan of such a graph runs 1F1B as GPipe (``heterog.compiler.micro``).
"""
from __future__ import annotations

import numpy as np

from heterog.compiler.context import CompileContext
from heterog.compiler.registries import ConfigTable


def gathering_device(configs: ConfigTable, cfg: int) -> int:
    """The device of config ``cfg`` that runs its group's coupled ops: the largest batch share, first of equals."""
    config = configs.configs[cfg]
    if config.split is not None:
        return int(config.devices[0])
    return int(config.devices[int(np.argmax(config.shares))])


def place_coupled(ctx: CompileContext, configs: ConfigTable, op_cfg: np.ndarray, op_lay: np.ndarray,
                  n_micro: int, op_shard: np.ndarray | None, out_split: np.ndarray | None) -> np.ndarray:
    """(n_ops,) the coupled ops moved to one device over the whole batch (module docstring); edits ``op_lay``
    (and ``op_shard``, ``out_split`` where the op was divided beyond the batch) in place."""
    coupled = ctx.graph.coupled & ctx.index.is_compute
    moved = np.zeros(len(op_lay), dtype=bool)
    if not coupled.any():
        return moved
    layouts, B = configs.layouts, ctx.batch_size
    for lid in np.unique(op_lay[coupled]).tolist():
        if n_micro == 1 and all(s == B for s in layouts.shares[lid]):
            continue                               # every instance holds the whole batch already
        moved |= coupled & (op_lay == lid)
    for cfg in np.unique(op_cfg[moved]).tolist():
        sel = moved & (op_cfg == cfg)
        op_lay[sel] = gathering_device(configs, cfg)     # layout d: device d alone, the whole batch
    if op_shard is not None and out_split is not None:
        op_shard[moved] = -1
        out_split[moved] = 0.0
    return moved
