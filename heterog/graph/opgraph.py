"""OpGraph: the captured training step (forward + backward + optimizer update) as a DAG of ATen ops.

Every other part (grouping, cost model, compiler, agent features, runtime) reads this structure.
Ops are numbered 0..n-1 in a topological order; edges carry one tensor each.
"""
from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from heterog.errors import GraphError

FORMAT = "heterog-graph"
VERSION = 1

PHASES = ("forward", "backward", "update")
# an op that draws random values (dropout) draws them in blocks of this many consecutive samples, each from
# a generator of its own (heterog.runtime.rng): a replica draws the blocks its samples fall in
DRAW_BLOCK_SAMPLES = 8
# kind of an op: "compute" is a real ATen call; the others are graph inputs (zero cost).
#   param  - a model parameter (resident: param + grad + optimizer-state bytes live with it)
#   buffer - a non-trainable module buffer (resident)
#   state  - optimizer state tensor (momentum, Adam moments, step); resident, held by the param it serves
#   input  - a model input (batch on dim 0)
KINDS = ("compute", "param", "buffer", "state", "input")


@dataclass
class Op:
    """One node of the training graph (after fusion: an ATen op plus the zero-cost ops fused into it)."""

    name: str                         # unique; the fx node name of the main op
    target: str                       # "aten.mm.default", or "placeholder" for graph inputs
    kind: str = "compute"             # see KINDS
    phase: str = "forward"            # forward | backward | update
    output_shapes: list[list[int]] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    batch_dims: list[int | None] = field(default_factory=list)  # per output: batch dimension or None
    flops: float = 0.0                # at the graph's global batch size
    flops_estimated: bool = False     # True when no FLOP formula exists (bytes-based estimate used)
    bytes_read: int = 0               # bytes of all tensor inputs
    bytes_written: int = 0            # bytes of all outputs
    batch_bytes: int = 0              # the part of bytes_read + bytes_written that scales with batch
    param_bytes: int = 0              # resident parameter/buffer bytes (param/buffer kinds)
    grad_bytes: int = 0               # resident gradient bytes (param kind)
    state_bytes: int = 0              # resident optimizer-state bytes (param kind: its optimizer state)
    module_path: str = ""             # e.g. "encoder.layers.3.attn.q_proj"
    param: str | None = None          # parameter name: for param ops, their update ops and grad producers
    is_grad: bool = False             # output is a parameter gradient (allocated where made)
    fx_nodes: list[str] = field(default_factory=list)  # fx node names executed for this op, in order
    draws: bool = False               # draws random values (dropout), in blocks of DRAW_BLOCK_SAMPLES samples
    writes: str | None = None         # the placeholder (op name) whose next value this op's output is: the
                                      # step's new parameter or optimizer state (None: none; older files)
    coupled: bool = False             # couples the samples (a B x B similarity): runs once over the whole batch
                                      # (heterog.graph.coupling)

    @property
    def output_bytes(self) -> int:
        return int(self.bytes_written)

    @property
    def batch_dim(self) -> int | None:
        """Batch dimension of the first output (None if it carries no batch)."""
        return self.batch_dims[0] if self.batch_dims else None

    @property
    def is_placeholder(self) -> bool:
        return self.kind != "compute"


@dataclass
class Edge:
    """One tensor flowing from ``src`` to ``dst``."""

    src: int
    dst: int
    bytes: int
    batch_dim: int | None = None      # batch dimension of the tensor, None if it carries no batch
    src_output: int = 0               # which output of src


