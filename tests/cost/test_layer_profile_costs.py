"""The cost model with a per-layer profile: a tiny Hugging Face OPT (2 blocks: 4 layers) on an A100-40GB
(profiled) and a V100-16GB (not): each layer's ops sum to its measured time, the optimizer's update ops
to the optimizer time, and the simulated single-device iteration is their sum."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import heterog  # noqa: E402
from heterog.baselines.expert import block_layers  # noqa: E402
from heterog.cli import main  # noqa: E402
from heterog.cluster import load_cluster  # noqa: E402
from heterog.cost import CostModel, LayerProfile, LayerProfileError  # noqa: E402
from heterog.cost.layer_profile import LayerEntry  # noqa: E402
from heterog.evaluate import Evaluator  # noqa: E402
from heterog.strategy import ParallelConfig, Strategy  # noqa: E402

BATCH = 4
LAYER_MS = {(4, 1): [1.0, 2.0, 3.0, 4.0], (2, 1): [0.6, 1.2, 1.8, 2.4], (4, 2): [0.7, 1.1, 1.7, 2.3]}
OPTIMIZER_MS = {1: 5.0, 2: 3.0}
CLUSTER = """name: a100-v100
switch: {bandwidth: 100 Gbit/s}
servers:
  - name: s
    gpus: [{type: A100-40GB, count: 1}, {type: V100-16GB, count: 1}]
    intra: {kind: pcie, bandwidth: 12 GB/s, latency_us: 5}
    nic: {bandwidth: 100 Gbit/s, latency_us: 10}
