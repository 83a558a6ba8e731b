"""The encoder-decoder Transformer of Vaswani et al. 2017 ("base": N=6, d_model 512, 8 heads,
d_ff 2048), post-LN, sinusoidal positions, one shared source/target embedding tied to the output."""
from __future__ import annotations

import math

import torch
from torch import nn

from heterog.zoo.common import InputFactory, Inputs, check_positive, dropout
from heterog.zoo.layers import TransformerLayer, causal_mask, init_normal, sinusoid, token_loss


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer trained with teacher forcing.

    Args:
        vocab: shared source/target (BPE) vocabulary; the one embedding matrix is used for the
            encoder input, the decoder input and the pre-softmax projection (paper section 3.4).
        layers: N encoder and N decoder layers; hidden: d_model; heads; ffn: d_ff.
        label_smoothing: of the cross-entropy (paper 0.1); dropout_p: residual/attention dropout
            (paper 0.1; default 0 keeps steps deterministic).

    Shapes:
        src_ids `(B, S)`, tgt_ids `(B, T)` (decoder input), tgt_labels `(B, T)` -> scalar mean
        token loss.
    """

    def __init__(
        self,
        *,
        vocab: int,
        layers: int,
        hidden: int,
        heads: int,
        ffn: int,
        label_smoothing: float,
        dropout_p: float,
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.label_smoothing = label_smoothing
        self.embed = nn.Embedding(vocab, hidden)
        self.drop = dropout(dropout_p)
        self.encoder = nn.ModuleList(
            TransformerLayer(hidden, heads, ffn, activation="relu", dropout_p=dropout_p)
            for _ in range(layers)
        )
        self.decoder = nn.ModuleList(
            TransformerLayer(hidden, heads, ffn, activation="relu", cross_attention=True, dropout_p=dropout_p)
            for _ in range(layers)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_normal(self, 0.02)
        nn.init.normal_(self.embed.weight, std=self.hidden**-0.5)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        encoding = sinusoid(positions, self.hidden, interleave=True).to(self.embed.weight.dtype)
        return self.drop(self.embed(ids) * math.sqrt(self.hidden) + encoding)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor, tgt_labels: torch.Tensor) -> torch.Tensor:
        memory = self.embed_tokens(src_ids)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embed_tokens(tgt_ids)
        blocked = causal_mask(tgt_ids.shape[1], tgt_ids.device)
        for layer in self.decoder:
            x = layer(x, blocked, memory)
        logits = x @ self.embed.weight.t()
        return token_loss(logits, tgt_labels, self.label_smoothing)


def build_transformer(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 6,
    hidden: int = 512,
    heads: int = 8,
    ffn: int | None = None,
    vocab: int = 37000,
    seq_len: int = 128,
    tgt_len: int | None = None,
    label_smoothing: float = 0.1,
    dropout: float = 0.0,
) -> tuple[nn.Module, Inputs]:
    ffn = 4 * hidden if ffn is None else ffn
    tgt_len = seq_len if tgt_len is None else tgt_len
    check_positive("transformer", layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab,
                   seq_len=seq_len, tgt_len=tgt_len)
    model = Seq2SeqTransformer(vocab=vocab, layers=layers, hidden=hidden, heads=heads, ffn=ffn,
                               label_smoothing=label_smoothing, dropout_p=dropout)
    src = factory.integers(vocab, batch_size, seq_len)
    target = factory.integers(vocab, batch_size, tgt_len + 1)  # <s> y1 .. yT: input is [:-1], labels [1:]
    return model, (src, target[:, :-1].contiguous(), target[:, 1:].contiguous())
