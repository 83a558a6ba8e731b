"""Expert model parallelism (the "Expert" of the Pesto paper): contiguous layers by module path, balanced
by cost over the devices; plus the helpers the placement planners (DPOS, Pesto) share."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from heterog.errors import HeterogError
from heterog.graph.grouping import attach_params_to_grads, units_on_groups
from heterog.strategy import ParallelConfig, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph

_INDEX = re.compile(r"^\d+$")


# ----------------------------------------------------------------------------- shared placement helpers
def param_units(graph: OpGraph) -> np.ndarray:
    """(n_ops,) unit id per op: every op is its own unit, except that parameter and optimizer-state
    placeholders and update ops join the unit of their parameter's gradient producer (they must share a
    device). Ids are op indices of a representative (not contiguous)."""
    return attach_params_to_grads(graph, np.arange(graph.n_ops, dtype=np.int64))


def op_memory_bytes(graph: OpGraph, fraction: float | np.ndarray = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Memory an op puts on its device when it processes ``fraction`` of the batch, split into what
    stays for most of the iteration and what is transient.

    Returns ``(held_bytes, transient_bytes)``, both (n_ops,): held = resident parameter, gradient and
    optimizer-state bytes plus the outputs of forward ops that a backward or update op reads
    (activations kept for the backward pass); transient = every other output (freed after its last,
    nearby consumer). A device's estimated peak is sum(held) + max(transient) over its ops (allocation
    sizes follow the compiler's accounting).
    """
    from heterog.compiler.compile import graph_index

    gi = graph_index(graph)
    # gradients count as held (``graph.resident_bytes`` has them): the simulator allocates each where it is
    # made, but an order that runs the updates last holds them all together
    alloc = np.where(gi.is_grad, 0.0, gi.out_fixed_bytes + gi.out_batch_bytes * fraction)
    kept = np.zeros(graph.n_ops, dtype=bool)
    if len(graph.edges):
        late = graph.phase_index[graph.edge_dst] > 0
        kept[graph.edge_src[late]] = True
    kept &= graph.phase_index == 0
    return graph.resident_bytes + np.where(kept, alloc, 0.0), np.where(kept, 0.0, alloc)


def group_strategy(ev: PlanEvaluator, group_of: np.ndarray,
                   config_of: Mapping[int, ParallelConfig] | Sequence[ParallelConfig], *,
                   priorities: np.ndarray | None = None, meta: dict[str, Any] | None = None) -> Strategy:
    """A Strategy with group ``g`` running under ``config_of[g]``, on the evaluator's groups: where one of
    ``ev.group_of``'s groups spans several of the given groups, all its ops join the one holding most of
    its op time (``units_on_groups``), so that every plan a planner builds here is one the agent's plan
    actions hold (one action per evaluator group).

    Args:
        group_of: (n_ops,) group id per op (any ids; renumbered 0..G-1 in order of first appearance).
        config_of: ParallelConfig per given group id (a mapping, or a sequence indexed by the ids).
        priorities: (n_ops,) execution order to export (higher runs first), or None.
    """
    graph, cluster = ev.graph, ev.cluster
    group_of = units_on_groups(group_of, ev.group_of, ev.cost.full_batch_times(graph).mean(axis=1))
    _, first = np.unique(group_of, return_index=True)
    ids = group_of[np.sort(first)]
    remap = {int(g): k for k, g in enumerate(ids.tolist())}
    configs = [config_of[int(g)] for g in ids.tolist()]
    new_group = np.fromiter((remap[int(g)] for g in group_of.tolist()), dtype=np.int64, count=len(group_of))
    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, graph.batch_size, new_group, configs,
                    priorities=None if priorities is None else np.asarray(priorities, dtype=np.float64),
                    meta=dict(meta or {}))


def mp_strategy(ev: PlanEvaluator, group_of: np.ndarray, group_device: np.ndarray | Sequence[int], *,
                priorities: np.ndarray | None = None, meta: dict[str, Any] | None = None,
                micro_batches: int = 1) -> Strategy:
    """A model-parallel Strategy: group ``g`` runs on device ``group_device[g]`` with the whole batch,
    over ``micro_batches`` even micro-batches."""
    batch = ev.graph.batch_size
    single = {d: ParallelConfig.single(d, batch) for d in range(ev.cluster.n_devices)}
    config_of = {int(g): single[int(group_device[int(g)])] for g in np.unique(group_of).tolist()}
    return group_strategy(ev, group_of, config_of, priorities=priorities, meta=meta).with_micro_batches(micro_batches)


