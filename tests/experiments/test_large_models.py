"""experiments/large_models.py: the state arithmetic of a captured graph, the least offloading a plan needs
(hand-computed on paper-8gpu's hosts), what a plan uses, and one run end to end on a tiny model."""
from __future__ import annotations

import json

import numpy as np
import pytest

import heterog
from experiments import large_models
from heterog import zoo
from heterog.cluster import load_cluster


@pytest.fixture(scope="module")
def tiny_adam():
    module, inputs = zoo.build("tiny_transformer", 8, device="meta")
    return module, heterog.capture(module, inputs, optimizer="adam")


def test_state_arithmetic_is_16_bytes_per_parameter_plus_step_counters(tiny_adam):
    module, graph = tiny_adam
    cluster = load_cluster("paper-8gpu")
    a = large_models.state_arithmetic(graph, cluster)
    tensors = sum(1 for _ in module.parameters())
    assert a["params"] == zoo.count_parameters(module) == 7_744
    assert (a["param_bytes"], a["grad_bytes"]) == (4 * 7_744, 4 * 7_744)
    assert a["optimizer_state_bytes"] == 8 * 7_744 + 4 * tensors
    assert a["resident_bytes"] == 16 * 7_744 + 4 * tensors
    assert a["gpu_memory_bytes"] == 100 * 2**30 and a["host_memory_bytes"] == 4 * 384e9


def test_least_offloading_follows_from_the_state_over_gpu_memory():
    cluster = load_cluster("paper-8gpu")
    gpu = float(np.sum(cluster.memory_bytes))
    arithmetic = {"resident_bytes": gpu + 12 * 8e9, "gpu_memory_bytes": gpu}     # 8e9 parameters must leave
    o = large_models.offload_bounds(None, cluster, arithmetic)
    host = cluster.servers[0].host
    assert o["offloaded_params_at_least"] == pytest.approx(8e9)
    assert o["host_memory_need_bytes"] == pytest.approx(16 * 8e9)
    # 1e9 parameters per GPU: 8 GB over its own PCIe link, two GPUs of a server sharing the host's memory
    rate = min(12e9, host.effective_memory_Bps / 2)
    assert o["pcie_bound_s"] == pytest.approx(5e-6 + 8e9 / rate)
    # each server steps 2e9 parameters: 28 bytes of host traffic and 14 FLOPs each
    assert o["host_step_bound_s"] == pytest.approx(max(2e9 * 28 / host.effective_memory_Bps,
                                                       2e9 * 14 / host.effective_flops))
    assert large_models.offload_bounds(None, cluster, {"resident_bytes": gpu / 2,
                                                       "gpu_memory_bytes": gpu})["pcie_bound_s"] == 0.0


def test_what_the_gpus_hold_with_every_optimizer_state_offloaded():
    # 13e9 parameters in fp32: 52 GB of parameters and 52 GB of gradients stay on the GPUs
    cluster = load_cluster("paper-8gpu")
    gpu = float(np.sum(cluster.memory_bytes))
    arithmetic = {"param_bytes": 4 * 13e9, "buffer_bytes": 1e6, "grad_bytes": 4 * 13e9,
                  "resident_bytes": 16 * 13e9, "gpu_memory_bytes": gpu}
    o = large_models.offload_bounds(None, cluster, arithmetic)
    assert o["gpu_floor_bytes"] == pytest.approx(104e9 + 1e6)
    assert o["gpu_room_bytes"] == pytest.approx(gpu - 104e9 - 1e6)


def test_sharded_dp_uses_stage_3_over_every_device_with_shards_by_memory(tiny_adam):
    from heterog.evaluate import Evaluator

    _, graph = tiny_adam
    cluster = load_cluster("paper-8gpu")
    ev = Evaluator(graph, cluster)
    s = large_models.sharded_dp(ev)
    u = large_models.uses(s)
    assert (u["max_sharded_stage"], u["sharded_groups"], u["split_groups"]) == (3, 1.0, 0.0)
    (cfg,) = u["configs"]
    assert cfg["devices"] == list(range(8)) and sum(cfg["shares"]) == 8
    assert cfg["groups"] == s.n_groups == 2 + 2          # embeddings, the 2 blocks, the head: a group per layer
    w = np.asarray(cfg["shard_weights"], dtype=float)
    np.testing.assert_allclose(w / w.sum(), cluster.memory_bytes / cluster.memory_bytes.sum(), atol=2e-3)


def test_smoke_run_keeps_a_fitting_plan_and_writes_json(tiny_adam, tmp_path, monkeypatch, capsys):
    import heterog.cli.args

    monkeypatch.setattr(heterog.cli.args, "resolve_graph", lambda model, batch, optimizer: tiny_adam[1])
    assert large_models.main(["--graphs", "tiny_transformer:8", "--planners", "", "--out", str(tmp_path)]) == 0
    (rec,) = json.loads((tmp_path / "large_models.json").read_text())
    assert rec["best"] is not None and rec["least_memory"] is None
    best = next(r for r in rec["candidates"] if r["label"] == rec["best"])
    assert not best["oom"] and best["iteration_time_s"] >= rec["compute_bound_s"] > 0
    assert "(kept)" in capsys.readouterr().out


def test_offloading_of_a_plan_is_its_shard_of_every_offloaded_parameter(tiny_adam):
    from types import SimpleNamespace

    _, graph = tiny_adam
    cluster = load_cluster("paper-8gpu")
    host = cluster.servers[0].host
    offloaded = SimpleNamespace(devices=(0, 1), sharded=SimpleNamespace(offload="optimizer",
                                                                        fractions=np.array([0.25, 0.75])))
    plan = SimpleNamespace(configs=[offloaded], group_of=np.zeros(graph.n_ops, dtype=np.int64))
    o = large_models.plan_offload(graph, cluster, plan)
    assert o["offloaded_params"] == pytest.approx([0.25 * 7_744, 0.75 * 7_744] + [0.0] * 6)
    # the busier GPU moves 8 bytes per parameter; both GPUs of server s0 share its host
    assert o["pcie_s"] == pytest.approx(5e-6 + 8 * 0.75 * 7_744 / min(12e9, host.effective_memory_Bps / 2))
    assert o["host_step_s"] == pytest.approx(max(2 * 0.75 * 7_744 * 28 / host.effective_memory_Bps,
                                                 2 * 0.75 * 7_744 * 14 / host.effective_flops))
    plan.configs = [SimpleNamespace(devices=(0, 1), sharded=None)]
    assert large_models.plan_offload(graph, cluster, plan)["pcie_s"] == 0.0
