"""A small OPT (two blocks, sequence 16, batch 8) and small clusters written as YAML, for the importers."""
from __future__ import annotations

from pathlib import Path

import pytest

from heterog.cluster import load_cluster

DATA = Path(__file__).resolve().parents[1] / "data" / "sailor"

A100_YAML = """
name: two-a100-nodes
switch: {bandwidth: 100 Gbit/s}
servers:
  - name: n0
    gpus: [{type: A100-40GB, count: 4}]
    intra: {kind: nvlink, bandwidth: 300 GB/s}
    nic: {bandwidth: 100 Gbit/s}
  - name: n1
    gpus: [{type: A100-40GB, count: 4}]
    intra: {kind: nvlink, bandwidth: 300 GB/s}
    nic: {bandwidth: 100 Gbit/s}
"""

# the MIT testbed's GPU mix in small: a Titan RTX is described by its own numbers (not in the catalog)
MIXED_YAML = """
name: mixed-3090-titan
switch: {bandwidth: 25 Gbit/s}
servers:
  - name: n0
    gpus: [{type: RTX-3090, count: 2}]
    intra: {kind: pcie, bandwidth: 12 GB/s}
    nic: {bandwidth: 25 Gbit/s}
  - name: n1
    gpus: [{name: Titan-RTX, peak_tflops: 16.3, tensor_tflops: 130, memory_bandwidth: 672 GB/s, memory: 24 GiB,
            count: 2}]
    intra: {kind: pcie, bandwidth: 12 GB/s}
    nic: {bandwidth: 25 Gbit/s}
"""


def _cluster(tmp_path_factory: pytest.TempPathFactory, text: str, name: str):
    path = tmp_path_factory.mktemp("clusters") / f"{name}.yaml"
    path.write_text(text)
    return load_cluster(path)


@pytest.fixture(scope="session")
def a100_cluster(tmp_path_factory: pytest.TempPathFactory):
    return _cluster(tmp_path_factory, A100_YAML, "a100")


@pytest.fixture(scope="session")
def mixed_cluster(tmp_path_factory: pytest.TempPathFactory):
    return _cluster(tmp_path_factory, MIXED_YAML, "mixed")


@pytest.fixture(scope="session")
def opt_graph():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    import heterog

    torch.manual_seed(0)
    config = tf.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                          max_position_embeddings=40, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2,
                          eos_token_id=2)
    ids = torch.randint(3, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    return heterog.capture(tf.OPTForCausalLM(config), {"input_ids": ids, "labels": ids})
