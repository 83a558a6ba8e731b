"""BERT (Devlin et al. 2019) pre-training model: post-LN encoder, pooler, masked-LM head tied to
the word embeddings and next-sentence head; BERT-Large (24 x 1024, 16 heads) by default."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heterog.errors import HeterogError
from heterog.zoo.common import InputFactory, Inputs, check_positive, dropout
from heterog.zoo.layers import TransformerLayer, init_normal

LN_EPS = 1e-12


class BertForPreTraining(nn.Module):
    """BERT encoder with the two pre-training heads; loss = mean MLM CE + mean NSP CE.

    The masked-LM head reads a fixed number P of positions per sequence (BERT's
    max_predictions_per_seq), gathered by index, so every sequence weighs the same in the mean.

    Args:
        vocab, max_positions, type_vocab: embedding tables (30522, 512, 2).
        layers, hidden, heads, ffn: encoder size (24, 1024, 16, 4096).
        dropout_p: hidden/attention dropout (paper 0.1; default 0 keeps steps deterministic).

    Shapes:
        input_ids `(B, T)`, token_type_ids `(B, T)`, masked_positions `(B, P)`,
        masked_ids `(B, P)`, next_sentence `(B,)` -> scalar loss.
    """

    def __init__(
        self,
        *,
        vocab: int,
        max_positions: int,
        type_vocab: int,
        layers: int,
        hidden: int,
        heads: int,
        ffn: int,
        dropout_p: float,
    ) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=LN_EPS)
        self.drop = dropout(dropout_p)
        self.layers = nn.ModuleList(
            TransformerLayer(hidden, heads, ffn, activation="gelu", eps=LN_EPS, dropout_p=dropout_p)
            for _ in range(layers)
        )
        self.pooler = nn.Linear(hidden, hidden)
        self.mlm_transform = nn.Linear(hidden, hidden)
        self.mlm_norm = nn.LayerNorm(hidden, eps=LN_EPS)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.nsp = nn.Linear(hidden, 2)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_normal(self, 0.02)
        nn.init.zeros_(self.mlm_bias)

    def encode(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = self.position.weight[: input_ids.shape[1]]
        x = self.word(input_ids) + positions + self.token_type(token_type_ids)
        x = self.drop(self.embed_norm(x))
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        masked_positions: torch.Tensor,
        masked_ids: torch.Tensor,
        next_sentence: torch.Tensor,
    ) -> torch.Tensor:
        x = self.encode(input_ids, token_type_ids)
        picked = torch.gather(x, 1, masked_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        h = self.mlm_norm(F.gelu(self.mlm_transform(picked)))
        mlm_logits = h @ self.word.weight.t() + self.mlm_bias
        mlm_loss = F.cross_entropy(mlm_logits.flatten(0, 1), masked_ids.flatten())
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return mlm_loss + F.cross_entropy(self.nsp(pooled), next_sentence)


def build_bert_large(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    ffn: int | None = None,
    vocab: int = 30522,
    seq_len: int = 128,
    max_positions: int = 512,
    predictions: int | None = None,
    dropout: float = 0.0,
) -> tuple[nn.Module, Inputs]:
    ffn = 4 * hidden if ffn is None else ffn
    predictions = -(-seq_len * 15 // 100) if predictions is None else predictions  # 20 at 128, 77 at 512
    check_positive("bert_large", layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab,
                   seq_len=seq_len, max_positions=max_positions, predictions=predictions)
    if seq_len > max_positions:
        raise HeterogError(f"zoo model 'bert_large': seq_len {seq_len} exceeds max_positions {max_positions}")
    if predictions > seq_len:
        raise HeterogError(f"zoo model 'bert_large': predictions {predictions} exceeds seq_len {seq_len}")
    model = BertForPreTraining(vocab=vocab, max_positions=max_positions, type_vocab=2, layers=layers,
                               hidden=hidden, heads=heads, ffn=ffn, dropout_p=dropout)
    input_ids = factory.integers(vocab, batch_size, seq_len)
    segment_b = torch.arange(seq_len, device=factory.device) >= seq_len // 2  # [A A .. B B]
    token_type_ids = segment_b.long().expand(batch_size, seq_len).contiguous()
    # P distinct positions per sequence: the first P of a random permutation.
    masked_positions = factory.uniform(batch_size, seq_len).argsort(dim=1)[:, :predictions].contiguous()
    masked_ids = factory.integers(vocab, batch_size, predictions)
    next_sentence = factory.integers(2, batch_size)
    return model, (input_ids, token_type_ids, masked_positions, masked_ids, next_sentence)
