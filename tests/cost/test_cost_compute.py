"""Compute cost: roofline values by hand, V100 vs 1080Ti ratios, batch fractions, profile overrides."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterog.cluster import CATALOG, load_cluster
from heterog.cost import CostModel, ProfileTable, op_signature
from heterog.graph.opgraph import Edge, Op, OpGraph

N = 4096
ELEMS = 64 * 2**20
BATCH = 32


def matmul(n: int = N, dtype: str = "float32") -> Op:
    """(n, n) @ (n, n) with the batch on the rows of the left input and of the output."""
    size = 2 if dtype in ("bfloat16", "float16") else 4
    return Op(f"mm_{n}_{dtype}", "aten.mm.default", output_shapes=[[n, n]], output_dtypes=[dtype],
              batch_dims=[0], flops=2.0 * n**3, bytes_read=2 * n * n * size, bytes_written=n * n * size,
              batch_bytes=2 * n * n * size)


def add(elems: int = ELEMS) -> Op:
    return Op(f"add_{elems}", "aten.add.Tensor", output_shapes=[[elems]], output_dtypes=["float32"], batch_dims=[0],
              flops=float(elems), bytes_read=8 * elems, bytes_written=4 * elems, batch_bytes=12 * elems)


def graph(*ops: Op, edges: list[Edge] | None = None) -> OpGraph:
    return OpGraph("t", BATCH, list(ops), edges or [])


@pytest.fixture(scope="module")
def paper8() -> CostModel:
    return CostModel(load_cluster("paper-8gpu"))   # devices: 0-1 V100, 2-5 1080Ti, 6-7 P100


def roofline_s(type_name: str, flops: float, nbytes: float) -> float:
    t = CATALOG[type_name]
    return max(flops / t.effective_flops, nbytes / t.effective_memory_Bps) + t.launch_overhead_s


def test_roofline_matches_formula(paper8):
    g = graph(matmul(), add())
    times = paper8.op_times(g, np.array([0, 0, 1, 1]), np.array([0, 2, 0, 6]), np.ones(4))
    expected = [roofline_s("V100-16GB", 2.0 * N**3, 12 * N * N), roofline_s("GTX-1080Ti", 2.0 * N**3, 12 * N * N),
                roofline_s("V100-16GB", ELEMS, 12 * ELEMS), roofline_s("P100-12GB", ELEMS, 12 * ELEMS)]
    assert times == pytest.approx(expected, rel=1e-12)


def test_v100_speedup_differs_between_compute_and_memory_bound(paper8):
    g = graph(matmul(), add(), add(64))
    full = paper8.full_batch_times(g)
    mm_ratio, add_ratio, tiny_ratio = full[:, 2] / full[:, 0]
    assert 1.1 <= mm_ratio <= 1.9 and 1.1 <= add_ratio <= 1.9
    assert add_ratio - mm_ratio > 0.3
    assert tiny_ratio == pytest.approx(1.1, abs=0.01)      # launch-bound: the paper's lower end


def test_fractions_scale_only_batch_ops(paper8):
    weight_update = Op("sgd", "aten.add_.Tensor", phase="update", output_shapes=[[N, N]], output_dtypes=["float32"],
                       batch_dims=[None], flops=float(N * N), bytes_read=8 * N * N, bytes_written=4 * N * N)
    g = graph(matmul(), weight_update)
    half = paper8.op_times(g, np.array([0, 1]), np.array([0, 0]), np.array([0.5, 0.5]))
    full = paper8.op_times(g, np.array([0, 1]), np.array([0, 0]), np.array([1.0, 1.0]))
    assert half[0] == pytest.approx(roofline_s("V100-16GB", N**3, 8 * N * N), rel=1e-12)
    assert half[1] == full[1]
    assert not g.has_batch[1] and g.has_batch[0]


def test_batch_edge_makes_op_splittable(paper8):
    loss = Op("loss", "aten.mean.default", output_shapes=[[]], output_dtypes=["float32"], batch_dims=[None],
              flops=float(N * N), bytes_read=4 * N * N, bytes_written=4, batch_bytes=4 * N * N)
    g = graph(matmul(), loss, edges=[Edge(0, 1, 4 * N * N, batch_dim=0)])
    quarter = paper8.op_times(g, np.array([1]), np.array([0]), np.array([0.25]))[0]
    assert quarter == pytest.approx(roofline_s("V100-16GB", N * N / 4, N * N + 4), rel=1e-12)


def test_placeholders_take_no_time_and_slowdown_multiplies():
    param = Op("w", "placeholder", kind="param", output_shapes=[[N, N]], output_dtypes=["float32"], batch_dims=[None],
               param_bytes=4 * N * N)
    g = graph(param, matmul())
    cm = CostModel(load_cluster("local-cpu-2:slowdown=1,3"))
    times = cm.full_batch_times(g)
    assert times[0].tolist() == [0.0, 0.0]
    assert times[1, 0] == pytest.approx(roofline_s("cpu", 2.0 * N**3, 12 * N * N), rel=1e-12)
    assert times[1, 1] == pytest.approx(3 * times[1, 0], rel=1e-12)


def test_half_precision_uses_tensor_cores():
    cm = CostModel(load_cluster("mixed-a100-v100-t4"))   # device 0: A100-40GB
    g = graph(matmul(dtype="bfloat16"), matmul(dtype="float32"))
    t = cm.op_times(g, np.array([0, 1]), np.array([0, 0]), np.ones(2))
    a100 = CATALOG["A100-40GB"]
    assert t[0] == pytest.approx(max(2.0 * N**3 / a100.effective_tensor_flops, 6 * N * N / a100.effective_memory_Bps)
                                 + a100.launch_overhead_s, rel=1e-12)
    assert t[1] / t[0] > 10


def test_full_batch_times_shape_cache_and_agreement(paper8):
    g = graph(matmul(), add())
    full = paper8.full_batch_times(g)
    assert full.shape == (2, 8) and paper8.full_batch_times(g) is full and not full.flags.writeable
    assert paper8.op_times(g, np.array([1]), np.array([5]), np.array([1.0]))[0] == full[1, 5]


def test_bad_fraction_and_index(paper8):
    g = graph(matmul())
    with pytest.raises(ValueError, match="fractions"):
        paper8.op_times(g, np.array([0]), np.array([0]), np.array([1.5]))
    with pytest.raises(IndexError, match="device index"):
        paper8.op_times(g, np.array([0]), np.array([8]), np.array([1.0]))


def test_profile_overrides_roofline_exactly(tmp_path):
    mm = matmul()
    profile = ProfileTable()
    profile.set_op("V100-16GB", op_signature(mm), 1e-3, 2e-5)
    profile.save(tmp_path / "p.json")
    cm = CostModel(load_cluster("paper-8gpu"), ProfileTable.load(tmp_path / "p.json"))
    g = graph(mm, add())
    t = cm.op_times(g, np.array([0, 0, 0, 1]), np.array([0, 1, 2, 0]), np.array([0.5, 1.0, 0.5, 1.0]))
    assert t[0] == 1e-3 + 2e-5 * (0.5 * BATCH)
    assert t[1] == 1e-3 + 2e-5 * BATCH
    assert t[2] == pytest.approx(roofline_s("GTX-1080Ti", N**3, 8 * N * N), rel=1e-12)   # no entry: roofline
    assert t[3] == pytest.approx(roofline_s("V100-16GB", ELEMS, 12 * ELEMS), rel=1e-12)


def test_profile_is_snapshotted_at_build():
    mm = matmul()
    profile = ProfileTable()
    cm = CostModel(load_cluster("paper-8gpu"), profile)
    profile.set_op("V100-16GB", op_signature(mm), 1.0, 0.0)
    assert cm.op_times(graph(mm), np.array([0]), np.array([0]), np.array([1.0]))[0] < 0.1


def test_profile_points_interpolate_piecewise_and_extend_the_end_segments():
    """Points at 8/16/32 samples (BATCH = 32): exact at the points, linear between, end segments
    extended outside; ``op_points=False`` uses the least-squares line instead."""
    mm = matmul()
    profile = ProfileTable()
    profile.add_op("V100-16GB", op_signature(mm), [8, 16, 32], [1e-3, 2e-3, 6e-3])
    cm = CostModel(load_cluster("paper-8gpu"), profile)
    g = graph(mm)
    fractions = np.array([0.25, 0.5, 1.0, 0.375, 0.75, 0.125])       # 8, 16, 32, 12, 24, 4 samples
    t = cm.op_times(g, np.zeros(6, dtype=np.int64), np.zeros(6, dtype=np.int64), fractions)
    assert t == pytest.approx([1e-3, 2e-3, 6e-3, 1.5e-3, 4e-3, 0.5e-3], rel=1e-12)
    a, b = profile.ops["V100-16GB"][op_signature(mm)]
    line = CostModel(load_cluster("paper-8gpu"), profile, op_points=False)
    t_line = line.op_times(g, np.zeros(6, dtype=np.int64), np.zeros(6, dtype=np.int64), fractions)
    assert t_line == pytest.approx(np.maximum(a + b * fractions * BATCH, 0.0), rel=1e-12)
    # another op with a line only and a device without entries keep their own rules in the same call
    profile.set_op("V100-16GB", op_signature(add()), 1e-4, 0.0)
    both = CostModel(load_cluster("paper-8gpu"), profile)
    g2 = graph(mm, add())
    t2 = both.op_times(g2, np.array([0, 1, 0]), np.array([0, 0, 2]), np.array([0.375, 0.5, 1.0]))
    assert t2[:2] == pytest.approx([1.5e-3, 1e-4], rel=1e-12)
    assert t2[2] == pytest.approx(roofline_s("GTX-1080Ti", N**3 * 2, 12 * N * N), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, BATCH), min_size=1, max_size=5, unique=True),
       st.lists(st.floats(1e-5, 1e-2), min_size=5, max_size=5), st.floats(0.0, 1.0))
def test_profile_points_are_met_exactly_and_bound_what_lies_between(sizes, times, fraction):
    sizes = sorted(sizes)
    times = times[:len(sizes)]
    mm = matmul()
    profile = ProfileTable()
    profile.add_op("V100-16GB", op_signature(mm), sizes, times)
    cm = CostModel(load_cluster("paper-8gpu"), profile)
    g = graph(mm)
    at_points = cm.op_times(g, np.zeros(len(sizes), dtype=np.int64), np.zeros(len(sizes), dtype=np.int64),
                            np.array(sizes) / BATCH)
    assert at_points == pytest.approx(times, rel=1e-9, abs=1e-15)
    x = fraction * BATCH
    t = cm.op_times(g, np.array([0]), np.array([0]), np.array([fraction]))[0]
    if sizes[0] <= x <= sizes[-1]:                  # inside: between the two neighbouring points
        k = max(i for i, s in enumerate(sizes) if s <= x)
        neighbours = times[k:k + 2]                 # one point when x is the last size: t is that point's time
        lo, hi = min(neighbours), max(neighbours)
        assert lo - 1e-12 <= t <= hi + 1e-12
    assert t >= 0.0


def test_random_ops_draw_whole_blocks_of_samples(paper8):
    """Dropout at a share of s of B = 32 samples draws n = min(ceil(s/8) + 1, 4) blocks of 8: the time of
    n*8 samples plus n launches; the whole batch draws its 4 blocks (4 launches)."""
    drop = add()
    drop.name, drop.draws = "dropout", True
    g = graph(add(), drop)
    launch = CATALOG["V100-16GB"].launch_overhead_s
    plain = paper8.op_times(g, np.zeros(4, np.int64), np.zeros(4, np.int64), np.array([1.0, 0.25, 5 / 32, 0.75]))
    drawn = paper8.op_times(g, np.ones(4, np.int64), np.zeros(4, np.int64), np.array([1.0, 0.25, 5 / 32, 0.75]))
    for got, blocks in zip(drawn, [4, 2, 2, 4]):
        f = blocks * 8 / BATCH
        assert got == pytest.approx(roofline_s("V100-16GB", ELEMS * f, 12 * ELEMS * f) + (blocks - 1) * launch,
                                    rel=1e-12)
    assert (drawn > plain).all()
