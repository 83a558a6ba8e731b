"""The benchmark models of the HeteroG paper (plus models larger than one GPU and tiny test models) in plain
torch.nn, each built as (module, example_inputs) with module(*inputs) = scalar mean loss; heterog/zoo/README.md
has the table."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from heterog.errors import HeterogError
from heterog.zoo.bert import build_bert_large
from heterog.zoo.big_embedding import build_big_embedding
from heterog.zoo.common import InputFactory, Inputs, ModelSpec, count_parameters
from heterog.zoo.gpt2 import build_gpt2, build_gpt2_xl
from heterog.zoo.hf_lm import (
    build_gpt_neo_2_7b,
    build_gpt_neo_2_7b_megatron,
    build_gptj_6b,
    build_opt_13b,
    build_opt_350m,
    build_opt_350m_megatron,
)
from heterog.zoo.inception import build_inception_v3
from heterog.zoo.mobilenet import build_mobilenet_v2
from heterog.zoo.nasnet import build_nasnet
from heterog.zoo.resnet import build_resnet50, build_resnet101, build_resnet200
from heterog.zoo.tiny import build_tiny_cnn, build_tiny_mlp, build_tiny_transformer
from heterog.zoo.transformer import build_transformer
from heterog.zoo.vgg import build_vgg19
from heterog.zoo.xlnet import build_xlnet_large

__all__ = [
    "ModelSpec", "build", "count_parameters", "default_batch_size", "info", "names", "small_overrides",
    "spec",
]

PAPER = "HeteroG paper (Yi et al., CoNEXT 2020)"
CHOSEN = "chosen here (the HeteroG paper's value could not be consulted)"
NO_DROPOUT = "Dropout defaults to 0 so that training steps are deterministic."
ADAM = ("Sized for Adam (capture with --optimizer adam: the zoo has no per-model optimizer, and the CLI's "
        "default is sgd): 16 bytes per parameter for weight, gradient, exp_avg and exp_avg_sq.")

# Meaning of each override; a model's builder signature says which it accepts and their defaults.
KNOB_DOCS = {
    "width": "channel multiplier on every convolution (1.0 = published network)",
    "hidden": "hidden size (transformers) / width of the hidden FC layers (vgg19, tiny_mlp)",
    "image_size": "input height = width in pixels",
    "num_classes": "classifier outputs",
    "dropout": "dropout probability (0 = no dropout op in the graph)",
    "layers": "number of layers (resnets: blocks per stage as a tuple of 4)",
    "preact": "pre-activation (v2) bottlenecks instead of post-activation v1.5",
    "aux_logits": "include the auxiliary classifier and its 0.4-weighted loss",
    "variant": "'large' (6 @ 4032, 331 px) or 'mobile' (4 @ 1056, 224 px); sets the next five defaults",
    "num_blocks": "normal cells per stack (N)",
    "penultimate_filters": "channels before global pooling (P); multiple of 96",
    "stem_filters": "channels of the stem convolution",
    "skip_reduction": "cell after a reduction takes the pre-reduction input as its previous input",
    "heads": "attention heads (must divide hidden)",
    "ffn": "feed-forward inner size (default 4 * hidden)",
    "vocab": "vocabulary size",
    "seq_len": "tokens per sequence (the source side for transformer)",
    "tgt_len": "target tokens per sequence (default seq_len)",
    "max_positions": "rows of the learned position table",
    "predictions": "predicted tokens per sequence (bert: masked positions; xlnet: permutation targets)",
    "label_smoothing": "label smoothing of the cross-entropy",
    "in_features": "input features",
    "channels": "channels of the first convolution",
    "embed_proj": "width of the token embedding, projected to and from the hidden size (OPT's word_embed_proj_dim)",
    "pre_ln": "normalise before each sublayer (pre-LN) instead of after",
    "tie_head": "the output layer shares the token embedding's weight",
}
SAILOR = ("Sailor's validation runs (eth-easl/sailor cf2c8e3, sailor/Planner/simulations/validation/clariden/) "
          "train at global batch 32 to 1024 in micro-batches of 1 to 8; 8 chosen here")

IMAGE_INPUTS = (("images", "(B, 3, S, S) float"), ("labels", "(B,) int64"))
LM_INPUTS = (("input_ids", "(B, T) int64"), ("labels", "(B, T) int64, input shifted by one"))

_SPECS = (
    ModelSpec(
        name="vgg19",
        description="VGG-19 (Simonyan & Zisserman 2015, config E), no batch norm, 224x224",
        builder=build_vgg19,
        default_batch_size=192,
        batch_size_source=PAPER,
        params=143_667_240,
        published_params=143_667_240,
        published_source="torchvision vgg19 (equal)",
        inputs=IMAGE_INPUTS,
        small_overrides={"width": 0.125, "hidden": 32, "image_size": 32, "num_classes": 10},
        notes="The 7x7x512 map is flattened directly (no adaptive pool), so the first FC size follows "
              "image_size. " + NO_DROPOUT,
    ),
    ModelSpec(
        name="resnet50",
        description="ResNet-50 v1.5 (He et al. 2015; stride on the 3x3, torchvision layout), 224x224",
        builder=build_resnet50,
        default_batch_size=128,
        batch_size_source="chosen here (not a HeteroG benchmark model)",
        params=25_557_032,
        published_params=25_557_032,
        published_source="torchvision resnet50 (equal)",
        inputs=IMAGE_INPUTS,
        small_overrides={"layers": (1, 1, 1, 1), "width": 8, "image_size": 32, "num_classes": 10},
        notes="BatchNorm in training mode: statistics are per replica under data parallelism.",
    ),
    ModelSpec(
        name="resnet101",
        description="ResNet-101 v1.5 (He et al. 2015; torchvision layout), 224x224",
        builder=build_resnet101,
        default_batch_size=128,
        batch_size_source="chosen here (not a HeteroG benchmark model)",
        params=44_549_160,
        published_params=44_549_160,
        published_source="torchvision resnet101 (equal)",
        inputs=IMAGE_INPUTS,
        small_overrides={"layers": (1, 1, 2, 1), "width": 8, "image_size": 32, "num_classes": 10},
        notes="BatchNorm in training mode: statistics are per replica under data parallelism.",
    ),
    ModelSpec(
        name="resnet200",
        description="ResNet-200 v2, pre-activation bottlenecks [3, 24, 36, 3] (He et al. 2016, "
                    "'Identity Mappings'; HeteroG used TF-slim resnet_v2_200), 224x224",
        builder=build_resnet200,
        default_batch_size=96,
        batch_size_source=CHOSEN,
        params=64_666_152,
        published_params=None,
        published_source="about 64.7M for ResNet-200 (He et al. 2016). The post-activation variant "
                         "(preact=False) has 64,673,832; TF-slim's has conv biases and differs slightly",
        inputs=IMAGE_INPUTS,
        small_overrides={"layers": (1, 2, 2, 1), "width": 8, "image_size": 32, "num_classes": 10},
        notes="Stem conv without BN (the first unit's pre-activation follows it), projection "
              "shortcuts are bare 1x1 convs on the pre-activated input, final BN-ReLU before the pool.",
    ),
    ModelSpec(
        name="inception_v3",
        description="Inception-v3 (Szegedy et al. 2016; torchvision layout) with auxiliary classifier, "
                    "299x299",
        builder=build_inception_v3,
        default_batch_size=192,
        batch_size_source=CHOSEN,
        params=27_161_264,
        published_params=27_161_264,
        published_source="torchvision inception_v3 with aux_logits (equal); 23,834,568 without "
                         "(aux_logits=False, also equal)",
        inputs=IMAGE_INPUTS,
        small_overrides={"width": 0.0625, "num_classes": 10},
        notes="Loss = CE(main) + 0.4 * CE(aux). The auxiliary head needs image_size near 299 "
              "(use aux_logits=False or width<1 for small tests). " + NO_DROPOUT,
    ),
    ModelSpec(
        name="mobilenet_v2",
        description="MobileNetV2 1.0 (Sandler et al. 2018; torchvision layout), 224x224",
        builder=build_mobilenet_v2,
        default_batch_size=192,
        batch_size_source=CHOSEN,
        params=3_504_872,
        published_params=3_504_872,
        published_source="torchvision mobilenet_v2 (equal)",
        inputs=IMAGE_INPUTS,
        small_overrides={"width": 0.25, "image_size": 32, "num_classes": 10},
        notes="Depthwise convolutions are grouped Conv2d (groups = channels). " + NO_DROPOUT,
    ),
    ModelSpec(
        name="nasnet",
        description="NASNet-A Large 6 @ 4032 (Zoph et al. 2018; Keras/TF-slim layout), 331x331",
        builder=build_nasnet,
        default_batch_size=96,
        batch_size_source=CHOSEN,
        params=88_753_150,
        published_params=88_949_818,
        published_source="Keras NASNetLarge total 88,949,818 = 88,753,150 trainable (equal to this model) "
                         "+ 196,668 BN moving statistics (buffers here); paper: 88.9M. variant='mobile' "
                         "gives 5,289,978 (Keras NASNetMobile 5,326,716 with BN statistics)",
        inputs=IMAGE_INPUTS,
        small_overrides={"num_blocks": 1, "penultimate_filters": 96, "stem_filters": 8,
                         "image_size": 35, "num_classes": 10},
        notes="Normal cell: sep3x3/sep5x5 pairs, 3x3 avg pools and identities over (h, p); reduction cell: "
              "stride-2 sep5x5/sep7x7, 3x3 max/avg pools. Keras 'same' padding (asymmetric at stride 2) "
              "is computed statically from image_size. No auxiliary head, no drop-path. " + NO_DROPOUT,
    ),
    ModelSpec(
        name="transformer",
        description="Transformer base (Vaswani et al. 2017): 6+6 post-LN layers, d_model 512, 8 heads, "
                    "d_ff 2048, shared 37000-token BPE vocabulary, 128 source / 128 target tokens",
        builder=build_transformer,
        default_batch_size=64,
        batch_size_source=CHOSEN + "; 64 sentence pairs = 8192 target tokens",
        params=63_082_496,
        published_params=65_000_000,
        published_source="paper Table 3 'base' reports 65M (rounded, with its own vocabulary); here one "
                         "37000 x 512 embedding is shared by encoder input, decoder input and output "
                         "projection, no output bias",
        inputs=(("src_ids", "(B, S) int64"), ("tgt_ids", "(B, T) int64 decoder input"),
                ("tgt_labels", "(B, T) int64")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 12, "tgt_len": 10},
        notes="Loss: mean label-smoothed (0.1) CE over all target tokens. Sinusoidal positions are "
              "computed in forward (no parameters). " + NO_DROPOUT,
    ),
    ModelSpec(
        name="bert_large",
        description="BERT-Large pre-training (Devlin et al. 2019): 24 layers, hidden 1024, 16 heads, "
                    "vocab 30522, seq 128, MLM (20 positions) + NSP heads",
        builder=build_bert_large,
        default_batch_size=48,
        batch_size_source=PAPER,
        params=336_226_108,
        published_params=335_141_888,
        published_source="BertModel (embeddings + 24 layers + pooler) has 335,141,888; the heads add "
                         "1,084,220 = MLM transform 1,049,600 + its LayerNorm 2,048 + MLM output bias "
                         "30,522 (decoder weight tied to the word embedding) + NSP 2,050, as in "
                         "BertForPreTraining",
        inputs=(("input_ids", "(B, T) int64"), ("token_type_ids", "(B, T) int64"),
                ("masked_positions", "(B, P) int64"), ("masked_ids", "(B, P) int64"),
                ("next_sentence", "(B,) int64")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16,
                         "max_positions": 32},
        notes="Loss = mean MLM CE over B*P gathered positions + mean NSP CE; no padding mask (all tokens "
              "valid). layers=48 gives 638,535,484 parameters. " + NO_DROPOUT,
    ),
    ModelSpec(
        name="xlnet_large",
        description="XLNet-Large permutation LM (Yang et al. 2019): 24 layers, hidden 1024, 16 heads, "
                    "vocab 32000, two-stream relative attention, seq 128, 21 targets per sequence",
        builder=build_xlnet_large,
        default_batch_size=24,
        batch_size_source=CHOSEN,
        params=360_300_800,
        published_params=360_268_800,
        published_source="xlnet-large-cased XLNetModel has 360,268,800 (about 360M); the LM head adds "
                         "its 32,000 output bias (weight tied to the word embedding)",
        inputs=(("input_ids", "(B, T) int64"), ("token_type_ids", "(B, T) int64"),
                ("perm_mask", "(B, T, T) float, 1 = may not attend"),
                ("target_mapping", "(B, P, T) float one-hot"), ("labels", "(B, P) int64")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16},
        notes="Faithful to XLNet's layer: content and query streams share q/k/v/o and the r projection, "
              "untied per-layer r_w/r_r/r_s biases and relative segment embeddings, Transformer-XL "
              "sinusoidal relative positions with rel_shift, post-LN GELU FFN. Simplified against the "
              "original pre-training: no recurrence memory (mems), no bidirectional data, one random "
              "factorisation order per sequence with the last T//6 positions as targets (K=6). "
              + NO_DROPOUT,
    ),
    ModelSpec(
        name="gpt2",
        description="GPT-2 small (Radford et al. 2019): 12 pre-LN layers, hidden 768, 12 heads, "
                    "vocab 50257, context 1024, tied embeddings",
        builder=build_gpt2,
        default_batch_size=8,
        batch_size_source="chosen here (not a HeteroG benchmark model); 8 x 1024 tokens",
        params=124_439_808,
        published_params=124_439_808,
        published_source="HF gpt2 GPT2LMHeadModel, tied embeddings (equal)",
        inputs=LM_INPUTS,
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16,
                         "max_positions": 32},
        notes="Loss: mean next-token CE over all B*T positions; q/k/v are separate Linear layers "
              "(same count as GPT-2's fused c_attn). " + NO_DROPOUT,
    ),
    ModelSpec(
        name="gpt2_xl",
        description="GPT-2 XL (Radford et al. 2019): 48 pre-LN layers, hidden 1600, 25 heads, ffn 6400, "
                    "vocab 50257, 640 of its 1024 positions, tied embeddings",
        builder=build_gpt2_xl,
        default_batch_size=8,
        batch_size_source="chosen here (not a HeteroG benchmark model); 8 x 640 tokens, so that layer-wise "
                          "model parallelism fits paper-8gpu while no data-parallel plan does",
        params=1_557_611_200,
        published_params=1_557_611_200,
        published_source="HF gpt2-xl GPT2LMHeadModel, tied embeddings (equal; the 1024 x 1600 position "
                          "table is whole, only 640 rows are read)",
        inputs=LM_INPUTS,
        small_overrides={"layers": 2, "hidden": 40, "heads": 5, "vocab": 100, "seq_len": 16,
                         "max_positions": 32},
        notes="Same code as gpt2 (heterog.zoo.gpt2.CausalLM). " + ADAM + " Its 24.9 GB overflow every GPU "
              "of paper-8gpu (V100 16 GB), so every data-parallel plan and 'single' are out of memory there, "
              "while placing whole layers on different GPUs fits. " + NO_DROPOUT,
    ),
    ModelSpec(
        name="big_embedding",
        description="Causal LM with one operator larger than a 16 GB GPU: tied 400,000 x 4096 token embedding "
                    "and output projection, 2 pre-LN layers (32 heads, ffn 16384), 128 tokens",
        builder=build_big_embedding,
        default_batch_size=8,
        batch_size_source="chosen here (memory stress model); 8 x 128 tokens",
        params=2_041_692_160,
        published_params=None,
        published_source="stress model, no published counterpart: embedding 1,638,400,000 + positions "
                         "524,288 + 2 layers x 201,379,840 + final LayerNorm 8,192",
        inputs=LM_INPUTS,
        small_overrides={"layers": 1, "hidden": 32, "heads": 4, "vocab": 500, "seq_len": 16,
                         "max_positions": 16},
        notes="Same code as gpt2 (heterog.zoo.gpt2.CausalLM). " + ADAM + " The embedding's 26.2 GB "
              "(6.55 GB each for weight, gradient and two moments) overflow every GPU of paper-8gpu (V100 "
              "16 GB): no plan that keeps the parameter whole fits there. The (B, T, 400000) logits are "
              "1.6 GB at the default batch. " + NO_DROPOUT,
    ),
    ModelSpec(
        name="opt_350m",
        description="OPT-350M (Zhang et al. 2022; HF facebook/opt-350m config): 24 post-LN layers, hidden 1024, "
                    "16 heads, ffn 4096, ReLU, 512-wide embedding projected in and out, vocab 50272, seq 2048",
        builder=build_opt_350m,
        default_batch_size=8,
        batch_size_source=SAILOR,
        params=331_196_416,
        published_params=331_196_416,
        published_source="HF facebook/opt-350m OPTForCausalLM, output tied to the token embedding (equal)",
        inputs=(("input_ids", "(B, T) int64"), ("labels", "(B, T) int64, equal to input_ids")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "embed_proj": 16, "vocab": 100,
                         "seq_len": 16},
        notes="transformers.OPTForCausalLM from its configuration with random weights, called with keyword "
              "inputs {input_ids, labels}; it returns an output whose .loss is the mean next-token CE. Dropout 0, "
              "as in Sailor's Megatron-DeepSpeed OPT (heterog/zoo/hf_lm.py). Sailor's OPT-350 differs from the "
              "HF layout: pre-LN, 1024-wide embeddings without projections, vocabulary padded to 50304.",
    ),
    ModelSpec(
        name="opt_350m_megatron",
        description="OPT-350M as Sailor trained it (Megatron-DeepSpeed): 24 pre-LN layers, hidden 1024, 16 heads, "
                    "ffn 4096, ReLU, 1024-wide embeddings, vocab padded to 50304, untied output, seq 2048",
        builder=build_opt_350m_megatron,
        default_batch_size=8,
        batch_size_source=SAILOR,
        params=407_433_216,
        published_params=407_431_168,
        published_source="Metis' profiles of Sailor's OPT-350 (eth-easl/sailor cf2c8e3, sailor/Planner/baselines/"
                         "Metis/profiles/OPT-350/GH-96/mbs1_tmp1.json, total_parameters_bytes / 4); HF's position "
                         "table has 2 offset rows more (2,048 parameters)",
        inputs=(("input_ids", "(B, T) int64"), ("labels", "(B, T) int64, equal to input_ids")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 100, "seq_len": 16},
        notes="The model behind Sailor's measured OPT-350 runs, as a transformers.OPTForCausalLM configuration "
              "(heterog/zoo/hf_lm.py); what Sailor and Metis plans of OPT-350 import onto. Dropout 0. " + ADAM,
    ),
    ModelSpec(
        name="gpt_neo_2_7b",
        description="GPT-Neo-2.7B (Black et al. 2021; HF EleutherAI/gpt-neo-2.7B config): 32 pre-LN layers "
                    "alternating global and local (256) attention, hidden 2560, 20 heads, vocab 50257, seq 2048",
        builder=build_gpt_neo_2_7b,
        default_batch_size=8,
        batch_size_source=SAILOR,
        params=2_651_307_520,
        published_params=2_651_307_520,
        published_source="HF EleutherAI/gpt-neo-2.7B GPTNeoForCausalLM, output tied to the token embedding "
                         "(equal)",
        inputs=(("input_ids", "(B, T) int64"), ("labels", "(B, T) int64, equal to input_ids")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16},
        notes="transformers.GPTNeoForCausalLM from its configuration with random weights, called with keyword "
              "inputs {input_ids, labels}; .loss is the mean next-token CE. Dropout 0.1 on the embeddings and "
              "residual branches, none on attention probabilities, as in Sailor's Megatron-DeepSpeed GPT-Neo "
              "(heterog/zoo/hf_lm.py). " + ADAM,
    ),
    ModelSpec(
        name="gpt_neo_2_7b_megatron",
        description="GPT-Neo-2.7B as Sailor trained it (Megatron-DeepSpeed): gpt_neo_2_7b with the vocabulary "
                    "padded to 50304",
        builder=build_gpt_neo_2_7b_megatron,
        default_batch_size=8,
        batch_size_source=SAILOR,
        params=2_651_427_840,
        published_params=2_651_673_600,
        published_source="Metis' profiles of Sailor's GPT-Neo-2.7 (eth-easl/sailor cf2c8e3, sailor/Planner/"
                         "baselines/Metis/profiles/GPT-Neo-2.7/GH-96/mbs1_tmp1.json, total_parameters_bytes / 4); "
                         "Megatron's q, k, v biases (7,680 per block) are not in the HF layout",
        inputs=(("input_ids", "(B, T) int64"), ("labels", "(B, T) int64, equal to input_ids")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq_len": 16},
        notes="The model behind Sailor's measured GPT-Neo runs, as a transformers.GPTNeoForCausalLM "
              "configuration (heterog/zoo/hf_lm.py); what Sailor's GPT-Neo plans import onto. " + ADAM,
    ),
    ModelSpec(
        name="gptj_6b",
        description="GPT-J-6B (Wang & Komatsuzaki 2021; HF EleutherAI/gpt-j-6b config): 28 blocks with parallel "
                    "attention and feed-forward, hidden 4096, 16 heads, rotary 64, ffn 16384, vocab 50400, seq 2048",
        builder=build_gptj_6b,
        default_batch_size=8,
        batch_size_source="chosen here (larger than any GPU of paper-8gpu); 8 x 2048 tokens",
        params=6_050_882_784,
        published_params=6_053_381_344,
        published_source="EleutherAI/gpt-j-6b model card (counted on the mesh-transformer-jax checkpoint); the HF "
                         "GPTJForCausalLM layout built here has 6,050,882,784 (output layer with bias, untied)",
        inputs=(("input_ids", "(B, T) int64"), ("labels", "(B, T) int64, equal to input_ids")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 100, "seq_len": 16},
        notes="transformers.GPTJForCausalLM from its configuration with random weights, keyword inputs "
              "{input_ids, labels}. Its rotary table is a 2048 x 64 buffer, not a parameter. " + ADAM + " About "
              "96.8 GB (90.2 GiB) with Adam, against paper-8gpu's 100 GiB of GPU memory: no plan without sharded "
              "state fits. " + NO_DROPOUT,
    ),
    ModelSpec(
        name="opt_13b",
        description="OPT-13B (Zhang et al. 2022; HF facebook/opt-13b config): 40 pre-LN layers, hidden 5120, "
                    "40 heads, ffn 20480, ReLU, vocab 50272, seq 2048, tied embeddings",
        builder=build_opt_13b,
        default_batch_size=8,
        batch_size_source="chosen here (larger than paper-8gpu's GPU memory); 8 x 2048 tokens",
        params=12_853_473_280,
        published_params=12_853_473_280,
        published_source="HF facebook/opt-13b OPTForCausalLM, output tied to the token embedding (equal)",
        inputs=(("input_ids", "(B, T) int64"), ("labels", "(B, T) int64, equal to input_ids")),
        small_overrides={"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 100, "seq_len": 16},
        notes="opt_350m's code (heterog/zoo/hf_lm.py) with the 13B configuration: pre-LN, embeddings as wide as "
              "the blocks. " + ADAM + " About 205.7 GB (191.6 GiB) with Adam, more than paper-8gpu's 100 GiB of "
              "GPU memory: a plan needs the servers' host memory (offloading). " + NO_DROPOUT,
    ),
    ModelSpec(
        name="tiny_mlp",
        description="Tiny MLP 32-64-64-10 for tests",
        builder=build_tiny_mlp,
        default_batch_size=16,
        batch_size_source="test model",
        params=6_922,
        published_params=None,
        published_source="test model",
        inputs=(("features", "(B, 32) float"), ("labels", "(B,) int64")),
        notes="No batch statistics: data-parallel training equals single-device training.",
    ),
    ModelSpec(
        name="tiny_cnn",
        description="Tiny CNN (conv 3->8, conv 8->16 stride 2, max pool, FC 16->10) on 16x16 images",
        builder=build_tiny_cnn,
        default_batch_size=8,
        batch_size_source="test model",
        params=1_562,
        published_params=None,
        published_source="test model",
        inputs=IMAGE_INPUTS,
        notes="No batch norm: data-parallel training equals single-device training.",
    ),
    ModelSpec(
        name="tiny_transformer",
        description="Tiny 2-layer causal Transformer LM (hidden 16, 2 heads, vocab 64, 8 tokens)",
        builder=build_tiny_transformer,
        default_batch_size=8,
        batch_size_source="test model",
        params=7_744,
        published_params=None,
        published_source="test model",
        inputs=LM_INPUTS,
        notes="Same code as gpt2 (pre-LN, tied embeddings); no batch statistics.",
    ),
)

_REGISTRY = {s.name: s for s in _SPECS}


def names() -> list[str]:
    """Registered model names, benchmark models first, then the tiny test models."""
    return list(_REGISTRY)


def spec(name: str) -> ModelSpec:
    """The registry record of a model; HeterogError for an unknown name."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise HeterogError(f"unknown zoo model {name!r}; known: {', '.join(_REGISTRY)}") from None


