"""Value checks: a branch on tensor values whose one side only raises (a validation of labels, shapes or
ranges: ``if labels.max() >= vocab_size: raise ValueError(...)``, ``assert (x >= 0).all()``) is captured on the
side the example inputs take (inputs without values, on the meta device: the side that does not raise), and
recorded as an assumption that every step's inputs are checked against.

While a step is traced the tensors are fake, so ``bool()`` of one has no value. Where the model's own code
asks for it in the test of an ``if`` whose body (or ``else``) is only a ``raise``, or of an ``assert``, the
condition is computed from what it reads, which must be the model's inputs alone (a check that reads
parameters or activations is refused: the step cannot know it before running), on the example inputs; the
trace goes on with that truth value, and ``ValueCheck`` keeps the computation, to be run on the inputs of
every step (``check_inputs``; the runtime and ``train_single_process`` call it). Example inputs that take
the raising side make the model raise its own error, which the capture reports as such. Any other branch
on tensor values keeps its error (``heterog.errors.DataDependentControlFlowError``).
"""
from __future__ import annotations

import ast
import linecache
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from heterog.errors import DataDependentControlFlowError, HeterogError, ModelError
from heterog.graph.forward_guards import outside_library
from heterog.graph.random_ops import is_random


@dataclass
class ValueCheck:
    """One assumption on the inputs: ``code`` (the condition as written, at ``where``) is ``holds`` on every
    step's inputs. ``program`` computes it from the flat model inputs ``input_indices``."""

    where: str
    code: str
    holds: bool
    program: torch.fx.GraphModule | None = None
    input_indices: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"{self.code} is {self.holds} ({self.where})"

    def record(self) -> dict[str, Any]:
        """The JSON form kept in graph files (``OpGraph.assumptions``)."""
        return {"where": self.where, "code": self.code, "holds": self.holds}

    def evaluate(self, inputs: Sequence[torch.Tensor]) -> bool:
        """The condition's truth value on the flat model inputs ``inputs``."""
        if self.program is None:
            raise HeterogError(f"the check {self.describe()} was loaded from a file and cannot be run")
        return bool(self.program(*[inputs[i] for i in self.input_indices]))


def check_inputs(checks: Sequence[ValueCheck], inputs: Sequence[torch.Tensor], step: int) -> None:
    """Refuse, in one line, inputs of training step ``step`` that break one of ``checks``."""
    for check in checks:
        got = check.evaluate(inputs)
        if got != check.holds:
            raise ModelError(f"step {step}: the inputs break the model's check at {check.where}: {check.code} is "
                             f"{got}, where the captured step assumes {check.holds} (the model would raise)")


# ---------------------------------------------------------------------------- finding a validation
_TREES: dict[str, ast.Module | None] = {}


def _tree(filename: str) -> ast.Module | None:
    if filename not in _TREES:
        try:
            _TREES[filename] = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):
            _TREES[filename] = None
    return _TREES[filename]


def _only_raises(body: list[ast.stmt]) -> bool:
    """The statements build a message at most and raise."""
    return bool(body) and isinstance(body[-1], ast.Raise) and all(
        isinstance(s, (ast.Assign, ast.AnnAssign, ast.Pass)) or (isinstance(s, ast.Expr) and isinstance(
            s.value, ast.Constant)) for s in body[:-1])


def _contains(node: ast.expr | ast.stmt, line: int, col: int) -> bool:
    end_line = node.end_lineno or node.lineno
    end_col = node.end_col_offset if node.end_col_offset is not None else sys.maxsize
    return (node.lineno, node.col_offset) <= (line, col) and (line, col) < (end_line, end_col)


def _segment(filename: str, line: int, end_line: int, col: int, end_col: int | None) -> str:
    """The source text from (line, col) to (end_line, end_col): the operand whose truth the trace asks for."""
    lines = linecache.getlines(filename)[line - 1:end_line]
    if not lines or end_col is None:
        return ""
    if len(lines) == 1:
        return lines[0][col:end_col]
    return "".join([lines[0][col:], *lines[1:-1], lines[-1][:end_col]])


