"""Value checks (heterog.graph.value_checks): a branch on tensor values whose one side only raises is captured
on the side the example inputs take, recorded on the graph and checked on every step's inputs; any other
branch on values keeps its error."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import heterog
from heterog.errors import DataDependentControlFlowError, ModelError
from heterog.graph.opgraph import OpGraph
from heterog.runtime import capture_model_for_runtime, train_single_process

N_CLASSES = 4


class Checked(nn.Module):
    """A classifier that validates its labels, as model libraries do."""

    def __init__(self, check: str = "labels") -> None:
        super().__init__()
        self.fc = nn.Linear(3, N_CLASSES)
        self.check = check

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.check == "labels" and y.max() >= N_CLASSES:
            raise ValueError(f"labels must be below {N_CLASSES}")
        if self.check == "assert":
            assert (y >= 0).all(), "negative label"
        if self.check == "params" and self.fc.weight.abs().max() > 100:
            raise ValueError("weights blew up")
        if self.check == "branch" and y.max() > 1:          # not a validation: both sides compute
            x = x * 2
        return F.cross_entropy(self.fc(x), y)


def _inputs(batch: int = 6, top: int = N_CLASSES) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, generator=g), torch.randint(0, top, (batch,), generator=g)


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)


@pytest.mark.parametrize("check, code, holds", [("labels", "y.max() >= N_CLASSES", False),
                                                ("assert", "(y >= 0).all()", True)])
def test_a_validation_is_captured_and_recorded_as_an_assumption(check, code, holds, tmp_path) -> None:
    g = heterog.capture(Checked(check), _inputs())
    assert [(a["code"], a["holds"]) for a in g.assumptions] == [(code, holds)]
    assert g.assumptions[0]["where"].endswith(f"test_value_checks.py:{_line_of(code)}")
    assert not any(op.target.startswith(("aten.max", "aten.ge", "aten.all")) for op in g.ops)   # no dead ops
    path = g.save(tmp_path / "g.json")
    assert heterog.load_graph(path).assumptions == g.assumptions


def test_graph_files_without_assumptions_still_load(tmp_path) -> None:
    d = heterog.capture(Checked("none"), _inputs()).to_dict()
    d.pop("assumptions")
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert heterog.load_graph(tmp_path / "old.json").assumptions == []
    assert OpGraph.from_dict(d).assumptions == []


def test_example_inputs_on_the_raising_side_are_refused_with_the_models_message() -> None:
    with pytest.raises(ModelError, match=r"example inputs fail the model's own check at .*test_value_checks.py:\d+ "
                                         r"\(y.max\(\) >= N_CLASSES\): ValueError: labels must be below 4"):
        heterog.capture(Checked("labels"), _inputs(top=N_CLASSES + 2))


def test_a_check_that_reads_parameters_is_refused_naming_it() -> None:
    with pytest.raises(DataDependentControlFlowError, match=r"the check at .*test_value_checks.py:\d+ "
                                                            r"\(self.fc.weight.abs\(\).max\(\) > 100\) reads"):
        heterog.capture(Checked("params"), _inputs())


def test_other_branches_on_values_keep_their_error() -> None:
    with pytest.raises(DataDependentControlFlowError, match=r"test_value_checks.py:\d+ in forward\(\) "
                                                            r"\(if self.check == \"branch\" and y.max\(\) > 1:"):
        heterog.capture(Checked("branch"), _inputs())


def test_each_steps_inputs_are_checked_in_one_line() -> None:
    m = capture_model_for_runtime(Checked("labels"), _inputs(), lr=0.1)
    good, bad = list(_inputs()), list(_inputs())
    bad[1] = bad[1].clone()
    bad[1][2] = N_CLASSES + 3
    losses, _ = train_single_process(m, [good], 2)
    assert len(losses) == 2
    with pytest.raises(ModelError) as info:
        train_single_process(m, [good, bad], 2)
    msg = str(info.value)
    assert msg.startswith("step 1: the inputs break the model's check at ") and "\n" not in msg
    assert "y.max() >= N_CLASSES is True, where the captured step assumes False" in msg


def _line_of(code: str) -> int:
    text = open(__file__).read().splitlines()
    return next(i + 1 for i, line in enumerate(text) if code in line and ("if " in line or "assert " in line))
