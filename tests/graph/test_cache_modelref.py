"""Model references (zoo names, file.py:build) and the content-hashed graph cache."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import heterog
from heterog.errors import HeterogError, ModelError
from heterog.graph.cache import cache_key, capture_model
from heterog.graph.modelref import load_model_fn, model_name

MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc(x), y)


def build(batch_size=5):
    return Net(), (torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,)))


def build_fixed():
    return Net(), (torch.randn(2, 6), torch.randint(0, 3, (2,)))


def build_bad():
    return Net()


not_a_function = 3
'''


@pytest.fixture()
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text(MODEL_FILE)
    return path


def test_file_reference_builds_with_and_without_batch_size(model_file: Path) -> None:
    fn = load_model_fn(f"{model_file}:build")
    module, inputs = fn(None)
    assert isinstance(module, torch.nn.Module) and inputs[0].shape == (5, 6)
    module, inputs = fn(7, device="meta")
    assert inputs[0].shape == (7, 6) and inputs[0].is_meta and next(module.parameters()).is_meta
    assert load_model_fn(str(model_file))(3)[1][1].shape == (3,)          # function defaults to build
    assert model_name(f"{model_file}:build") == "user_model"
    assert model_name(f"{model_file}:build_fixed") == "user_model.build_fixed"


def test_bad_file_references_name_what_is_wrong(model_file: Path, tmp_path: Path) -> None:
    with pytest.raises(HeterogError, match="model file .*missing.py' does not exist"):
        load_model_fn(f"{tmp_path / 'missing.py'}:build")
    with pytest.raises(HeterogError, match="has no function 'nope'"):
        load_model_fn(f"{model_file}:nope")
    with pytest.raises(HeterogError, match="'not_a_function' .* is a int, not a function"):
        load_model_fn(f"{model_file}:not_a_function")
    with pytest.raises(ModelError, match=r"build_fixed\(\) takes no batch size"):
        load_model_fn(f"{model_file}:build_fixed")(4)
    with pytest.raises(ModelError, match=r"build must return \(module, example_inputs\)"):
        load_model_fn(f"{model_file}:build_bad")()
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ModelError, match="importing model file .*broken.py' failed: RuntimeError: boom"):
        load_model_fn(f"{broken}:build")


@pytest.fixture()
def fake_zoo(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in heterog.zoo with one model, so these tests do not depend on the real zoo."""
    from graph_models import MLP

    zoo = types.ModuleType("heterog.zoo")
    calls: list[tuple] = []

    def build(name: str, batch_size: int, *, device=None):
        calls.append((name, batch_size, device))
        with torch.device(device or "cpu"):
            return MLP(), (torch.randn(batch_size, 8), torch.randn(batch_size, 2))

    zoo.names = lambda: ["tiny"]
    zoo.default_batch_size = lambda name: 6
    zoo.build = build
    zoo.calls = calls
    monkeypatch.setitem(sys.modules, "heterog.zoo", zoo)
    monkeypatch.setattr(heterog, "zoo", zoo, raising=False)
    return zoo


def test_zoo_reference_uses_default_batch_and_device(fake_zoo: types.ModuleType) -> None:
    fn = load_model_fn("tiny")
    _, inputs = fn(None)
    assert inputs[0].shape == (6, 8)
    fn(3, device="meta")
    assert fake_zoo.calls == [("tiny", 6, None), ("tiny", 3, "meta")]
    with pytest.raises(HeterogError, match=r"unknown model 'nope': not a zoo model \(known: tiny\)"):
        load_model_fn("nope")


def test_capture_model_of_a_zoo_name_builds_on_meta(fake_zoo: types.ModuleType, tmp_path: Path) -> None:
    g = capture_model("tiny", optimizer="adam", cache_dir=tmp_path)
    assert g.batch_size == 6 and g.optimizer == "adam" and g.name == "tiny"
    assert fake_zoo.calls == [("tiny", 6, "meta")]
    assert g.meta["model"] == "tiny" and g.meta["ops_after_fusion"] < g.meta["ops_before_fusion"]


