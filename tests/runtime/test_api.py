"""get_runner: the HeteroG programming interface plans, then trains, and matches single-process training."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import heterog
from heterog import zoo
from heterog.evaluate import Evaluator
from heterog.runtime import RunnerConfig, capture_model_for_runtime, train_single_process
from heterog.runtime.api import DP_METHODS, default_method, resolve_strategy


def build_model() -> torch.nn.Module:
    return zoo.build("tiny_mlp", 8, seed=1)[0]


class Batches:
    """A fresh global batch per call (seeded), as a data loader would give."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self):
        g = torch.Generator().manual_seed(100 + self.step)
        self.step += 1
        return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def test_get_runner_plans_then_trains_like_one_process(pool2) -> None:
    runner = heterog.get_runner(build_model, Batches(), "local-cpu-2",
                                {"method": "ev-ar", "steps": 3, "lr": 0.1, "pool": pool2})
    assert runner.strategy.method == "ev-ar"
    first = runner.run()
    assert len(first.losses) == len(first.iteration_times_s) == 3
    second = runner.run(2)                           # parameters carry over between calls
    # the same 5 steps in one process, on the same batches
    data = Batches()
    batches = [data() for _ in range(5)]
    ref = capture_model_for_runtime(build_model(), batches[0], lr=0.1)
    ref_losses, ref_values = train_single_process(ref, batches, 5)
    np.testing.assert_allclose(first.losses + second.losses, ref_losses, rtol=1e-5)
    got = runner.parameters()
    for name, ph in zip(ref.prog.param_names, ref.prog.placeholders):
        torch.testing.assert_close(got[name], ref_values[ph], rtol=1e-5, atol=1e-6)
    assert first.simulated_iteration_time_s > 0 and second.iteration_time_s > 0
    runner.close()


def test_default_planner_is_the_agent_when_importable_else_the_fastest_dp_baseline() -> None:
    assert default_method() == "agent"          # agents.planner exists in this repository
    m = capture_model_for_runtime(build_model(), Batches()())
    cluster = heterog.load_cluster("local-cpu-2:slowdown=1,3")
    s = resolve_strategy(m, cluster, method="best-dp")
    ev = Evaluator(m.graph, cluster)
    times = {name: ev.iteration_time(heterog.baselines.run(name, m.graph, cluster, evaluator=ev))[0]
             for name in DP_METHODS}
    assert s.method == min(times, key=times.get)
    assert ev.iteration_time(s)[0] == pytest.approx(min(times.values()))


def test_runner_config_rejects_unknown_settings() -> None:
    with pytest.raises(heterog.errors.HeterogError, match="unknown runner settings"):
        RunnerConfig.of({"stpes": 3})


class DictOutput(torch.nn.Module):
    """A classifier returning ``{"logits": ..., "loss": ...}`` as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.fc2 = torch.nn.Linear(32, 16), torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc2(torch.relu(self.fc1(x)))
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}


def test_runtime_trains_on_the_loss_entry_of_a_dict_output(pool2) -> None:
    from heterog.runtime.api import compare_values, prepare, run_prepared

    module, batch = DictOutput(), Batches()()
    m = capture_model_for_runtime(module, batch, lr=0.1)
    cluster = heterog.load_cluster("local-cpu-2")
    r = run_prepared(prepare(m, cluster, resolve_strategy(m, cluster, method="ev-ar")), [batch], 3, pool=pool2)
    ref_losses, ref_values = train_single_process(m, [batch], 3)
    assert r.losses[0] == pytest.approx(float(module(*batch)["loss"].detach()), rel=1e-5)
    np.testing.assert_allclose(r.losses, ref_losses, rtol=1e-5)
    assert ref_losses[2] < ref_losses[0]                  # it trains on that loss
    ok, diff, bad = compare_values(m, r.values, ref_values)
    assert ok, (diff, bad)
