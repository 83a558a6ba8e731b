"""Checkpoints of a training run in ``torch.distributed.checkpoint``'s (DCP) format: every rank writes the
parts of the state it holds under the plan, and the checkpoint loads under any other plan, cluster or in
one process.

A checkpoint directory ``D`` holds::

    D/step-N/                       a complete checkpoint: the state after N training steps
        .metadata, __<rank>_0.distcp    DCP's files: each rank's parts, one metadata file
        heterog-checkpoint.json         the marker, written last (``MARKER``)
    D/.tmp-step-N-<run id>/         a checkpoint being written; renamed to step-N once its marker is in
    D/.removing-step-N-<id>/        a checkpoint being pruned (renamed first, then its files removed)

so a checkpoint counts only once complete, and a crash at any point leaves every complete one whole.

Keys (the model's own names, as ``module.state_dict()`` and torch's optimizer state dicts name them):
``model.<name>`` for parameters and buffers, ``optimizer.state.<parameter>.<slot>`` for optimizer state
(``heterog.graph.optimizer.STATE_SLOTS``), and ``train.step``, ``train.data_position`` (the index of the
next batch) and ``train.rng_seed`` (random values are drawn from generators keyed by the run's seed, the
step, the fx node and the block of samples, ``heterog.runtime.rng``: the seed and the step are the streams'
whole state). The marker repeats the position, keeps the losses of every step so far, and names the model,
its keys with their shapes and dtypes, and the plan that wrote it.

The parts a rank holds (``Held``): whole tensors, or chunks of a tensor at offsets. A value divided under
``Shard(d, sf)`` is ``sf`` chunks along dimension ``d`` (``chunks_of``); any other layout of state whose
parts are blocks of the whole tensor (rows of a sharded optimizer state) is given as chunks the same way.
DCP checks that the parts of all ranks cover every tensor once.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from heterog.atomic import atomic_write_json, read_json
from heterog.errors import CheckpointError, HeterogError
from heterog.placement import Shard, as_placement

if TYPE_CHECKING:  # pragma: no cover
    from heterog.runtime.instructions import Part
    from heterog.runtime.stepprog import StepProgram

FORMAT = "heterog-checkpoint"
VERSION = 1
MARKER = "heterog-checkpoint.json"
STEP_DIR = re.compile(r"step-(\d+)")
TMP_PREFIX = ".tmp-"
REMOVING_PREFIX = ".removing-"
POSITION_KEYS = ("train.step", "train.data_position", "train.rng_seed")


# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class CheckpointSettings:
    """When and where a run writes checkpoints."""

    directory: Path                      # D: step-N directories are written here
    every_steps: int | None = None       # a checkpoint after every step N with N % every_steps == 0
    every_s: float | None = None         # and one when this many seconds passed since the last (rank 0 decides)
    keep: int | None = None              # complete checkpoints kept (the newest); None: all
    job: str | None = None               # the job writing them (torchrun's run id): a restart resumes its own

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        problems = []
        if self.every_steps is None and self.every_s is None:
            problems.append("give --checkpoint-every N (steps) or --checkpoint-every-s T (seconds)")
        if self.every_steps is not None and (isinstance(self.every_steps, bool) or int(self.every_steps) < 1):
            problems.append(f"checkpoint interval must be at least 1 step, got {self.every_steps}")
        if self.every_s is not None and not 0 < float(self.every_s) < math.inf:
            problems.append(f"checkpoint interval must be a positive number of seconds, got {self.every_s}")
        if self.keep is not None and int(self.keep) < 1:
            problems.append(f"--keep must be at least 1, got {self.keep}")
        if self.directory.exists() and not self.directory.is_dir():
            problems.append(f"checkpoint directory {str(self.directory)!r} is a file")
        if problems:
            raise CheckpointError("; ".join(problems))

    def due_by_steps(self, step: int, last: int) -> bool:
        """A checkpoint is due after step ``step`` (steps done) by the step interval, or as the run's last."""
        return step == last or (self.every_steps is not None and step % self.every_steps == 0)


