"""CLIP at the size of OpenAI's ViT-B/16 (``openai/clip-vit-base-patch16``'s configuration: a 12-layer 768-wide
vision transformer on 224 x 224 images in 16 x 16 patches, a 12-layer 512-wide text transformer on 77 tokens,
512-dimensional embeddings), random weights, trained on its own contrastive loss (``return_loss=True``: every
image against every text of the batch). Used by ``python -m experiments.contrastive``.
"""
from __future__ import annotations

import torch
import transformers as tf

DEFAULT_BATCH = 256
TOKENS, IMAGE = 77, 224


def config() -> tf.CLIPConfig:
    return tf.CLIPConfig(
        text_config={"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                     "num_attention_heads": 8, "max_position_embeddings": TOKENS},
        vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                       "num_attention_heads": 12, "image_size": IMAGE, "patch_size": 16},
        projection_dim=512)


def build(batch_size: int | None = None):
    """``(CLIPModel, keyword inputs)`` at ``batch_size`` (default 256) pairs of an image and a caption."""
    b = batch_size or DEFAULT_BATCH
    model = tf.CLIPModel(config())
    return model, {"input_ids": torch.randint(0, 49408, (b, TOKENS)),
                   "pixel_values": torch.randn(b, 3, IMAGE, IMAGE), "return_loss": True}
