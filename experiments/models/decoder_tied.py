"""A small causal decoder as users write it with torch.nn: ``nn.TransformerEncoderLayer`` blocks
(``norm_first=True``, the causal mask passed as ``src_mask``) and the output projection tied to the
token embedding. Used by the fidelity measurement:
``python -m heterog fidelity --model experiments/models/decoder_tied.py:build --cluster local-cpu-2 --plans 8 --json``.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ_LEN, D_MODEL, HEADS, FFN, LAYERS = 256, 32, 64, 4, 256, 2
DEFAULT_BATCH = 16


class TiedDecoder(nn.Module):
    """Token + learned position embedding, ``layers`` pre-LN ``nn.TransformerEncoderLayer`` blocks with a
    causal ``src_mask``, final LayerNorm, logits = hidden @ embedding.T (tied); mean next-token CE.

    Shapes:
        input_ids `(B, T)` int64, labels `(B, T)` int64 -> scalar mean loss.
    """

    def __init__(self, vocab: int = VOCAB, seq_len: int = SEQ_LEN, d_model: int = D_MODEL, heads: int = HEADS,
                 ffn: int = FFN, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.embed.weight            # tied output projection
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        x = self.embed(input_ids) + self.pos[:length]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.lm_head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(batch_size: int = DEFAULT_BATCH) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """(model, (input_ids, labels)) with random weights and tokens (seeded), batch on dim 0."""
    torch.manual_seed(0)
    model = TiedDecoder()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
