"""Checkpoints (``heterog.runtime.checkpoint``): the state under the model's own names in
torch.distributed.checkpoint's format, each rank writing the parts it holds; resuming under another plan on
another cluster, or in one process, trains exactly as an uninterrupted run (dropout on); a checkpoint counts
once complete, pruning keeps the newest; a missing, incomplete, damaged or foreign checkpoint is refused in
one line (exit 2 from the CLI) and nothing written is touched.

``make conformance`` (``HETEROG_SURVIVE_MORE=1``) resumes a transformers model across plans too.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.cli import main
from heterog.errors import CheckpointError, HeterogError
from heterog.graph.shard_exec import shard_of
from heterog.runtime import compare_values, prepare, run_prepared, train_single_process
from heterog.runtime.api import resume_state
from heterog.runtime.checkpoint import (
    MARKER,
    CheckpointSettings,
    chunks_of,
    complete_checkpoints,
    find_checkpoint,
    prune,
    publish,
    remove_incomplete,
    state_keys,
)
from heterog.runtime.instructions import Part
from tests.runtime import transformers_models as tm
from tests.runtime.conftest import model
from tests.runtime.test_conformance import ATOL, POOLS, RTOL, captured, cluster_of, plan, with_micro_batches
from tests.runtime.test_split_conformance import with_splits

MORE = bool(os.environ.get("HETEROG_SURVIVE_MORE"))


# ---------------------------------------------------------------------------- names and parts
def test_keys_are_the_models_own_names() -> None:
    m = model("tiny_mlp", optimizer="adam")
    keys = set(state_keys(m.prog).values())
    params = {f"model.{n}" for n in m.prog.param_names}
    slots = {f"optimizer.state.{p}.{s}" for p in m.prog.param_names for s in ("exp_avg", "exp_avg_sq", "step")}
    assert keys == params | slots and "model.fc1.weight" in keys


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_chunks_of_every_ranks_shard_cover_the_tensor_once(data) -> None:
    """For any shape, divided dim, split factor and uneven shares (a rank may hold none), each rank's chunks
    sit at their offsets in the whole tensor, and together they cover it exactly once."""
    ndim = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, ndim - 1))
    sf = data.draw(st.integers(1, 3))
    extent = data.draw(st.integers(1, 5))
    n = data.draw(st.integers(1, 3))
    shares = data.draw(st.lists(st.integers(0, extent), min_size=n, max_size=n).filter(lambda s: sum(s) == extent))
    shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = sf * extent * data.draw(st.integers(1, 2))
    whole = torch.randn(*shape)
    placement = f"S{dim}:{sf}" if sf > 1 else f"S{dim}"
    rebuilt, covered = torch.zeros_like(whole), torch.zeros_like(whole)
    for r in range(n):
        part = shard_of(whole, placement, extent, shares, r)
        held = chunks_of(part, Part(placement, extent, tuple(shares), r), shape)
        assert held.shape == tuple(shape) and len(held.chunks) == (sf if shares[r] else 0)
        for offsets, chunk in held.chunks:
            where = tuple(slice(o, o + s) for o, s in zip(offsets, chunk.shape))
            rebuilt[where] = chunk
            covered[where] += 1
    assert torch.equal(rebuilt, whole) and torch.equal(covered, torch.ones_like(whole))


def test_a_partial_sum_is_refused_as_a_part() -> None:
    with pytest.raises(CheckpointError, match="'P' is not a block"):
        chunks_of(torch.zeros(4), Part("P", None, (), 0), (4,))


# ---------------------------------------------------------------------------- one process
def test_one_process_writes_prunes_and_resumes_exactly(tmp_path) -> None:
    """Checkpoints every 2 steps of 5 (and the last), the newest 2 kept; resumed from step 4, the run ends
    where the uninterrupted one does, losses included (dropout on)."""
    m = captured("dropout_net")
    assert any(op.draws for op in m.graph.ops)
    want_losses, want = train_single_process(m, [m.example_inputs], 7)
    ck = CheckpointSettings(tmp_path, every_steps=2, keep=2)
    train_single_process(m, [m.example_inputs], 5, checkpoint=ck)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]      # nothing half-written left
    marker = json.loads((tmp_path / "step-4" / MARKER).read_text())
    assert marker["step"] == 4 and marker["losses"] == pytest.approx(want_losses[:4], rel=1e-6)
    losses, got = train_single_process(m, [m.example_inputs], 7, resume=tmp_path / "step-4")
    ok, diff, bad = compare_values(m, got, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{bad[:4]} differ (max |diff| {diff:.3g})"
    assert losses == pytest.approx(want_losses, rel=1e-6)


def test_the_position_is_the_step_and_the_next_batch(tmp_path) -> None:
    """Three batches in turn: after 4 steps the next is batch 1; resuming reads it, as the uninterrupted
    run does."""
    m = model("tiny_mlp")
    g = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randn(x.shape, generator=g) if x.is_floating_point() else x for x in m.example_inputs)
               for _ in range(2)] + [m.example_inputs]
    train_single_process(m, batches, 4, checkpoint=CheckpointSettings(tmp_path, every_steps=4))
    r = resume_state(m, tmp_path)
    assert (r.step, r.data_position, r.rng_seed) == (4, 1, 0)
    _, got = train_single_process(m, batches, 6, resume=r)
    _, want = train_single_process(m, batches, 6)
    assert compare_values(m, got, want, rtol=RTOL, atol=ATOL)[0]


# ---------------------------------------------------------------------------- across plans and clusters
def divided_plan(m, cluster, seed: int):
    """A random plan of ``m`` on ``cluster`` with about 60% of its groups divided beyond the batch and 2-4
    micro-batches, that holds some parameter divided (the first such from ``seed``, seeds 100 apart)."""
    for k in range(20):
        s = with_micro_batches(with_splits(plan(m, cluster, "random", seed + 100 * k), cluster.n_devices,
                                           seed + 100 * k), seed)
        prepared = prepare(m, cluster, s)
        if prepared.lowered.parts:
            return prepared
    raise AssertionError(f"{m.name}: no random split plan holds a parameter divided")


def assert_resumes_across_plans_and_clusters(m, tmp_path, request, seed: int = 0) -> None:
    """Steps 0-2 under a divided random plan on local-cpu-3, steps 2-4 under another on local-cpu-2 (both
    writing checkpoints), steps 4-6 in one process: equal to 6 uninterrupted steps in one process."""
    want_losses, want = train_single_process(m, [m.example_inputs], 6)
    first = divided_plan(m, cluster_of("local-cpu-3"), seed)
    ck = CheckpointSettings(tmp_path, every_steps=2)
    run_prepared(first, [m.example_inputs], 2, checkpoint=ck, pool=request.getfixturevalue(POOLS["local-cpu-3"]))
    # each rank wrote its own parts: a divided parameter is stored as chunks from several ranks
    meta = dcp.FileSystemReader(tmp_path / "step-2").read_metadata()
    ph, (_, devs) = next(iter(first.lowered.parts.items()))
    key = state_keys(m.prog)[ph]
    assert len(meta.state_dict_metadata[key].chunks) >= len(devs) > 1
    second = divided_plan(m, cluster_of("local-cpu-2"), seed + 1)
    res = run_prepared(second, [m.example_inputs], 4, checkpoint=ck, resume=tmp_path,
                       pool=request.getfixturevalue(POOLS["local-cpu-2"]))
    assert res.first_step == 2 and [s for s, _ in res.checkpoints] == [4]
    assert res.losses == pytest.approx(want_losses[:4], rel=RTOL)
    losses, got = train_single_process(m, [m.example_inputs], 6, resume=tmp_path)
    ok, diff, bad = compare_values(m, got, want, rtol=RTOL, atol=ATOL)
    assert ok, f"{m.name}: {bad[:4]} differ after resuming twice (max |diff| {diff:.3g})"
    assert losses == pytest.approx(want_losses, rel=RTOL)


def test_resume_under_another_plan_on_another_cluster_and_in_one_process(tmp_path, request) -> None:
    assert_resumes_across_plans_and_clusters(captured("dropout_net"), tmp_path, request)


def test_sharded_adam_state_resumes_under_other_plans(tmp_path, request) -> None:
    """Adam's state in shards over replicas (ZeRO stages 0-3, offloaded to the host) written by local-cpu-3's
    ranks, resumed under a sharded plan with splits on local-cpu-2, then in one process: six steps equal to six
    uninterrupted ones in one process, the optimizer's moments included."""
    from tests.runtime import test_sharded_conformance as sc

    name = "residual_glu"
    m = sc.captured(name, "adam")
    want_losses, want = train_single_process(m, [m.example_inputs], 6)
    ck = CheckpointSettings(tmp_path, every_steps=2)
    first = prepare(m, sc.cluster_of("local-cpu-3"), sc.sharded_plan(name, "local-cpu-3", "offload", 0, "adam"))
    run_prepared(first, [m.example_inputs], 2, checkpoint=ck, pool=request.getfixturevalue(POOLS["local-cpu-3"]))
    second = prepare(m, sc.cluster_of("local-cpu-2"), sc.sharded_plan(name, "local-cpu-2", "splits", 1, "adam"))
    res = run_prepared(second, [m.example_inputs], 4, checkpoint=ck, resume=tmp_path,
                       pool=request.getfixturevalue(POOLS["local-cpu-2"]))
    assert res.first_step == 2 and res.losses == pytest.approx(want_losses[:4], rel=RTOL)
    losses, got = train_single_process(m, [m.example_inputs], 6, resume=tmp_path)
    assert losses == pytest.approx(want_losses, rel=RTOL)
    assert m.state                                      # the moments are compared too
    for ph, v in want.items():
        np.testing.assert_allclose(got[ph].double().numpy(), v.double().numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not MORE, reason="make conformance (HETEROG_SURVIVE_MORE=1)")