@dataclass(frozen=True)
class Validation:
    """A validation statement of the model's code: its test ``code`` at ``filename:line``, the lines of its
    raising side (``raise_lines``) and the truth of the asked operand that does not raise (``passes``)."""

    filename: str
    line: int
    code: str
    raise_lines: tuple[int, int]
    passes: bool = False


def _passing_value(test: ast.expr, raises_when: bool, line: int, col: int) -> bool:
    """The truth of the operand of ``test`` at (line, col) that keeps the statement from raising (``raises_when``:
    the test's value that raises): the opposite, flipped by every ``not`` between the test and the operand."""
    flips, node = 0, test
    while True:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            flips, node = flips + 1, node.operand
        elif isinstance(node, ast.BoolOp):
            inner = [v for v in node.values if _contains(v, line, col)]
            if not inner:
                break
            node = inner[0]
        else:
            break
    return (not raises_when) ^ bool(flips % 2)


def validation_at(frame: Any) -> Validation | None:
    """The validation (``if`` whose one side only raises, or ``assert``) whose test the frame's current
    instruction evaluates; None for any other statement."""
    code = frame.f_code
    positions = list(code.co_positions())
    i = frame.f_lasti // 2
    if not 0 <= i < len(positions) or positions[i][0] is None:
        return None
    line, end_line, col, end_col = positions[i]
    col = col or 0
    tree = _tree(code.co_filename)
    if tree is None:
        return None
    best: tuple[int, ast.If | ast.Assert] | None = None
    for node in ast.walk(tree):         # an assert's jump spans the statement, an if's its test's operand
        if isinstance(node, (ast.If, ast.Assert)) and _contains(node.test if isinstance(node, ast.If) else node,
                                                                 line, col):
            span = (node.test.end_lineno or node.lineno) - node.test.lineno
            if best is None or span <= best[0]:
                best = (span, node)
    if best is None:
        return None
    stmt = best[1]
    text = "" if isinstance(stmt, ast.Assert) else _segment(code.co_filename, line, end_line or line, col, end_col)
    text = text or ast.get_source_segment("".join(linecache.getlines(code.co_filename)), stmt.test) or ""
    side: list[ast.stmt] | None = None
    if isinstance(stmt, ast.Assert):
        return Validation(code.co_filename, stmt.lineno, " ".join(text.split()), (stmt.lineno, stmt.end_lineno or 0),
                          _passing_value(stmt.test, False, line, col))
    assert isinstance(stmt, ast.If)
    if _only_raises(stmt.body):
        side = stmt.body
    elif stmt.orelse and _only_raises(stmt.orelse):
        side = stmt.orelse
    if side is None:
        return None
    return Validation(code.co_filename, stmt.lineno, " ".join(text.split()),
                      (side[0].lineno, side[-1].end_lineno or side[-1].lineno),
                      _passing_value(stmt.test, side is stmt.body, line, col))


