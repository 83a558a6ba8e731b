"""Per-layer measured times in Metis' profile format, a cost source the cost model prefers to the roofline:
layer times keyed by (GPU type, micro-batch size, tensor-parallel degree), interpolated between entries.

Layout (as in Sailor's copy of Metis, ``sailor/Planner/baselines/Metis/profiles``)::

    <root>/<MODEL>/<GPU>/mbs{b}_tmp{t}.json

one file per GPU type, micro-batch size ``b`` and tensor-parallel degree ``t``. The fields, as Metis'
loader and cost estimator read them (``data_loader.py``, ``model/cost_estimator.py``):

  execution_time.layer_compute_total_ms  per layer, forward + backward of one micro-batch of ``b`` samples
                                         on each GPU of a ``t``-way tensor-parallel group (the layer's own
                                         tensor-parallel collectives included); Metis sums a stage's layers
                                         per micro-batch. Layers: 0 embeddings, 1..L blocks, L+1 head+loss.
  execution_time.forward_backward_time_ms  the step's forward + backward; minus the layers' sum is what
                                         Metis calls ``fb_sync`` (0 in every published file)
  execution_time.optimizer_time_ms       one optimizer step of the whole model on one GPU of the group
                                         (its 1/t shard); Metis' loader doubles it, we take it as measured
  execution_time.total_time_ms           forward_backward + batch_generator + optimizer
  execution_memory.layer_memory_total_mb per layer, MiB one GPU of the group holds for it
  model.parameters.parameters_per_layer_bytes  per layer, bytes of the GPU's parameters (4 per parameter:
                                         divided tensors / t, norms and row-parallel biases whole)
  model.parameters.activation_parameters_bytes per layer, bytes of its output activation (the boundary a
                                         pipeline stage sends; not divided by t)

The files give no forward/backward split: the cost model spreads a layer's time over the layer's ops in
proportion to their roofline times, so the split is the roofline's own.

Interpolation of a quantity q (a layer's time, the optimizer time, a layer's memory) at ``x`` samples per
micro-batch and tensor-parallel degree ``tp`` (any positive reals):
  1. for each measured degree t, piecewise linear in samples through the measured sizes b of that degree,
     extended beyond them by the line through the two nearest sizes; with a single size,
     q(b) * x / b (proportional);
  2. across the measured degrees, the same rule in 1/t: between two measured degrees
     q = a + c / tp through them, beyond them the curve through the two nearest; with a single degree,
     q(t) * t / tp. Results are clipped at 0. The optimizer time skips step 1 (its mean over sizes).

GPU names are Metis' ("A100-40"); ``heterog.cluster.catalog.sailor_type`` maps them to the catalog's type names.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from heterog.graph.opgraph import OpGraph

_FILE = re.compile(r"^mbs(\d+)_tmp(\d+)\.json$")
_MiB = float(1 << 20)


def _catalog_name(gpu: str) -> str | None:
    """The catalog type of a Metis GPU directory name, or None if the catalog has none."""
    from heterog.cluster.catalog import sailor_type
    from heterog.errors import ClusterError

    try:
        return sailor_type(gpu)
    except ClusterError:
        return None


class LayerProfileError(HeterogError):
    """A per-layer profile that cannot be read or does not fit the graph."""


@dataclass(frozen=True)
class LayerEntry:
    """One profile file: a GPU type at micro-batch size ``mbs`` and tensor-parallel degree ``tp``.

    Shapes: ``layer_s``, ``memory_bytes``, ``param_bytes``, ``activation_bytes`` (n_layers,).
    """

    mbs: int
    tp: int
    layer_s: np.ndarray            # forward + backward of one micro-batch, per GPU of the group
    optimizer_s: float             # one optimizer step on one GPU of the group
    fb_sync_s: float               # forward_backward - sum(layer_s)
    total_s: float
    memory_bytes: np.ndarray
    param_bytes: np.ndarray        # the GPU's shard
    activation_bytes: np.ndarray


def _read_entry(path: Path, mbs: int, tp: int) -> tuple[str, LayerEntry]:
    try:
        raw = json.loads(path.read_text())
        times = raw["execution_time"]
        params = raw["model"]["parameters"]
        layer_ms = np.asarray(times["layer_compute_total_ms"], dtype=np.float64)
        n = int(raw["model"]["num_layers"])
        entry = LayerEntry(
            mbs=mbs, tp=tp, layer_s=layer_ms * 1e-3, optimizer_s=float(times["optimizer_time_ms"]) * 1e-3,
            fb_sync_s=(float(times["forward_backward_time_ms"]) - float(layer_ms.sum())) * 1e-3,
            total_s=float(times["total_time_ms"]) * 1e-3,
            memory_bytes=np.asarray(raw["execution_memory"]["layer_memory_total_mb"], dtype=np.float64) * _MiB,
            param_bytes=np.asarray(params["parameters_per_layer_bytes"], dtype=np.float64),
            activation_bytes=np.asarray(params["activation_parameters_bytes"], dtype=np.float64))
        model = str(raw["model"]["model_name"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LayerProfileError(f"layer profile {path}: cannot read it ({type(e).__name__}: {e})") from None
    for name, arr in (("layer_compute_total_ms", entry.layer_s), ("layer_memory_total_mb", entry.memory_bytes),
                      ("parameters_per_layer_bytes", entry.param_bytes)):
        if arr.shape != (n,):
            raise LayerProfileError(f"layer profile {path}: {name} has {arr.size} values, num_layers is {n}")
    return model, entry


def interpolate(knots: np.ndarray, values: np.ndarray, u: float) -> np.ndarray:
    """Piecewise linear in ``u`` through ``(knots[k], values[k])`` (knots ascending, values (K, ...)),
    extended beyond the knots by the line through the two nearest; one knot: ``values[0] * u / knots[0]``."""
    if len(knots) == 1:
        return values[0] * (u / knots[0])
    k = int(np.clip(np.searchsorted(knots, u, side="right") - 1, 0, len(knots) - 2))
    w = (u - knots[k]) / (knots[k + 1] - knots[k])
    return values[k] + w * (values[k + 1] - values[k])


class LayerProfile:
    """Per-layer times of one model on several GPU types (module docstring).

    Args: ``model`` (its name in the files); ``entries`` (GPU, mbs, tp) -> LayerEntry, all with the same
    number of layers; ``aliases`` Metis GPU name -> catalog type name (default ``sailor_type`` of each).
    """

    def __init__(self, model: str, entries: Mapping[tuple[str, int, int], LayerEntry],
                 aliases: Mapping[str, str] | None = None) -> None:
        if not entries:
            raise LayerProfileError(f"layer profile of {model!r} has no entries")
        sizes = {e.layer_s.size for e in entries.values()}
        if len(sizes) != 1:
            raise LayerProfileError(f"layer profile of {model!r}: entries disagree on the number of layers "
                                    f"({sorted(sizes)})")
        self.model = model
        self.entries = dict(entries)
        self.num_layers = sizes.pop()
        self.aliases: dict[str, str | None] = (dict(aliases) if aliases is not None else
                                               {g: _catalog_name(g) for g, _, _ in entries})
        self._cache: dict[tuple[str, str, float, float], np.ndarray] = {}

    @classmethod
    def load(cls, directory: str | Path, model: str | None = None,
             aliases: Mapping[str, str] | None = None) -> LayerProfile:
        """The profile under ``directory/model`` (or ``directory`` itself when ``model`` is None): one
        folder per GPU type holding ``mbs{b}_tmp{t}.json`` files."""
        root = Path(directory) / model if model else Path(directory)
        if not root.is_dir():
            raise LayerProfileError(f"layer profile directory {root} does not exist")
        entries: dict[tuple[str, int, int], LayerEntry] = {}
        names: set[str] = set()
        for gpu_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            for f in sorted(gpu_dir.iterdir()):
                m = _FILE.match(f.name)
                if m:
                    name, entry = _read_entry(f, int(m.group(1)), int(m.group(2)))
                    names.add(name)
                    entries[gpu_dir.name, entry.mbs, entry.tp] = entry
        if not entries:
            raise LayerProfileError(f"layer profile directory {root} holds no <GPU>/mbs<b>_tmp<t>.json files")
        if len(names) > 1:
            raise LayerProfileError(f"layer profile directory {root} mixes models {sorted(names)}")
        return cls(model or names.pop(), entries, aliases)

    def __repr__(self) -> str:
        return f"LayerProfile({self.model!r}, {self.num_layers} layers, GPUs {list(self.gpus)})"

    @property
    def gpus(self) -> tuple[str, ...]:
        """The profiled GPU types (Metis names), sorted."""
        return tuple(sorted({g for g, _, _ in self.entries}))

    def gpu_for(self, type_name: str) -> str | None:
        """The profiled GPU a catalog device type stands for (its own name or an alias's), or None."""
        for gpu in self.gpus:
            if type_name == self.aliases.get(gpu, gpu):
                return gpu
        return None

    def _grid(self, gpu: str, what: str) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """Measured degrees (ascending) and, per degree, its sizes (ascending) and values (sizes, ...)."""
        if gpu not in self.gpus:
            raise LayerProfileError(f"layer profile of {self.model!r} has no GPU {gpu!r}; it has {list(self.gpus)}")
        keys = sorted((t, b) for g, b, t in self.entries if g == gpu)
        tps = np.array(sorted({t for t, _ in keys}), dtype=np.float64)
        per_tp = []
        for t in tps:
            bs = [b for tt, b in keys if tt == t]
            vals = np.array([getattr(self.entries[gpu, b, int(t)], what) for b in bs], dtype=np.float64)
            per_tp.append((np.array(bs, dtype=np.float64), vals))
        return tps, per_tp

    def _value(self, gpu: str, what: str, samples: float, tp: float) -> np.ndarray:
        key = (gpu, what, float(samples), float(tp))
        hit = self._cache.get(key)
        if hit is None:
            if not (samples > 0 and tp > 0):
                raise LayerProfileError(f"layer profile lookup needs samples > 0 and tp > 0, got {samples}, {tp}")
            tps, per_tp = self._grid(gpu, what)
            if what == "optimizer_s":      # no dependence on the micro-batch: the mean over measured sizes
                at_tp = np.array([vals.mean() for _, vals in per_tp])
            else:
                at_tp = np.array([interpolate(bs, vals, samples) for bs, vals in per_tp])
            # a + c / tp: linear in 1/tp, knots ascending in 1/tp
            hit = np.maximum(interpolate(1.0 / tps[::-1], at_tp[::-1], 1.0 / tp), 0.0)
            self._cache[key] = hit
        return hit

    def layer_times_s(self, gpu: str, samples: float, tp: float = 1.0) -> np.ndarray:
        """(num_layers,) seconds of each layer's forward + backward of one micro-batch of ``samples``
        samples, per GPU of a ``tp``-way group (interpolated: module docstring)."""
        return self._value(gpu, "layer_s", samples, tp)

    def optimizer_time_s(self, gpu: str, tp: float = 1.0) -> float:
        """Seconds of one optimizer step of the whole model on one GPU of a ``tp``-way group."""
        return float(self._value(gpu, "optimizer_s", 1.0, tp))

    def memory_bytes(self, gpu: str, samples: float, tp: float = 1.0) -> np.ndarray:
        """(num_layers,) bytes one GPU of a ``tp``-way group holds for each layer at ``samples`` per
        micro-batch (interpolated like the times)."""
        return self._value(gpu, "memory_bytes", samples, tp)


# ----------------------------------------------------------------------------------- graph units
LayerNumbering = Callable[["OpGraph"], tuple[np.ndarray, int]]


@dataclass(frozen=True)
class LayerUnits:
    """The units a graph's ops take their profiled time from: unit ``l < n_layers`` is layer ``l``
    (its forward and backward compute ops share the layer's time), unit ``n_layers + k`` the ``k``-th
    parameter (its update compute ops share ``param_share[k]`` of the optimizer time); -1: no unit (the
    roofline stays).

    Shapes: ``unit_of`` (n_ops,); ``unit_ptr`` (n_units + 1,), ``unit_ops`` (unit_ptr[-1],): each unit's
    ops (CSR); ``param_share`` (n_units - n_layers,).
    """

    unit_of: np.ndarray
    unit_ptr: np.ndarray
    unit_ops: np.ndarray
    n_layers: int
    param_share: np.ndarray


def layer_units(graph: OpGraph, numbering: LayerNumbering, profile: LayerProfile) -> LayerUnits:
    """The graph's units under ``profile``, its layers numbered by ``numbering`` (0 embeddings, 1..L
    blocks, L+1 head); LayerProfileError if L + 2 is not the profile's number of layers."""
    layer_of, n_blocks = numbering(graph)
    if n_blocks + 2 != profile.num_layers:
        raise LayerProfileError(f"graph {graph.name!r} has {n_blocks} blocks ({n_blocks + 2} layers with the "
                                f"embeddings and the head), the layer profile of {profile.model!r} has "
                                f"{profile.num_layers} layers")
    n_layers = profile.num_layers
    compute = np.array([op.kind == "compute" for op in graph.ops], dtype=bool)
    phase = np.array([op.phase for op in graph.ops])
    unit_of = np.where(compute & (phase != "update"), np.asarray(layer_of, dtype=np.int64), -1)
    param_bytes = {op.param or op.name: float(op.param_bytes) for op in graph.ops if op.kind == "param"}
    updated = sorted({op.param for op in graph.ops
                      if op.kind == "compute" and op.phase == "update" and op.param in param_bytes})
    index = {p: k for k, p in enumerate(updated)}
    for i, op in enumerate(graph.ops):
        if compute[i] and op.phase == "update" and op.param in index:
            unit_of[i] = n_layers + index[op.param]
    sizes = np.array([param_bytes[p] for p in updated], dtype=np.float64)
    share = sizes / sizes.sum() if sizes.sum() > 0 else np.full(len(sizes), 1.0 / max(len(sizes), 1))
    n_units = n_layers + len(updated)
    member = np.nonzero(unit_of >= 0)[0]
    order = member[np.argsort(unit_of[member], kind="stable")]
    ptr = np.concatenate([[0], np.cumsum(np.bincount(unit_of[member], minlength=n_units))]).astype(np.int64)
    return LayerUnits(unit_of, ptr, order.astype(np.int64), n_layers, share)


def source_summary(type_names: Sequence[str], profiled: np.ndarray, ops: np.ndarray, devices: np.ndarray,
                   seconds: np.ndarray) -> dict[str, dict[str, dict[str, float]]]:
    """Per device type, per source ("profile", "roofline"): distinct ops, op instances (tasks) and their
    seconds. ``profiled`` (n_ops, M) says which op on which device takes a profiled time; ``ops``,
    ``devices``, ``seconds`` (K,) are the instances (compute tasks) counted."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    src = profiled[ops, devices]
    for t in sorted(set(type_names)):
        on_t = np.isin(devices, [d for d, n in enumerate(type_names) if n == t])
        out[t] = {}
        for name, mask in (("profile", on_t & src), ("roofline", on_t & ~src)):
            out[t][name] = {"ops": float(len(np.unique(ops[mask]))), "tasks": float(mask.sum()),
                            "seconds": float(seconds[mask].sum())}
    return out
