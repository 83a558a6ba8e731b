"""Profile tables: signatures, least-squares fits, measurement entry and file round trips."""
import json

import pytest

from heterog.cost import ProfileTable, fit_linear, op_signature
from heterog.cost.profile import segments
from heterog.errors import HeterogError
from heterog.graph.opgraph import Op


def linear(batch: int, k: int) -> Op:
    """(batch, k) @ (k, 1024): the output carries the batch; the weight does not."""
    return Op("mm", "aten.mm.default", output_shapes=[[batch, 1024]], output_dtypes=["torch.float32"],
              batch_dims=[0], flops=2.0 * batch * k * 1024, bytes_read=4 * (batch * k + k * 1024),
              bytes_written=4 * batch * 1024, batch_bytes=4 * (batch * k + batch * 1024))


def test_signature_is_batch_independent_and_tells_weights_apart():
    assert op_signature(linear(8, 1024)) == op_signature(linear(64, 1024))
    assert op_signature(linear(8, 1024)) == f"aten.mm.default|Bx1024:float32|w={4 * 1024 * 1024}"
    assert op_signature(linear(8, 4096)) != op_signature(linear(8, 1024))
    scalar = Op("loss", "aten.mean.default", output_shapes=[[]], output_dtypes=["float32"], batch_dims=[None])
    assert op_signature(scalar) == "aten.mean.default|scalar:float32|w=0"


def test_fit_linear():
    assert fit_linear([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0]) == pytest.approx((1.0, 2.0))
    a, b = fit_linear([1, 2, 3], [1.0, 2.0, 4.0])
    assert (a, b) == pytest.approx((-2 / 3, 1.5))
    assert fit_linear([8, 8], [1.0, 3.0]) == (2.0, 0.0)
    with pytest.raises(ValueError, match="2 x values but 3"):
        fit_linear([1, 2], [1, 2, 3])


def test_relative_fit_minimises_relative_errors():
    # exact data: both fits recover it
    assert fit_linear([1, 10, 100], [2.0, 11.0, 101.0], relative=True) == pytest.approx((1.0, 1.0))
    # noisy data over three decades: the relative fit has the least sum of squared relative errors,
    # the absolute fit the least sum of squared errors (each is the optimum of its own criterion)
    xs, ys = [16, 1024, 16384, 131072, 2097152], [1.9e-3, 0.9e-3, 2.1e-3, 2.0e-3, 19.2e-3]
    fits = {"abs": fit_linear(xs, ys), "rel": fit_linear(xs, ys, relative=True)}
    sq = {k: sum((a + b * x - y) ** 2 for x, y in zip(xs, ys)) for k, (a, b) in fits.items()}
    rel = {k: sum(((a + b * x - y) / y) ** 2 for x, y in zip(xs, ys)) for k, (a, b) in fits.items()}
    assert sq["abs"] < sq["rel"] and rel["rel"] < rel["abs"]
    with pytest.raises(ValueError, match="positive"):
        fit_linear([1, 2], [1.0, 0.0], relative=True)


def test_add_measurements_and_round_trip(tmp_path):
    table = ProfileTable()
    assert table.add_op("T4", "sig", [8, 16, 32], [1.1e-3, 1.2e-3, 1.4e-3]) == pytest.approx((1.0e-3, 1.25e-5))
    assert table.add_link("loopback", [0, 1e6], [2e-5, 5.2e-4]) == pytest.approx((2e-5, 5e-10))
    path = table.save(tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["format"] == "heterog-profile" and data["version"] == 1
    loaded = ProfileTable.load(path)
    assert loaded == table and loaded.op_entry("T4", "sig") == table.op_entry("T4", "sig")
    assert loaded.link_entry("loopback") == table.links["loopback"] and loaded.op_entry("L4", "sig") is None


def test_collectives_round_trip_and_files_without_them_still_load(tmp_path):
    table = ProfileTable()
    table.add_collective("allreduce", ["b", "a"], [16, 1 << 20], [1e-3, 2e-3])
    assert list(table.collectives) == ["allreduce:a,b"] and len(table) == 1
    assert table.collective_entry("allreduce", ["a", "b"]) == table.collectives["allreduce:a,b"]
    loaded = ProfileTable.load(table.save(tmp_path / "p.json"))
    assert loaded == table
    (tmp_path / "old.json").write_text(json.dumps({"format": "heterog-profile", "version": 1, "ops": {}, "links": {}}))
    assert ProfileTable.load(tmp_path / "old.json").collectives == {}
    (tmp_path / "bad.json").write_text(json.dumps({"format": "heterog-profile", "version": 1,
                                                   "collectives": {"allreduce:a,b": "fast"}}))
    with pytest.raises(HeterogError, match=r"collectives\['allreduce:a,b'\]"):
        ProfileTable.load(tmp_path / "bad.json")


def test_bad_profile_files_name_the_problem(tmp_path):
    with pytest.raises(HeterogError, match="does not exist"):
        ProfileTable.load(tmp_path / "missing.json")
    (tmp_path / "cut.json").write_text('{"format": "heterog-pro')
    with pytest.raises(HeterogError, match=r"cut\.json.*truncated"):
        ProfileTable.load(tmp_path / "cut.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "heterog-profile", "version": 1,
                                                   "ops": {"T4": {"sig": [1.0]}}}))
    with pytest.raises(HeterogError, match=r"ops\['T4'\]\['sig'\]"):
        ProfileTable.load(tmp_path / "bad.json")


