"""Device catalog: published numbers present, validation of DeviceType, unknown-type errors."""
import pytest

from heterog.cluster import CATALOG, DeviceType
from heterog.cluster.catalog import GiB, device_type
from heterog.errors import ClusterError

REQUIRED = ["V100-16GB", "V100-32GB", "GTX-1080Ti", "P100-12GB", "T4", "A100-40GB", "A100-80GB", "H100",
            "H200", "L4", "RTX-3090", "RTX-4090", "cpu"]


def test_catalog_has_required_types_with_datasheet_numbers():
    assert set(REQUIRED) <= set(CATALOG)
    v100, gtx = CATALOG["V100-16GB"], CATALOG["GTX-1080Ti"]
    assert v100.peak_flops == 15.7e12 and v100.memory_bandwidth_Bps == 900e9 and v100.memory_bytes == 16 * GiB
    assert gtx.peak_flops == 11.34e12 and gtx.memory_bandwidth_Bps == 484e9 and gtx.memory_bytes == 11 * GiB
    assert gtx.tensor_flops is None and v100.tensor_flops == 125e12
    assert CATALOG["cpu"].peak_flops == 50e9 and CATALOG["cpu"].memory_bytes == 8 * GiB
    h100, h200 = CATALOG["H100"], CATALOG["H200"]   # the same compute, more and faster memory
    assert h200.peak_flops == h100.peak_flops and h200.tensor_flops == h100.tensor_flops == 989e12
    assert h200.memory_bandwidth_Bps == 4.8e12 and h200.memory_bytes == 141 * GiB


def test_v100_over_1080ti_ratios_differ_between_compute_and_memory():
    v100, gtx = CATALOG["V100-16GB"], CATALOG["GTX-1080Ti"]
    compute_ratio = v100.effective_flops / gtx.effective_flops
    memory_ratio = v100.effective_memory_Bps / gtx.effective_memory_Bps
    assert 1.1 <= compute_ratio <= 1.9 and 1.1 <= memory_ratio <= 1.9
    assert memory_ratio - compute_ratio > 0.3


def test_unknown_device_type_names_it_and_lists_known():
    with pytest.raises(ClusterError, match=r"unknown device type 'K80'.*V100-16GB"):
        device_type("K80")


@pytest.mark.parametrize("field, value", [("peak_flops", 0.0), ("memory_bandwidth_Bps", -1.0),
                                          ("compute_efficiency", 1.5), ("memory_efficiency", 0.0)])
def test_device_type_rejects_bad_numbers(field, value):
    kwargs = {"name": "Bad", "peak_flops": 1e12, "tensor_flops": None, "memory_bandwidth_Bps": 1e11,
              "memory_bytes": GiB}
    kwargs[field] = value
    with pytest.raises(ClusterError, match=rf"'Bad'.*{field}"):
        DeviceType(**kwargs)
