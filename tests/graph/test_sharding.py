"""Split options (heterog.graph.sharding): every option of every op of small zoo and Hugging Face models,
run on uneven shards of real tensors, gives the whole op's result; hand-checked options of Linear,
convolution, layer norm, embedding and attention; views carrying shards; the JSON form; the options'
tensors match the graph's edges."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from heterog import zoo
from heterog.graph.capture import capture_fx, graph_from_step
from heterog.graph.opgraph import OpGraph
from heterog.graph.shard_exec import ShardRunner, combine, dense_like, shard_of
from heterog.graph.sharding import (
    OpSplits,
    SplitOption,
    coverage,
    rule_sources,
    split_options,
    splits_from_json,
    splits_to_json,
)
from heterog.graph.split_rules import TensorInfo
from heterog.graph.split_views import propagate_view
from heterog.graph.tracing import CapturedStep
from heterog.placement import Shard, parse, text
from tests.runtime import transformers_models as tm

B = 4                   # batch; batch splits over 3 devices take shares (1, 1, 2)
DEVICES = 3
aten = torch.ops.aten

Key = tuple[str, "int | None"]


def uneven_shares(extent: int, devices: int = DEVICES) -> list[int]:
    """Shares of ``extent`` over up to ``devices`` devices in proportion 1 : 2 : 4 (each at least 1):
    7 -> (1, 2, 4), 16 -> (2, 4, 10), 4 -> (1, 1, 2), 2 -> (1, 1)."""
    n = min(devices, extent)
    weights = [2 ** i for i in range(n)]
    shares = [max(1, extent * w // sum(weights)) for w in weights[:-1]]
    return shares + [extent - sum(shares)]


def test_uneven_shares() -> None:
    assert uneven_shares(7) == [1, 2, 4]
    assert uneven_shares(16) == [2, 4, 10]
    assert uneven_shares(4) == [1, 1, 2]
    assert uneven_shares(2) == [1, 1]


# ---------------------------------------------------------------------------- captured models with values
@dataclass
class Case:
    """A captured small model, its split options and, per op, the values it read and gave when the whole
    step ran on real tensors."""

    step: CapturedStep
    graph: OpGraph
    splits: list[OpSplits]
    read: list[dict[Key, torch.Tensor]]         # per op: its inputs before it ran (a graph input: itself)
    gave: list[dict[Key, torch.Tensor]]         # per op: its exits (later ops may write into buffers)
    mutated: list[dict[Key, torch.Tensor]]      # per op: inputs it wrote into, after it ran


_CASES: dict[str, Case] = {}


@pytest.fixture(autouse=True, scope="module")
def _small_kernels() -> Iterator[None]:
    """Thousands of tiny ops: one intra-op thread (a second one spins for nothing, and on a loaded
    machine costs several times the work) and ATen's own convolutions (oneDNN builds a kernel for every
    new shard shape)."""
    threads, onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.backends.mkldnn.enabled = onednn

ZOO = ("tiny_mlp", "tiny_cnn", "tiny_transformer", "bert_large", "gpt2", "vgg19", "resnet50")
HF = ("bert", "gpt2", "llama", "vit")        # vit: CPU flash attention (a rule written here)


def _build(model: str) -> tuple[torch.nn.Module, object]:
    model = model.removesuffix(":unfused")
    if model.startswith("hf_"):
        return tm.EQUIVALENCE_MODELS[model[3:]](B)
    return zoo.build(model, B, **zoo.small_overrides(model))


def case(model: str) -> Case:
    """``model`` (a zoo name, or hf_<name> of tests/runtime/transformers_models; ":unfused": every view an
    op of its own) captured once; tiny_mlp with Adam (optimizer state in the update ops), the others
    with SGD."""
    if model in _CASES:
        return _CASES[model]
    logging.getLogger("heterog.graph").setLevel(logging.ERROR)
    torch.manual_seed(0)
    module, inputs = _build(model)
    step = capture_fx(module, inputs, optimizer="adam" if model == "tiny_mlp" else "sgd", tracing_mode="symbolic")
    graph = graph_from_step(step, fuse=not model.endswith(":unfused"))
    splits = split_options(step, graph)
    trainable = [p.detach().clone() for p in module.parameters() if p.requires_grad]
    buffers = [b.detach().clone() for b in module.buffers()]
    buffers += [p.detach().clone() for p in module.parameters() if not p.requires_grad]
    state = [s + 0.1 * torch.rand_like(s) if s.dim() else s for s in step.init_state(trainable)]  # moments >= 0
    env: dict[str, object] = dict(zip(step.placeholders, [*trainable, *buffers, *state,
                                                          *step.input_spec.flatten(inputs)]))
    for node in step.gm.graph.nodes:
        if node.op == "get_attr":
            env[node.name] = getattr(step.gm, node.target)

    def value(key: Key) -> torch.Tensor:
        v = env[key[0]]
        return v[key[1]] if key[1] is not None else v  # type: ignore[index,return-value]

    read, gave, mutated = [], [], []
    for op, s in zip(graph.ops, splits):
        keys = _input_keys(op.kind, op.fx_nodes, s)
        before = {k: value(k).clone() for k in keys}
        step.run_nodes(op.fx_nodes[1:] if op.target == "get_attr" else op.fx_nodes, env)
        read.append(before)
        gave.append({(e.node, e.index): value((e.node, e.index)).clone() for e in s.exits})
        mutated.append({k: value(k).clone() for k in keys
                        if op.kind == "compute" and not torch.equal(value(k), before[k])})
    _CASES[model] = Case(step, graph, splits, read, gave, mutated)
    return _CASES[model]


def _input_keys(kind: str, fx_nodes: list[str], s: OpSplits) -> list[Key]:
    return [(r.node, r.index) for r in s.inputs] if kind == "compute" else [(fx_nodes[0], None)]


# ---------------------------------------------------------------------------- running an option on shards
def _partial_parts(whole: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``n`` tensors summing to ``whole``, each a signed random multiple of it (values beyond 1e30 or not
    finite, e.g. attention masks, whole on the first device)."""
    finite = whole.abs() < 1e30
    parts = [torch.where(finite, whole * (3 * torch.rand(whole.shape, generator=gen) - 1), 0.0 if r else whole)
             for r in range(n - 1)]
    parts.append(torch.where(finite, whole - sum(parts), 0.0))
    return parts