def test_measured_points_are_kept_beside_the_line_and_round_trip(tmp_path):
    table = ProfileTable()
    table.add_op("cpu", "sig", [16, 32, 64], [1.6e-3, 2.0e-3, 4.0e-3])
    assert table.op_points["cpu"]["sig"] == ((16.0, 32.0, 64.0), (1.6e-3, 2.0e-3, 4.0e-3))
    # through the points: 1.6 -> 2.0 ms over 16 samples, then 2.0 -> 4.0 ms over 32
    breaks, a, b = table.op_segments("cpu", "sig")
    assert breaks == (32.0,) and b == pytest.approx((0.4e-3 / 16, 2.0e-3 / 32))
    assert a == pytest.approx((1.2e-3, 0.0))
    assert table.op_segments("cpu", "sig", points=False) == ((), table.ops["cpu"]["sig"][:1],
                                                              table.ops["cpu"]["sig"][1:])
    assert table.op_segments("cpu", "other") is None
    replaced = table.copy()
    replaced.set_op("cpu", "sig", 1e-3, 0.0)              # a new line replaces the old points too
    assert replaced.op_segments("cpu", "sig") == ((), (1e-3,), (0.0,)) and "sig" not in replaced.op_points["cpu"]
    loaded = ProfileTable.load(table.save(tmp_path / "p.json"))
    assert loaded == table
    # a file written before points existed loads with lines only
    (tmp_path / "old.json").write_text(json.dumps({"format": "heterog-profile", "version": 1,
                                                   "ops": {"cpu": {"sig": [1e-3, 1e-5]}}}))
    old = ProfileTable.load(tmp_path / "old.json")
    assert old.op_points == {} and old.op_segments("cpu", "sig") == ((), (1e-3,), (1e-5,))


def test_one_point_is_a_constant():
    assert segments([64.0], [3e-3]) == ((), (3e-3,), (0.0,))


@pytest.mark.parametrize("points, match", [
    ([[16, 32], [1e-3]], "as many times as sizes"),
    ([[32, 16], [1e-3, 2e-3]], "increase strictly"),
    ([[16, 16], [1e-3, 2e-3]], "increase strictly"),
    ([[16], "fast"], r"\[\[sizes\], \[times\]\]"),
])
def test_bad_op_points_name_the_entry(tmp_path, points, match):
    (tmp_path / "bad.json").write_text(json.dumps({"format": "heterog-profile", "version": 1,
                                                   "op_points": {"cpu": {"sig": points}}}))
    with pytest.raises(HeterogError, match=rf"op_points\['cpu'\]\['sig'\].*{match}"):
        ProfileTable.load(tmp_path / "bad.json")


def test_link_latency_round_trips_and_files_without_it_still_load(tmp_path):
    table = ProfileTable()
    table.set_link("a->b", 5e-5, 4e-10, latency_s=1e-4, latency_s_per_byte=2e-10)
    table.set_link("b->a", 5e-5, 4e-10)
    assert table.link_latency == {"a->b": (1e-4, 2e-10)} and table.link_latency_entry("b->a") is None
    assert ProfileTable.load(table.save(tmp_path / "p.json")) == table
    (tmp_path / "old.json").write_text(json.dumps({"format": "heterog-profile", "version": 1,
                                                   "links": {"a->b": [1e-4, 1e-9]}}))
    assert ProfileTable.load(tmp_path / "old.json").link_latency == {}
    with pytest.raises(HeterogError, match="latency must be finite and >= 0"):
        table.set_link("a->b", 5e-5, 4e-10, latency_s=-1e-6)
    for bad in ([-1.0, 0.0], [1e-4, -1e-10], "slow", 1e-4):
        (tmp_path / "bad.json").write_text(json.dumps({"format": "heterog-profile", "version": 1,
                                                       "link_latency": {"a->b": bad}}))
        with pytest.raises(HeterogError, match=r"link_latency\['a->b'\]"):
            ProfileTable.load(tmp_path / "bad.json")