def default_batch_size(name: str) -> int:
    """The model's default global batch (images, or sequences for NLP models)."""
    return spec(name).default_batch_size


def small_overrides(name: str) -> dict:
    """Overrides that shrink `name` for fast real forward/backward passes (empty for tiny models)."""
    return dict(spec(name).small_overrides)


def knob_defaults(name: str) -> dict:
    """Override name -> default value, read from the builder's signature."""
    parameters = inspect.signature(spec(name).builder).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def info(name: str) -> dict:
    """Description, default batch size and its source, exact parameter count of this implementation,
    published count and its source, inputs, overrides (knob -> {default, doc}) and notes."""
    record = spec(name).as_dict()
    record["knobs"] = {k: {"default": v, "doc": KNOB_DOCS[k]} for k, v in knob_defaults(name).items()}
    return record


def build(
    name: str,
    batch_size: int | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> tuple[nn.Module, Inputs | dict[str, torch.Tensor]]:
    """Build zoo model `name` in training mode with example inputs for `batch_size` samples.

    Args:
        batch_size: global batch (images or sequences); None = the model's default.
        device: where module and inputs live (default CPU); "meta" allocates nothing.
        dtype: of the parameters and floating-point inputs (labels and ids stay int64).
        seed: weights and inputs are drawn from generators seeded with it (equal seeds, equal builds).
        overrides: the model's knobs (see info(name)["knobs"]) to shrink or reshape it.

    Returns:
        (module, inputs) with module(*inputs) the scalar mean loss, or for the Hugging Face models a dict of
        keyword inputs and module(**inputs).loss the loss; the batch is on dim 0 of every input.
    """
    model = spec(name)
    batch_size = model.default_batch_size if batch_size is None else batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise HeterogError(f"zoo model '{name}': batch_size must be a positive integer, got {batch_size!r}")
    unknown = sorted(set(overrides) - set(knob_defaults(name)))
    if unknown:
        raise HeterogError(
            f"zoo model '{name}' has no override {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(knob_defaults(name))}"
        )
    device = torch.device("cpu" if device is None else device)
    meta = device.type == "meta"
    factory = InputFactory(meta=meta, seed=seed)
    if meta:
        with torch.device("meta"):
            module, inputs = model.builder(batch_size, factory, **overrides)
    else:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            module, inputs = model.builder(batch_size, factory, **overrides)
    module = module.to(device=device, dtype=dtype).train()
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    if isinstance(inputs, Mapping):
        return module, {key: move(t) for key, t in inputs.items()}
    return module, tuple(move(t) for t in inputs)
