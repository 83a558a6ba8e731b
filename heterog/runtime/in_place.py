"""The runtime's in-place writes, which keep what a rank holds to what an optimizer's step holds: an op of the
update writes its output into an input it reads last (the old parameter or state, or an intermediate of the
update), a parameter's next value gathered or copied up into the old one, a rank's own copies of the values it
holds, and the small value helpers the executor shares.
``heterog.compiler.memory`` counts the same in the simulator."""
from __future__ import annotations

from collections import Counter

import torch

from heterog.runtime.instructions import AllGather, Compute, Copy, Env, RankProgram, Slice, Source, sources
from heterog.runtime.kernel import Kernel
from heterog.runtime.layout import narrow_batch
from heterog.runtime.stepprog import StepProgram


def scaled(v: torch.Tensor, scale: float) -> torch.Tensor:
    """``v * scale``; an integer value (an index, a count) whose scaled entries are whole numbers keeps its
    dtype, as its readers and messages expect."""
    out = v * scale
    if out.dtype != v.dtype and bool(torch.equal(out, out.round())):
        return out.to(v.dtype)
    return out


def cut(v: torch.Tensor, sl: Slice | None, scale: float, shift: int = 0) -> torch.Tensor:
    """Samples ``sl`` of ``v`` (all: None), times ``scale``, plus ``shift``."""
    if sl is not None:
        v = narrow_batch(v, sl)
    if scale != 1.0:
        v = scaled(v, scale)
    if shift:
        v = v + shift
    return v


def owned(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``v`` on ``device`` in a tensor of this rank's own (a copy even where it is on ``device`` already)."""
    w = v.to(device)
    return v.clone() if w is v else w


def in_place_writers(rp: RankProgram, prog: StepProgram, kernels: dict[tuple, Kernel]
                     ) -> dict[int, tuple[str, tuple[str, ...]]]:
    """Per compute instruction of ``rp`` that runs an op of the update, its first node and the inputs it may
    write its output into: those it reads last (whole, unscaled), in argument order. The step then updates
    in place, as an optimizer's step does: the new parameter or state goes into the old one's buffer, an
    intermediate into its input's (``heterog.compiler.memory`` counts the same). Whether this rank alone holds
    such an input, and whether it has the output's shape and dtype, is checked when it runs
    (``Kernel``)."""
    out: dict[int, tuple[str, tuple[str, ...]]] = {}
    if not prog.op_phase:
        return out
    reads: Counter[Source] = Counter(src for ins in rp.instrs for src in sources(ins))
    for i, ins in enumerate(rp.instrs):
        if not isinstance(ins, Compute) or prog.op_phase[ins.op] != "update":
            continue
        # a parameter or state value it reads last, or an intermediate that no other instruction reads
        dying = {inp.node for inp in ins.inputs if inp.source in rp.frees[i] and not inp.chain and inp.scale == 1.0
                 and inp.tuple_index is None and isinstance(inp.source, Env)
                 and (inp.source.node in rp.persist or reads[inp.source] == 1)}
        if not dying:
            continue
        kernel = kernels[(ins.op, ins.local, stats_scale(ins), ins.host)]
        node, args = kernel.arguments()[0]
        victims = tuple(a for a in args if a in dying)
        if victims:
            out[i] = (node, victims)
    return out


def write_targets(rp: RankProgram) -> dict[tuple, str]:
    """Per all-gather and copy of ``rp`` with a target (``AllGather.into``, ``Copy.into``: a parameter's next
    value gathered or copied up into the old one's buffer, as ZeRO's all-gather of the updated partitions and
    its copy up of offloaded ones write into the parameter), its stash key and the target's env name, where
    no later instruction reads the target (the old value is intact until then)."""
    last: dict[str, int] = {}
    for i, ins in enumerate(rp.instrs):
        for src in sources(ins):
            if isinstance(src, Env):
                last[src.node] = i
    return {ins.key: ins.into for i, ins in enumerate(rp.instrs)
            if isinstance(ins, (AllGather, Copy)) and ins.into is not None and last.get(ins.into, -1) < i}


def stats_scale(ins: Compute) -> float | None:
    """The kernel variant of a compute instruction: None, or a synced batch norm's gradient convention."""
    return None if ins.stats is None else ins.stats_scale
