"""The language models of Sailor's validation runs (OPT-350M, GPT-Neo-2.7B) as Hugging Face ``transformers``
models built from their published configurations with random weights (nothing is downloaded, no tokenizer).

Dropout follows Sailor's training (third_party/Megatron-DeepSpeed of eth-easl/sailor cf2c8e3, launched by
ae_scripts/clariden_scripts/run_opt.slurm, which sets no dropout flag, so Megatron's defaults of 0.1 apply
where a dropout is applied): its OPT model applies none (megatron/model/opt_model.py: the residual dropouts
are commented out, the attention probabilities and embeddings are not dropped), its GPT-Neo model drops the
embeddings (hidden_dropout 0.1) and each residual branch (residual_dropout 0.1) but not the attention
probabilities (megatron/model/gpt_neo_model.py defines attn_dropout and never applies it).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from heterog.errors import HeterogError
from heterog.zoo.common import InputFactory, check_positive

SEQ_LEN = 2048
OPT_VOCAB = 50272        # facebook/opt-350m config.json
GPT_NEO_VOCAB = 50257    # EleutherAI/gpt-neo-2.7B config.json
MEGATRON_VOCAB = 50304   # GPT-2's 50257 padded to a multiple of 128 (Megatron's --make-vocab-size-divisible-by)
MEGATRON_DROPOUT = 0.1   # Megatron-DeepSpeed megatron/arguments.py: --hidden-dropout, --residual-dropout


def _check(name: str, *, hidden: int, heads: int, seq_len: int, max_positions: int, dropout: float,
           **sizes: int) -> None:
    check_positive(name, hidden=hidden, heads=heads, seq_len=seq_len, **sizes)
    if hidden % heads:
        raise HeterogError(f"zoo model '{name}': hidden size {hidden} is not divisible by {heads} heads")
    if seq_len > max_positions:
        raise HeterogError(f"zoo model '{name}': seq_len {seq_len} exceeds max_positions {max_positions}")
    if not 0.0 <= dropout < 1.0:
        raise HeterogError(f"zoo model '{name}': dropout must be in [0, 1), got {dropout}")


def _lm_inputs(factory: InputFactory, vocab: int, batch_size: int, seq_len: int) -> dict[str, Any]:
    """{"input_ids", "labels"} of shape (B, T); the model shifts the labels itself, so they equal the ids."""
    ids = factory.integers(vocab, batch_size, seq_len)
    return {"input_ids": ids, "labels": ids}


def build_opt_350m(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    ffn: int = 4096,
    embed_proj: int = 512,
    vocab: int = OPT_VOCAB,
    seq_len: int = SEQ_LEN,
    dropout: float = 0.0,
    pre_ln: bool = False,
    tie_head: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """OPT-350M (facebook/opt-350m): post-LN blocks, ReLU, 512-wide token embedding projected to the hidden
    size and back, learned positions (2048 + 2 rows), output tied to the token embedding."""
    import transformers

    _check("opt_350m", layers=layers, hidden=hidden, heads=heads, ffn=ffn, embed_proj=embed_proj, vocab=vocab,
           seq_len=seq_len, max_positions=SEQ_LEN, dropout=dropout)
    config = transformers.OPTConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=ffn, num_attention_heads=heads,
        max_position_embeddings=SEQ_LEN, word_embed_proj_dim=embed_proj, do_layer_norm_before=bool(pre_ln),
        tie_word_embeddings=bool(tie_head),
        activation_function="relu", dropout=dropout, attention_dropout=dropout,
        layerdrop=0.0, pad_token_id=min(1, vocab - 1), bos_token_id=min(2, vocab - 1), eos_token_id=min(2, vocab - 1),
        use_cache=False)
    return transformers.OPTForCausalLM(config), _lm_inputs(factory, vocab, batch_size, seq_len)


def build_opt_350m_megatron(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    ffn: int = 4096,
    vocab: int = MEGATRON_VOCAB,
    seq_len: int = SEQ_LEN,
    pre_ln: bool = True,
    tie_head: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """OPT-350M as Sailor's runs trained it (Megatron-DeepSpeed's OPT): the blocks of ``opt_350m`` with the
    norm first, 1024-wide token embeddings (no projections), the vocabulary padded to 50304 and an output
    layer of its own, so that each layer holds the parameters Metis' profiles list (a block 12,596,224, the
    head and final norm 51,513,344, layer 0 53,608,448 plus the 2 offset rows of HF's position table)."""
    module, inputs = build_opt_350m(batch_size, factory, layers=layers, hidden=hidden, heads=heads, ffn=ffn,
                                    embed_proj=hidden, vocab=vocab, seq_len=seq_len, pre_ln=pre_ln, tie_head=tie_head)
    return _megatron_attention(module), inputs