def check_option(c: Case, runner: ShardRunner, index: int, option: SplitOption, gen: torch.Generator) -> str | None:
    """Run op ``index`` under ``option`` on each device's shard (uneven shares) and put the exits back
    together: concatenation along a divided dimension, the sum of partial sums, every replica equal.
    Inputs the op writes into are checked the same way. Returns what differs, or None."""
    op, s = c.graph.ops[index], c.splits[index]
    keys = _input_keys(op.kind, op.fx_nodes, s)
    placements = option.inputs if op.kind == "compute" else option.outputs
    shares = uneven_shares(option.extent) if option.extent is not None else [1] * DEVICES
    n = len(shares)
    local: list[dict[Key, torch.Tensor]] = [{} for _ in range(n)]
    for key, p in zip(keys, placements):
        whole = c.read[index][key]
        parts = (_partial_parts(whole, n, gen) if p == "P" else
                 [dense_like(shard_of(whole, p, option.extent, shares, r), whole) for r in range(n)])
        for r in range(n):
            local[r][key] = parts[r]
    outs = [runner.run(op.fx_nodes, s, option, shares, r, local[r]) for r in range(n)]
    checks = [((e.node, e.index), p, [o[(e.node, e.index)] for o in outs], c.gave[index][(e.node, e.index)])
              for e, p in zip(s.exits, option.exits)]
    checks += [(k, p, [local[r][k] for r in range(n)], after) for k, p in zip(keys, placements)
               for kk, after in c.mutated[index].items() if kk == k]
    for key, p, parts, whole in checks:
        got = parts if p == "R" else [combine(parts, p)]
        scale = 1.0 + (float(whole.abs().max()) if whole.is_floating_point() and whole.numel() else 0.0)
        for g in got:
            try:
                torch.testing.assert_close(g, whole, rtol=1e-4, atol=1e-4 * scale)
            except AssertionError as exc:
                return f"op {index} {op.target} {option}: exit {key} ({p}): {str(exc).splitlines()[0]}"
    return None


@pytest.mark.parametrize("model", [*ZOO, *(f"hf_{m}" for m in HF), "tiny_transformer:unfused"])
def test_every_option_gives_the_whole_result_on_uneven_shares(model: str) -> None:
    c = case(model)
    runner = ShardRunner(c.step)
    gen = torch.Generator().manual_seed(1)
    failures, uneven = [], 0
    for i, s in enumerate(c.splits):
        for option in s.options:
            problem = check_option(c, runner, i, option, gen)
            if problem:
                failures.append(problem)
            uneven += option.extent is not None and len(set(uneven_shares(option.extent))) > 1
    assert not failures, f"{len(failures)} options differ:\n" + "\n".join(failures[:10])
    assert uneven >= 20


