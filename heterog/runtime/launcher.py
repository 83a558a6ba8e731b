"""Worker processes: a pool of one process per device on this machine (torch.multiprocessing, spawn), or
the current process as one rank of an env:// job (torchrun on several machines).

Faults: the parent watches its workers. A worker that dies (killed, crashed) or raises makes the parent
kill the whole pool at once and raise ``WorkerFailure`` naming the rank; a worker that makes no
progress for ``hang_timeout_s`` (its instruction counter in shared memory stands still) is named as hung,
and the pool is killed the same way. Collectives and messages also carry a timeout (the process
group's), and each worker exits by itself when its parent disappears, so nothing hangs and no process
outlives the launcher.
"""
from __future__ import annotations

import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from heterog.errors import HeterogError

if TYPE_CHECKING:  # pragma: no cover
    from multiprocessing.queues import Queue

    import torch

    from heterog.runtime.transport import SharedInts, StatusLike

BACKENDS = ("gloo", "nccl")


class WorkerFailure(HeterogError):
    """A worker process died, hung or raised; the message names the rank. ``lost``: the ranks whose worker
    is gone or stuck (died without reporting an error, or made no progress): their devices are lost to the
    run; empty when a worker raised (a fault of the plan or the model, not of a device)."""

    def __init__(self, message: str, lost: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.lost = tuple(sorted(int(r) for r in lost))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _device_for(rank: int, backend: str, world: int = 1) -> torch.device:
    """The device of ``rank``: GPU ``rank % n`` under NCCL. More ranks than GPUs share them (a test of a
    plan's NCCL programs on one GPU): NCCL refuses two ranks of one communicator on one GPU unless
    ``NCCL_MULTI_RANK_GPU_ENABLE`` is set (recent NCCL), or unless the ranks pose as distinct hosts
    (``HETEROG_NCCL_DISTINCT_HOSTS=1`` sets a ``NCCL_HOSTID`` per rank; NCCL then talks over sockets)."""
    import torch

    if backend == "nccl":
        n = torch.cuda.device_count()
        if n == 0:
            raise HeterogError("backend nccl needs CUDA GPUs; none is visible (use --backend gloo on CPU)")
        if world > n:
            os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
            if os.environ.get("HETEROG_NCCL_DISTINCT_HOSTS") == "1":
                os.environ["NCCL_HOSTID"] = f"heterog-rank-{rank}"
        dev = torch.device("cuda", rank % n)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def execute_job(job: Any, rank: int, device: torch.device, status: StatusLike | None = None) -> Any:
    """Run one job (training steps, link ping-pong, collective bursts, or any picklable callable
    ``job(rank, device)``) as ``rank`` of the current process group."""
    from heterog.runtime.benchmarks import CollectiveJob, PingPongJob, collectives, pingpong
    from heterog.runtime.executor import Job, RankExecutor

    if isinstance(job, PingPongJob):
        return pingpong(job, rank, device)
    if isinstance(job, CollectiveJob):
        return collectives(job, rank, device)
    if isinstance(job, Job):
        ex = RankExecutor(job, rank, device, status)
        try:
            return ex.run()
        finally:
            import torch.distributed as dist

            for g in ex.groups:
                dist.destroy_process_group(g)
    if callable(job):
        return job(rank, device)
    raise HeterogError(f"unknown job type {type(job).__name__}")


def _fine_timer_slack() -> None:
    """Linux: wake from sleeps within ~1 us instead of the default 50 us slack, so that emulated slowdown
    and link delays (many short sleeps) are not stretched. Best effort; nothing happens elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)      # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass


def _report_and_exit(result_q: Queue[Any], rank: int, text: str | dict[str, Any]) -> None:
    """Send the error to the parent (flushing the queue's feeder thread) and leave at once: the process
    group may be broken, so nothing else is attempted."""
    result_q.put(("error", rank, text))
    result_q.close()
    result_q.join_thread()
    os._exit(1)


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this worker when its parent disappears (no orphans after a crash of the launcher)."""
    def loop() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(3)
    threading.Thread(target=loop, daemon=True, name="heterog-parent-watch").start()


def _worker_main(rank: int, world: int, init_method: str, backend: str, job_q: Queue[Any], result_q: Queue[Any],
                 status_array: SharedInts, parent_pid: int, timeout_s: float, threads: int) -> None:
    """Entry point of a pool worker (spawned): join the group, then run jobs until told to stop."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from heterog.runtime.transport import Status

    watch_parent(parent_pid)
    _fine_timer_slack()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        device = _device_for(rank, backend, world)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which names this rank
        _report_and_exit(result_q, rank, f"{type(exc).__name__}: {exc}")
    result_q.put(("ready", rank, None))
    status = Status(status_array, rank)
    while True:
        job = job_q.get()
        if job is None:
            break
        try:
            out = execute_job(job, rank, device, status)
        except BaseException as exc:  # noqa: BLE001
            from heterog.runtime.executor import describe_failure

            _report_and_exit(result_q, rank, describe_failure(exc, rank))
        result_q.put(("done", rank, out))
    dist.destroy_process_group()


def _as_report(rank: int, payload: Any) -> dict[str, Any]:
    """A worker's error report as a dict (workers that fail before a job send plain text)."""
    if isinstance(payload, dict):
        return payload
    return {"rank": rank, "error": str(payload), "where": None, "step": None, "notes": [], "secondary": False,
            "waited_for": None, "time": float("inf"), "traceback": ""}


def first_failure(errors: dict[int, Any], dead: dict[int, int], names: Sequence[str], steps: Sequence[int]
                  ) -> str:
    """The message of a failed run: the first failure first, then what the other ranks reported.

    The cause is, in this order: a rank that died without reporting (killed, crashed in native code);
    the earliest error raised while the rank was not waiting for another one (an op that failed, a bad
    value); the earliest error of all. Errors raised while waiting for a peer (gloo's ``Connection closed by
    peer``, a timeout) are usually consequences of the cause and come after it."""
    silent = sorted(r for r in dead if r not in errors)
    reports = [_as_report(r, p) for r, p in errors.items()]
    if silent:
        r = silent[0]
        head = f"worker {names[r]} (rank {r}) died ({_describe_exit(dead[r])}) during step {steps[r]}"
        rest = reports + [{"rank": q, "error": f"died ({_describe_exit(dead[q])})", "where": None, "notes": [],
                           "waited_for": None, "traceback": ""} for q in silent[1:]]
    else:
        reports.sort(key=lambda e: (bool(e["secondary"]), e["time"], e["rank"]))
        first, rest = reports[0], reports[1:]
        r = first["rank"]
        where = first["where"] or f"step {steps[r]}"
        notes = "".join(f"\n  {n}" for n in first["notes"])
        trace = f"\n{first['traceback'].rstrip()}" if first["traceback"] else ""
        head = f"worker {names[r]} (rank {r}) failed at {where}: {first['error']}{notes}{trace}"
    if not rest:
        return head
    lines = []
    for e in sorted(rest, key=lambda e: e["rank"]):
        q = e["rank"]
        err = e["error"].splitlines()[0] if e["error"] else ""
        wait = f" while waiting for {e['waited_for']}" if e.get("waited_for") else ""
        lines.append(f"\n  then {names[q]} (rank {q}){wait}: {err}")
    return head + "\nother ranks (consequences):" + "".join(lines)


class WorkerPool:
    """``world_size`` worker processes on this machine forming one process group, reused across jobs.

    Args:
        world_size: number of ranks (one per device of the cluster).
        backend: "gloo" (CPU) or "nccl" (one GPU per rank).
        device_names: names used in error messages (default ``rank i``).
        hang_timeout_s: a job fails when no rank makes progress for this long.
        threads: torch intra-op threads per worker.
    """

    def __init__(self, world_size: int, backend: str = "gloo", *, device_names: Sequence[str] | None = None,
                 hang_timeout_s: float = 60.0, start_timeout_s: float = 180.0, threads: int = 1) -> None:
        if backend not in BACKENDS:
            raise HeterogError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        if world_size < 1:
            raise HeterogError(f"a worker pool needs at least one rank, got {world_size}")
        self.world, self.backend = int(world_size), backend
        self.names = list(device_names) if device_names else [f"rank {r}" for r in range(world_size)]
        self.hang_timeout_s, self.start_timeout_s, self.threads = hang_timeout_s, start_timeout_s, threads
        self.procs: list = []
        self.closed = False
        self._start()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="heterog-rdzv-")
        init = "file://" + os.path.join(self._tmp.name, "store")
        self.status = ctx.Array("q", 3 * self.world, lock=False)
        for i in range(3 * self.world):
            self.status[i] = -1
        self.result_q = ctx.Queue()
        self.job_qs = [ctx.Queue() for _ in range(self.world)]
        group_timeout = max(30.0, 2 * self.hang_timeout_s)
        for r in range(self.world):
            p = ctx.Process(target=_worker_main, name=f"heterog-worker-{r}", daemon=True,
                            args=(r, self.world, init, self.backend, self.job_qs[r], self.result_q, self.status,
                                  os.getpid(), group_timeout, self.threads))
            p.start()
            self.procs.append(p)
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.world:
            msg = self._get(0.2)
            if msg is not None:
                kind, rank, payload = msg
                if kind == "ready":
                    ready.add(rank)
                    continue
                self._fail(f"worker {self.names[rank]} (rank {rank}) could not join the process group: {payload}")
            dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
            if dead:
                r = dead[0]
                self._fail(f"worker {self.names[r]} (rank {r}) died while starting "
                           f"({_describe_exit(self.procs[r].exitcode)})", [r])
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - ready)
                self._fail(f"workers {missing} did not start within {self.start_timeout_s:.0f} s")

    def close(self) -> None:
        """Stop the workers (politely, then by force) and remove the rendezvous files."""
        if self.closed:
            return
        self.closed = True
        for q in self.job_qs:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        self._tmp.cleanup()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ jobs
    def _get(self, timeout: float) -> tuple[str, int, Any] | None:
        try:
            return self.result_q.get(timeout=timeout)
        except queue.Empty:
            return None

    def _fail(self, message: str, lost: Sequence[int] = ()) -> None:
        self.closed = True
        self._kill()
        try:
            self._tmp.cleanup()
        except OSError:
            pass
        raise WorkerFailure(message + "; all workers were stopped", lost)

    def _progress(self) -> tuple[int, ...]:
        return tuple(self.status[i] for i in range(3 * self.world))

    def run(self, jobs: Sequence[Any]) -> list[dict[str, Any]]:
        """Give ``jobs[r]`` to rank r and return their results (in rank order)."""
        if self.closed:
            raise HeterogError("the worker pool is closed (a previous job failed or it was shut down)")
        if len(jobs) != self.world:
            raise HeterogError(f"{len(jobs)} jobs for {self.world} workers")
        for q, job in zip(self.job_qs, jobs):
            q.put(job)
        results: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        last, last_change = self._progress(), time.monotonic()
        while len(results) < self.world:
            msg = self._get(0.1)
            if msg is not None:
                kind, rank, payload = msg
                if kind == "done":
                    results[rank] = payload
                elif kind == "error":
                    errors[rank] = payload
            dead = {r: p.exitcode for r, p in enumerate(self.procs)
                    if p.exitcode is not None and r not in results}
            if errors or dead:
                self._report_failure(errors, dead)
            now = time.monotonic()
            cur = self._progress()
            if cur != last:
                last, last_change = cur, now
            elif now - last_change > self.hang_timeout_s:
                self._report_hang(cur, results)
        return [results[r] for r in range(self.world)]

    def _report_failure(self, errors: dict[int, Any], dead: dict[int, int]) -> None:
        """Stop the pool and raise the first failure (see ``first_failure``) with the others after it."""
        # give the other ranks a moment to report (a peer of a crashed rank fails on its closed connection)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            msg = self._get(0.05)
            if msg is not None and msg[0] == "error":
                errors[msg[1]] = msg[2]
            for r, p in enumerate(self.procs):
                if p.exitcode is not None:
                    dead[r] = p.exitcode
            if all(r in errors or r in dead for r in range(self.world)) and all(r in errors for r in dead):
                break
        for r, p in enumerate(self.procs):
            if p.exitcode is not None:
                dead[r] = p.exitcode
        self._fail(first_failure(errors, dead, self.names, [max(int(self.status[3 * r]), 0)
                                                            for r in range(self.world)]),
                   [r for r in dead if r not in errors])

    def _report_hang(self, status: tuple[int, ...], results: dict[int, Any]) -> None:
        busy = [r for r in range(self.world) if r not in results and status[3 * r + 2] == -1]   # not waiting
        waited = sorted({int(status[3 * r + 2]) for r in range(self.world) if status[3 * r + 2] >= 0})
        open_ = [r for r in range(self.world) if r not in results]
        behind = min((status[3 * r], status[3 * r + 1]) for r in open_) if open_ else None
        laggards = [r for r in open_ if (status[3 * r], status[3 * r + 1]) == behind]
        culprits = busy or waited or laggards
        where = ", ".join(f"rank {r} at step {status[3 * r]} instruction {status[3 * r + 1]}" for r in culprits)
        self._fail(f"worker(s) {', '.join(self.names[r] + f' (rank {r})' for r in culprits)} made no progress "
                   f"for {self.hang_timeout_s:.0f} s ({where}); the others were waiting", culprits)


