"""Hugging Face ``transformers`` families of the kinds that plain data parallelism gets wrong or that a
captured step must refuse, built as users build them (small configs, random weights, library defaults,
keyword inputs), each ``build_*(batch_size)`` returning ``(model, inputs)``:

  - losses that couple samples: CLIP and SigLIP (``return_loss=True``: a B x B similarity, ``arange(B)`` or
    ``eye(B)`` as labels) and a SimCLR-style toy whose NT-Xent loss is written with ``z.shape[0]``;
  - batch norm: SegFormer (trained exactly with synchronized batch statistics);
  - a validation of the labels: Wav2Vec2ForCTC (``labels.max() >= vocab_size`` raises), SpecAugment off
    (it draws with numpy); its library CTC loss selects the labels by value (``masked_select``) and calls
    ``aten._ctc_loss``, whose shapes depend on values, so ``padded_ctc_loss`` (the same loss in torch ops of
    fixed shapes) replaces it;
  - a module that casts itself: Switch Transformers' router (``self.classifier.to(self.dtype)``); its expert
    loop iterates over ``nonzero()``, so ``dense_experts`` runs every expert on every token, weighted by the
    routing (the same outputs);
  - reversible layers with a hand-written backward: Reformer, with dropout off (it re-seeds torch's
    generator so that its backward redraws the forward's masks).
"""
from __future__ import annotations

import types

import torch
import transformers as tf
from torch import nn
from torch.nn import functional as F

VOCAB = 64
NEG = -1e30           # log of zero in the CTC recursion (finite: logsumexp's gradient stays a number)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- samples coupled
def build_clip(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.CLIPConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 16, "bos_token_id": 1, "eos_token_id": 2},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8}, projection_dim=16)
    return tf.CLIPModel(config), {"input_ids": torch.randint(3, VOCAB, (batch_size, 12), generator=_gen(1)),
                                  "pixel_values": torch.randn(batch_size, 3, 16, 16, generator=_gen(2)),
                                  "return_loss": True}


def build_siglip(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.SiglipConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8})
    return tf.SiglipModel(config), {"input_ids": torch.randint(3, VOCAB, (batch_size, 12), generator=_gen(3)),
                                    "pixel_values": torch.randn(batch_size, 3, 16, 16, generator=_gen(4)),
                                    "return_loss": True}


class SimCLR(nn.Module):
    """Two views of each sample through one encoder and projection; NT-Xent over the 2B embeddings, its sizes
    taken from the embeddings' shape (as SimCLR implementations write it). No dropout: its 2B rows hold the
    two views of every sample apart (sample-minor), which random draws in blocks of samples do not follow."""

    def __init__(self, temperature: float = 0.5) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projection = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.temperature = temperature

    def forward(self, view_a: torch.Tensor, view_b: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.projection(self.encoder(torch.cat([view_a, view_b]))), dim=1)
        n = z.shape[0] // 2
        sim = (z @ z.t()) / self.temperature
        sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
        targets = torch.cat([torch.arange(n) + n, torch.arange(n)])
        return F.cross_entropy(sim, targets)


def build_simclr(batch_size: int = 8):
    torch.manual_seed(0)
    x = torch.randn(batch_size, 3, 8, 8, generator=_gen(5))
    return SimCLR(), (x, x.flip(-1) + 0.1 * torch.randn(batch_size, 3, 8, 8, generator=_gen(6)))


# ---------------------------------------------------------------------------- batch norm
def build_segformer(batch_size: int = 8):
    torch.manual_seed(0)
    config = tf.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2],
                                mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3)
    return tf.SegformerForSemanticSegmentation(config), {
        "pixel_values": torch.randn(batch_size, 3, 16, 16, generator=_gen(7)),
        "labels": torch.randint(0, 3, (batch_size, 16, 16), generator=_gen(8))}


