"""experiments/models: the user-style models the fidelity measurements use follow the model contract."""
from __future__ import annotations

import math

import pytest
import torch

from heterog.graph.modelref import load_model_fn


def test_decoder_tied_follows_the_contract_and_ties_the_output_projection() -> None:
    module, (ids, labels) = load_model_fn("experiments/models/decoder_tied.py:build")(4)
    from experiments.models.decoder_tied import SEQ_LEN, VOCAB

    assert ids.shape == labels.shape == (4, SEQ_LEN) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])                  # next-token targets
    assert module.lm_head.weight is module.embed.weight
    blocks = list(module.blocks)
    assert len(blocks) in (2, 3) and all(isinstance(b, torch.nn.TransformerEncoderLayer) and b.norm_first
                                        for b in blocks)
    with torch.no_grad():
        loss = module(ids, labels)
    assert loss.shape == () and loss.item() == pytest.approx(math.log(VOCAB), abs=0.1)   # small random init
    again = load_model_fn("experiments/models/decoder_tied.py:build")(4)
    assert torch.equal(again[1][0], ids) and torch.equal(again[0].embed.weight, module.embed.weight)
