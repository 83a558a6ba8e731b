"""Tracing one training step (forward, backward, optimizer update) with make_fx on fake tensors, with the
batch size as one symbol: the captured step, the phase and module path of every fx node, the loss taken
from what the model returns, and the errors a model's own code causes, named."""
from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from heterog.errors import DataDependentControlFlowError, HeterogError, ModelError
from heterog.graph.forward_guards import ForwardGuards, refuse_state_constants, shape_error_message, traceback_line
from heterog.graph.inputs import ExampleInputs, InputSpec, input_spec
from heterog.graph.mutations import (
    buffer_outputs,
    functionalize,
    intermediate_mutations,
    placeholder_writers,
    placeholder_writes,
)
from heterog.graph.normalisers import split_loss_normalisers
from heterog.graph.optimizer import STATE_SLOTS, check_optimizer, init_state, optimizer_update
from heterog.graph.random_ops import draws, dropout_as_eager
from heterog.graph.value_checks import ValueCheck, ValueChecks

log = logging.getLogger(__name__)

TRACING_MODES = ("fake", "symbolic")


# ---------------------------------------------------------------------------- the captured step
@dataclass
class CapturedStep:
    """A traced training step and how to call it.

    Calling convention of ``gm`` (P params, K buffers, S = P * len(state slots) state tensors, N inputs)::

        outputs = gm(*params, *buffers, *state, *inputs)
        loss = outputs[0]; new_params = outputs[1:1+P]; new_state = outputs[1+P:1+P+S]
        new values of the buffers the step writes (``buffer_outputs``) = outputs[1+P+S:]

    ``params`` follow ``param_names`` (trainable ``named_parameters()`` order), ``buffers`` follow
    ``buffer_names`` (``named_buffers()`` then frozen parameters), ``state`` follows ``state_names``
    (``(param, slot)`` for each param in order, slots ``STATE_SLOTS[optimizer]``; ``init_state`` builds
    zeros), ``inputs`` are the model inputs. Buffers the model updates (batch-norm running statistics) are
    not written in place: their new values are outputs of the step (``buffer_outputs``: buffer name -> the
    output node), so that every device holding a buffer gets its new value. A parameter that gets no
    gradient is returned unchanged (its state too), as ``torch.optim`` skips it. With
    ``tracing_mode="symbolic"`` the graph runs at any batch size (dim 0 of every input); with ``"fake"`` only
    at the traced one.

    Node-level view: ``node_phase``/``node_module_path`` give each fx node's phase and module path,
    ``grad_nodes[param]`` names the node whose output is that parameter's gradient (None: no gradient),
    ``shape_nodes`` lists the nodes that compute sizes (SymInts) rather than tensors; ``run_nodes``
    executes any subset of nodes in order (computing shape nodes on demand), which is how a runtime runs
    one OpGraph op (``Op.fx_nodes``) at a time.
    """

    gm: GraphModule
    tracing_mode: str
    optimizer: str
    lr: float
    param_names: list[str]
    buffer_names: list[str]
    state_names: list[tuple[str, str]]
    n_inputs: int
    batch_size: int                            # batch of the example inputs
    placeholders: list[str]                    # fx names in calling order
    outputs: list[str]                         # fx names of loss, new params, new state
    grad_nodes: dict[str, str | None]
    node_phase: dict[str, str]
    node_module_path: dict[str, str]
    shape_nodes: list[str]
    buffer_outputs: dict[str, str] = field(default_factory=dict)   # buffer name -> node of its new value
    checks: list[ValueCheck] = field(default_factory=list)   # assumptions on the inputs (heterog.graph.value_checks)
    param_writes: list[str] = field(default_factory=list)    # writes into parameters inside forward, one line each
    trace_time_s: float = 0.0
    batch_symbols: tuple[Any, ...] = ()        # sympy symbols of the batch size (symbolic mode)
    input_spec: InputSpec | None = None        # how the model is called on the inputs (keywords, batch or not)
    model_name: str = ""
    _nodes: dict[str, Node] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._nodes = {n.name: n for n in self.gm.graph.nodes}
        self._shape_nodes = frozenset(self.shape_nodes)

    @property
    def n_params(self) -> int:
        return len(self.param_names)

    def node(self, name: str) -> Node:
        return self._nodes[name]

    def init_state(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Zero optimizer state for ``params`` (in ``param_names`` order)."""
        return init_state(self.optimizer, params)

    def __call__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                 state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run the whole step: returns (loss, new params, new state); ``buffers`` (a list) gets the new values of
        the buffers the step writes."""
        if (len(params), len(buffers), len(state), len(inputs)) != (
                self.n_params, len(self.buffer_names), len(self.state_names), self.n_inputs):
            raise HeterogError(
                f"captured step takes {self.n_params} params, {len(self.buffer_names)} buffers, "
                f"{len(self.state_names)} state tensors and {self.n_inputs} inputs; got {len(params)}, "
                f"{len(buffers)}, {len(state)} and {len(inputs)}")
        out = self.gm(*params, *buffers, *state, *inputs)
        p, n_state = self.n_params, len(self.state_names)
        if isinstance(buffers, list):
            for name, value in zip(self.buffer_outputs, out[1 + p + n_state:]):
                buffers[self.buffer_names.index(name)] = value
        return out[0], list(out[1:1 + p]), list(out[1 + p:1 + p + n_state])

    def run_nodes(self, names: Sequence[str], env: dict[str, Any]) -> None:
        """Execute fx nodes ``names`` (e.g. one op's ``fx_nodes``) in order, reading arguments from ``env``
        (node name -> value) and storing each result there. Placeholders must already be in ``env``;
        shape nodes (sizes) an argument needs are computed on demand from the tensors in ``env``."""
        def value(n: Node) -> Any:
            if n.name not in env:
                if n.name not in self._shape_nodes:
                    raise HeterogError(f"fx node {n.name!r} ({n.op}) has not been computed yet")
                _run_node(n, value, env)
            return env[n.name]

        for name in names:
            node = self._nodes[name]
            if node.op == "placeholder":
                if name not in env:
                    raise HeterogError(f"placeholder {name!r} has no value in env")
                continue
            _run_node(node, value, env)


def _run_node(node: Node, value: Callable[[Node], Any], env: dict[str, Any]) -> None:
    args = torch.fx.node.map_arg(node.args, value)
    kwargs = torch.fx.node.map_arg(node.kwargs, value)
    target = node.target
    if not callable(target):
        raise HeterogError(f"fx node {node.name!r} ({node.op}) calls {target!r}, which is not a function")
    env[node.name] = target(*args, **kwargs)


# ---------------------------------------------------------------------------- tracing
class _TraceRecorder:
    """Attributes every fx node created during tracing to a phase and a module path.

    Forward nodes take the innermost module whose forward was running; backward nodes take the module
    whose forward created the autograd node being differentiated (matched by autograd sequence number).
    """

    def __init__(self, module: nn.Module) -> None:
        self.paths: dict[int, str] = {}
        for name, m in module.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), name)  # a module shared at several paths: its first path
        self.stack = [""]
        self.path = ""
        self.phase = "forward"
        self.last: Node | None = None
        self.node_phase: dict[str, str] = {}
        self.node_path: dict[str, str] = {}
        self.seq_starts: list[int] = []
        self.seq_paths: list[str] = []
        self._grad_fn_hooks: list[Any] = []

    def flush(self) -> None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            return
        new: list[Node] = []
        for node in reversed(mode.tracer.graph.nodes):
            if node is self.last:
                break
            new.append(node)
        for node in new:
            self.node_phase[node.name] = self.phase
            self.node_path[node.name] = self.path
        if new:
            self.last = new[0]

    def _set_path(self, path: str) -> None:
        self.flush()
        self.path = path
        if self.phase == "forward":
            self.seq_starts.append(_sequence_nr())
            self.seq_paths.append(path)

    def pre_hook(self, mod: nn.Module, args: Any) -> None:
        name = self.paths.get(id(mod))
        if name is not None and self.phase == "forward":
            self.stack.append(name)
            self._set_path(name)

    def post_hook(self, mod: nn.Module, args: Any, out: Any) -> None:
        if id(mod) in self.paths and self.phase == "forward" and len(self.stack) > 1:
            self.stack.pop()
            self._set_path(self.stack[-1])

    def set_phase(self, phase: str) -> None:
        self.flush()
        self.phase = phase
        self.path = ""

    def hook_backward(self, loss: torch.Tensor) -> None:
        """Before each autograd node runs, switch the module path to the module that created it."""
        seen: set[int] = set()
        todo = [loss.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            todo.extend(nf for nf, _ in fn.next_functions)
            if type(fn).__name__ == "AccumulateGrad":
                continue
            path = self._path_of_seq(fn._sequence_nr())
            self._grad_fn_hooks.append(fn.register_prehook(self._backward_prehook(path)))

    def _backward_prehook(self, path: str) -> Callable[[Any], None]:
        def prehook(grad_outputs: Any) -> None:
            self.flush()
            self.path = path
        return prehook

    def _path_of_seq(self, seq: int) -> str:
        i = bisect.bisect_right(self.seq_starts, seq) - 1
        return self.seq_paths[i] if i >= 0 else ""

    def remove_hooks(self) -> None:
        for h in self._grad_fn_hooks:
            h.remove()
        self._grad_fn_hooks.clear()


def _sequence_nr() -> int:
    """The autograd sequence number the next autograd node will get."""
    return int(torch.autograd._get_sequence_nr())


def capture_fx(module: nn.Module, example_inputs: ExampleInputs, *,
               optimizer: str = "sgd", lr: float = 0.01, tracing_mode: str = "symbolic") -> CapturedStep:
    """Trace one training step of ``module`` on ``example_inputs`` into a GraphModule (see CapturedStep).

    Nothing is allocated for parameters, buffers, state or inputs: the trace runs on fake tensors built
    from their shapes and dtypes (CPU kernels' decompositions). In ``"symbolic"`` mode the trace uses batch
    ``max(B, 2)`` internally (batch 1 would be specialised) and the graph runs at any batch size.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    check_optimizer(optimizer)
    if tracing_mode not in TRACING_MODES:
        raise HeterogError(f"unknown tracing mode {tracing_mode!r} (choose from {', '.join(TRACING_MODES)})")
    if not isinstance(module, nn.Module):
        raise ModelError(f"model is a {type(module).__name__}, not a torch.nn.Module")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise HeterogError(f"learning rate must be a positive number, got {lr!r}")
    spec = input_spec(example_inputs)
    inputs = spec.flatten(example_inputs)
    batch_size = spec.batch_size
    noted = (type(module).__name__, tuple(spec.unbatched))
    if spec.unbatched and noted not in _INPUTS_NOTED:
        _INPUTS_NOTED.add(noted)
        log.warning("model %s: inputs without the batch (passed whole to every replica): %s", noted[0],
                    ", ".join(spec.unbatched))
    symbolic = tracing_mode == "symbolic"
    t0 = time.perf_counter()

    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    buffers = list(module.named_buffers()) + frozen
    if not trainable:
        raise ModelError(f"model {type(module).__name__} has no trainable parameters")
    param_names = [n for n, _ in trainable]
    buffer_names = [n for n, _ in buffers]
    slots = STATE_SLOTS[optimizer]
    state_names = [(n, s) for n in param_names for s in slots]

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env, static_shapes=not symbolic, allow_non_fake_inputs=True)
    with fake_mode:
        fake_params = [torch.empty(p.shape, dtype=p.dtype, device="cpu", requires_grad=True) for _, p in trainable]
        fake_buffers = [torch.empty(b.shape, dtype=b.dtype, device="cpu") for _, b in buffers]
        fake_state = init_state(optimizer, [p.detach() for p in fake_params])
    fake_inputs, batch_symbols = _fake_inputs(inputs, spec.batched, fake_mode, symbolic)
    sizes = Sizes(batch_symbols, batch_size)

    rec = _TraceRecorder(module)
    n_params, n_buffers, n_state = len(fake_params), len(fake_buffers), len(fake_state)
    model_name = type(module).__name__
    guards = ForwardGuards(module, model_name)
    checks = ValueChecks(model_name, n_params + n_buffers + n_state, inputs)

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torch.nn.utils.stateless import _reparametrize_module

        params = flat[:n_params]
        bufs = flat[n_params:n_params + n_buffers]
        state = flat[n_params + n_buffers:n_params + n_buffers + n_state]
        xs = flat[n_params + n_buffers + n_state:]
        tensors = {**dict(zip(param_names, params)), **dict(zip(buffer_names, bufs))}
        # the module's tensors stay substituted through the backward: a hand-written backward
        # (torch.autograd.Function) may run the module again there
        with _reparametrize_module(module, tensors, tie_weights=True):
            rec.set_phase("forward")
            loss = _forward(module, spec.call_args(xs), model_name, sizes, checks)
            rec.set_phase("backward")
            rec.hook_backward(loss)
            grads = _backward(loss, params, model_name)
            rec.remove_hooks()
        rec.set_phase("update")
        new_params: list[torch.Tensor] = []
        new_state: list[torch.Tensor] = []
        for i, (p, g) in enumerate(zip(params, grads)):
            st = list(state[i * len(slots):(i + 1) * len(slots)])
            if g is None:
                new_params.append(p)
                new_state.extend(st)
                continue
            p_new, st_new = optimizer_update(optimizer, lr, p, g, st)
            new_params.append(p_new)
            new_state.extend(st_new)
        rec.flush()
        # gradients ride along as extra outputs so their nodes can be found; they are stripped below
        return (loss, *new_params, *new_state, *[g for g in grads if g is not None])

    fwd_pre = nn.modules.module.register_module_forward_pre_hook(rec.pre_hook)
    fwd_post = nn.modules.module.register_module_forward_hook(rec.post_hook)
    try:
        with guards.installed(), checks.installed(), dropout_as_eager():
            gm = make_fx(step, tracing_mode="symbolic" if symbolic else "fake")(
                *fake_params, *fake_buffers, *fake_state, *fake_inputs)
    finally:
        fwd_pre.remove()
        fwd_post.remove()
        rec.remove_hooks()
    guards.refuse_reseeding(any(n.op == "call_function" and draws(n.target, n.args, n.kwargs) for n in gm.graph.nodes))
    refuse_state_constants([getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"], module, model_name)
    checks.drop_dead_nodes(gm)
    if symbolic:
        _check_batch_not_specialised(shape_env, batch_symbols, model_name)
    node_phase, node_path = rec.node_phase, rec.node_path
    param_writes = [f"{w.name} ({w.target}) writes parameter '{param_names[placeholders(gm).index(p)]}'"
                    for w, p in placeholder_writers(gm, placeholders(gm)[:n_params])
                    if node_phase.get(w.name) == "forward"]
    buffer_nodes = [n for n in placeholders(gm)[n_params:n_params + n_buffers]]
    if any(intermediate_mutations(gm).values()) or placeholder_writes(gm, buffer_nodes):
        gm, origin = functionalize(gm)
        node_phase = {n: node_phase[o] for n, o in origin.items() if o in node_phase}
        node_path = {n: node_path[o] for n, o in origin.items() if o in node_path}
    for made, loss in split_loss_normalisers(gm).items():     # counts from the targets, not from the loss
        node_phase[made.name] = node_phase.get(loss.name, "forward")
        if loss.name in node_path:
            node_path[made.name] = node_path[loss.name]

    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    n_out = 1 + n_params + n_state
    grad_iter = iter(outs[n_out:])
    grad_nodes: dict[str, str | None] = {}
    for name, p_node, p_out in zip(param_names, placeholders(gm)[:n_params], outs[1:1 + n_params]):
        grad_nodes[name] = None if p_out is p_node else next(grad_iter).name
    written = buffer_outputs(gm, placeholders(gm)[n_params:n_params + n_buffers])   # index -> new value's node
    for node in written.values():
        node_phase.setdefault(node.name, "forward")
    out_node.args = (tuple(outs[:n_out]) + tuple(written.values()),)
    gm.recompile()

    shape_nodes = [n.name for n in gm.graph.nodes if n.op == "call_function" and not _has_tensor(n)]
    return CapturedStep(
        gm=gm, tracing_mode=tracing_mode, optimizer=optimizer, lr=float(lr), param_names=param_names,
        buffer_names=buffer_names, state_names=state_names, n_inputs=len(inputs), batch_size=batch_size,
        placeholders=[n.name for n in placeholders(gm)],
        outputs=[n.name for n in outs[:n_out]] + [n.name for n in written.values()],
        grad_nodes=grad_nodes, node_phase=node_phase, node_module_path=node_path,
        shape_nodes=shape_nodes, trace_time_s=time.perf_counter() - t0, batch_symbols=batch_symbols,
        model_name=model_name, input_spec=spec, checks=checks.checks, param_writes=param_writes,
        buffer_outputs={buffer_names[i]: node.name for i, node in written.items()})


def _forward(module: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], model_name: str, sizes: Sizes,
             checks: ValueChecks) -> torch.Tensor:
    """The model call inside the trace (its tensors substituted by the caller) and the loss taken from its
    output (``select_loss``); a failure there is the model's (ModelError, cause kept; data-dependent control
    flow: DataDependentControlFlowError; its own check failing on the example inputs: named)."""
    try:
        out = module(*call[0], **call[1])
    except HeterogError:
        raise
    except Exception as exc:
        raise _model_failure(exc, model_name, "forward", checks.explain(exc)) from exc
    loss, where = select_loss(out, model_name)
    if where != "output" and (model_name, where) not in _LOSS_NOTED:
        _LOSS_NOTED.add((model_name, where))
        log.warning("model %s returned %s; training on its loss, %s", model_name, _describe(out), where)
    if loss.dim() != 0:
        shape = ", ".join(str(s) for s in sizes.shape(loss))
        raise ModelError(f"model {where} has shape ({shape}); it must be a scalar mean loss")
    if not loss.dtype.is_floating_point:
        raise ModelError(f"model loss ({where}) has dtype {loss.dtype}; it must be a floating-point scalar")
    if not loss.requires_grad:
        raise ModelError(f"model {model_name}: the loss ({where}) does not depend on any trainable parameter")
    return loss


def _backward(loss: torch.Tensor, params: Sequence[torch.Tensor], model_name: str) -> list[torch.Tensor | None]:
    """The gradients of ``loss`` with respect to ``params``: what autograd returns plus what a hand-written
    backward writes into ``param.grad`` (reversible layers accumulate their parameters' gradients there)."""
    for p in params:
        p.grad = None
    try:
        grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    except HeterogError:
        raise
    except Exception as exc:
        raise _model_failure(exc, model_name, "backward") from exc
    out: list[torch.Tensor | None] = []
    for g, p in zip(grads, params):
        written = p.grad
        p.grad = None
        out.append(written if g is None else g if written is None else g + written)
    return out


def _model_failure(exc: BaseException, model_name: str, phase: str, explained: str | None = None) -> ModelError:
    """The one-line error for a model's own code failing in the ``phase`` pass of the trace."""
    if explained is not None:
        return ModelError(explained)
    if _is_data_dependent(exc):
        return DataDependentControlFlowError(_data_dependent_message(exc, model_name))
    shape = shape_error_message(exc, model_name)
    if shape is not None:
        return ModelError(shape)
    where = traceback_line(exc)
    first = str(exc).splitlines()[0] if str(exc) else ""
    return ModelError(f"model {model_name}: {phase} pass failed while tracing on fake tensors"
                      f"{' at ' + where if where else ''}: {type(exc).__name__}: {first}")


_LOSS_NOTED: set[tuple[str, str]] = set()   # (model, output taken) already reported (once per process)
_INPUTS_NOTED: set[tuple[str, tuple[str, ...]]] = set()   # (model, inputs without the batch) reported


def select_loss(out: Any, model_name: str = "model") -> tuple[torch.Tensor, str]:
    """The loss in a model's output and where it was found, as users write models:

    a tensor (``"output"``); a mapping with a ``"loss"`` entry, e.g. a dict or a Hugging Face
    ``ModelOutput`` (``'output["loss"]'``); an object with a tensor ``.loss`` attribute (``"output.loss"``);
    a tuple or list whose first element is a tensor (``"output[0]"``). Anything else is a ModelError naming
    what was returned. The shape is not checked here (``_forward`` does that)."""
    if isinstance(out, torch.Tensor):
        return out, "output"
    if isinstance(out, Mapping):
        if isinstance(out.get("loss"), torch.Tensor):
            return out["loss"], 'output["loss"]'
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss, "output.loss"
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], "output[0]"
    raise ModelError(f"model {model_name} returned {_describe(out)}; it must return the scalar mean loss: a "
                     "tensor, a tuple or list whose first element is the loss, a dict with a \"loss\" entry or an "
                     "object with a .loss attribute")


