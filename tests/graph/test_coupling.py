"""Ops that couple samples (heterog.graph.coupling): told apart at capture by the degree of the batch symbol
in their sizes, and by values made from the batch size alone that only they read."""
from __future__ import annotations

import json
import logging

import pytest
import sympy
import torch
from torch import nn
from torch.nn import functional as F

import heterog
from heterog.graph.coupling import BatchDegree


class Towers(nn.Module):
    """A two-tower contrastive model: a B x B similarity with ``arange(len(logits))`` as labels (CLIP's loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        za, zb = F.normalize(self.a(x), dim=1), F.normalize(self.b(y), dim=1)
        logits = za @ zb.t() * 10.0
        labels = torch.arange(len(logits))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def towers_inputs(batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 5, generator=g), torch.randn(batch, 6, generator=g)


@pytest.fixture(scope="module")
def towers() -> heterog.OpGraph:
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    return heterog.capture(Towers(), towers_inputs())


def test_the_degree_of_the_batch_in_a_size() -> None:
    s, t = sympy.symbols("s0 s1", positive=True, integer=True)
    degree = BatchDegree([s])

    class Size(torch.SymInt):                       # what the degree reads of a SymInt: node.expr
        def __init__(self, expr: object) -> None:
            self.node = type("Node", (), {"expr": expr})()

    exprs = (s, 12 * s, s ** 2, s * (s - 1), sympy.floor(s / 2), t, sympy.Integer(12))
    assert [degree.of_size(Size(e)) for e in exprs] == [1, 1, 2, 2, 1, 0, 0]
    assert degree.of_size(12) == 0


def test_ops_that_pair_samples_are_coupled_and_the_towers_are_not(towers) -> None:
    coupled = {op.name: op for op in towers.ops if op.coupled}
    assert coupled and towers.meta["coupled_ops"] >= len(coupled)
    for op in coupled.values():
        assert op.kind == "compute"
    # the B x B similarity and its gradient, the labels made from the batch size, the losses over all pairs
    assert any(op.target == "aten.mm.default" and op.output_shapes[0] == [6, 6] for op in coupled.values())
    assert any(op.target.startswith("aten.arange") for op in coupled.values())
    assert any(op.target.startswith("aten.nll_loss_forward") for op in coupled.values())
    assert any(op.target == "aten.mm.default" and op.output_shapes[0] == [6, 4] and op.phase == "backward"
               for op in coupled.values())
    # the towers (their linear layers, forward and backward) run on each replica's samples
    assert not any(op.target == "aten.addmm.default" for op in coupled.values())
    assert not any(op.is_grad and op.param in ("a.weight", "b.weight") for op in coupled.values())


def test_graph_files_without_coupled_ops_still_load(towers, tmp_path) -> None:
    d = towers.to_dict()
    for op in d["ops"]:
        op.pop("coupled")
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = heterog.load_graph(tmp_path / "old.json")
    assert not old.coupled.any() and old.fingerprint == towers.fingerprint


class AlongTheBatch(nn.Module):
    """Ops along a dimension of size B: ranks over the batch divided by the batch size, a running sum over the
    samples, a softmax over them, the batch flipped; and, not coupling, a running sum over the sequence and
    (``route``) a sort of the flattened B * T tokens put back (a router's)."""

    def __init__(self, route: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.route = route

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)                                               # (B, T, 4)
        if self.route:
            tokens = h.reshape(-1, 4)
            order = tokens[:, 0].argsort()
            h = tokens[order][order.argsort()].view_as(h)
        h = h + h.cumsum(1)
        p = h.mean(1)                                               # (B, 4)
        p = p * (p[:, :1].argsort(0).float() / x.shape[0]) + p.cumsum(0) / x.shape[0]
        p = p * F.softmax(p[:, 1:2], dim=0) + 0.5 * p.flip(0)
        return F.cross_entropy(self.b(p), y)


def along_inputs(batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(batch, 3, 4, generator=g), torch.randint(0, 3, (batch,), generator=g)


def test_ops_along_the_batch_are_coupled_and_ops_along_its_tokens_are_not() -> None:
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    g = heterog.capture(AlongTheBatch(), along_inputs())
    coupled = [op for op in g.ops if op.coupled]
    targets = {op.target for op in coupled}
    for name in ("aten.sort.default", "aten.cumsum.default", "aten._softmax.default", "aten.flip.default",
                 "aten.div.Tensor", "aten._to_copy.default"):
        assert name in targets, (name, sorted(targets))
    # along the batch only: the running sum over the sequence and the tokens' sort are each sample's own
    assert not any(op.target == "aten.cumsum.default" and len(op.output_shapes[0]) == 3 for op in coupled)
    assert not any(op.target == "aten.sort.default" and op.output_shapes[0] == [18] for op in coupled)
    assert not any(op.target == "aten.addmm.default" for op in coupled)
