"""Every command's error paths: bad input gives one line naming what is wrong and a non-zero exit, never a
traceback, whatever the input: a file that is missing, truncated or of another kind, a model whose own code
fails in the trace (in its forward, in a hand-written backward, on a value it checks), numbers out of range."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from heterog.cli import main
from tests.compiler.helpers import linear_graph
from tests.test_cli import assert_clean_error

MODELS = '''
import torch
from torch import nn
from torch.nn import functional as F


class Broken(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("this backward was never written for fake tensors")


class Net(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.mode = mode

    def forward(self, x, y):
        h = self.fc(x)
        if self.mode == "backward":
            h = Broken.apply(h)
        if self.mode == "forward":
            h = h.view(-1, 5, 7)
        if self.mode == "check" and y.max() >= 3:
            raise ValueError("labels out of range")
        if self.mode == "numpy":
            import numpy as np
            h = h * float(np.random.rand())
        return F.cross_entropy(h, y)


def _build(mode, top=3):
    g = torch.Generator().manual_seed(0)
    return Net(mode), (torch.randn(6, 4, generator=g), torch.randint(0, top, (6,), generator=g))


def build_backward(batch_size=None):
    return _build("backward")


def build_forward(batch_size=None):
    return _build("forward")


def build_bad_labels(batch_size=None):
    return _build("check", top=5)


def build_numpy(batch_size=None):
    return _build("numpy")


def build_raises(batch_size=None):
    raise KeyError("no such dataset")


def build_not_a_model(batch_size=None):
    return 42, (torch.zeros(2),)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
    d = tmp_path_factory.mktemp("cli-errors")
    (d / "models.py").write_text(MODELS)
    graph = linear_graph(batch=16).save(d / "linear.json")
    other = linear_graph(batch=8).save(d / "other.json")
    truncated = d / "truncated.json"
    truncated.write_text(graph.read_text()[:100])
    strategy = d / "s.json"
    assert main(["plan", "--graph", str(other), "--cluster", "paper-8gpu", "--method", "ev-ar", "-o",
                 str(strategy)]) == 0
    (d / "not-json.json").write_text("{ this is not json")
    (d / "cluster.yaml").write_text("name: x\nservers:\n  - gpus: [NoSuchGPU]\n")
    (d / "sailor.json").write_text(json.dumps({"pipeline_list": "nonsense"}))
    return {"dir": d, "models": d / "models.py", "graph": graph, "truncated": truncated, "strategy": strategy,
            "not_json": d / "not-json.json", "cluster": d / "cluster.yaml", "sailor": d / "sailor.json"}


def _cases() -> list[tuple[str, Callable[[dict[str, Path]], list[str]], str]]:
    def model(name: str) -> Callable[[dict[str, Path]], str]:
        return lambda f: f"{f['models']}:{name}"

    def cap(ref: Callable[[dict[str, Path]], str]) -> Callable[[dict[str, Path]], list[str]]:
        return lambda f: ["capture", ref(f), "--no-cache", "-o", str(f["dir"] / "out.json")]

    def sim(*extra: str, graph: str = "graph") -> Callable[[dict[str, Path]], list[str]]:
        return lambda f: ["simulate", "--graph", str(f[graph]), "--cluster", "paper-8gpu", *[
            str(f[e[1:]]) if e.startswith("@") else e for e in extra]]

    def run(ref: Callable[[dict[str, Path]], str], *extra: str) -> Callable[[dict[str, Path]], list[str]]:
        return lambda f: ["run", "--model", ref(f), "--cluster", "local-cpu-2", *extra]

    zoo = lambda f: "tiny_mlp"                                  # noqa: E731 - a model ref that needs no file
    return [
        ("capture: unknown zoo model", cap(lambda f: "no_such_model"), "no_such_model"),
        ("capture: missing model file", cap(lambda f: str(f["dir"] / "absent.py:build")), "absent.py"),
        ("capture: build raises", cap(model("build_raises")), "no such dataset"),
        ("capture: not a module", cap(model("build_not_a_model")), "not a torch.nn.Module"),
        ("capture: forward fails", cap(model("build_forward")), "forward pass failed while tracing"),
        ("capture: hand-written backward fails", cap(model("build_backward")),
         "backward pass failed while tracing on fake tensors at"),
        ("run: inputs fail the model's check", run(model("build_bad_labels"), "--method", "ev-ar"),
         "example inputs fail the model's own check"),
        ("capture: numpy in forward", cap(model("build_numpy")), "numpy.random.rand"),
        ("capture: batch size 0", lambda f: ["capture", "tiny_mlp", "--batch-size", "0", "-o",
                                             str(f["dir"] / "out.json")], "batch"),
        ("simulate: missing graph", sim("--method", "ev-ar", graph="not_there"), "does not exist"),
        ("simulate: truncated graph", sim("--method", "ev-ar", graph="truncated"), "truncated"),
        ("simulate: not json", sim("--method", "ev-ar", graph="not_json"), "truncated or not JSON"),
        ("simulate: unknown method", sim("--method", "no-such-planner"), "no-such-planner"),
        ("simulate: strategy of another graph", sim("--strategy", "@strategy"), "strategy is for graph"),
        ("simulate: strategy file not json", sim("--strategy", "@not_json"), "not-json.json"),
        ("simulate: bad cluster file", lambda f: ["simulate", "--graph", str(f["graph"]), "--cluster",
                                                  str(f["cluster"]), "--method", "ev-ar"], "NoSuchGPU"),
        ("compare: unknown method", lambda f: ["compare", "--graph", str(f["graph"]), "--cluster", "paper-8gpu",
                                               "--methods", "ev-ar,nope"], "nope"),
        ("plan: unknown option", lambda f: ["plan", "--graph", str(f["graph"]), "--cluster", "paper-8gpu",
                                            "--method", "mcmc", "--option", "budget=1", "-o",
                                            str(f["dir"] / "p.json")], "budget"),
        ("plan: option without a value", lambda f: ["plan", "--graph", str(f["graph"]), "--cluster", "paper-8gpu",
                                                    "--method", "mcmc", "--option", "max_evals", "-o",
                                                    str(f["dir"] / "p.json")], "NAME=VALUE"),
        ("plan: unknown cluster", lambda f: ["plan", "--graph", str(f["graph"]), "--cluster", "no-such-cluster",
                                             "--method", "ev-ar", "-o", str(f["dir"] / "p.json")], "no-such-cluster"),
        ("run: no steps", run(zoo, "--method", "ev-ar", "--steps", "0"), "--steps"),
        ("run: strategy of another graph", lambda f: ["run", "--model", "tiny_mlp", "--cluster", "paper-8gpu",
                                                      "--strategy", str(f["strategy"])], "strategy is for"),
        ("run: model fails", run(model("build_forward"), "--method", "ev-ar"), "forward pass failed"),
        ("fidelity: no plans", lambda f: ["fidelity", "--model", "tiny_mlp", "--cluster", "local-cpu-2",
                                          "--plans", "0"], "--plans"),
        ("fidelity: missing published folder", lambda f: ["fidelity", "--published", str(f["dir"] / "nothing")],
         "nothing"),
        ("import-plan: missing file", lambda f: ["import-plan", str(f["dir"] / "none.json"), "--format", "sailor",
                                                 "--graph", str(f["graph"]), "--cluster", "paper-8gpu", "-o",
                                                 str(f["dir"] / "i.json")], "none.json"),
        ("import-plan: malformed plan", lambda f: ["import-plan", str(f["sailor"]), "--format", "sailor",
                                                   "--graph", str(f["graph"]), "--cluster", "paper-8gpu", "-o",
                                                   str(f["dir"] / "i.json")], "sailor.json"),
    ]


CASES = _cases()


@pytest.mark.parametrize("argv, needle", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_an_error_path_gives_one_line_and_a_non_zero_exit(capsys, files, argv, needle) -> None:
    args = argv({**files, "not_there": files["dir"] / "absent.json"})
    code = main(args)
    _, err = capsys.readouterr()
    assert_clean_error(code, err, needle, f"heterog {args[0]}: error:")


def test_every_command_has_an_error_path_here() -> None:
    from heterog.cli import COMMANDS

    covered = {c[0].split(":")[0] for c in CASES}
    names = {c.__name__.rsplit(".", 1)[-1].replace("_", "-") for c in COMMANDS}
    assert names - covered <= {"bench", "main-job"}, names - covered      # they read no input of the user's