def test_cache_hit_returns_the_same_graph_without_capturing(model_file: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import heterog.graph.capture as capture_module

    captures = []
    real_capture = capture_module.capture

    def counting_capture(*args, **kwargs):
        captures.append(kwargs.get("name"))
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(capture_module, "capture", counting_capture)
    ref, cache = f"{model_file}:build", tmp_path / "cache"
    first = capture_model(ref, 4, cache_dir=cache)
    assert len(captures) == 1
    files = list(cache.glob("*.json.gz"))
    assert len(files) == 1 and files[0].name.startswith("user_model-b4-sgd-")
    assert files[0].read_bytes()[:2] == b"\x1f\x8b"
    written = files[0].read_bytes()
    second = capture_model(ref, 4, cache_dir=cache)
    assert second.fingerprint == first.fingerprint and second.to_dict() == first.to_dict()
    assert len(captures) == 1 and files[0].read_bytes() == written       # a hit: not captured, not rewritten
    assert not list(cache.glob(".*.tmp"))                     # written by rename, nothing left behind
    # other batch / optimizer / fusion: other keys
    assert capture_model(ref, 3, cache_dir=cache).batch_size == 3
    assert capture_model(ref, 4, "adam", cache_dir=cache, fuse=False).optimizer == "adam"
    assert len(list(cache.glob("*.json.gz"))) == 3 and len(captures) == 3
    capture_model(ref, 4, cache_dir=cache, use_cache=False)
    assert len(captures) == 4                                 # use_cache=False captures afresh


def test_cache_key_follows_file_content_and_settings(model_file: Path) -> None:
    ref = f"{model_file}:build"
    key = cache_key(ref, 4, "sgd", True)
    assert key == cache_key(ref, 4, "sgd", True)
    assert len({key, cache_key(ref, 5, "sgd", True), cache_key(ref, 4, "adam", True),
                cache_key(ref, 4, "sgd", False), cache_key(ref, 4, "sgd", True, lr=0.1)}) == 5
    model_file.write_text(MODEL_FILE.replace("nn.Linear(6, 3)", "nn.Linear(6, 3, bias=False)"))
    assert cache_key(ref, 4, "sgd", True) != key


def test_corrupt_cache_file_is_replaced(model_file: Path, tmp_path: Path) -> None:
    ref = f"{model_file}:build"
    first = capture_model(ref, 4, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json.gz")
    path.write_bytes(path.read_bytes()[:40])
    again = capture_model(ref, 4, cache_dir=tmp_path)
    assert again.fingerprint == first.fingerprint
    assert capture_model(ref, 4, cache_dir=tmp_path, use_cache=False).fingerprint == first.fingerprint


def test_capture_model_rejects_bad_settings(model_file: Path, tmp_path: Path) -> None:
    with pytest.raises(HeterogError, match="unknown optimizer 'lamb'"):
        capture_model(f"{model_file}:build", 4, "lamb", cache_dir=tmp_path)
    with pytest.raises(HeterogError, match="batch size must be positive"):
        capture_model(f"{model_file}:build", 0, cache_dir=tmp_path)


def test_cache_key_follows_every_module_the_capture_runs(model_file: Path, monkeypatch) -> None:
    """A graph depends on the tracing, the loss normalisers and the rest of the graph package, not only on
    capture.py: the key digests every module of it."""
    from heterog.graph import cache

    sources = cache.capture_sources()
    assert {"capture.py", "fusion.py", "opgraph.py", "tracing.py", "normalisers.py", "flops.py"} <= \
        {p.name for p in sources}
    ref = f"{model_file}:build"
    key = cache_key(ref, 4, "sgd", True)
    edited = model_file.parent / "normalisers.py"              # the same module with one more line
    edited.write_text(next(p for p in sources if p.name == "normalisers.py").read_text() + "\n# edited\n")
    monkeypatch.setattr(cache, "capture_sources",
                        lambda: [edited if p.name == "normalisers.py" else p for p in sources])
    assert cache_key(ref, 4, "sgd", True) != key