# ---------------------------------------------------------------------------- a check of the labels (CTC)
def padded_ctc_loss(logits: torch.Tensor, labels: torch.Tensor, logit_lengths: torch.Tensor, blank_token_id: int,
                    reduction: str = "mean", zero_infinity: bool = False, ignore_index: int = -100,
                    **kwargs: object) -> torch.Tensor:
    """``transformers.loss.loss_ctc.ForCTCLoss`` (``F.ctc_loss`` of the labels that are neither ``ignore_index``
    nor blank, padding at the end of each row) in torch ops whose shapes follow from the inputs': the CTC
    forward recursion over the labels extended with blanks (2 U + 1 states), in log space."""
    log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32)                # (B, T, V)
    b, t_max, _ = log_probs.shape
    keep = (labels != ignore_index) & (labels != blank_token_id)
    target_lengths = keep.sum(-1)
    lab = torch.where(keep, labels, torch.full_like(labels, blank_token_id))
    blanks = torch.full_like(lab, blank_token_id)
    ext = torch.cat([torch.stack([blanks, lab], dim=2).flatten(1), blanks[:, :1]], dim=1)     # (B, S)
    s = ext.shape[1]
    emit = log_probs.gather(2, ext[:, None, :].expand(b, t_max, s))                  # (B, T, S)
    skip = torch.cat([torch.zeros(b, 2, dtype=torch.bool),
                      (ext[:, 2:] != blank_token_id) & (ext[:, 2:] != ext[:, :-2])], dim=1)
    neg = torch.full((b, s), NEG)
    start = torch.arange(s) < 2
    alpha = torch.where(start, emit[:, 0], neg)
    alphas = [alpha]
    for t in range(1, t_max):
        prev1 = torch.cat([neg[:, :1], alpha[:, :-1]], dim=1)
        prev2 = torch.where(skip, torch.cat([neg[:, :2], alpha[:, :-2]], dim=1), neg)
        alpha = torch.logsumexp(torch.stack([alpha, prev1, prev2]), dim=0) + emit[:, t]
        alphas.append(alpha)
    at_end = torch.stack(alphas, dim=1).gather(1, (logit_lengths - 1).view(b, 1, 1).expand(b, 1, s)).squeeze(1)
    last = at_end.gather(1, (2 * target_lengths).view(b, 1)).squeeze(1)
    before = at_end.gather(1, (2 * target_lengths - 1).clamp_min(0).view(b, 1)).squeeze(1)
    nll = -torch.where(target_lengths > 0, torch.logaddexp(last, before), last)
    if zero_infinity:
        nll = torch.where(nll > -NEG / 2, torch.zeros_like(nll), nll)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return (nll / target_lengths.clamp_min(1)).mean()


def ctc_labels(batch_size: int, seed: int, width: int = 6) -> torch.Tensor:
    """Labels 1..VOCAB-1 of 3 to ``width`` tokens per sample, padded with -100."""
    g = _gen(seed)
    labels = torch.randint(1, VOCAB, (batch_size, width), generator=g)
    lengths = torch.randint(3, width + 1, (batch_size,), generator=g)
    return torch.where(torch.arange(width) < lengths[:, None], labels, torch.full_like(labels, -100))


def wav2vec2_config(spec_augment: bool = False) -> tf.Wav2Vec2Config:
    return tf.Wav2Vec2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                             mask_time_prob=0.05 if spec_augment else 0.0, mask_time_length=2, layerdrop=0.0,
                             ctc_loss_reduction="mean", pad_token_id=0)


def build_wav2vec2_ctc(batch_size: int = 8):
    """Wav2Vec2ForCTC, SpecAugment and LayerDrop off, its CTC loss in ops of fixed shapes (module docstring)."""
    torch.manual_seed(0)
    model = tf.Wav2Vec2ForCTC(wav2vec2_config())
    model.loss_function = padded_ctc_loss
    return model, {"input_values": torch.randn(batch_size, 400, generator=_gen(9)),
                   "labels": ctc_labels(batch_size, 10)}


# ---------------------------------------------------------------------------- a router that casts itself
def dense_experts(self: nn.Module, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                  routing_weights: torch.Tensor) -> torch.Tensor:
    """``SwitchTransformersExperts.forward`` without the loop over ``nonzero()``: every expert on every token,
    each token taking its routed expert's output times its routing weight (zero where it was dropped)."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        weight = selected_experts[:, 0, e:e + 1].to(hidden_states.dtype) * routing_weights
        out = out + self[f"expert_{e}"](hidden_states) * weight
    return out


def switch_config(router_dtype: str = "float32") -> tf.SwitchTransformersConfig:
    return tf.SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                       num_decoder_layers=2, num_heads=2, num_experts=4, expert_capacity=8,
                                       num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                       router_dtype=router_dtype, decoder_start_token_id=0, pad_token_id=0,
                                       eos_token_id=1)


def build_switch(batch_size: int = 8):
    torch.manual_seed(0)
    model = tf.SwitchTransformersForConditionalGeneration(switch_config())
    for module in model.modules():
        if type(module).__name__ == "SwitchTransformersExperts":
            module.forward = types.MethodType(dense_experts, module)
    return model, {"input_ids": torch.randint(3, VOCAB, (batch_size, 12), generator=_gen(11)),
                   "labels": torch.randint(3, VOCAB, (batch_size, 12), generator=_gen(12))}


# ---------------------------------------------------------------------------- reversible layers
def reformer_config(dropout: float = 0.0) -> tf.ReformerConfig:
    return tf.ReformerConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=16,
                             attn_layers=["local", "local"], axial_pos_embds=True, axial_pos_shape=[4, 4],
                             axial_pos_embds_dim=[16, 16], feed_forward_size=64, max_position_embeddings=16,
                             local_attn_chunk_length=4, is_decoder=True, pad_token_id=0, eos_token_id=1,
                             hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                             local_attention_probs_dropout_prob=dropout, lsh_attention_probs_dropout_prob=dropout,
                             axial_pos_embds_dropout=dropout)


def build_reformer(batch_size: int = 8):
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch_size, 16), generator=_gen(13))
    return tf.ReformerModelWithLMHead(reformer_config()), {"input_ids": ids, "labels": ids}


# name -> build: every plan trains these exactly like one process (SegFormer with synchronized statistics)
FAMILIES = {
    "clip": build_clip,
    "siglip": build_siglip,
    "simclr": build_simclr,
    "segformer": build_segformer,
    "wav2vec2_ctc": build_wav2vec2_ctc,
    "switch": build_switch,
    "reformer": build_reformer,
}
SYNCED = {"segformer"}          # families planned with synchronized batch statistics


# ---------------------------------------------------------------------------- held out (make conformance)
def build_clip_wide(batch_size: int = 8):
    """CLIP with three layers per tower, more heads and a wider projection: another configuration."""
    torch.manual_seed(1)
    config = tf.CLIPConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
                     "num_attention_heads": 4, "max_position_embeddings": 16, "bos_token_id": 1, "eos_token_id": 2},
        vision_config={"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
                       "image_size": 16, "patch_size": 4}, projection_dim=24)
    return tf.CLIPModel(config), {"input_ids": torch.randint(3, VOCAB, (batch_size, 10), generator=_gen(21)),
                                  "pixel_values": torch.randn(batch_size, 3, 16, 16, generator=_gen(22)),
                                  "return_loss": True}


def build_regnet(batch_size: int = 8):
    """RegNet's grouped-convolution stages, batch norm after every convolution."""
    torch.manual_seed(0)
    config = tf.RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
                             num_labels=3)
    return tf.RegNetForImageClassification(config), {
        "pixel_values": torch.randn(batch_size, 3, 16, 16, generator=_gen(23)),
        "labels": torch.randint(0, 3, (batch_size,), generator=_gen(24))}


