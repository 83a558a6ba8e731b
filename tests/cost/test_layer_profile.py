"""Per-layer profiles in Metis' format: reading the published files, the interpolation rule on hand-made
tables, and the cost model taking a layer's measured time (a tiny OPT captured from Hugging Face)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from heterog.cost import LayerProfile, LayerProfileError
from heterog.cost.layer_profile import LayerEntry, interpolate

METIS = Path(__file__).resolve().parents[1] / "data" / "metis"


def entry(mbs: int, tp: int, layer_ms: list[float], optimizer_ms: float = 0.0) -> LayerEntry:
    z = np.zeros(len(layer_ms))
    return LayerEntry(mbs=mbs, tp=tp, layer_s=np.array(layer_ms) * 1e-3, optimizer_s=optimizer_ms * 1e-3,
                      fb_sync_s=0.0, total_s=0.0, memory_bytes=z, param_bytes=z, activation_bytes=z)


# ----------------------------------------------------------------------------------- the published files
def test_loads_the_published_opt350_files():
    lp = LayerProfile.load(METIS, model="OPT-350")
    assert lp.model == "OPT-350" and lp.num_layers == 26 and lp.gpus == ("A100-40", "V100-16")
    raw = json.loads((METIS / "OPT-350/A100-40/mbs1_tmp1.json").read_text())
    e = lp.entries["A100-40", 1, 1]
    assert e.layer_s[1] == pytest.approx(8.692e-3) and e.layer_s[0] == pytest.approx(0.403e-3)
    assert e.optimizer_s == pytest.approx(76.38800000000003e-3)
    assert e.total_s == pytest.approx(e.layer_s.sum() + e.optimizer_s)       # no batch generator, no fb_sync
    assert e.fb_sync_s == pytest.approx(0.0, abs=1e-12)
    assert e.param_bytes[1] == 50384896 and e.memory_bytes[1] == pytest.approx(584.26953125 * 2**20)
    assert e.activation_bytes[-1] == raw["model"]["parameters"]["activation_parameters_bytes"][-1]
    # tp 2: the GPU holds half of a block's divided tensors plus its replicated norms and row-parallel biases
    assert lp.entries["A100-40", 1, 2].param_bytes[1] * 2 - e.param_bytes[1] == 4 * 3 * 2048
    # measured points come back as measured; mbs 3 lies halfway between mbs 2 and 4
    np.testing.assert_allclose(lp.layer_times_s("A100-40", 1, 1), e.layer_s)
    mid = (lp.entries["A100-40", 2, 1].layer_s + lp.entries["A100-40", 4, 1].layer_s) / 2
    np.testing.assert_allclose(lp.layer_times_s("A100-40", 3, 1), mid)
    opt_tp1 = np.mean([lp.entries["A100-40", b, 1].optimizer_s for b in (1, 2, 4)])
    assert lp.optimizer_time_s("A100-40", 1) == pytest.approx(opt_tp1)
    assert lp.gpu_for("A100-40GB") == "A100-40" and lp.gpu_for("V100-16GB") == "V100-16"
    assert lp.gpu_for("V100-16") is None and lp.gpu_for("H100") is None     # device types only, not Metis names


def test_loading_refuses_a_missing_or_empty_directory(tmp_path):
    with pytest.raises(LayerProfileError, match="does not exist"):
        LayerProfile.load(tmp_path / "nowhere")
    (tmp_path / "A100-40").mkdir()
    with pytest.raises(LayerProfileError, match="no <GPU>/mbs<b>_tmp<t>.json"):
        LayerProfile.load(tmp_path)
    (tmp_path / "A100-40" / "mbs1_tmp1.json").write_text("{}")
    with pytest.raises(LayerProfileError, match="cannot read it"):
        LayerProfile.load(tmp_path)


# ----------------------------------------------------------------------------------- interpolation
def test_interpolation_over_samples_is_piecewise_linear_and_extends_the_nearest_segment():
    lp = LayerProfile("m", {("X", 1, 1): entry(1, 1, [1.0]), ("X", 2, 1): entry(2, 1, [3.0]),
                            ("X", 4, 1): entry(4, 1, [5.0])})
    at = {x: float(lp.layer_times_s("X", x, 1)[0]) * 1e3 for x in (1, 1.5, 3, 8, 0.5, 0.25)}
    assert at == pytest.approx({1: 1.0, 1.5: 2.0, 3: 4.0, 8: 9.0, 0.5: 0.0, 0.25: 0.0})   # 0.25: -0.5 clipped
    # one measured degree: the time divides by the degree
    assert lp.layer_times_s("X", 2, 2)[0] * 1e3 == pytest.approx(1.5)


def test_interpolation_over_the_degree_is_a_plus_c_over_tp_between_measured_degrees():
    lp = LayerProfile("m", {("Y", 2, 1): entry(2, 1, [10.0], 8.0), ("Y", 2, 2): entry(2, 2, [6.0], 4.0),
                            ("Y", 2, 4): entry(2, 4, [4.0], 3.0), ("Y", 4, 4): entry(4, 4, [6.0], 5.0)})
    ms = {tp: float(lp.layer_times_s("Y", 2, tp)[0]) * 1e3 for tp in (1, 4 / 3, 2, 4, 8)}
    # through (1, 10) and (2, 6): 2 + 8 / tp; through (2, 6) and (4, 4): 2 + 8 / tp as well
    assert ms == pytest.approx({1: 10.0, 4 / 3: 8.0, 2: 6.0, 4: 4.0, 8: 3.0})
    # samples first, per degree (tp 1 and 2 have one size: proportional; tp 4 two sizes), then the degree
    assert lp.layer_times_s("Y", 4, 4)[0] * 1e3 == pytest.approx(6.0)
    assert lp.layer_times_s("Y", 4, 2)[0] * 1e3 == pytest.approx(12.0)
    assert lp.layer_times_s("Y", 3, 4)[0] * 1e3 == pytest.approx(5.0)
    # the optimizer: the mean over sizes at each degree (tp 4: 4 ms), then a + c / tp
    assert lp.optimizer_time_s("Y", 4) * 1e3 == pytest.approx(4.0)
    assert lp.optimizer_time_s("Y", 1) * 1e3 == pytest.approx(8.0)
    assert lp.optimizer_time_s("Y", 8) * 1e3 == pytest.approx(4.0)    # through (2, 4) and (4, 4): constant


def test_interpolate_with_one_knot_is_proportional():
    assert interpolate(np.array([2.0]), np.array([[4.0, 6.0]]), 3.0).tolist() == [6.0, 9.0]
    assert interpolate(np.array([1.0, 2.0]), np.array([1.0, 3.0]), 2.0) == pytest.approx(3.0)


def test_profile_refuses_entries_of_different_lengths_and_unknown_gpus():
    with pytest.raises(LayerProfileError, match="disagree on the number of layers"):
        LayerProfile("m", {("X", 1, 1): entry(1, 1, [1.0]), ("X", 2, 1): entry(2, 1, [1.0, 2.0])})
    lp = LayerProfile("m", {("X", 1, 1): entry(1, 1, [1.0])})
    with pytest.raises(LayerProfileError, match="has no GPU 'Z'"):
        lp.layer_times_s("Z", 1, 1)
    with pytest.raises(LayerProfileError, match="samples > 0"):
        lp.layer_times_s("X", 0, 1)