# ---------------------------------------------------------------------------- hand-checked options
def _ops(c: Case, target: str, phase: str = "forward") -> list[int]:
    return [i for i, op in enumerate(c.graph.ops) if op.target == target and op.phase == phase]


def _option(s: OpSplits, outputs: tuple[str, ...], inputs: tuple[str, ...]) -> SplitOption:
    found = [o for o in s.options if o.outputs == outputs and o.inputs == inputs]
    assert found, f"no option {inputs} -> {outputs} among {[(o.inputs, o.outputs) for o in s.options]}"
    return found[0]


def test_linear_splits_columns_and_rows() -> None:
    """addmm(bias, x, weight.t()) of tiny_mlp's fc1 (32 -> 64): columns (output features: weight rows,
    bias divided, output S1) and rows (input features: x S1, weight.t() S0, output and bias partial
    sums); the weight stored divided by rows gives exactly the column split's weight.t()."""
    c = case("tiny_mlp")
    i = _ops(c, "aten.addmm.default")[0]
    s = c.splits[i]
    assert [c.graph.ops[r.src].kind for r in s.inputs] == ["param", "input", "param"]
    col = _option(s, ("S1",), ("S0", "R", "S1"))
    assert (col.kind, col.extent, col.source) == ("parameter", 64, "dtensor")
    row = _option(s, ("P",), ("P", "S1", "S0"))
    assert (row.kind, row.extent) == ("parameter", 32)
    batch = _option(s, ("S0",), ("R", "S0", "R"))
    assert (batch.kind, batch.extent) == ("batch", B)
    weight = c.splits[s.inputs[2].src]
    t_exit = [e.node for e in weight.exits].index(s.inputs[2].node)
    assert {o.outputs[0]: o.exits[t_exit] for o in weight.options} == {"S0": "S1", "S1": "S0"}
    assert {o.kind for o in weight.options} == {"parameter"}


def test_matmul_of_the_lm_head_splits_columns_and_rows() -> None:
    """mm(x, weight.t()) (tiny_transformer's head, no bias): columns S1 <- (R, S1), rows P <- (S1, S0)."""
    c = case("tiny_transformer")
    s = c.splits[_ops(c, "aten.mm.default")[0]]
    assert _option(s, ("S1",), ("R", "S1")).kind == "parameter"
    assert _option(s, ("P",), ("S1", "S0")).kind == "parameter"


def test_convolution_splits_output_and_input_channels() -> None:
    """tiny_cnn's conv2 (8 -> 16 channels): output channels (weight rows and bias divided, output S1),
    input channels (input S1, weight columns, partial sums, bias a partial sum too), batch; no spatial
    split (it would need halos). Its backward has the same three."""
    c = case("tiny_cnn")
    s = c.splits[_ops(c, "aten.convolution.default")[1]]
    out_ch = _option(s, ("S1",), ("R", "S0", "S0"))
    in_ch = _option(s, ("P",), ("S1", "S1", "P"))
    assert (out_ch.kind, out_ch.extent, out_ch.source) == ("parameter", 16, "hand")
    assert (in_ch.kind, in_ch.extent) == ("parameter", 8)
    assert _option(s, ("S0",), ("S0", "R", "R")).kind == "batch"
    assert {o.split for o in s.options} == {"S0", "S1", "P"}
    assert rule_sources(c.graph, c.splits)["aten.convolution.default"] == "dtensor+hand"
    back = c.splits[_ops(c, "aten.convolution_backward.default", "backward")[0]]
    assert any(o.outputs == ("P", "S0", "S0") and o.inputs == ("S1", "R", "S0") for o in back.options)
    assert any(o.outputs[:2] == ("S1", "S1") and o.inputs == ("R", "S1", "S1") for o in back.options)


