"""Hugging Face ``transformers`` models as users take them: built from small configs with random weights
(nothing is downloaded), called with keyword arguments, dropout left at the library's defaults and in
training mode, each ``build_*(batch_size)`` returning ``(model, {"input_ids": ..., "labels": ...})``.

The families cover what a model library writes differently from plain torch.nn: token-type ids from a
buffer expanded to the batch (BERT), masks built from the input's shape (GPT-2), labels shifted right by
writing into a slice (T5) and a relative position bias, rotary embeddings with grouped-query attention
(Llama), patch embeddings (ViT), batch norm (ResNet), a mixture of experts (Mixtral), and the BERT
variants DistilBERT and RoBERTa.
"""
from __future__ import annotations

import torch
import transformers as tf

VOCAB, T, HIDDEN = 64, 12, 32
SMALL = {"vocab_size": VOCAB}


def _ids(batch_size: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch_size, T), generator=torch.Generator().manual_seed(seed))


def _classes(batch_size: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, n, (batch_size,), generator=torch.Generator().manual_seed(seed))


def build_bert(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=2 * HIDDEN, max_position_embeddings=32, num_labels=3)
    return tf.BertForSequenceClassification(config), {"input_ids": _ids(batch_size, 1),
                                                      "labels": _classes(batch_size, 3, 2)}


def build_gpt2(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32,
                           bos_token_id=0, eos_token_id=0)
    ids = _ids(batch_size, 3)
    return tf.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def build_t5(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=2 * HIDDEN, num_layers=2, num_heads=2,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return tf.T5ForConditionalGeneration(config), {"input_ids": _ids(batch_size, 4), "labels": _ids(batch_size, 5)}


def build_llama(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                            attention_dropout=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    ids = _ids(batch_size, 6)
    return tf.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def build_vit(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=2 * HIDDEN, num_labels=3,
                          hidden_dropout_prob=0.1)
    g = torch.Generator().manual_seed(7)
    return tf.ViTForImageClassification(config), {"pixel_values": torch.randn(batch_size, 3, 16, 16, generator=g),
                                                  "labels": _classes(batch_size, 3, 8)}


def build_resnet(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                             layer_type="basic", num_labels=3)
    g = torch.Generator().manual_seed(9)
    return tf.ResNetForImageClassification(config), {"pixel_values": torch.randn(batch_size, 3, 16, 16, generator=g),
                                                     "labels": _classes(batch_size, 3, 10)}


def build_distilbert(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=2 * HIDDEN,
                                 max_position_embeddings=32, num_labels=3)
    return tf.DistilBertForSequenceClassification(config), {"input_ids": _ids(batch_size, 11),
                                                            "labels": _classes(batch_size, 3, 12)}


def build_roberta(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.RobertaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=2 * HIDDEN, max_position_embeddings=40, pad_token_id=1)
    ids = _ids(batch_size, 13)
    return tf.RobertaForMaskedLM(config), {"input_ids": ids, "labels": ids}


def build_mixtral(batch_size: int = 8):
    """Mixtral's sparse mixture of experts (top-2 of 4), with the experts computed by batched matmuls
    (``experts_implementation="batched_mm"``: every token through the weights of its chosen experts, no
    data-dependent shapes)."""
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=32, attention_dropout=0.1,
                              experts_implementation="batched_mm", bos_token_id=0, eos_token_id=1)
    ids = _ids(batch_size, 14)
    return tf.MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


# name -> build: every plan trains these exactly like one process
EQUIVALENCE_MODELS = {
    "bert": build_bert,
    "gpt2": build_gpt2,
    "t5": build_t5,
    "llama": build_llama,
    "vit": build_vit,
    "distilbert": build_distilbert,
    "roberta": build_roberta,
    "mixtral": build_mixtral,
}
# batch statistics: plans equal per-replica training
BATCH_NORM_MODELS = {"resnet": build_resnet}


# ---------------------------------------------------------------------------- more families (make conformance)
def _lm(cls, config, batch_size: int, seed: int):
    torch.manual_seed(0)
    ids = _ids(batch_size, seed)
    return cls(config), {"input_ids": ids, "labels": ids}


def _classifier(cls, config, batch_size: int, seed: int, classes: int = 2):
    torch.manual_seed(0)
    return cls(config), {"input_ids": _ids(batch_size, seed), "labels": _classes(batch_size, classes, seed + 1)}


def _images(cls, config, batch_size: int, seed: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(seed)
    return cls(config), {"pixel_values": torch.randn(batch_size, 3, 16, 16, generator=g),
                         "labels": _classes(batch_size, 3, seed + 1)}


def build_bert_eager(batch_size: int = 8):
    """BERT with eager attention, three layers."""
    return _classifier(tf.BertForSequenceClassification, tf.BertConfig(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=32, num_labels=2, attn_implementation="eager"), batch_size, 20)


def build_bart(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           decoder_start_token_id=2)
    return tf.BartForConditionalGeneration(config), {"input_ids": _ids(batch_size, 21), "labels": _ids(batch_size, 22)}


def build_opt(batch_size: int = 8):
    return _lm(tf.OPTForCausalLM, tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        max_position_embeddings=40, word_embed_proj_dim=HIDDEN, pad_token_id=1, bos_token_id=2, eos_token_id=2),
        batch_size, 23)


def build_qwen2(batch_size: int = 8):
    return _lm(tf.Qwen2ForCausalLM, tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=40, attention_dropout=0.1), batch_size, 24)


