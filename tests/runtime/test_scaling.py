"""Batch-scaling exponents: measured by running the step on k and on 2k (duplicated) samples."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from heterog.runtime import capture_model_for_runtime
from heterog.runtime.scaling import _duplicate, lockstep, measured_exponent, probe_exponents
from heterog.runtime.stepprog import _refs
from tests.runtime.conftest import model


def test_measured_exponent_reads_powers_of_two_against_the_duplicated_value() -> None:
    v1 = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    dup = torch.cat([v1, v1])
    assert measured_exponent(v1, dup, 0) == 0
    assert measured_exponent(v1, 0.5 * dup, 0) == -1
    assert measured_exponent(v1, 2.0 * v1, None) == 1
    assert measured_exponent(v1, dup + torch.tensor([[0.0, 1.0]] * 4), 0) is None      # samples interact
    assert measured_exponent(torch.tensor([1, 2]), torch.tensor([1, 2, 1, 2]), 0) == 0
    assert measured_exponent(torch.tensor([1e-12]), torch.tensor([-3e-12]), None, zero_below=1e-9) == 0


def test_tiny_mlp_exponents_forward_backward_loss_and_token_count() -> None:
    m = model("tiny_mlp")
    exps = probe_exponents(m.prog, m.params, m.buffers, m.state, m.example_inputs)
    by_name = {m.graph.ops[op].name: (op, k) for (op, k) in m.prog.leaves}
    ops = {op.name: i for i, op in enumerate(m.graph.ops)}
    assert exps[(ops["addmm"], 0)] == 0                       # forward activation
    assert exps[(ops["nll_loss_backward"], 0)] == -1          # backward activation: 1/b of the mean
    assert exps[(ops["nll_loss_forward"], 0)] == 0            # the loss: a mean
    assert exps[(ops["nll_loss_forward"], 1)] == 1            # its total weight, an output no getitem picks
    # the token count, computed from the targets (heterog.graph.normalisers): an integer sum, then a float
    assert exps[(ops["sum_default"], 0)] == 1 and exps[(ops["_to_copy_default"], 0)] == 1
    assert exps[(ops["mm_1"], 0)] == 0                        # a weight gradient: a mean
    assert not exps.coupled and not exps.statistics and "addmm" in by_name


def test_the_probe_holds_only_the_values_later_ops_read() -> None:
    """The two runs go op by op and drop every value once its last reader has run: at no op do they hold
    more than a fifth of the step's values (a probe that kept them all would hold every one by the end)."""
    m = model("tiny_transformer")
    prog, k = m.prog, 2
    small = [x[:k] if prog.input_batched(i) else x for i, x in enumerate(m.example_inputs)]
    doubled = [_duplicate(x, k) if prog.input_batched(i) else x for i, x in enumerate(m.example_inputs)]
    fixed = set(prog.placeholders) | set(prog.consts)
    held: list[tuple[int, int]] = []
    lockstep(prog, m.params, m.buffers, m.state, small, doubled, {},
             lambda op, env1, env2: held.append((len(env1.keys() - fixed), len(env2.keys() - fixed))), None)
    values = sum(len(nodes) for nodes in prog.op_nodes)
    assert len(held) == sum(1 for nodes in prog.op_nodes if nodes)
    assert max(max(h) for h in held) < values / 5 and held[-1][0] <= 2


@pytest.mark.parametrize("name", ["tiny_transformer", "tiny_cnn"])
def test_each_value_is_dropped_once_after_its_last_reader(name) -> None:
    """What a run op by op drops after each op (the probe's two runs, a single-process step): every value but
    the placeholders, constants and the kept ones, exactly once, and never before an op that reads it."""
    prog = model(name).prog
    keep = {*prog.outputs, *(node for _, node in prog.buffer_updates)}
    drops = prog.last_readers(keep=keep)
    dropped_at = {n: op for op, names in enumerate(drops) for n in names}
    assert sum(map(len, drops)) == len(dropped_at)
    made = {n for nodes in prog.op_nodes for n in nodes}
    assert set(dropped_at) == made - keep - set(prog.placeholders)
    for op, nodes in enumerate(prog.op_nodes):
        for n in nodes:
            for read in _refs((prog.calls[n].args, prog.calls[n].kwargs)):
                assert dropped_at.get(read, op) >= op, (read, dropped_at[read], op)


def test_batch_statistics_are_found_and_kept_per_replica() -> None:
    torch.manual_seed(0)

    class BNNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.bn(self.fc(x)), y)

    m = capture_model_for_runtime(BNNet(), (torch.randn(6, 4), torch.randint(0, 3, (6,))))
    exps = probe_exponents(m.prog, m.params, m.buffers, m.state, m.example_inputs)
    stats = {m.graph.ops[op].target for op, _ in exps.statistics}
    # its mean and inverse std (the running statistics are outputs of the step: the functional overload)
    assert stats == {"aten._native_batch_norm_legit_functional.default"}


@pytest.mark.parametrize("name", ["tiny_cnn", "tiny_transformer"])
def test_backward_activations_scale_with_one_over_the_local_batch(name) -> None:
    m = model(name)
    exps = probe_exponents(m.prog, m.params, m.buffers, m.state, m.example_inputs)
    batch_leaves = [(leaf, info) for leaf, info in m.prog.leaves.items()
                    if info.batch_dim is not None and m.prog.op_kind[leaf[0]] == "compute"]
    phases = {m.graph.ops[leaf[0]].phase for leaf, _ in batch_leaves}
    assert phases == {"forward", "backward"}
    for leaf, info in batch_leaves:
        if info.dtype.is_floating_point:
            expected = -1 if m.graph.ops[leaf[0]].phase == "backward" else 0
            assert exps[leaf] == expected, m.graph.ops[leaf[0]].name