# ---------------------------------------------------------------------------- names
def state_keys(prog: StepProgram) -> dict[str, str]:
    """Placeholder -> checkpoint key of every parameter, buffer and optimizer state tensor (module docstring)."""
    names = [f"model.{n}" for n in prog.param_names] + [f"model.{n}" for n in prog.buffer_names]
    names += [f"optimizer.state.{p}.{slot}" for p, slot in prog.state_names]
    return dict(zip(prog.placeholders[:len(names)], names))


# ---------------------------------------------------------------------------- the parts a rank holds
@dataclass(frozen=True)
class Held:
    """Chunks of one tensor of shape ``shape`` held by a rank: (offsets in the whole tensor, the chunk)."""

    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], torch.Tensor], ...]

    def at(self, offsets: Sequence[int]) -> torch.Tensor:
        for off, t in self.chunks:
            if tuple(off) == tuple(offsets):
                return t
        raise KeyError(f"no chunk at offsets {tuple(offsets)}")


def chunks_of(value: torch.Tensor, part: Part, shape: Sequence[int]) -> Held:
    """The chunks of the whole tensor of ``shape`` that ``value``, device ``part.rank``'s part under a shard
    placement (``heterog.graph.shard_exec.shard_of``), holds: one per outer block of ``Shard(d, sf)``."""
    p = as_placement(part.placement)
    if not isinstance(p, Shard) or part.extent is None:
        raise CheckpointError(f"a part held as {part.placement!r} is not a block of the whole tensor; only "
                              "whole values and shards can be written")
    shape = tuple(int(s) for s in shape)
    block = shape[p.dim] // p.sf
    unit = block // part.extent
    mine = part.shares[part.rank] * unit
    before = sum(part.shares[:part.rank]) * unit
    chunks = []
    if mine:
        for b in range(p.sf):
            offsets = [0] * len(shape)
            offsets[p.dim] = b * block + before
            chunks.append((tuple(offsets), value.narrow(p.dim, b * mine, mine)))
    return Held(shape, tuple(chunks))


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in storage of its own (``torch.save`` writes a view's whole storage)."""
    t = t.detach().to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    return t


def _write_items(key: str, obj: torch.Tensor | Held) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    if isinstance(obj, torch.Tensor):
        pieces: Sequence[tuple[tuple[int, ...], torch.Tensor]] = ((tuple([0] * obj.dim()), obj),)
        size, kind = obj.shape, WriteItemType.TENSOR
    else:
        pieces, size, kind = obj.chunks, torch.Size(obj.shape), WriteItemType.SHARD
    return [WriteItem(index=MetadataIndex(key, torch.Size(off)), type=kind,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape),
                                                  properties=TensorProperties.create_from_tensor(t),
                                                  size=torch.Size(size)))
            for off, t in pieces]


