"""The bytes a worker holds during a step (its tables of values), metered as the simulator counts them."""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def exclusive(v: Any) -> bool:
    """Whether tensor ``v`` is the only tensor on its storage (no view of it or other view of its base is
    alive), so that writing into it changes no other value."""
    if not isinstance(v, torch.Tensor) or v._base is not None:
        return False
    try:
        return int(torch._C._storage_Use_Count(v.untyped_storage()._cdata)) <= 2   # v's and this call's
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class Meter(Protocol):
    """What the interpreter tells a memory meter: a table entry (any hashable key) took a value or was freed."""

    def put(self, entry: Hashable, value: Any) -> None: ...

    def drop(self, entry: Hashable) -> None: ...

    def reset(self) -> None: ...


class NoMeter:
    def put(self, entry: Hashable, value: Any) -> None:
        pass

    def drop(self, entry: Hashable) -> None:
        pass

    def reset(self) -> None:
        pass


class LiveBytes:
    """Bytes of the tensors a rank holds in its value tables, counted once per storage, and their
    high-water mark (``peak``: ``RankExecutor.run()`` reports it as ``peak_memory_bytes``).

    The tables are the rank's parameters, buffers and optimizer state (``persist``), the values of its ops
    (``env``: inputs, activations, gradients, new parameters) and derived values (``stash``: assembled
    pieces, PS sums, AllReduce results); a value enters when it is stored (after the instruction that
    makes it) and leaves when the program frees it after its last consumer; a message's receive buffer
    counts from when it is posted (its transfer's simulated start) to the end of the instruction that takes
    it, what a rank sends from its send to the transfer's simulated end (``Sent``;
    ``heterog.runtime.transfers``). This is the simulator's
    memory model (docs/design.md, "Resources, memory and time": resident parameters and state, gradients
    and activations from production until their last reader, updates and collectives in place) applied
    to what the runtime actually holds, so the two are comparable on any backend; allocator caches,
    kernels' temporaries and the Python process are not counted (the process RSS of a CPU worker is hundreds of MB
    of libraries, and CPU tensors have no allocator statistics). Views count their storage once, whole
    (its bytes are held), except views of ``sliced`` storages (the global input batches a job carries),
    which count the union of the bytes they span: a rank's input is its batch share (its micro-batches'
    rows, which other ranks' rows may separate). A storage is known by its address,
    so the meter keeps a reference to each value it counts until its entry is freed: an address is then
    not reused while it is counted (a value the runtime let go of without freeing its entry would otherwise
    merge with a later storage at its address, and the figures would depend on allocation order).

    A rank meters its first ``Job.memory_steps`` steps (default 1: the first step, which the median
    iteration time leaves out as warm-up): every step runs the same program on tensors of the same
    sizes, so they hold the same bytes, and metering costs about 1.5 us per value, which would otherwise
    add to the measured time of every step.
    """

    def __init__(self, sliced: Sequence[torch.Tensor] = ()) -> None:
        self.sliced = {t.untyped_storage().data_ptr() for t in sliced if t.numel()}
        self.held: dict[Hashable, list[tuple[int, tuple[int, int] | None]]] = {}   # entry -> (storage key, span)
        self.values: dict[Hashable, Any] = {}                # table entry -> its value, referenced while counted
        self.storages: dict[int, list[Any]] = {}           # storage key -> [references, bytes, spans, size]
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        self.held.clear()
        self.values.clear()
        self.storages.clear()
        self.live = 0

    def put(self, entry: Hashable, value: Any) -> None:
        """``value`` stored in table entry ``entry`` (replacing what it held)."""
        if entry in self.held:
            self.drop(entry)
        keys: list[tuple[int, tuple[int, int] | None]] = []
        for t in _tensors(value):
            st = t.untyped_storage()
            key = st.data_ptr()
            if not st.nbytes() or not key:
                continue
            span = None
            if key in self.sliced:
                size = t.element_size()
                lo = int(t.storage_offset()) * size
                hi = lo + (sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * size if t.numel() else lo
                span = (lo, hi)
            rec = self.storages.get(key)
            if rec is None:
                rec = self.storages[key] = [0, 0, Counter(), st.nbytes()]
            rec[0] += 1
            if span is not None:
                rec[2][span] += 1
            self._recount(rec)
            keys.append((key, span))
        self.held[entry] = keys
        self.values[entry] = value
        if self.live > self.peak:
            self.peak = self.live

    def drop(self, entry: Hashable) -> None:
        """Table entry ``entry`` freed (no-op if it holds nothing counted)."""
        self.values.pop(entry, None)
        for key, span in self.held.pop(entry, ()):
            rec = self.storages[key]
            rec[0] -= 1
            if span is not None:
                rec[2][span] -= 1
                if not rec[2][span]:
                    del rec[2][span]
            if rec[0] == 0:
                self.live -= rec[1]
                del self.storages[key]
            else:
                self._recount(rec)

    def _recount(self, rec: list[Any]) -> None:
        """A storage's counted bytes (``rec``: references, counted bytes, the spans of views of a sliced
        storage held, its bytes): the whole storage, or the union of the spans held of a sliced one."""
        counted, end = 0, 0
        if rec[2]:
            for lo, hi in sorted(rec[2]):
                if hi > end:
                    counted += hi - max(lo, end)
                    end = hi
        else:
            counted = rec[3]
        self.live += counted - rec[1]
        rec[1] = counted