def build_mistral(batch_size: int = 8):
    return _lm(tf.MistralForCausalLM, tf.MistralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=40, attention_dropout=0.1, bos_token_id=0, eos_token_id=1),
        batch_size, 25)


def build_electra(batch_size: int = 8):
    return _classifier(tf.ElectraForSequenceClassification, tf.ElectraConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, num_labels=2), batch_size, 26)


def build_albert(batch_size: int = 8):
    return _classifier(tf.AlbertForSequenceClassification, tf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, num_labels=2, hidden_dropout_prob=0.1), batch_size, 27)


def build_deberta_v2(batch_size: int = 8):
    """DeBERTa-v2's disentangled relative attention (position buckets, p2c and c2p)."""
    return _lm(tf.DebertaV2ForMaskedLM, tf.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
        batch_size, 28)


def build_convnext(batch_size: int = 8):
    """ConvNeXt with stochastic depth (``drop_path``: a random value per sample)."""
    return _images(tf.ConvNextForImageClassification, tf.ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=16,
        drop_path_rate=0.1), batch_size, 29)


def build_swin(batch_size: int = 8):
    """Swin: shifted-window attention, stochastic depth, dropout."""
    return _images(tf.SwinForImageClassification, tf.SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4,
        num_labels=3, hidden_dropout_prob=0.1, drop_path_rate=0.1), batch_size, 31)


def build_bloom(batch_size: int = 8):
    """BLOOM: ALiBi, a bias per head added to the attention scores in place of positions."""
    return _lm(tf.BloomForCausalLM, tf.BloomConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=2, hidden_dropout=0.1, attention_dropout=0.1),
        batch_size, 32)


def build_falcon(batch_size: int = 8):
    """Falcon: multi-query attention (one key and value head), attention and MLP in parallel."""
    return _lm(tf.FalconForCausalLM, tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, hidden_dropout=0.1, attention_dropout=0.1), batch_size, 33)


def build_gpt_neox(batch_size: int = 8):
    """GPT-NeoX: rotary embeddings over a quarter of each head, the parallel residual."""
    return _lm(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, rotary_pct=0.25, use_parallel_residual=True, hidden_dropout=0.1,
        attention_dropout=0.1), batch_size, 34)


def build_gemma2(batch_size: int = 8):
    """Gemma 2: logit soft-capping (tanh) of scores and outputs, sliding-window layers, norms after each block."""
    return _lm(tf.Gemma2ForCausalLM, tf.Gemma2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=40, sliding_window=4, attention_dropout=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2), batch_size, 35)


def build_mamba(batch_size: int = 8):
    """Mamba: a selective state-space scan over the sequence (no attention), a causal depthwise convolution."""
    return _lm(tf.MambaForCausalLM, tf.MambaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=3,
        pad_token_id=0, bos_token_id=1, eos_token_id=2), batch_size, 36)


def build_modernbert(batch_size: int = 8):
    """ModernBERT: global attention every second layer, local (a window of 8 tokens) between, GeGLU."""
    return _classifier(tf.ModernBertForSequenceClassification, tf.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, global_attn_every_n_layers=2, local_attention=8, num_labels=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, attention_dropout=0.1,
        embedding_dropout=0.1, mlp_dropout=0.1), batch_size, 37)


def build_funnel(batch_size: int = 8):
    """Funnel Transformer: the sequence pooled to half its length between blocks, then upsampled."""
    return _classifier(tf.FunnelForSequenceClassification, tf.FunnelConfig(
        vocab_size=VOCAB, block_sizes=[1, 1], d_model=HIDDEN, n_head=2, d_head=16, d_inner=64,
        max_position_embeddings=40, num_labels=2), batch_size, 38)


def build_beit(batch_size: int = 8):
    """BEiT: a relative position bias between image patches, layer scale, stochastic depth."""
    return _images(tf.BeitForImageClassification, tf.BeitConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, use_relative_position_bias=True, drop_path_rate=0.1, num_labels=3), batch_size, 39)


# families beyond the suite's, trained by `make conformance`
MORE_MODELS = {
    "bert_eager": build_bert_eager,
    "bart": build_bart,
    "opt": build_opt,
    "qwen2": build_qwen2,
    "mistral": build_mistral,
    "electra": build_electra,
    "albert": build_albert,
    "deberta_v2": build_deberta_v2,
    "convnext": build_convnext,
    "swin": build_swin,
    "bloom": build_bloom,
    "falcon": build_falcon,
    "gpt_neox": build_gpt_neox,
    "gemma2": build_gemma2,
    "mamba": build_mamba,
    "modernbert": build_modernbert,
    "funnel": build_funnel,
    "beit": build_beit,
}
