"""Profile tables: measured op times per (device type, op signature) and link alpha-beta fits,
which override the roofline and nominal link speeds in the cost model where present.

File format (JSON, written atomically)::

    {"format": "heterog-profile", "version": 1,
     "ops":   {device_type: {signature: [a_s, b_s_per_sample]}},   # t = a + b * samples
     "op_points": {device_type: {signature: [[samples...], [seconds...]]}},   # optional, see below
     "links": {link_name_or_kind: [alpha_s, beta_s_per_byte]},      # t = alpha + beta * bytes
     "link_latency": {link_name_or_kind: [latency_s, s_per_byte]},   # optional, see below
     "collectives": {"allreduce:<dev>,<dev>,...": [alpha_s, beta_s_per_byte]}}   # optional; t as links

``op_points`` keeps the measured op times themselves (one median per local batch size, sizes
increasing); where an op has them, the cost model interpolates between them (piecewise linear, the end
segments extended beyond the measured sizes) instead of using the line of ``ops``, because an op's time
is not linear in the batch on every device (docs/results.md, "Simulator fidelity"). ``ops`` still holds
the least-squares line for every entry.

``links`` is how long a message holds the link (its occupancy: what back-to-back messages on the
link pay each); ``link_latency`` is the further delay ``latency_s + s_per_byte * bytes`` until the
message is at the receiver, which does not hold the link (messages in flight overlap it, as the
receiver's copy of one message overlaps the next one's transfer). A file without ``link_latency`` puts
all of a message's time in the occupancy, as ``alpha + beta * bytes``. The profiler measures occupancy
by streaming messages one way and the latency as a ping-pong's one-way time less the occupancy
(charging a whole ping-pong to each message in turn over-predicts a PS step's pushes and pulls;
docs/results.md, "Simulator fidelity").

A collective's key names its device set (device names, sorted, comma-separated; see
``collective_key``), since what one AllReduce costs depends on who takes part, not on one link.
"""
from __future__ import annotations

import copy
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from heterog.atomic import atomic_write_json, read_json
from heterog.errors import HeterogError
from heterog.graph.opgraph import Op

FORMAT = "heterog-profile"
VERSION = 1


def _shape_text(shape: Sequence[int], batch_dim: int | None) -> str:
    dims = ["B" if i == batch_dim else str(int(s)) for i, s in enumerate(shape)]
    return "x".join(dims) if dims else "scalar"


def op_signature(op: Op) -> str:
    """A stable key for "the same op" across batch sizes and graphs.

    ``target|shape:dtype;...|w=<bytes>``: the ATen target, each output's shape with its batch
    dimension written ``B`` and its dtype, and the op's batch-independent bytes (inputs + outputs
    that carry no batch, i.e. weights). The last part tells apart ops whose outputs agree but whose
    weights do not (a 1024->1024 and a 4096->1024 projection both output ``Bx1024``).
    """
    outputs = []
    for k, shape in enumerate(op.output_shapes):
        batch_dim = op.batch_dims[k] if k < len(op.batch_dims) else None
        dtype = op.output_dtypes[k] if k < len(op.output_dtypes) else "?"
        outputs.append(f"{_shape_text(shape, batch_dim)}:{str(dtype).removeprefix('torch.')}")
    fixed_bytes = int(op.bytes_read + op.bytes_written - op.batch_bytes)
    return f"{op.target}|{';'.join(outputs)}|w={fixed_bytes}"


def collective_key(kind: str, device_names: Sequence[str]) -> str:
    """Key of a measured collective: ``"allreduce:a,b"`` for an AllReduce over devices named a and b."""
    return f"{kind}:{','.join(sorted(set(device_names)))}"


def fit_linear(xs: Sequence[float] | np.ndarray, ys: Sequence[float] | np.ndarray, *,
               relative: bool = False) -> tuple[float, float]:
    """Least-squares ``y = a + b * x``; returns (a, b). With one distinct x, b = 0 and a = mean(y).

    ``relative``: minimise relative instead of absolute errors (each row weighted by 1 / y), for
    measurements over sizes that span orders of magnitude, where the largest would otherwise decide."""
    x = np.asarray(xs, dtype=np.float64).ravel()
    y = np.asarray(ys, dtype=np.float64).ravel()
    if x.size != y.size:
        raise ValueError(f"fit_linear: {x.size} x values but {y.size} y values")
    if x.size == 0:
        raise ValueError("fit_linear: no measurements")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("fit_linear: measurements must be finite")
    if np.ptp(x) == 0:
        return float(y.mean()), 0.0
    design = np.stack([np.ones_like(x), x], axis=1)
    if relative:
        if np.any(y <= 0):
            raise ValueError("fit_linear: relative fit needs positive measurements")
        design, y = design / y[:, None], np.ones_like(y)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    return float(a), float(b)