def _describe(out: Any) -> str:
    """A short description of a model output for messages ("a dict with keys ['logits']")."""
    name = type(out).__name__
    if isinstance(out, Mapping):
        return f"a {name} with keys {list(out.keys())}"
    if isinstance(out, (tuple, list)):
        kinds = ", ".join(type(x).__name__ for x in out[:4]) + (", ..." if len(out) > 4 else "")
        return f"a {name} of {len(out)} ({kinds})"
    return "None" if out is None else f"a {name}"


def _is_data_dependent(exc: BaseException) -> bool:
    """True for torch's errors on Python control flow (``if``, ``bool()``, ``.item()`` used as a Python
    number) that depends on tensor values, which a trace on fake tensors cannot follow."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(exc, (GuardOnDataDependentSymNode, DataDependentOutputException))


def _data_dependent_message(exc: BaseException, model_name: str) -> str:
    """One line: the cause, the user's line (innermost traceback frame of the model's code), the fix."""
    where = traceback_line(exc)
    return (f"model {model_name}: Python control flow depends on tensor values{' at ' + where if where else ''}; "
            "a training step is captured once for all inputs, so branch on tensors with torch.where (or torch.cond) "
            "instead of if/while on a tensor, bool() or .item()")


def _fake_inputs(inputs: Sequence[torch.Tensor], batched: Sequence[bool], fake_mode: Any, symbolic: bool
                 ) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    """Fake CPU tensors shaped like ``inputs``; in symbolic mode dim 0 of each batch input is a fresh symbol
    (hint >= 2)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext, SymbolicContext

    out: list[torch.Tensor] = []
    symbols: list[Any] = []
    for i, (x, has_batch) in enumerate(zip(inputs, batched)):
        if not symbolic or not has_batch:
            with fake_mode:
                out.append(torch.empty(x.shape, dtype=x.dtype, device="cpu"))
            continue
        meta = torch.empty((max(int(x.shape[0]), 2), *x.shape[1:]), dtype=x.dtype, device="meta")
        dynamic_sizes = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (x.dim() - 1)
        ctx: SymbolicContext = StatelessSymbolicContext(dynamic_sizes=dynamic_sizes)
        fake = fake_mode.from_tensor(meta, symbolic_context=ctx, source=ConstantSource(f"input{i}"))
        with fake_mode:
            fake = torch.empty_like(fake, device="cpu")
        size0 = fake.shape[0]
        if isinstance(size0, torch.SymInt):
            symbols.extend(size0.node.expr.free_symbols)
        out.append(fake)
    return out, tuple(dict.fromkeys(symbols))