def order_priorities(order: np.ndarray, n_ops: int) -> np.ndarray:
    """Priorities (higher first) that make ops run in ``order`` (a permutation of 0..n_ops-1)."""
    prio = np.empty(n_ops, dtype=np.float64)
    prio[np.asarray(order, dtype=np.int64)] = np.arange(n_ops, 0, -1, dtype=np.float64)
    return prio


# ----------------------------------------------------------------------------- layers
def layer_key(module_path: str) -> str:
    """``"encoder.layers.3.attn.q"`` -> ``"encoder.layers.3"``; ``"classifier.0"`` -> ``"classifier.0"``;
    ``"pooler.dense"`` -> ``"pooler"``; ``""`` -> ``""`` (no module)."""
    if not module_path:
        return ""
    parts = module_path.split(".")
    for i, p in enumerate(parts):
        if _INDEX.match(p):
            return ".".join(parts[:i + 1])
    return parts[0]


def _unit_keys(graph: OpGraph, key_of: Callable[[str], str]) -> list[str]:
    """``key_of(module_path)`` per op; ops without a module path take the key of the nearest op they are
    connected to (predecessors first, in topological order; then successors); parameters, their state
    and updates take their gradient's key."""
    keys = [key_of(op.module_path) for op in graph.ops]
    order = graph.topo_order()
    for neighbours, seq in ((graph.pred, order), (graph.succ, order[::-1])):
        for i in seq.tolist():
            if not keys[i]:
                keys[i] = next((keys[j] for j in neighbours[i] if keys[j]), "")
    keys = [k or "(graph)" for k in keys]
    units = param_units(graph)
    for i in range(graph.n_ops):                      # a parameter's unit lives with its gradient's layer
        if units[i] != i:
            keys[i] = keys[int(units[i])]
    return keys