def build_hubert_ctc(batch_size: int = 8):
    """HubertForCTC (another speech encoder with the same label check), its CTC loss in ops of fixed shapes."""
    torch.manual_seed(0)
    c = wav2vec2_config()
    config = tf.HubertConfig(**{k: getattr(c, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "conv_dim",
        "conv_stride", "conv_kernel", "num_conv_pos_embeddings", "num_conv_pos_embedding_groups", "mask_time_prob",
        "layerdrop", "ctc_loss_reduction", "pad_token_id")})
    model = tf.HubertForCTC(config)
    model.loss_function = padded_ctc_loss
    return model, {"input_values": torch.randn(batch_size, 400, generator=_gen(25)),
                   "labels": ctc_labels(batch_size, 26)}


HELD_OUT = {
    "clip_wide": build_clip_wide,
    "regnet": build_regnet,
    "hubert_ctc": build_hubert_ctc,
}
HELD_OUT_SYNCED = {"regnet"}


# ---------------------------------------------------------------------------- refused in one line
def build_wav2vec2_spec_augment(batch_size: int = 8):
    """SpecAugment on: its masks are drawn with numpy inside forward."""
    torch.manual_seed(0)
    model = tf.Wav2Vec2ForCTC(wav2vec2_config(spec_augment=True))
    model.loss_function = padded_ctc_loss
    return model, {"input_values": torch.randn(batch_size, 400, generator=_gen(9)),
                   "labels": ctc_labels(batch_size, 10)}


def build_switch_bf16_router(batch_size: int = 8):
    """A router kept in bfloat16 in a float32 model: it casts its classifier inside forward."""
    torch.manual_seed(0)
    model = tf.SwitchTransformersForConditionalGeneration(switch_config("bfloat16"))
    return model, {"input_ids": torch.randint(3, VOCAB, (batch_size, 12), generator=_gen(11)),
                   "labels": torch.randint(3, VOCAB, (batch_size, 12), generator=_gen(12))}


def build_reformer_dropout(batch_size: int = 8):
    """Reformer with dropout: it re-seeds torch's generator so that its backward redraws the forward's masks."""
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch_size, 16), generator=_gen(13))
    return tf.ReformerModelWithLMHead(reformer_config(dropout=0.1)), {"input_ids": ids, "labels": ids}


def build_hubert_library_ctc(batch_size: int = 8):
    """HubertForCTC with the library's CTC loss (``masked_select`` of the labels, ``aten._ctc_loss``)."""
    model, inputs = build_hubert_ctc(batch_size)
    del model._loss_function                  # what the loss_function setter stored: the library's loss again
    return model, inputs


# name -> (build, what the one-line refusal names)
REFUSED = {
    "wav2vec2_spec_augment": (build_wav2vec2_spec_augment, r"numpy\.random\.rand at .*modeling_wav2vec2\.py:\d+"),
    "switch_bf16_router": (build_switch_bf16_router, r"module '.*router\.classifier' \(Linear\) casts itself to "
                                                     r"bfloat16 inside forward"),
    "reformer_dropout": (build_reformer_dropout, r"re-seeds torch's random generator inside forward at "
                                                 r".*modeling_reformer\.py:\d+"),
    "hubert_library_ctc": (build_hubert_library_ctc, r"aten\._ctc_loss\.\w+ has an output shape that depends on "
                                                     r"tensor values at .*loss_ctc\.py:\d+"),
}
QUICK_REFUSALS = ("wav2vec2_spec_augment", "switch_bf16_router", "reformer_dropout")   # refused within seconds
