"""Decoder-only causal language model in the GPT-2 layout (Radford et al. 2019): learned positions,
pre-LN blocks with tanh-GELU, final LayerNorm and output tied to the token embedding."""
from __future__ import annotations

import math

import torch
from torch import nn

from heterog.errors import HeterogError
from heterog.zoo.common import Builder, InputFactory, Inputs, check_positive, dropout
from heterog.zoo.layers import TransformerLayer, causal_mask, init_normal, token_loss

LN_EPS = 1e-5


class CausalLM(nn.Module):
    """GPT-2 style language model; loss is the mean next-token CE over all B*T positions.

    Args:
        vocab, max_positions: token and position tables (GPT-2: 50257, 1024).
        layers, hidden, heads, ffn: decoder size (GPT-2 small: 12, 768, 12, 3072).
        dropout_p: embedding/residual/attention dropout (GPT-2 0.1; default 0 keeps steps deterministic).

    Shapes:
        input_ids `(B, T)`, labels `(B, T)` (input shifted by one) -> scalar mean loss.
    """

    def __init__(
        self,
        *,
        vocab: int,
        max_positions: int,
        layers: int,
        hidden: int,
        heads: int,
        ffn: int,
        dropout_p: float,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_positions, hidden)
        self.drop = dropout(dropout_p)
        self.blocks = nn.ModuleList(
            TransformerLayer(hidden, heads, ffn, activation="gelu_tanh", norm_first=True, eps=LN_EPS,
                             dropout_p=dropout_p)
            for _ in range(layers)
        )
        self.final_norm = nn.LayerNorm(hidden, eps=LN_EPS)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02), with the residual output projections scaled by 1/sqrt(2 * layers) (GPT-2)."""
        init_normal(self, 0.02)
        residual_std = 0.02 / math.sqrt(2 * max(1, len(self.blocks)))
        for block in self.blocks:
            assert isinstance(block, TransformerLayer)
            nn.init.normal_(block.self_attn.out.weight, std=residual_std)
            nn.init.normal_(block.ffn.fc2.weight, std=residual_std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        x = self.drop(self.wte(input_ids) + self.wpe.weight[:length])
        blocked = causal_mask(length, input_ids.device)
        for block in self.blocks:
            x = block(x, blocked)
        logits = self.final_norm(x) @ self.wte.weight.t()
        return token_loss(logits, labels)


def make_causal_lm_builder(name: str, *, layers: int, hidden: int, heads: int, vocab: int, seq_len: int,
                           max_positions: int) -> Builder:
    """Builder of one causal LM configuration; every causal LM of the zoo (gpt2, gpt2_xl, big_embedding,
    tiny_transformer) has the same knobs."""
    defaults = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq_len": seq_len,
                "max_positions": max_positions}

    def build(
        batch_size: int,
        factory: InputFactory,
        *,
        layers: int = defaults["layers"],
        hidden: int = defaults["hidden"],
        heads: int = defaults["heads"],
        ffn: int | None = None,
        vocab: int = defaults["vocab"],
        seq_len: int = defaults["seq_len"],
        max_positions: int = defaults["max_positions"],
        dropout: float = 0.0,
    ) -> tuple[nn.Module, Inputs]:
        ffn = 4 * hidden if ffn is None else ffn
        check_positive(name, layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab, seq_len=seq_len,
                       max_positions=max_positions)
        if seq_len > max_positions:
            raise HeterogError(f"zoo model '{name}': seq_len {seq_len} exceeds max_positions {max_positions}")
        model = CausalLM(vocab=vocab, max_positions=max_positions, layers=layers, hidden=hidden, heads=heads,
                         ffn=ffn, dropout_p=dropout)
        tokens = factory.integers(vocab, batch_size, seq_len + 1)
        return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    build.__name__ = f"build_{name}"
    return build


build_gpt2 = make_causal_lm_builder("gpt2", layers=12, hidden=768, heads=12, vocab=50257, seq_len=1024,
                                    max_positions=1024)
# GPT-2 XL's size at 640 of its 1024 positions: with Adam (16 bytes per parameter, 25 GB) no data-parallel
# plan fits paper-8gpu, while the activations of 8 x 640 tokens still let a layer-wise plan fit there.
build_gpt2_xl = make_causal_lm_builder("gpt2_xl", layers=48, hidden=1600, heads=25, vocab=50257, seq_len=640,
                                       max_positions=1024)