def test_grouped_convolution_splits_whole_groups() -> None:
    """mobilenet_v2's depthwise convolutions (groups = channels): input, weight and output divided by
    whole groups, ``groups`` passed as the local count; no input-channel split. Every option of every
    convolution and its backward runs on uneven shares."""
    c = case("mobilenet_v2")
    convs = _ops(c, "aten.convolution.default") + _ops(c, "aten.convolution_backward.default", "backward")
    nodes = {i: c.step.node(c.graph.ops[i].name) for i in convs}
    depthwise = [i for i, n in nodes.items() if n.args[8 if n.target is aten.convolution.default else 9] != 1]
    assert depthwise
    for i in depthwise:
        groups = [o for o in c.splits[i].options if o.kind == "parameter"]
        assert len(groups) == 1 and groups[0].size_args[0].arg in (8, 9) and groups[0].size_args[0].index is None
    runner, gen = ShardRunner(c.step), torch.Generator().manual_seed(1)
    problems = [check_option(c, runner, i, o, gen) for i in convs for o in c.splits[i].options]
    assert not [p for p in problems if p]


def test_layer_norm_splits_rows_not_features() -> None:
    """native_layer_norm normalises over the features with statistics of all of them: its options
    divide batch and sequence only, its weight and bias stay whole, and its backward gives their
    gradients as partial sums. A decomposed norm (Llama's RMSNorm) divides its features: the mean of
    squares over a divided dimension is a partial sum (written here; DTensor's average partial would be
    wrong for unequal shares)."""
    c = case("tiny_transformer")
    for i in _ops(c, "aten.native_layer_norm.default"):
        s = c.splits[i]
        assert {o.split for o in s.options} == {"S0", "S1"}
        assert all(o.inputs[1:] == ("R", "R") and o.kind != "parameter" for o in s.options)
    back = c.splits[_ops(c, "aten.native_layer_norm_backward.default", "backward")[0]]
    assert {o.outputs for o in back.options if o.kind != "partial"} == {("S0", "P", "P"), ("S1", "P", "P")}
    llama = case("hf_llama")
    means = [c2 for i in _ops(llama, "aten.mean.dim") for c2 in llama.splits[i].options if c2.transform]
    assert means and all(o.outputs == ("P",) and o.inputs == ("S2",) and o.transform == "partial_mean"
                         for o in means)


def test_embedding_splits_rows_and_columns() -> None:
    """embedding(weight, ids) of tiny_transformer (vocab 64, width 16): rows (each device looks up the
    ids in its rows, zeros elsewhere: partial sums) and columns (output S2); its weight gradient
    divides the same rows (written here) and columns (DTensor)."""
    c = case("tiny_transformer")
    s = c.splits[_ops(c, "aten.embedding.default")[0]]
    rows = _option(s, ("P",), ("S0", "R"))
    assert (rows.kind, rows.extent, rows.transform, rows.source) == ("parameter", 64, "embedding_rows", "hand")
    cols = _option(s, ("S2",), ("S1", "R"))
    assert (cols.kind, cols.extent, cols.transform) == ("parameter", 16, None)
    back = c.splits[_ops(c, "aten.embedding_dense_backward.default", "backward")[0]]
    assert _option(back, ("S0",), ("R", "R")).transform == "embedding_rows"
    assert _option(back, ("S1",), ("S2", "R")).transform is None


def test_attention_heads() -> None:
    """A query projection divided by columns gives the attention its heads (2 of 8 features each: the
    extent drops from 16 features to 2 heads); the score matmul on (batch * heads, S, S) divides heads
    as dim 0 in B outer blocks ("S0:4") and gives them back as dim 1 of (B, heads, S, S)."""
    c = case("tiny_transformer")
    q = c.splits[_ops(c, "aten.addmm.default")[0]]
    col = _option(q, ("S1",), ("S0", "R", "S1"))
    assert (col.exits, col.extent) == (("S1",), 2)
    assert any(a.index == 2 for a in col.size_args)      # view (B, S, heads, hd): heads passed as local
    scores = c.splits[_ops(c, "aten.bmm.default")[0]]
    heads = _option(scores, ("S0:4",), ("S0:4", "S0:4"))
    assert (heads.exits, heads.extent, heads.kind) == (("S1",), 2, "attribute")


def test_random_ops_get_no_option() -> None:
    c = case("hf_gpt2")
    dropout = [s for op, s in zip(c.graph.ops, c.splits) if op.draws]
    assert dropout and all(s.source == "random" and not s.options for s in dropout)