# ---------------------------------------------------------------------------- capture
class ValueChecks:
    """Captures the validations a traced step meets (module docstring): ``with checks.installed():`` around
    the trace; ``checks`` then lists them. ``n_leading``: the step's arguments before the model inputs
    (parameters, buffers, optimizer state), ``inputs``: the example inputs in flat order."""

    def __init__(self, model_name: str, n_leading: int, inputs: Sequence[torch.Tensor]) -> None:
        self.model_name = model_name
        self.n_leading = n_leading
        self.inputs = list(inputs)
        self.checks: list[ValueCheck] = []
        self.dead_nodes: list[str] = []          # nodes the trace made only to compute the checks
        self._seen: list[Validation] = []

    @contextmanager
    def installed(self) -> Iterator[None]:
        original = torch.Tensor.__bool__
        torch.Tensor.__bool__ = self._bool_of(original)   # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.Tensor.__bool__ = original               # type: ignore[method-assign]

    def _bool_of(self, original: Callable[[Any], bool]) -> Callable[[torch.Tensor], bool]:
        def bool_(t: torch.Tensor) -> bool:
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            mode = get_proxy_mode()
            frame = sys._getframe(1)
            if mode is None or not outside_library(frame.f_code.co_filename):
                return original(t)
            found = validation_at(frame)
            if found is None:
                return original(t)
            return self._capture(t, mode.tracer, found)
        return bool_

    def _capture(self, t: torch.Tensor, tracer: Any, found: Validation) -> bool:
        from torch.fx.experimental.proxy_tensor import get_proxy_slot
        from torch.utils._python_dispatch import _disable_current_modes

        where = f"{found.filename}:{found.line}"
        node = get_proxy_slot(t, tracer).proxy.node
        graph = tracer.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        needed: set[torch.fx.Node] = set()
        todo = [node]
        while todo:
            n = todo.pop()
            if n in needed:
                continue
            needed.add(n)
            todo.extend(n.all_input_nodes)
        reads = [placeholders.index(n) for n in needed if n.op == "placeholder"]
        if any(i < self.n_leading for i in reads) or any(n.op == "call_function" and is_random(n.target)
                                                          for n in needed):
            raise DataDependentControlFlowError(
                f"model {self.model_name}: the check at {where} ({found.code}) reads the model's parameters, "
                "activations or random values, not only its inputs; a captured step can assume only what the "
                "inputs say: compute the check from the inputs, or branch with torch.where")
        program, indices = self._program(graph, tracer.root, needed, node, placeholders)
        values = [self.inputs[i] for i in indices]
        if any(v.device.type == "meta" for v in values):        # no values (captured on meta): the passing side
            holds = found.passes
        else:
            with _disable_current_modes(), torch._C.DisableTorchFunction(), torch._C._DisablePythonDispatcher():
                holds = bool(program(*values).detach().numpy())     # real values, outside the trace
        self._seen.append(found)
        self.checks.append(ValueCheck(where, found.code, holds, program, indices))
        self.dead_nodes.extend(n.name for n in needed if n.op == "call_function")
        return holds

    def _program(self, graph: torch.fx.Graph, root: nn.Module, needed: set[torch.fx.Node], out: torch.fx.Node,
                 placeholders: list[torch.fx.Node]) -> tuple[torch.fx.GraphModule, tuple[int, ...]]:
        new = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        holder = nn.Module()
        indices = []
        for n in graph.nodes:
            if n not in needed:
                continue
            if n.op == "placeholder":
                indices.append(placeholders.index(n) - self.n_leading)
            elif n.op == "get_attr":
                setattr(holder, str(n.target), getattr(root, str(n.target)))
            env[n] = new.node_copy(n, lambda x: env[x])
        new.output(env[out])
        return torch.fx.GraphModule(holder, new), tuple(indices)

    def explain(self, exc: BaseException) -> str | None:
        """The message for a model that raised on a validation's raising side (its example inputs fail the
        model's own check); None when ``exc`` did not come from one."""
        import traceback

        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            for v in self._seen:
                if frame.filename == v.filename and v.raise_lines[0] <= (frame.lineno or 0) <= v.raise_lines[1]:
                    return (f"model {self.model_name}: the example inputs fail the model's own check at "
                            f"{v.filename}:{v.line} ({v.code}): {type(exc).__name__}: {exc}")
        return None

    def drop_dead_nodes(self, gm: torch.fx.GraphModule) -> None:
        """Remove from the traced graph the nodes made only to compute the checks (no other node reads them)."""
        names = set(self.dead_nodes)
        for n in reversed(list(gm.graph.nodes)):
            if n.name in names and not n.users:
                gm.graph.erase_node(n)
