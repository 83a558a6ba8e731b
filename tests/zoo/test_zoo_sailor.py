"""The models of Sailor's validation runs: Hugging Face configurations, keyword inputs, dropout as Sailor's
training has it, the Metis/Sailor layer numbering of their captured graphs and parameter bytes per block."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import heterog
from heterog import zoo
from heterog.baselines.expert import block_layers

OPT_SMALL = {"layers": 3, "hidden": 32, "heads": 4, "ffn": 64, "embed_proj": 16, "vocab": 100, "seq_len": 16}
NEO_SMALL = {"layers": 3, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16}


def test_full_configurations_are_the_published_ones():
    opt, opt_inputs = zoo.build("opt_350m", 2, device="meta")
    neo, neo_inputs = zoo.build("gpt_neo_2_7b", 2, device="meta")
    c = opt.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.ffn_dim, c.word_embed_proj_dim,
            c.vocab_size, c.max_position_embeddings, c.do_layer_norm_before) == (24, 1024, 16, 4096, 512, 50272,
                                                                                  2048, False)
    assert (c.dropout, c.attention_dropout) == (0.0, 0.0)
    c = neo.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.vocab_size, c.max_position_embeddings,
            c.window_size) == (32, 2560, 20, 50257, 2048, 256)
    assert c.attention_layers == ["global", "local"] * 16
    assert (c.embed_dropout, c.resid_dropout, c.attention_dropout) == (0.1, 0.1, 0.0)
    for inputs in (opt_inputs, neo_inputs):
        assert set(inputs) == {"input_ids", "labels"} and inputs["input_ids"].shape == (2, 2048)


def test_labels_are_the_ids_and_the_loss_is_the_mean_token_loss():
    module, inputs = zoo.build("opt_350m", 2, dtype=torch.float64, **OPT_SMALL)
    assert torch.equal(inputs["input_ids"], inputs["labels"])
    with torch.no_grad():
        out = module(**inputs)
    logits = out.logits[:, :-1].reshape(-1, 100)
    expected = torch.nn.functional.cross_entropy(logits, inputs["labels"][:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-6)   # HF takes the loss in fp32


@pytest.mark.parametrize("name, overrides", [("opt_350m", OPT_SMALL), ("gpt_neo_2_7b", NEO_SMALL)])
def test_captured_blocks_follow_the_metis_numbering(name, overrides):
    module, inputs = zoo.build(name, 2, device="meta", **overrides)
    graph = heterog.capture(module, inputs)
    layer_of, n_blocks = block_layers(graph)
    assert n_blocks == 3 and set(layer_of.tolist()) == {0, 1, 2, 3, 4}


def test_parameter_bytes_per_block_match_the_metis_profile():
    # Metis' OPT-350 profiles (eth-easl/sailor cf2c8e3, sailor/Planner/baselines/Metis/profiles/OPT-350/GH-96/
    # mbs1_tmp1.json) give 50,384,896 bytes for each of the 24 transformer blocks: fp32, 12,596,224 parameters
    module, _ = zoo.build("opt_350m", 1, device="meta")
    per_block = {sum(p.numel() * 4 for p in block.parameters()) for block in module.model.decoder.layers}
    assert per_block == {50_384_896}
    neo, _ = zoo.build("gpt_neo_2_7b", 1, device="meta")
    # 12 h^2 + 10 h with h = 2560 (q, k, v without bias; out h, fc 4h, proj h biases; two LayerNorms 4h); the
    # Metis profile of GPT-Neo-2.7 has 12 h^2 + 13 h per block: Megatron gives q, k and v biases
    assert {sum(p.numel() for p in block.parameters()) for block in neo.transformer.h} == {12 * 2560**2 + 10 * 2560}


def test_megatron_opt_layers_hold_the_parameters_of_the_metis_profile():
    # parameters_per_layer_bytes of Metis' OPT-350 profile (eth-easl/sailor cf2c8e3, sailor/Planner/baselines/
    # Metis/profiles/OPT-350/GH-96/mbs1_tmp1.json): layer 0 (token and position embeddings), 24 blocks, the
    # final norm with the untied output layer; fp32. HF's position table has 2 offset rows (2 x 1024 x 4 bytes).
    module, inputs = zoo.build("opt_350m_megatron", 2, device="meta", layers=2)
    graph = heterog.capture(module, inputs)
    layer_of, n_blocks = block_layers(graph)
    held = np.bincount(layer_of, weights=[op.param_bytes for op in graph.ops], minlength=n_blocks + 2)
    assert held.tolist() == [214_433_792 + 2 * 1024 * 4, 50_384_896, 50_384_896, 206_053_376]


@pytest.mark.parametrize("name, overrides", [("opt_350m_megatron", {k: v for k, v in OPT_SMALL.items()
                                                                    if k != "embed_proj"}),
                                             ("gpt_neo_2_7b_megatron", {**NEO_SMALL, "dropout": 0.0})])
def test_megatron_attention_computes_what_eager_attention_does(name, overrides):
    """The Megatron-layout models attend as Megatron's kernels do (scale inside the score product, only the
    softmax kept, no dropout at p = 0): the same loss and gradients as Hugging Face's eager attention."""
    torch.manual_seed(0)
    module, inputs = zoo.build(name, 2, dtype=torch.float64, **overrides)
    assert module.config._attn_implementation == "heterog-megatron"
    assert not any(isinstance(m, torch.nn.Dropout) for n, m in module.named_modules() if n.endswith("attn_dropout"))

    def loss_and_grads(implementation: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module.config._attn_implementation = implementation
        module.zero_grad()
        loss = module(**inputs).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.parameters()]

    ours, eager = loss_and_grads(module.config._attn_implementation), loss_and_grads("eager")
    torch.testing.assert_close(ours[0], eager[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(ours[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)     # the loss is taken in fp32