"""


@pytest.fixture(scope="module")
def opt_graph():
    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                 num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                                 dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (BATCH, 8))
    return heterog.capture(transformers.OPTForCausalLM(cfg), {"input_ids": ids, "labels": ids}, optimizer="adam")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "a100-v100.yaml"
    path.write_text(CLUSTER)
    return load_cluster(path)


def hand_profile() -> LayerProfile:
    z = np.zeros(4)
    return LayerProfile("tiny-opt", {
        ("A100-40", b, t): LayerEntry(mbs=b, tp=t, layer_s=np.array(ms) * 1e-3, optimizer_s=OPTIMIZER_MS[t] * 1e-3,
                                      fb_sync_s=0.0, total_s=0.0, memory_bytes=z, param_bytes=z, activation_bytes=z)
        for (b, t), ms in LAYER_MS.items()})


def test_layers_and_update_ops_sum_to_the_measurements(opt_graph, cluster):
    cost = CostModel(cluster, layer_profile=hand_profile(), layer_numbering=block_layers)
    base = CostModel(cluster)
    layer_of, _ = block_layers(opt_graph)
    profiled = cost.time_sources(opt_graph)
    assert profiled[:, 1].sum() == 0                              # the V100 is not profiled: all roofline
    full, roof = cost.full_batch_times(opt_graph), base.full_batch_times(opt_graph)
    np.testing.assert_array_equal(full[:, 1], roof[:, 1])
    phase = np.array([op.phase for op in opt_graph.ops])
    fb = profiled[:, 0] & (phase != "update")
    update = profiled[:, 0] & (phase == "update")
    per_layer = np.bincount(layer_of[fb], weights=full[fb, 0], minlength=4)
    np.testing.assert_allclose(per_layer, np.array(LAYER_MS[4, 1]) * 1e-3, rtol=1e-12)
    assert full[update, 0].sum() == pytest.approx(OPTIMIZER_MS[1] * 1e-3, rel=1e-12)
    # within a layer the roofline's proportions stay (forward : backward included)
    ops = np.nonzero(fb & (layer_of == 2))[0]
    np.testing.assert_allclose(full[ops, 0] / full[ops, 0].sum(), roof[ops, 0] / roof[ops, 0].sum(), rtol=1e-12)
    # ops without a unit keep the roofline: here only the non-compute ones (all take 0)
    np.testing.assert_array_equal(full[~profiled[:, 0], 0], roof[~profiled[:, 0], 0])


def test_half_a_micro_batch_and_a_two_way_split_take_those_entries(opt_graph, cluster):
    cost = CostModel(cluster, layer_profile=hand_profile(), layer_numbering=block_layers)
    layer_of, _ = block_layers(opt_graph)
    fb = cost.time_sources(opt_graph)[:, 0] & np.array([op.phase != "update" for op in opt_graph.ops])
    ops = np.nonzero(fb)[0]
    zeros = np.zeros(len(ops), dtype=np.int64)
    half = cost.op_times(opt_graph, ops, zeros, np.full(len(ops), 0.5))            # 2 samples: the mbs-2 entry
    np.testing.assert_allclose(np.bincount(layer_of[ops], weights=half, minlength=4),
                               np.array(LAYER_MS[2, 1]) * 1e-3, rtol=1e-12)
    split = cost.op_times(opt_graph, ops, zeros, np.ones(len(ops)), np.full(len(ops), 0.5))   # tp 2
    np.testing.assert_allclose(np.bincount(layer_of[ops], weights=split, minlength=4),
                               np.array(LAYER_MS[4, 2]) * 1e-3, rtol=1e-12)


def test_single_device_iteration_is_the_profile_sum(opt_graph, cluster):
    ev = Evaluator(opt_graph, cluster, layer_profile=hand_profile())
    strategy = Strategy(opt_graph.fingerprint, cluster.name, cluster.n_devices, BATCH,
                        np.zeros(opt_graph.n_ops, dtype=np.int64), [ParallelConfig.single(0, BATCH)])
    res = ev.evaluate(strategy)
    assert res.plan is not None
    profiled = ev.cost.time_sources(opt_graph)[:, 0]
    kept_s = CostModel(cluster).full_batch_times(opt_graph)[~profiled, 0].sum()
    assert kept_s == 0.0                       # every compute op of this graph is in a layer or a parameter
    expected = (sum(LAYER_MS[4, 1]) + OPTIMIZER_MS[1]) * 1e-3 + kept_s
    assert res.iteration_time_s == pytest.approx(expected, rel=1e-12)
    sources = ev.time_sources(res.plan)
    assert sources["A100-40GB"]["profile"]["seconds"] == pytest.approx(expected, rel=1e-12)
    assert sources["A100-40GB"]["roofline"] == {"ops": 0.0, "tasks": 0.0, "seconds": 0.0}
    assert sources["V100-16GB"]["profile"]["tasks"] == 0 and sources["V100-16GB"]["roofline"]["tasks"] == 0
    # on the unprofiled V100 the iteration is the roofline's
    on_v100 = Strategy(opt_graph.fingerprint, cluster.name, cluster.n_devices, BATCH,
                       np.zeros(opt_graph.n_ops, dtype=np.int64), [ParallelConfig.single(1, BATCH)])
    assert ev.evaluate(on_v100).iteration_time_s == Evaluator(opt_graph, cluster).evaluate(on_v100).iteration_time_s


def test_a_profile_with_another_number_of_layers_is_refused(opt_graph, cluster):
    z = np.zeros(26)
    lp = LayerProfile("OPT-350", {("A100-40", 1, 1): LayerEntry(1, 1, z, 0.0, 0.0, 0.0, z, z, z)})
    cost = CostModel(cluster, layer_profile=lp, layer_numbering=block_layers)
    with pytest.raises(LayerProfileError, match="has 2 blocks .4 layers.*'OPT-350' has 26 layers"):
        cost.full_batch_times(opt_graph)
    with pytest.raises(LayerProfileError, match="layer numbering"):
        CostModel(cluster, layer_profile=lp)


def test_cli_simulate_reports_the_sources(opt_graph, cluster, tmp_path, capsys):
    graph_file = opt_graph.save(tmp_path / "opt.json")
    cluster_file = tmp_path / "c.yaml"
    cluster_file.write_text(CLUSTER)
    strategy = Strategy(opt_graph.fingerprint, cluster.name, cluster.n_devices, BATCH,
                        np.zeros(opt_graph.n_ops, dtype=np.int64), [ParallelConfig.single(0, BATCH)])
    strategy.save(tmp_path / "s.json")
    prof = tmp_path / "prof" / "A100-40"
    prof.mkdir(parents=True)
    for (b, t), ms in LAYER_MS.items():
        (prof / f"mbs{b}_tmp{t}.json").write_text(json.dumps({
            "model": {"model_name": "tiny-opt", "num_layers": 4,
                      "parameters": {"parameters_per_layer_bytes": [0] * 4, "activation_parameters_bytes": [0] * 4}},
            "execution_time": {"total_time_ms": 0.0, "forward_backward_time_ms": sum(ms),
                               "batch_generator_time_ms": 0.0, "optimizer_time_ms": OPTIMIZER_MS[t],
                               "layer_compute_total_ms": ms},
            "execution_memory": {"layer_memory_total_mb": [0.0] * 4}}))
    code = main(["simulate", "--graph", str(graph_file), "--cluster", str(cluster_file), "--strategy",
                 str(tmp_path / "s.json"), "--layer-profiles", str(tmp_path / "prof"), "--json"])
    assert code == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["iteration_time_s"] == pytest.approx(15e-3, rel=1e-12)
    assert rec["time_sources"]["A100-40GB"]["profile"]["seconds"] == pytest.approx(15e-3, rel=1e-12)
    code = main(["simulate", "--graph", str(graph_file), "--cluster", str(cluster_file), "--strategy",
                 str(tmp_path / "s.json"), "--layer-profiles", str(Path(tmp_path / "missing"))])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
