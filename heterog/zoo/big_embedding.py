"""A causal LM whose tied token embedding (400,000 x 4096) alone, with Adam's gradient and two moments,
outgrows a 16 GB GPU: a plan must split that one operator's parameter to fit a V100 cluster."""
from __future__ import annotations

from heterog.zoo.gpt2 import make_causal_lm_builder

# The GPT-2 layout (heterog.zoo.gpt2.CausalLM) with a small body: 2 pre-LN layers of width 4096.
# 400,000 x 4096 float32 = 6.55 GB of weight; with its gradient and Adam's exp_avg / exp_avg_sq, 26.2 GB.
build_big_embedding = make_causal_lm_builder("big_embedding", layers=2, hidden=4096, heads=32, vocab=400_000,
                                             seq_len=128, max_positions=128)