def _check_batch_not_specialised(shape_env: Any, symbols: Sequence[Any], model_name: str) -> None:
    for s in symbols:
        r = shape_env.replacements.get(s)
        if r is not None and getattr(r, "is_number", False):
            raise ModelError(f"model {model_name} fixes the batch size to {r} inside forward (e.g. a view with "
                             "a literal batch size); take sizes from the input (x.view(x.size(0), ...)) so that "
                             "it can run at any per-device batch size")


def placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _has_tensor(node: Node) -> bool:
    return bool(tensor_leaves(node.meta.get("val")))


def tensor_leaves(val: Any) -> list[tuple[int, torch.Tensor]]:
    """(index within the node's value, tensor) for a tensor value or a tuple/list of tensors."""
    if isinstance(val, torch.Tensor):
        return [(0, val)]
    if isinstance(val, (tuple, list)):
        return [(i, v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []



class Sizes:
    """Concrete sizes at the graph's batch size; batch dims from the batch symbol(s)."""

    def __init__(self, symbols: Sequence[Any], batch_size: int) -> None:
        import sympy

        self.symbols = frozenset(symbols)
        self.subs = {s: sympy.Integer(batch_size) for s in symbols}
        self._cache: dict[Any, int] = {}

    def value(self, x: Any) -> Any:
        """``x`` with a SymInt/SymFloat/SymBool replaced by its value at the batch size."""
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = x.node.expr
            v = self._cache.get(expr)
            if v is None:
                e = expr.xreplace(self.subs)
                if not e.is_number:
                    raise ModelError(f"a tensor size depends on tensor values ({expr}); models with "
                                     "data-dependent shapes cannot be captured")
                conv = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(x)]
                v = self._cache[expr] = conv(e)
            return v
        return x

    def shape(self, t: torch.Tensor) -> list[int]:
        return [int(self.value(s)) for s in t.shape]

    def batch_dim(self, t: torch.Tensor) -> int | None:
        for i, s in enumerate(t.shape):
            if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & self.symbols:
                return i
        return None