def build_gpt_neo_2_7b(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 32,
    hidden: int = 2560,
    heads: int = 20,
    vocab: int = GPT_NEO_VOCAB,
    seq_len: int = SEQ_LEN,
    dropout: float = MEGATRON_DROPOUT,
) -> tuple[nn.Module, dict[str, Any]]:
    """GPT-Neo-2.7B (EleutherAI/gpt-neo-2.7B): pre-LN blocks alternating global and local (window 256)
    attention, GELU, learned positions, output tied to the token embedding; ``dropout`` applies to the
    embeddings and the residual branches, not to the attention probabilities (as in Sailor's training)."""
    import transformers

    _check("gpt_neo_2_7b", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len,
           max_positions=SEQ_LEN, dropout=dropout)
    attention_types: list[list[Any]] = [[["global", "local"], layers // 2]] if layers >= 2 else []
    if layers % 2:
        attention_types.append([["global"], 1])
    config = transformers.GPTNeoConfig(
        vocab_size=vocab, max_position_embeddings=SEQ_LEN, hidden_size=hidden, num_layers=layers,
        attention_types=attention_types, num_heads=heads, window_size=256, activation_function="gelu_new",
        embed_dropout=dropout, resid_dropout=dropout, attention_dropout=0.0, bos_token_id=min(50256, vocab - 1),
        eos_token_id=min(50256, vocab - 1), use_cache=False)
    return transformers.GPTNeoForCausalLM(config), _lm_inputs(factory, vocab, batch_size, seq_len)


def build_gpt_neo_2_7b_megatron(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 32,
    hidden: int = 2560,
    heads: int = 20,
    vocab: int = MEGATRON_VOCAB,
    seq_len: int = SEQ_LEN,
    dropout: float = MEGATRON_DROPOUT,
) -> tuple[nn.Module, dict[str, Any]]:
    """GPT-Neo-2.7B as Sailor's runs trained it (Megatron-DeepSpeed's GPT-Neo): ``gpt_neo_2_7b`` with the
    vocabulary padded to 50304, as Metis' profiles count its embedding (134,021,120 parameters); Megatron's
    q, k and v biases (7,680 parameters per block) are left out."""
    module, inputs = build_gpt_neo_2_7b(batch_size, factory, layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                                        seq_len=seq_len, dropout=dropout)
    return _megatron_attention(module), inputs


MEGATRON_ATTENTION = "heterog-megatron"


def _megatron_softmax_attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any,
                                scaling: float, dropout: float = 0.0, **_: Any) -> tuple[Any, Any]:
    """Attention as Megatron-DeepSpeed's ``CoreAttention`` computes it (megatron/model/transformer.py): the
    scale applied inside the score GEMM (``baddbmm``'s alpha; here to the queries, the same product), the mask
    and softmax one fused kernel (``FusedScaleMaskSoftmax``) that keeps only its output for the backward, the
    probabilities dropped only where a dropout is set, then the product with the values. Hugging Face's
    "eager" function scales the scores and drops out at p = 0 too, each a pass over and a copy of the
    ``(batch, heads, seq, seq)`` scores that Megatron never makes."""
    import torch

    scores = torch.matmul(query * scaling, key.transpose(-1, -2))
    if attention_mask is not None:
        scores = scores + attention_mask
    else:                                   # causal, as the kernel masks it: no mask tensor per sample
        q_len, k_len = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if dropout > 0.0 and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _megatron_mask(**kwargs: Any) -> Any:
    """No mask tensor where there is no padding: the causal mask is applied inside the attention, as
    Megatron's ``scaled_upper_triang_masked_softmax`` kernel does (Hugging Face's eager mask is a
    ``(batch, 1, seq, seq)`` tensor made once and read by every layer, so it would cross every pipeline
    stage); Hugging Face's eager mask where padding is given."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import eager_mask

    return eager_mask(**kwargs)


def _megatron_attention(module: nn.Module) -> nn.Module:
    """Attention as Megatron-DeepSpeed computes it in Sailor's runs (no flash attention is enabled): the
    softmax of the scores held as a tensor for the backward, and nothing more of the scores; the causal mask
    made inside each attention (``_megatron_mask``). OPT's attention goes through
    ``_megatron_softmax_attention``; GPT-Neo's (a method of its own, without scaling, its causal and local
    windows from a buffer of its own) keeps Hugging Face's eager code with its attention dropout, which
    Sailor's training never applies, removed."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(MEGATRON_ATTENTION, _megatron_softmax_attention)
    AttentionMaskInterface.register(MEGATRON_ATTENTION, _megatron_mask)
    config: Any = getattr(module, "config")
    config._attn_implementation = MEGATRON_ATTENTION      # GPT-Neo's attention classes are built: it picks the mask
    for sub in module.modules():
        dropout = getattr(sub, "attn_dropout", None)
        if isinstance(dropout, nn.Dropout) and dropout.p == 0.0:
            sub.attn_dropout = nn.Identity()
    return module