@dataclass
class OpGraph:
    """A training step as a DAG of ops. ``ops[i]`` is op ``i``; edges refer to op indices."""

    name: str
    batch_size: int
    ops: list[Op]
    edges: list[Edge]
    optimizer: str = "sgd"
    meta: dict = field(default_factory=dict)
    # per op, its split options beyond the batch (``heterog.graph.sharding.splits_to_json``'s form), or None
    # when the graph was not captured from a module (then no group of it can be split)
    splits: list[dict] | None = None
    # what the captured step assumes of every step's inputs (``heterog.graph.value_checks``): {"where", "code",
    # "holds"} per check of the model's own code that the trace took one side of
    assumptions: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        n = len(self.ops)
        if self.batch_size <= 0:
            raise GraphError(f"graph {self.name!r}: batch size must be positive, got {self.batch_size}")
        names = set()
        for i, op in enumerate(self.ops):
            if op.phase not in PHASES:
                raise GraphError(f"graph {self.name!r}: op {i} ({op.name}) has unknown phase {op.phase!r}")
            if op.kind not in KINDS:
                raise GraphError(f"graph {self.name!r}: op {i} ({op.name}) has unknown kind {op.kind!r}")
            if op.name in names:
                raise GraphError(f"graph {self.name!r}: duplicate op name {op.name!r}")
            names.add(op.name)
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n):
                raise GraphError(f"graph {self.name!r}: edge {e.src}->{e.dst} refers to a missing op (n={n})")
            if e.src == e.dst:
                raise GraphError(f"graph {self.name!r}: self-loop on op {e.src} ({self.ops[e.src].name})")
        self._check_acyclic()

    def _check_acyclic(self) -> None:
        n = len(self.ops)
        indeg = np.zeros(n, dtype=np.int64)
        for e in self.edges:
            indeg[e.dst] += 1
        succ: list[list[int]] = [[] for _ in range(n)]
        for e in self.edges:
            succ[e.src].append(e.dst)
        stack = [i for i in range(n) if indeg[i] == 0]
        seen = 0
        while stack:
            u = stack.pop()
            seen += 1
            for v in succ[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    stack.append(v)
        if seen != n:
            cyc = [self.ops[i].name for i in np.nonzero(indeg > 0)[0][:5]]
            raise GraphError(f"graph {self.name!r} has a cycle through ops {', '.join(cyc)} ...")

    # ------------------------------------------------------------------ derived arrays
    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @cached_property
    def edge_src(self) -> np.ndarray:
        return np.array([e.src for e in self.edges], dtype=np.int64)

    @cached_property
    def edge_dst(self) -> np.ndarray:
        return np.array([e.dst for e in self.edges], dtype=np.int64)

    @cached_property
    def edge_bytes(self) -> np.ndarray:
        return np.array([e.bytes for e in self.edges], dtype=np.float64)

    @cached_property
    def edge_has_batch(self) -> np.ndarray:
        return np.array([e.batch_dim is not None for e in self.edges], dtype=bool)

    @cached_property
    def flops(self) -> np.ndarray:
        return np.array([op.flops for op in self.ops], dtype=np.float64)

    @cached_property
    def bytes_total(self) -> np.ndarray:
        return np.array([op.bytes_read + op.bytes_written for op in self.ops], dtype=np.float64)

    @cached_property
    def bytes_batch(self) -> np.ndarray:
        return np.array([op.batch_bytes for op in self.ops], dtype=np.float64)

    @cached_property
    def is_compute(self) -> np.ndarray:
        return np.array([op.kind == "compute" for op in self.ops], dtype=bool)

    @cached_property
    def has_batch(self) -> np.ndarray:
        """Op works on batch-carrying tensors (input or output): it can be split along the batch."""
        hb = np.array([any(d is not None for d in op.batch_dims) for op in self.ops], dtype=bool)
        if len(self.edges):
            np.logical_or.at(hb, self.edge_dst[self.edge_has_batch], True)
        return hb

    @cached_property
    def coupled(self) -> np.ndarray:
        """Op couples the samples (``Op.coupled``): it runs once over the whole batch."""
        return np.array([op.coupled for op in self.ops], dtype=bool)

    @cached_property
    def draws_batch(self) -> np.ndarray:
        """Op draws random values for batch samples (a replica draws whole blocks: ``DRAW_BLOCK_SAMPLES``)."""
        return np.array([op.draws for op in self.ops], dtype=bool) & self.has_batch

    @cached_property
    def phase_index(self) -> np.ndarray:
        return np.array([PHASES.index(op.phase) for op in self.ops], dtype=np.int64)

    @cached_property
    def resident_bytes(self) -> np.ndarray:
        return np.array([op.param_bytes + op.grad_bytes + op.state_bytes for op in self.ops], dtype=np.float64)

    @cached_property
    def succ(self) -> list[list[int]]:
        s: list[list[int]] = [[] for _ in range(self.n_ops)]
        for e in self.edges:
            s[e.src].append(e.dst)
        return s

    @cached_property
    def pred(self) -> list[list[int]]:
        p: list[list[int]] = [[] for _ in range(self.n_ops)]
        for e in self.edges:
            p[e.dst].append(e.src)
        return p

    def topo_order(self) -> np.ndarray:
        """Ops in a topological order (ops are stored topologically after capture; checked here)."""
        order = np.arange(self.n_ops)
        if len(self.edges) and np.any(self.edge_src >= self.edge_dst):
            indeg = np.bincount(self.edge_dst, minlength=self.n_ops)
            stack = list(np.nonzero(indeg == 0)[0][::-1])
            out = []
            while stack:
                u = stack.pop()
                out.append(u)
                for v in self.succ[u]:
                    indeg[v] -= 1
                    if indeg[v] == 0:
                        stack.append(v)
            order = np.array(out, dtype=np.int64)
        return order

    # ------------------------------------------------------------------ summaries
    @property
    def param_count(self) -> int:
        """Number of trainable parameter elements (from param ops' shapes)."""
        total = 0
        for op in self.ops:
            if op.kind == "param":
                total += int(np.prod(op.output_shapes[0])) if op.output_shapes else 0
        return total

    def summary(self) -> dict:
        by_phase = {p: 0 for p in PHASES}
        flops_by_phase = {p: 0.0 for p in PHASES}
        for op in self.ops:
            if op.kind == "compute":
                by_phase[op.phase] += 1
                flops_by_phase[op.phase] += op.flops
        return {
            "name": self.name,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "ops": self.n_ops,
            "compute_ops": int(self.is_compute.sum()),
            "edges": len(self.edges),
            "ops_by_phase": by_phase,
            "gflops_by_phase": {k: v / 1e9 for k, v in flops_by_phase.items()},
            "params": self.param_count,
            "param_bytes": int(sum(op.param_bytes for op in self.ops if op.kind == "param")),
            "state_bytes": int(sum(op.state_bytes for op in self.ops)),
            "estimated_flop_ops": sorted({op.target for op in self.ops if op.flops_estimated}),
            "fingerprint": self.fingerprint,
        }

    # ------------------------------------------------------------------ identity and files
    @cached_property
    def fingerprint(self) -> str:
        """Content hash of the structure (names, targets, shapes, edges, batch size)."""
        h = hashlib.sha256()
        h.update(f"{self.batch_size}|{self.optimizer}|{self.n_ops}|{len(self.edges)}".encode())
        for op in self.ops:
            h.update(f"{op.name}|{op.target}|{op.phase}|{op.output_shapes}|{op.batch_dims}\n".encode())
        h.update(np.asarray([(e.src, e.dst) for e in self.edges], dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "meta": self.meta,
            "ops": [asdict(op) for op in self.ops],
            "edges": [[e.src, e.dst, e.bytes, e.batch_dim, e.src_output] for e in self.edges],
            "splits": self.splits,
            "assumptions": self.assumptions,
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "OpGraph":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise GraphError(f"{source}: not a heterog graph file (missing format {FORMAT!r})")
        if d.get("version") != VERSION:
            raise GraphError(f"{source}: graph format version {d.get('version')} is not supported (need {VERSION})")
        try:
            ops = [Op(**o) for o in d["ops"]]
            edges = [Edge(int(s), int(t), int(b), bd, int(so)) for s, t, b, bd, so in d["edges"]]
            return cls(name=d["name"], batch_size=int(d["batch_size"]), ops=ops, edges=edges,
                       optimizer=d.get("optimizer", "sgd"), meta=d.get("meta", {}), splits=d.get("splits"),
                       assumptions=list(d.get("assumptions", [])))
        except (KeyError, TypeError, ValueError) as exc:
            raise GraphError(f"{source}: malformed graph file ({type(exc).__name__}: {exc})") from None

    def save(self, path: str | Path) -> Path:
        from heterog.atomic import atomic_write_json

        return atomic_write_json(path, self.to_dict(), indent=None)


def load_graph(path: str | Path) -> OpGraph:
    """Read a graph file (JSON, optionally gzip). Raises GraphError naming the file if it is bad."""
    from heterog.atomic import read_json

    p = Path(path)
    if not p.exists():
        raise GraphError(f"graph file {str(p)!r} does not exist")
    try:
        d = read_json(p)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, OSError, zlib.error) as exc:
        raise GraphError(f"graph file {str(p)!r} is truncated or not JSON ({type(exc).__name__})") from None
    return OpGraph.from_dict(d, source=repr(str(p)))