def _points(samples: Sequence[float], seconds: Sequence[float], where: str
            ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Validated measured points: equal lengths, at least one, finite, sizes strictly increasing."""
    xs, ys = tuple(float(x) for x in samples), tuple(float(y) for y in seconds)
    if not xs or len(xs) != len(ys):
        raise HeterogError(f"{where}: need as many times as sizes, at least one ({len(xs)} sizes, {len(ys)} times)")
    if not all(math.isfinite(v) for v in xs + ys):
        raise HeterogError(f"{where}: sizes and times must be finite")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise HeterogError(f"{where}: sizes must increase strictly, got {list(xs)}")
    return xs, ys


def segments(samples: Sequence[float], seconds: Sequence[float]
             ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """The piecewise-linear function through measured points as ``(breaks, a, b)``: segment k holds
    ``t = a[k] + b[k] * x`` for ``breaks[k-1] <= x < breaks[k]`` (the first and last segments extend to
    -inf and +inf), with ``len(breaks) == len(a) - 1``. One point gives the constant ``t = seconds[0]``."""
    xs, ys = samples, seconds
    if len(xs) == 1:
        return (), (float(ys[0]),), (0.0,)
    b = [(ys[k + 1] - ys[k]) / (xs[k + 1] - xs[k]) for k in range(len(xs) - 1)]
    a = [ys[k] - b[k] * xs[k] for k in range(len(xs) - 1)]
    return tuple(float(x) for x in xs[1:-1]), tuple(a), tuple(b)


def _pair(value: Any, where: str) -> tuple[float, float]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       for v in value)):
        raise HeterogError(f"{where}: expected [intercept, slope] (two finite numbers), got {value!r}")
    return float(value[0]), float(value[1])


@dataclass
class ProfileTable:
    """Measured costs. ``ops[device_type][signature] = (a_s, b_s_per_sample)``;
    ``op_points[device_type][signature] = (samples, seconds)`` (the measurements behind the line, optional);
    ``links[name_or_kind] = (alpha_s, beta_s_per_byte)`` (occupancy);
    ``link_latency[name_or_kind] = (latency_s, s_per_byte)`` (in flight, not holding the link; optional);
    ``collectives[collective_key(kind, device names)] = (alpha_s, beta_s_per_byte)``."""

    ops: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    op_points: dict[str, dict[str, tuple[tuple[float, ...], tuple[float, ...]]]] = field(default_factory=dict)
    link_latency: dict[str, tuple[float, float]] = field(default_factory=dict)

    # ------------------------------------------------------------------ lookups
    def op_entry(self, device_type: str, signature: str) -> tuple[float, float] | None:
        return self.ops.get(device_type, {}).get(signature)

    def op_segments(self, device_type: str, signature: str, *, points: bool = True
                    ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None:
        """``(breaks, a, b)`` of the op's time against samples (see ``segments``): through the measured
        points where there are some and ``points``, else the line of ``ops`` (one segment); None if absent."""
        measured = self.op_points.get(device_type, {}).get(signature) if points else None
        if measured is not None:
            return segments(*measured)
        line = self.op_entry(device_type, signature)
        return None if line is None else ((), (line[0],), (line[1],))

    def link_entry(self, name: str) -> tuple[float, float] | None:
        return self.links.get(name)

    def link_latency_entry(self, name: str) -> tuple[float, float] | None:
        return self.link_latency.get(name)

    def collective_entry(self, kind: str, device_names: Sequence[str]) -> tuple[float, float] | None:
        return self.collectives.get(collective_key(kind, device_names))

    def __len__(self) -> int:
        return sum(len(v) for v in self.ops.values()) + len(self.links) + len(self.collectives)

    # ------------------------------------------------------------------ measurements
    def set_op(self, device_type: str, signature: str, a_s: float, b_s_per_sample: float) -> None:
        """Set the op's line; measured points of an earlier entry, which would override it, are dropped."""
        self.ops.setdefault(device_type, {})[signature] = (float(a_s), float(b_s_per_sample))
        self.op_points.get(device_type, {}).pop(signature, None)

    def set_op_points(self, device_type: str, signature: str, samples: Sequence[float],
                      seconds: Sequence[float]) -> None:
        self.op_points.setdefault(device_type, {})[signature] = _points(
            samples, seconds, f"op points of {signature!r} on {device_type!r}")

    def add_op(self, device_type: str, signature: str, batch_sizes: Sequence[float],
               times_s: Sequence[float]) -> tuple[float, float]:
        """Store measurements (one time per batch size, sizes increasing) as points and their
        least-squares line ``t = a + b * batch_size``; return (a, b)."""
        a, b = fit_linear(batch_sizes, times_s)
        self.set_op(device_type, signature, a, b)
        self.set_op_points(device_type, signature, batch_sizes, times_s)
        return a, b

    def set_link(self, name: str, alpha_s: float, beta_s_per_byte: float, latency_s: float | None = None,
                 latency_s_per_byte: float = 0.0) -> None:
        """The link's occupancy ``alpha + beta * bytes`` and, if given, its latency in flight
        ``latency_s + latency_s_per_byte * bytes`` (both finite and >= 0)."""
        self.links[name] = (float(alpha_s), float(beta_s_per_byte))
        if latency_s is not None:
            if not all(math.isfinite(v) and v >= 0 for v in (latency_s, latency_s_per_byte)):
                raise HeterogError(f"link {name!r}: latency must be finite and >= 0, got "
                                   f"{latency_s!r} s + {latency_s_per_byte!r} s/B")
            self.link_latency[name] = (float(latency_s), float(latency_s_per_byte))

    def add_link(self, name: str, sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
        """Fit ``t = alpha + beta * bytes`` for a link name (or kind), store and return (alpha, beta)."""
        alpha, beta = fit_linear(sizes_bytes, times_s)
        self.set_link(name, alpha, beta)
        return alpha, beta

    def add_collective(self, kind: str, device_names: Sequence[str], sizes_bytes: Sequence[float],
                       times_s: Sequence[float]) -> tuple[float, float]:
        """Fit ``t = alpha + beta * bytes`` (relative errors, see ``fit_linear``) for a collective over a
        device set, store and return it."""
        alpha, beta = fit_linear(sizes_bytes, times_s, relative=True)
        self.collectives[collective_key(kind, device_names)] = (float(alpha), float(beta))
        return alpha, beta

    def copy(self) -> ProfileTable:
        return ProfileTable(copy.deepcopy(self.ops), dict(self.links), dict(self.collectives),
                            copy.deepcopy(self.op_points), dict(self.link_latency))

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION,
                "ops": {t: {s: list(v) for s, v in sigs.items()} for t, sigs in self.ops.items()},
                "op_points": {t: {s: [list(x), list(y)] for s, (x, y) in sigs.items()}
                              for t, sigs in self.op_points.items()},
                "links": {n: list(v) for n, v in self.links.items()},
                "link_latency": {n: list(v) for n, v in self.link_latency.items()},
                "collectives": {n: list(v) for n, v in self.collectives.items()}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> ProfileTable:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise HeterogError(f"{source}: not a heterog profile (missing format {FORMAT!r})")
        if d.get("version") != VERSION:
            raise HeterogError(f"{source}: profile version {d.get('version')} is not supported (need {VERSION})")
        ops_d, links_d, coll_d = d.get("ops", {}), d.get("links", {}), d.get("collectives", {})
        if not isinstance(ops_d, dict) or not all(isinstance(v, dict) for v in ops_d.values()):
            raise HeterogError(f"{source}: 'ops' must map device type -> {{signature: [a, b]}}")
        if not isinstance(links_d, dict):
            raise HeterogError(f"{source}: 'links' must map link name -> [alpha, beta]")
        ops = {t: {s: _pair(v, f"{source}: ops[{t!r}][{s!r}]") for s, v in sigs.items()}
               for t, sigs in ops_d.items()}
        if not isinstance(coll_d, dict):
            raise HeterogError(f"{source}: 'collectives' must map 'kind:devices' -> [alpha, beta]")
        links = {n: _pair(v, f"{source}: links[{n!r}]") for n, v in links_d.items()}
        colls = {n: _pair(v, f"{source}: collectives[{n!r}]") for n, v in coll_d.items()}
        points_d = d.get("op_points", {})
        if not isinstance(points_d, dict) or not all(isinstance(v, dict) for v in points_d.values()):
            raise HeterogError(f"{source}: 'op_points' must map device type -> {{signature: [[sizes], [times]]}}")
        points: dict[str, dict[str, tuple[tuple[float, ...], tuple[float, ...]]]] = {}
        for t, sigs in points_d.items():
            for sig, v in sigs.items():
                where = f"{source}: op_points[{t!r}][{sig!r}]"
                if (not isinstance(v, (list, tuple)) or len(v) != 2
                        or not all(isinstance(c, (list, tuple)) for c in v)
                        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for c in v for x in c)):
                    raise HeterogError(f"{where}: expected [[sizes], [times]] (two lists of numbers), got {v!r}")
                points.setdefault(t, {})[sig] = _points(v[0], v[1], where)
        lat_d = d.get("link_latency", {})
        if not isinstance(lat_d, dict):
            raise HeterogError(f"{source}: 'link_latency' must map link name -> [seconds, seconds per byte]")
        latency = {}
        for n, v in lat_d.items():
            pair = _pair(v, f"{source}: link_latency[{n!r}]")
            if min(pair) < 0:
                raise HeterogError(f"{source}: link_latency[{n!r}]: must not be negative, got {v!r}")
            latency[n] = pair
        return cls(ops, links, colls, points, latency)

    @classmethod
    def load(cls, path: str | Path) -> ProfileTable:
        p = Path(path)
        if not p.is_file():
            raise HeterogError(f"profile file {str(p)!r} does not exist")
        try:
            d = read_json(p)
        except (json.JSONDecodeError, UnicodeDecodeError, EOFError, OSError, zlib.error) as exc:
            raise HeterogError(f"profile file {str(p)!r} is truncated or not JSON ({type(exc).__name__})") from None
        return cls.from_dict(d, source=f"profile file {str(p)!r}")

    def save(self, path: str | Path) -> Path:
        """Write atomically (temporary file, then rename); gzip when the name ends in .gz."""
        return atomic_write_json(path, self.to_dict())