# ---------------------------------------------------------------------------- env:// (torchrun)
def env_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun (env:// rendezvous), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return None


SHARED_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def nnodes_of(agent_argv: Sequence[str], environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(fewest, most) nodes of the torchrun agent started with ``agent_argv`` (``--nnodes N`` or ``MIN:MAX``,
    else torchrun's ``PET_NNODES``); None when neither says, or says something torchrun would refuse."""
    value = environ.get("PET_NNODES")
    for i, arg in enumerate(agent_argv):
        if arg == "--nnodes" and i + 1 < len(agent_argv):
            value = agent_argv[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None
    try:
        low, _, high = value.partition(":")
        return int(low), int(high or low)
    except ValueError:
        return None


def joins_stall(agent_argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """Under torchrun: why a node that joins this job would stall torchrun's agents, or None.

    A job whose agents share their TCP store with the workers (torchrun's default, which the workers see as
    ``TORCHELASTIC_USE_AGENT_STORE=True``) publishes the store's address once: rank 0's agent writes it
    under the first rendezvous round's keys and keeps it. A node that joins in a later round reads it under
    that round's keys, which no agent writes, while rank 0's agent waits there for the newcomer's role: both
    wait until the store's read timeout and the agents fail (a newcomer that the rendezvous ranks first
    would start a store of its own instead, which the other nodes' workers never learn of). With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every agent, rank 0's agent publishes a fresh address under
    each round's keys, the workers meet at a store of their own (rank 0's, env://), and the job grows."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    nodes = nnodes_of(agent_argv, environ)
    if nodes is None or nodes[0] == nodes[1]:
        return None
    return (f"torchrun's agents share their store (--nnodes {nodes[0]}:{nodes[1]}): a node that joins would stall "
            f"their next rendezvous round until it times out; start every torchrun with {SHARED_STORE_SWITCH}=1 "
            "for a job that grows")


def agent_argv() -> list[str]:
    """The command line of this process's parent (torchrun's agent, for a rank it started); empty where it
    cannot be read (Linux's /proc)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _attempt_store(world: int, timeout: timedelta) -> Any:
    """The store of this attempt's process group under torchrun: the agent's store under a prefix of its
    own. The agent's store outlives the workers it restarts, and the addresses that a killed attempt's
    ranks left in it would otherwise be read by the next attempt's ranks that come up first (gloo then
    connects to a dead port). The attempt is told apart by torchrun's restart count, the world size and the
    order of arrival: every process adds one to a counter of its (restart, world) on arrival."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    key = f"heterog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{world}"
    arrival = int(store.add(f"{key}/arrivals", 1))
    return dist.PrefixStore(f"{key}/{(arrival - 1) // world}", store)


def run_env_job(make_jobs: Callable[[list[str | None]], list[Any]], backend: str, timeout_s: float = 600.0,
                device: str | None = None) -> list[dict[str, Any]] | None:
    """Run one job in an env:// process group (each process is one rank, e.g. under torchrun).

    Every rank names its ``device`` (None: not named); rank 0 calls ``make_jobs(names)`` with the names of
    all ranks in rank order (planning happens once) and scatters one job to each rank; every rank runs its
    own; rank 0 returns all results, the others None.
    """
    import torch
    import torch.distributed as dist

    rank, world, local = env_rank() or (0, 1, 0)
    if backend == "nccl":
        torch.cuda.set_device(local % max(torch.cuda.device_count(), 1))
        device_ = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
    else:
        device_ = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, store=_attempt_store(world, timeout), rank=rank, world_size=world,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    try:
        names: list[str | None] = [None] * world
        dist.all_gather_object(names, device)
        jobs: list[Any] | None = None
        if rank == 0:
            try:
                jobs = make_jobs(names)
                if len(jobs) != world:
                    raise HeterogError(f"the plan has {len(jobs)} devices but the job has {world} processes")
            except HeterogError as exc:         # every rank stops with rank 0's reason
                jobs = [exc] * world
        box: list[Any] = [None]
        dist.scatter_object_list(box, jobs, src=0)
        if isinstance(box[0], HeterogError):
            raise box[0]
        out = execute_job(box[0], rank, device_)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        return gathered
    finally:
        dist.destroy_process_group()