# ---------------------------------------------------------------------------- the options' tensors and form
@pytest.mark.parametrize("model", ["tiny_transformer", "resnet50", "hf_llama"])
def test_inputs_and_exits_match_the_graph_edges(model: str) -> None:
    """Every tensor an op reads is an exit of its producer and rides an edge producer -> op with the
    producer output it derives from; every option has one placement per input, output and exit."""
    c = case(model)
    edges = {(e.src, e.dst, e.src_output) for e in c.graph.edges}
    for i, (op, s) in enumerate(zip(c.graph.ops, c.splits)):
        for ref in s.inputs:
            assert (ref.src, i, ref.src_output) in edges
            assert (ref.node, ref.index) in {(e.node, e.index) for e in c.splits[ref.src].exits}
        for o in s.options:
            assert (len(o.inputs), len(o.outputs), len(o.exits)) == (len(s.inputs), len(op.output_shapes),
                                                                    len(s.exits))


def test_json_form_round_trips() -> None:
    c = case("tiny_transformer")
    data = json.loads(json.dumps(splits_to_json(c.splits)))
    assert splits_from_json(data) == c.splits
    assert data[c.splits.index(c.splits[_ops(c, "aten.embedding.default")[0]])]["options"]


def test_coverage_counts_ops_split_beyond_the_batch() -> None:
    c = case("tiny_mlp")
    compute = [s for op, s in zip(c.graph.ops, c.splits) if op.kind == "compute"]
    beyond = sum(any(o.kind in ("parameter", "attribute") for o in s.options) for s in compute)
    assert coverage(c.graph, c.splits) == beyond / len(compute) > 0.5


# ---------------------------------------------------------------------------- views and shards
def _view(src: tuple[int, ...], dst: tuple[int, ...], shard: Shard, extent: int) -> tuple[str, int | None] | None:
    step = propagate_view(aten.view.default, (TensorInfo(src, torch.float32), list(dst)), {},
                          TensorInfo(src, torch.float32), TensorInfo(dst, torch.float32), shard, extent)
    if step is None:
        return None
    assert isinstance(step.placement, Shard)
    return str(step.placement), step.extent


def test_views_carry_shards_with_hand_computed_extents() -> None:
    assert _view((4, 8, 16), (32, 16), Shard(0), 4) == ("S0", 4)          # batch rows stay together
    assert _view((4, 8, 16), (32, 16), Shard(2), 16) == ("S1", 16)        # features
    assert _view((4, 8, 16), (32, 16), Shard(1), 8) == ("S0:4", 8)        # sequence inside batch * seq
    assert _view((32, 16), (4, 8, 16), Shard(0), 32) == ("S0", 4)         # units grouped by 8: whole rows
    assert _view((32, 16), (4, 8, 2, 8), Shard(1), 16) == ("S2", 2)       # features -> heads of 8
    assert _view((4, 2, 8, 8), (8, 8, 8), Shard(1), 2) == ("S0:4", 2)     # heads inside batch * heads
    assert _view((8, 8, 8), (4, 2, 8, 8), Shard(0, 4), 2) == ("S1", 2)    # and back
    assert _view((6, 5), (2, 15), Shard(0), 6) == ("S0", 2)               # 6 rows -> 2 units of 3
    assert _view((6, 5), (3, 10), Shard(1), 5) == ("S1:2", 5)             # two rows of 5 in each row of 10
    assert _view((6, 5), (5, 6), Shard(1), 5) is None                     # columns across rows


def test_shard_and_combine_are_inverse_for_uneven_and_strided_shards() -> None:
    whole = torch.arange(4 * 6 * 3.0).reshape(4 * 6, 3)
    for placement in ("S0", "S0:4", "S1"):
        p = parse(placement)
        assert isinstance(p, Shard) and text(p) == placement
        extent = whole.shape[p.dim] // p.sf
        shares = uneven_shares(extent)
        parts = [shard_of(whole, placement, extent, shares, r) for r in range(len(shares))]
        assert [t.shape[p.dim] for t in parts] == [p.sf * s for s in shares]
        assert torch.equal(combine(parts, placement), whole)
    transposed = whole.t()
    assert dense_like(transposed[:, :5], transposed).stride() == (1, 3)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_a_scan_is_never_divided_along_the_dimension_it_scans(dim) -> None:
    """cumsum over a divided dimension would sum each shard's own entries only (a router's capacity count
    over the sequence came out per shard)."""
    from heterog.graph.split_rules import node_rules

    x = TensorInfo((4, 6, 3), torch.float32)
    rules, _ = node_rules(torch.ops.aten.cumsum.default, (x, dim), {}, [x])
    assert rules                                           # the other dimensions still divide
    scanned = dim % 3
    for r in rules:
        assert not any(isinstance(p, Shard) and p.dim == scanned for p in (*r.inputs, *r.outputs)), r
