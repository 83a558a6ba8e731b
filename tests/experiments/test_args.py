"""The experiments' shared argument helpers: MODEL:BATCH specs and the parser."""
from __future__ import annotations

import pytest

from experiments.args import argparse_type, model_batch, model_batch_list, parser
from heterog.errors import HeterogError


def test_model_batch_specs():
    assert model_batch("resnet50:128") == ("resnet50", 128)
    assert model_batch_list("vgg19:192, bert_large:48,") == [("vgg19", 192), ("bert_large", 48)]
    for bad in ("resnet50", "resnet50:", ":8", "resnet50:x", "resnet50:0"):
        with pytest.raises(HeterogError, match="must be MODEL:BATCH, e.g. resnet50:128"):
            model_batch(bad)


def test_parser_names_the_module_and_turns_bad_specs_into_usage_errors(capsys):
    ap = parser("experiments.x", "First paragraph\nstill first.\n\nSecond paragraph.")
    ap.add_argument("--models", type=argparse_type(model_batch_list), default="tiny_cnn:8")
    assert ap.prog == "python -m experiments.x" and ap.description == "First paragraph\nstill first."
    assert ap.parse_args([]).models == [("tiny_cnn", 8)]
    with pytest.raises(SystemExit) as exc:
        ap.parse_args(["--models", "tiny_cnn"])
    assert exc.value.code == 2 and "graph 'tiny_cnn' must be MODEL:BATCH" in capsys.readouterr().err