def test_a_transformers_model_resumes_across_plans_and_clusters(tmp_path, request) -> None:
    from heterog.runtime import capture_model_for_runtime

    module, inputs = tm.build_bert(12)
    m = capture_model_for_runtime(module, inputs, lr=0.1, name="bert")
    assert_resumes_across_plans_and_clusters(m, tmp_path, request, seed=3)


# ---------------------------------------------------------------------------- complete, pruned, replaced
def _fake_checkpoint(path: Path, step: int) -> Path:
    d = path / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / MARKER).write_text(json.dumps({"step": step}))
    return d


def test_a_checkpoint_counts_once_complete_and_pruning_renames_first(tmp_path, monkeypatch) -> None:
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / ".tmp-step-8-abcd").mkdir()                     # a write that never finished
    (tmp_path / ".tmp-step-8-abcd" / ".metadata").write_bytes(b"x")
    (tmp_path / "step-9").mkdir()                               # a step directory without its marker
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4, 6]
    assert find_checkpoint(tmp_path) == tmp_path / "step-6"
    removed_paths = []
    import shutil

    real = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, **kw: (removed_paths.append(Path(p).name), real(p, **kw)))
    assert prune(tmp_path, 1) == [2, 4]
    assert all(name.startswith(".removing-step-") for name in removed_paths)
    assert remove_incomplete(tmp_path) == [".tmp-step-8-abcd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-9"]


