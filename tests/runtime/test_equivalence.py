"""Training under any strategy gives the parameters of single-process training (3 processes, gloo).

Plans: all model-parallel (groups spread over the devices), data-parallel with even and proportional
(uneven: 3, 2, 1) shares under PS and AllReduce, a random mix of the (M+4) actions, and a hand-made mix
where the forward, the loss, the backward and the weight gradients sit on different layouts with uneven
explicit shares. Each runs 3 steps; parameters must match to rtol 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from heterog import baselines
from heterog.evaluate import Evaluator
from heterog.runtime import compare_values, prepare, run_prepared, train_single_process
from heterog.strategy import ParallelConfig, Strategy
from tests.runtime.conftest import model

STEPS = 3
MODELS = ["tiny_mlp", "tiny_cnn", "tiny_transformer"]
PLANS = ["all-mp", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "random", "phase-mixed"]


def phase_mixed(graph, cluster, group_of) -> Strategy:
    """Forward on uneven AllReduce (1, 4, 1), the loss alone on device 1, the backward on proportional PS
    (3, 2, 1) with the PS on device 1, weight gradients and updates on two devices (2, 4) with PS."""
    fwd = ParallelConfig.of([(0, 1), (1, 4), (2, 1)], sync="allreduce")
    loss = ParallelConfig.single(1, graph.batch_size)
    bwd = ParallelConfig.of([(0, 3), (1, 2), (2, 1)], sync="ps", ps_device=1)
    grads = ParallelConfig.of([(0, 2), (2, 4)], sync="ps")
    configs = []
    for g in range(int(group_of.max()) + 1):
        ops = [graph.ops[i] for i in np.nonzero(group_of == g)[0]]
        if any(op.is_grad or op.phase == "update" for op in ops):
            configs.append(grads)
        elif any("nll_loss_forward" in op.target for op in ops):
            configs.append(loss)
        elif all(op.phase == "forward" for op in ops):
            configs.append(fwd)
        else:
            configs.append(bwd)
    return Strategy(graph.fingerprint, cluster.name, cluster.n_devices, graph.batch_size, group_of, configs,
                    method="phase-mixed")


def make_strategy(plan: str, m, cluster) -> Strategy:
    ev = Evaluator(m.graph, cluster)
    if plan == "all-mp":
        return ev.strategy(np.arange(ev.n_groups) % cluster.n_devices, method="all-mp")
    if plan == "random":
        return baselines.run("random", m.graph, cluster, evaluator=ev, seed=3)
    if plan == "phase-mixed":
        return phase_mixed(m.graph, cluster, ev.group_of)
    return baselines.run(plan, m.graph, cluster, evaluator=ev)


def check_equivalent(m, cluster, strategy, pool) -> object:
    prepared = prepare(m, cluster, strategy)
    result = run_prepared(prepared, [m.example_inputs], STEPS, pool=pool)
    ref_losses, ref_values = train_single_process(m, [m.example_inputs], STEPS)
    ok, diff, bad = compare_values(m, result.values, ref_values)
    assert ok, f"{strategy.method}: parameters {bad[:5]} differ from single-process training (max |diff| {diff:.3g})"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-5)
    return result


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", MODELS)
def test_three_sgd_steps_equal_single_process_training(name, plan, hetero3, pool3) -> None:
    m = model(name)
    strategy = make_strategy(plan, m, hetero3)
    result = check_equivalent(m, hetero3, strategy, pool3)
    if plan in ("ev-ps", "cp-ps"):
        assert result.n_ps_aggregations > 0 and result.n_allreduce == 0
    if plan in ("ev-ar", "cp-ar"):
        assert result.n_allreduce > 0 and result.n_ps_aggregations == 0
    if plan == "cp-ps":
        assert {c.shares for c in strategy.configs} == {(3, 2, 1)}    # uneven shares
    if plan in ("all-mp", "random", "phase-mixed"):
        assert result.n_messages > 0


@pytest.mark.parametrize("plan", ["phase-mixed", "cp-ar"])
def test_adam_steps_equal_single_process_training(plan, hetero3, pool3) -> None:
    m = model("tiny_mlp", optimizer="adam", lr=0.01)
    check_equivalent(m, hetero3, make_strategy(plan, m, hetero3), pool3)


def test_single_process_reference_is_eager_pytorch_training() -> None:
    """The reference the runtime is compared with is ordinary training with torch.optim.SGD."""
    from heterog import zoo

    m = model("tiny_mlp")
    module, inputs = zoo.build("tiny_mlp", 6)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        module(*inputs).backward()
        opt.step()
    _, values = train_single_process(m, [m.example_inputs], STEPS)
    for (name, p), ph in zip(module.named_parameters(), m.prog.placeholders):
        torch.testing.assert_close(values[ph], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_phase_mixed_plan_puts_loss_backward_and_gradients_on_different_layouts(hetero3) -> None:
    from heterog.compiler import compile_strategy
    from heterog.cost import CostModel

    m = model("tiny_mlp")
    s = make_strategy("phase-mixed", m, hetero3)
    plan = compile_strategy(m.graph, hetero3, s, CostModel(hetero3))
    def lay(pred):
        return {int(plan.placements.op_layout[i]) for i, op in enumerate(m.graph.ops) if pred(op)}
    loss = lay(lambda op: "nll_loss_forward" in op.target)
    grads = lay(lambda op: op.is_grad)
    bwd = lay(lambda op: op.phase == "backward" and not op.is_grad and op.kind == "compute"
              and any(d is not None for d in op.batch_dims))
    assert len(loss) == 1 and loss.isdisjoint(grads) and loss.isdisjoint(bwd) and grads.isdisjoint(bwd)