def _first_forward(graph: OpGraph, keys: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per key, (0 if a forward compute op has it else 1, topological position of its first such op)."""
    pos = np.empty(graph.n_ops, dtype=np.int64)
    pos[graph.topo_order()] = np.arange(graph.n_ops)
    first: dict[str, tuple[int, int]] = {}
    for i, k in enumerate(keys):
        rank = (0 if graph.ops[i].phase == "forward" and graph.ops[i].kind == "compute" else 1, int(pos[i]))
        if k not in first or rank < first[k]:
            first[k] = rank
    return first


def _sibling_keys(prefix: str) -> Callable[[str], str]:
    """``layer_key``, except that a module beside the repeated blocks keeps its own name: with blocks under
    ``model.decoder.layers``, ``model.decoder.embed_tokens`` and ``model.decoder.final_layer_norm`` are two
    layers, not one ``model`` (a Hugging Face model nests every module under its backbone's)."""
    parent = prefix.rpartition(".")[0]
    if not parent:
        return layer_key
    depth = len(parent.split(".")) + 1

    def key_of(path: str) -> str:
        parts = path.split(".")
        if any(_INDEX.match(p) for p in parts):
            return layer_key(path)
        if path.startswith(parent + "."):
            return ".".join(parts[:depth])
        if path and (parent + ".").startswith(path + "."):      # the backbone's own ops (masks, positions)
            return path
        return layer_key(path)

    return key_of


def op_layers(graph: OpGraph) -> tuple[np.ndarray, list[str]]:
    """Layer index per op, layers numbered in forward order (first forward op of the layer); modules beside
    the repeated blocks are layers of their own (``_sibling_keys``).

    Ops without a module path take the layer of the nearest op they are connected to (predecessors
    first, in topological order; then successors); parameters, their state and updates follow their
    gradient's unit. Returns ``(layer_of (n_ops,), layer names)``.
    """
    keys = _unit_keys(graph, _sibling_keys(block_prefix(graph)))
    first = _first_forward(graph, keys)
    names = sorted(first, key=lambda k: first[k])
    index = {k: j for j, k in enumerate(names)}
    return np.array([index[k] for k in keys], dtype=np.int64), names


def block_prefix(graph: OpGraph) -> str:
    """The module list of the model's repeated blocks: the path ``P`` whose children ``P.0, P.1, ...`` are
    the most numerous (``"model.decoder.layers"`` in a Hugging Face OPT, ``"transformer.h"`` in GPT-Neo);
    ``""`` when no module path has an index."""
    counts: dict[str, set[str]] = {}
    for op in graph.ops:
        parts = op.module_path.split(".") if op.module_path else []
        for k, part in enumerate(parts):
            if _INDEX.match(part):
                counts.setdefault(".".join(parts[:k]), set()).add(part)
    return max(counts, key=lambda p: (len(counts[p]), -len(p)), default="")


def block_layers(graph: OpGraph) -> tuple[np.ndarray, int]:
    """Layer per op in the numbering of per-layer planners and profiles (Metis, Sailor, Megatron's
    pipeline stages): 0 is everything the forward pass runs before the first repeated block (the
    embeddings), ``1 .. L`` the blocks in index order, ``L + 1`` everything after the last (final norm,
    head, loss). Backward and update ops take their forward layer (``op_layers``' rules for ops without a
    module path). Returns ``(layer_of (n_ops,), L)``; a graph without repeated blocks is refused.
    """
    prefix = block_prefix(graph)
    if not prefix:
        raise HeterogError(f"graph {graph.name!r} has no repeated blocks (no module path with an index), so it "
                           f"has no per-layer numbering")
    depth = len(prefix.split("."))

    def key_of(path: str) -> str:
        if not path:
            return ""
        parts = path.split(".")
        if ".".join(parts[:depth]) == prefix and len(parts) > depth:
            return f"#{int(parts[depth])}"
        return path

    keys = _unit_keys(graph, key_of)
    blocks = sorted({int(k[1:]) for k in keys if k.startswith("#")})
    index = {b: j + 1 for j, b in enumerate(blocks)}
    first = _first_forward(graph, keys)
    start = min(first[f"#{b}"] for b in blocks)
    layer = [index[int(k[1:])] if k.startswith("#") else (0 if first[k] < start else len(blocks) + 1) for k in keys]
    return np.array(layer, dtype=np.int64), len(blocks)


def balanced_partition(layer_cost: np.ndarray, layer_mem: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Split layers 0..L-1 into contiguous segments, segment k on device k (devices in index order, a
    segment may be empty), minimising the largest per-device time ``sum(layer_cost[seg, k])`` subject to
    ``sum(layer_mem[seg]) <= capacity[k]``. Without a feasible split the memory limit is dropped.

    Args: layer_cost (L, M) seconds of each layer on each device; layer_mem (L,) bytes; capacity (M,).
    Returns: (L,) device per layer.
    """
    L, M = layer_cost.shape
    for limit in (np.asarray(capacity, dtype=np.float64), np.full(M, np.inf)):
        cum_t = np.vstack([np.zeros((1, M)), np.cumsum(layer_cost, axis=0)])       # (L+1, M)
        cum_m = np.concatenate([[0.0], np.cumsum(layer_mem)])
        # best[k][j]: min makespan placing layers [0, j) on devices 0..k; arg: start of device k's segment
        best = np.full((M, L + 1), np.inf)
        arg = np.zeros((M, L + 1), dtype=np.int64)
        for k in range(M):
            for j in range(L + 1):
                i = np.arange(j + 1)                                 # device k takes layers [i, j)
                seg_t = cum_t[j, k] - cum_t[i, k]
                ok = cum_m[j] - cum_m[i] <= limit[k]
                prev = np.where(i == 0, 0.0, np.inf) if k == 0 else best[k - 1, :j + 1]
                val = np.where(ok, np.maximum(prev, seg_t), np.inf)
                arg[k, j] = int(np.argmin(val))                      # ties: the earliest start
                best[k, j] = val[arg[k, j]]
        if np.isfinite(best[M - 1, L]):
            device = np.empty(L, dtype=np.int64)
            j = L
            for k in range(M - 1, -1, -1):
                first = int(arg[k, j])                               # device k's segment: layers [first, j)
                device[first:j] = k
                j = first
            return device
    raise AssertionError("unreachable: without a memory limit every split is feasible")


def expert(ev: PlanEvaluator) -> Strategy:
    """Layer-wise model parallelism: contiguous layers in forward order, one segment per device (device
    index order keeps neighbouring segments on the same server), balanced by each device's own time for
    the layers and within each device's memory where possible."""
    graph, cluster = ev.graph, ev.cluster
    layer_of, names = op_layers(graph)
    times = ev.cost.full_batch_times(graph)                                     # (n_ops, M)
    L = len(names)
    layer_cost = np.zeros((L, cluster.n_devices))
    np.add.at(layer_cost, layer_of, times)
    held, transient = op_memory_bytes(graph)
    layer_mem = np.bincount(layer_of, weights=held, minlength=L)
    device_of_layer = balanced_partition(layer_cost, layer_mem, cluster.memory_bytes - transient.max(initial=0.0))
    return mp_strategy(ev, layer_of, device_of_layer,
                       meta={"layers": names, "device_of_layer": device_of_layer.tolist()})