GPTJ_VOCAB = 50400       # EleutherAI/gpt-j-6b config.json (50257 tokens padded to 50400)


def build_gptj_6b(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 28,
    hidden: int = 4096,
    heads: int = 16,
    ffn: int = 16384,
    vocab: int = GPTJ_VOCAB,
    seq_len: int = SEQ_LEN,
    dropout: float = 0.0,
) -> tuple[nn.Module, dict[str, Any]]:
    """GPT-J-6B (EleutherAI/gpt-j-6b): 28 blocks with attention and feed-forward in parallel off one
    LayerNorm, rotary positions on the first 64 dimensions of each head, GELU, no position table, an output
    layer of its own (with bias). Published dropout is 0 (embd, resid and attn pdrop)."""
    import transformers

    _check("gptj_6b", layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab, seq_len=seq_len,
           max_positions=SEQ_LEN, dropout=dropout)
    rotary_dim = min(64, hidden // heads)
    config = transformers.GPTJConfig(
        vocab_size=vocab, n_positions=SEQ_LEN, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn,
        rotary_dim=rotary_dim, activation_function="gelu_new", resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, tie_word_embeddings=False, bos_token_id=min(50256, vocab - 1),
        eos_token_id=min(50256, vocab - 1), use_cache=False)
    return transformers.GPTJForCausalLM(config), _lm_inputs(factory, vocab, batch_size, seq_len)


def build_opt_13b(
    batch_size: int,
    factory: InputFactory,
    *,
    layers: int = 40,
    hidden: int = 5120,
    heads: int = 40,
    ffn: int = 20480,
    vocab: int = OPT_VOCAB,
    seq_len: int = SEQ_LEN,
    dropout: float = 0.0,
) -> tuple[nn.Module, dict[str, Any]]:
    """OPT-13B (facebook/opt-13b): 40 pre-LN blocks, hidden 5120, 40 heads, ffn 20480, ReLU, learned
    positions (2048 + 2 rows), output tied to the token embedding; ``opt_350m``'s code with the 13B
    configuration (its embeddings are as wide as the blocks, so there are no projections)."""
    return build_opt_350m(batch_size, factory, layers=layers, hidden=hidden, heads=heads, ffn=ffn,
                          embed_proj=hidden, vocab=vocab, seq_len=seq_len, dropout=dropout, pre_ln=True,
                          tie_head=True)