def _planner(state: Mapping[str, torch.Tensor | Held]) -> Any:
    """A DCP save planner for whole tensors and ``Held`` chunks (DCP's default planner for the rest: the
    global plan, its validation and the metadata)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class PartsPlanner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan([item for key, obj in state.items() for item in _write_items(key, obj)])
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            obj = state[index.fqn]
            return obj.at(index.offset) if isinstance(obj, Held) else obj

    return PartsPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


# ---------------------------------------------------------------------------- writing
def _step_of(name: str) -> int | None:
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def _remove(path: Path) -> None:
    """Remove checkpoint ``path``: renamed out of the names that count first, then deleted."""
    gone = path.with_name(f"{REMOVING_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename the written checkpoint ``tmp`` to ``final`` (one of the same step already there is replaced:
    moved aside first, removed once the new one is in place)."""
    old = None
    if final.exists():
        old = final.with_name(f"{REMOVING_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(directory: Path, keep: int | None) -> list[int]:
    """Remove all but the ``keep`` newest complete checkpoints of ``directory``; the steps removed."""
    if keep is None:
        return []
    removed = []
    for step, path in complete_checkpoints(directory)[:-keep]:
        _remove(path)
        removed.append(step)
    return removed


def remove_incomplete(directory: Path) -> list[str]:
    """Remove what a killed run left in ``directory`` that is no checkpoint: checkpoints being written or
    removed (``.tmp-*``, ``.removing-*``). Complete checkpoints are not touched."""
    gone = []
    if directory.is_dir():
        for p in sorted(directory.iterdir()):
            if p.is_dir() and p.name.startswith((TMP_PREFIX, REMOVING_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
    return gone


def write_checkpoint(settings: CheckpointSettings, step: int, state: Mapping[str, torch.Tensor | Held],
                     marker: dict[str, Any] | None, run_id: str, *, distributed: bool) -> Path | None:
    """Write the parts ``state`` (key -> whole tensor or ``Held`` chunks) of this process after ``step``
    steps. Every rank of the default process group calls it together (``distributed``; else one process
    writes everything). The coordinator (rank 0, which passes the ``marker``) then writes the marker,
    renames the checkpoint into place, prunes old ones, and returns its path; the others return None."""
    import torch.distributed.checkpoint as dcp

    directory = settings.directory
    tmp = directory / f"{TMP_PREFIX}step-{step}-{run_id}"
    tmp.mkdir(parents=True, exist_ok=True)
    own = {k: (_own(v) if isinstance(v, torch.Tensor) else
               Held(v.shape, tuple((off, _own(t)) for off, t in v.chunks))) for k, v in state.items()}
    with warnings.catch_warnings():         # DCP warns that one process writes alone: here that is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(own, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1), planner=_planner(own),
                 no_dist=not distributed)
    if marker is None:
        return None
    atomic_write_json(tmp / MARKER, marker)
    final = directory / f"step-{step}"
    publish(tmp, final)
    prune(directory, settings.keep)
    return final


def position_state(step: int, data_position: int, rng_seed: int) -> dict[str, torch.Tensor]:
    """The training position as tensors (module docstring), written by the coordinator."""
    return {k: torch.tensor(int(v), dtype=torch.int64) for k, v in zip(POSITION_KEYS, (step, data_position, rng_seed))}


def marker_of(*, step: int, n_batches: int, rng_seed: int, losses: Sequence[float],
              shapes: Mapping[str, tuple[Sequence[int], str]], about: Mapping[str, Any]) -> dict[str, Any]:
    """The marker of a checkpoint (module docstring): the position, the losses so far, the keys' shapes and
    dtypes, and ``about`` the run (model, graph_fingerprint, optimizer, lr, batch_size, plan)."""
    return {"format": FORMAT, "version": VERSION, "step": int(step), "data_position": int(step) % int(n_batches),
            "n_batches": int(n_batches), "rng_seed": int(rng_seed), "losses": [float(x) for x in losses],
            **about, "keys": {k: [list(s), d] for k, (s, d) in shapes.items()},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}


def rank_writers(prog: StepProgram, init: Mapping[str, torch.Tensor], held: Sequence[Sequence[tuple[str, Part | None]]],
                 settings: CheckpointSettings, *, first: int, steps: int, losses: Sequence[float], n_batches: int,
                 seed: int, about: Mapping[str, Any]) -> list[RankCheckpoint]:
    """One writer per rank of a run from step ``first`` to ``steps``: ``held[r]`` the (placeholder, part or None:
    whole) rank r writes; ``init`` a value of every placeholder of the state (shapes and dtypes)."""
    keys = state_keys(prog)
    marker = marker_of(step=first, n_batches=n_batches, rng_seed=seed, losses=losses,
                       shapes={keys[ph]: (tuple(v.shape), str(v.dtype)) for ph, v in init.items()},
                       about={**about, "job": settings.job})
    run_id = uuid.uuid4().hex[:8]
    return [RankCheckpoint(settings, run_id, steps, [(ph, keys[ph], tuple(init[ph].shape), part) for ph, part in mine],
                           marker, list(losses), n_batches, seed) for mine in held]


# ---------------------------------------------------------------------------- the parts of one rank
@dataclass
class RankCheckpoint:
    """What one rank of a run needs to write checkpoints (``heterog.runtime.executor`` calls ``after_step``).

    ``held``: (placeholder, key, whole shape, the part it holds or None: whole) for each value this rank
    writes; ``marker``: the fields of the marker fixed for the run (``marker_of`` less the position and
    losses); ``losses``: the losses of the steps before this job's first."""

    settings: CheckpointSettings
    run_id: str
    last_step: int
    held: list[tuple[str, str, tuple[int, ...], Part | None]]
    marker: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    n_batches: int = 1
    rng_seed: int = 0
    _since: list[float] = field(default_factory=list, repr=False)
    _last_write: float = field(default=-1.0, repr=False)

    def ready(self) -> None:
        """At the job's start: import DCP now, so that the first checkpoint's time is its writing, and start
        the clock of ``every_s``."""
        import torch.distributed.checkpoint  # noqa: F401

        self._last_write = time.monotonic()

    def after_step(self, step: int, persist: Mapping[str, torch.Tensor], loss: float, rank: int, world: int,
                   device: torch.device) -> float | None:
        """After step ``step`` (steps done) with this rank's ``loss`` terms: write a checkpoint when one is due
        (every rank decides alike: the step interval, or rank 0's clock broadcast). The seconds it took,
        or None."""
        import torch.distributed as dist

        now = time.monotonic()
        if self._last_write < 0:
            self.ready()
        self._since.append(loss)
        due = self.settings.due_by_steps(step, self.last_step)
        if self.settings.every_s is not None:
            late = rank == 0 and now - self._last_write >= float(self.settings.every_s)
            if world > 1:
                flag = torch.tensor([int(due or late)], device=device)
                dist.broadcast(flag, 0)
                due = bool(flag.item())
            else:
                due = due or late
        if not due:
            return None
        t0 = time.perf_counter()
        terms = torch.tensor(self._since, dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(terms)
        self.losses += [float(x) for x in terms.cpu()]
        self._since = []
        state: dict[str, torch.Tensor | Held] = {}
        for ph, key, shape, part in self.held:
            state[key] = persist[ph] if part is None else chunks_of(persist[ph], part, shape)
        marker = None
        if rank == 0:
            position = step % self.n_batches
            state.update(position_state(step, position, self.rng_seed))
            marker = {**self.marker, "step": step, "data_position": position, "losses": list(self.losses),
                      "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_checkpoint(self.settings, step, state, marker, self.run_id, distributed=world > 1)
        self._last_write = time.monotonic()
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------- reading
def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``directory`` (a marker in a step-N directory), oldest
    first."""
    out = []
    if directory.is_dir():
        for p in directory.iterdir():
            step = _step_of(p.name)
            if step is not None and p.is_dir() and (p / MARKER).is_file():
                out.append((step, p))
    return sorted(out)


def newest_of_job(directory: Path, job: str) -> Path | None:
    """The newest complete checkpoint in ``directory`` written by job ``job`` (its marker says so), or None."""
    for _, path in reversed(complete_checkpoints(directory)):
        try:
            if read_json(path / MARKER).get("job") == job:
                return path
        except Exception:  # noqa: BLE001 - a damaged marker is no checkpoint of this job
            continue
    return None


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: ``path`` itself when it is one (a step directory with its marker), else
    the newest complete checkpoint in it. CheckpointError, in one line, when there is none."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {str(p)!r} is not a directory")
    if (p / MARKER).is_file():
        return p
    done = complete_checkpoints(p)
    if done:
        return done[-1][1]
    if _step_of(p.name) is not None or (p / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {str(p)!r} is incomplete: it has no {MARKER} (written last)")
    partial = sorted(q.name for q in p.iterdir() if _step_of(q.name) is not None or q.name.startswith(TMP_PREFIX))
    found = f"; incomplete: {', '.join(partial[:4])}" if partial else ""
    raise CheckpointError(f"{str(p)!r} holds no complete checkpoint (step-N directories with {MARKER}){found}")


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of checkpoint ``path``, checked (format, version, its step, the fields resuming reads)."""
    where = f"checkpoint {str(path)!r}"
    try:
        m = read_json(path / MARKER)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is incomplete: it has no {MARKER}") from None
    except Exception as exc:  # noqa: BLE001 - any decoding problem is a bad marker
        raise CheckpointError(f"{where}: {MARKER} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {MARKER} is not a heterog checkpoint marker (format "
                              f"{m.get('format') if isinstance(m, dict) else type(m).__name__!r})")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{where}: marker version {m.get('version')!r}; this heterog reads version {VERSION}")
    missing = [k for k in ("step", "data_position", "rng_seed", "losses", "keys", "model") if k not in m]
    if missing:
        raise CheckpointError(f"{where}: the marker lacks {', '.join(missing)}")
    step = _step_of(path.name)
    if step is not None and step != m["step"]:
        raise CheckpointError(f"{where}: the directory says step {step}, its marker step {m['step']}")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{where} is incomplete: DCP's .metadata file is missing")
    return m


@dataclass
class Resumed:
    """A checkpoint read back: the whole values by placeholder and the training position."""

    path: Path
    step: int
    data_position: int
    rng_seed: int
    losses: list[float]
    values: dict[str, torch.Tensor]
    marker: dict[str, Any]


def run_start(prog: StepProgram, steps: int, resumed: Resumed | None) -> tuple[int, StepProgram]:
    """The first step of a run of ``prog`` to ``steps`` steps from ``resumed`` (None: from the start), and its
    step program (drawing from the checkpoint's random streams when resumed)."""
    if resumed is None:
        return 0, prog
    if resumed.step >= steps:
        raise HeterogError(f"checkpoint {str(resumed.path)!r} is at step {resumed.step}; a run resumed from it "
                           f"needs more steps than that (got {steps})")
    return resumed.step, prog if resumed.rng_seed == prog.rng_seed else replace(prog, rng_seed=resumed.rng_seed)


def _check_fits(where: str, marker: Mapping[str, Any], keys: Mapping[str, str], like: Mapping[str, torch.Tensor],
                model: str) -> None:
    """CheckpointError when the checkpoint's keys, shapes and dtypes are not this model's."""
    theirs = marker["keys"]
    mine = {keys[ph]: (list(v.shape), str(v.dtype)) for ph, v in like.items()}
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    if missing or extra:
        what = (f"it lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else
                f"it has {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''} that this model lacks")
        raise CheckpointError(f"{where} is of another model ({marker.get('model')!r}, optimizer "
                              f"{marker.get('optimizer')!r}) than {model!r}: {what}")
    bad = [k for k in mine if [list(theirs[k][0]), theirs[k][1]] != [mine[k][0], mine[k][1]]]
    if bad:
        k = bad[0]
        raise CheckpointError(f"{where} is of another model ({marker.get('model')!r}) than {model!r}: {k} is "
                              f"{tuple(theirs[k][0])} {theirs[k][1]} there, {tuple(mine[k][0])} {mine[k][1]} here"
                              f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")


def load_checkpoint(path: str | Path, prog: StepProgram, like: Mapping[str, torch.Tensor], model: str = "") -> Resumed:
    """Read checkpoint ``path`` (a checkpoint, or a directory of them: the newest complete one) into whole
    tensors shaped and laid out as ``like`` (placeholder -> a value of the model: its initial values), in
    this process. CheckpointError, in one line, for a missing, incomplete, damaged or foreign checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    ck = find_checkpoint(path)
    where = f"checkpoint {str(ck)!r}"
    marker = read_marker(ck)
    keys = state_keys(prog)
    _check_fits(where, marker, keys, like, model)
    state: dict[str, torch.Tensor] = {keys[ph]: torch.empty_like(v) for ph, v in like.items()}
    state.update({k: torch.zeros((), dtype=torch.int64) for k in POSITION_KEYS})
    try:
        with warnings.catch_warnings():     # DCP warns that one process reads alone: here that is meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(ck), no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a damaged checkpoint, in one line
        cause: BaseException = exc
        if isinstance(exc, CheckpointException) and exc.failures:
            cause = next(iter(exc.failures.values()))[0]
        reason = " ".join(str(cause).split())[:300] or "no message"
        raise CheckpointError(f"{where} cannot be read ({type(cause).__name__}: {reason})") from None
    step, position, seed = (int(state[k]) for k in POSITION_KEYS)
    if (step, position, seed) != (marker["step"], marker["data_position"], marker["rng_seed"]):
        raise CheckpointError(f"{where}: its data (step {step}, position {position}, seed {seed}) and its "
                              f"marker (step {marker['step']}, position {marker['data_position']}, seed "
                              f"{marker['rng_seed']}) disagree")
    if len(marker["losses"]) != step:
        raise CheckpointError(f"{where}: the marker holds {len(marker['losses'])} losses for {step} steps")
    values = {ph: state[keys[ph]] for ph in like}
    return Resumed(ck, step, position, seed, [float(x) for x in marker["losses"]], values, marker)