def test_publishing_a_step_again_replaces_it_whole(tmp_path) -> None:
    old = _fake_checkpoint(tmp_path, 4)
    new = tmp_path / ".tmp-step-4-x"
    new.mkdir()
    (new / "new").write_text("1")
    publish(new, old)
    assert sorted(p.name for p in old.iterdir()) == ["new"] and sorted(p.name for p in tmp_path.iterdir()) == \
        ["step-4"]


# ---------------------------------------------------------------------------- refused
def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Checkpoints of tiny_mlp (SGD) after 1 and 2 steps, written in one process."""
    d = tmp_path_factory.mktemp("ck")
    m = model("tiny_mlp")
    train_single_process(m, [m.example_inputs], 2, checkpoint=CheckpointSettings(d, every_steps=1))
    return d


def _broken(written: Path, tmp_path: Path, how: str) -> Path:
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(written, d)
    ck = d / "step-2"
    if how == "no marker":
        (ck / MARKER).unlink()
        return ck
    if how == "marker not JSON":
        (ck / MARKER).write_text("{not json")
    elif how == "marker of another format":
        (ck / MARKER).write_text(json.dumps({"format": "something-else"}))
    elif how == "no metadata":
        (ck / ".metadata").unlink()
    elif how == "truncated data":
        data = next(ck.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[:100])
    elif how == "marker disagrees":
        m = json.loads((ck / MARKER).read_text())
        m["step"] = 3
        (ck / MARKER).write_text(json.dumps(m))
    return ck


@pytest.mark.parametrize(("how", "message"), [
    ("no marker", "is incomplete: it has no heterog-checkpoint.json"),
    ("marker not JSON", "is not valid JSON"),
    ("marker of another format", "is not a heterog checkpoint marker"),
    ("no metadata", "DCP's .metadata file is missing"),
    ("truncated data", "cannot be read"),
    ("marker disagrees", "the directory says step 2, its marker step 3"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line_and_left_as_it_is(written, tmp_path, how, message) -> None:
    ck = _broken(written, tmp_path, how)
    before = _digest(ck.parent)
    with pytest.raises(CheckpointError, match=message) as info:
        resume_state(model("tiny_mlp"), ck)
    assert "\n" not in str(info.value)
    assert _digest(ck.parent) == before


def test_missing_empty_and_foreign_directories_are_refused(written, tmp_path) -> None:
    m = model("tiny_mlp")
    with pytest.raises(CheckpointError, match="does not exist"):
        resume_state(m, tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        resume_state(m, tmp_path / "file")
    (tmp_path / "empty" / ".tmp-step-3-ab").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint .*incomplete: \.tmp-step-3-ab"):
        resume_state(m, tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"of another model \('tiny_mlp', optimizer 'sgd'\) than 'tiny_cnn'"):
        resume_state(model("tiny_cnn"), written)
    with pytest.raises(CheckpointError, match="optimizer 'sgd'.*it lacks optimizer.state"):
        resume_state(model("tiny_mlp", optimizer="momentum"), written)


def test_a_run_cannot_resume_at_or_past_its_last_step(written) -> None:
    m = model("tiny_mlp")
    with pytest.raises(HeterogError, match="is at step 2; a run resumed from it needs more steps than that"):
        train_single_process(m, [m.example_inputs], 2, resume=written)


def test_bad_checkpoint_settings_are_refused_together(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError) as info:
        CheckpointSettings(tmp_path / "f", every_steps=0, keep=0)
    msg = str(info.value)
    assert "at least 1 step, got 0" in msg and "--keep must be at least 1" in msg and "is a file" in msg


# ---------------------------------------------------------------------------- the command line
def test_run_writes_checkpoints_and_resumes_from_the_command_line(tmp_path, capsys) -> None:
    common = ["run", "--model", "tiny_mlp", "--batch-size", "6", "--lr", "0.1", "--warmup", "0", "--json"]
    d = tmp_path / "ck"
    rc = main([*common, "--cluster", "local-cpu-3:slowdown=1,2,3", "--method", "cp-ar", "--steps", "3",
               "--checkpoint-dir", str(d), "--checkpoint-every-s", "1e-9", "--keep", "2"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [c["step"] for c in out["checkpoints"]] == [1, 2, 3]
    assert sorted(p.name for p in d.iterdir()) == ["step-2", "step-3"]
    rc = main([*common, "--cluster", "local-cpu-2", "--method", "ev-ps", "--steps", "5", "--resume", str(d),
               "--check-equivalence"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["equivalent"] is True and out["first_step"] == 3
    assert len(out["losses"]) == 5 and len(out["iteration_times_s"]) == 2
    assert np.allclose(out["losses"], out["reference_losses"], rtol=1e-5)


@pytest.mark.parametrize("argv", [["--checkpoint-every", "2"], ["--resume", "/nonexistent/checkpoints"],
                                  ["--checkpoint-dir", "D"], ["--max-restarts", "1", "--replan-method", "nope"]])
def test_bad_checkpoint_arguments_exit_2_in_one_line(argv, tmp_path, capsys) -> None:
    argv = [str(tmp_path / "D") if a == "D" else a for a in argv]
    rc = main(["run", "--model", "tiny_mlp", "--batch-size", "6", "--cluster", "local-cpu-2", "--method", "cp-ar",
               "--steps", "2", *argv])
    last = capsys.readouterr().err.splitlines()[-1]
    assert rc == 2 and last.startswith("heterog run: error: ")
