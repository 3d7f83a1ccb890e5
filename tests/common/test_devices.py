"""The chip table (maxtrain/common/devices.py): jax's device kinds find their rows, and the MFU
denominator, the memory fit and the step-time model read the same row."""

import pytest

from maxtrain.analysis import memory
from maxtrain.common import devices
from maxtrain.training import metrics


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("TPU v4", "TPU v4"),
        ("TPU v5 lite", "TPU v5e"),  # v5e's device_kind
        ("TPU v5", "TPU v5p"),  # v5p's: after "tpu v5 lite" in the table
        ("TPU v6 lite", "TPU v6e"),
        ("TPU7x", "TPU7x"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("cpu", None),
    ],
)
def test_a_device_kind_finds_its_row(kind, name):
    found = devices.chip(kind)
    assert (found.name if found else None) == name
    assert devices.platform(kind) == (found.platform if found else "cpu")


@pytest.mark.parametrize("chip", devices.CHIPS, ids=lambda c: c.name)
def test_mfu_and_the_memory_fit_read_the_chip_table(chip):
    kind = chip.kinds[0]
    assert metrics.peak_tflops(kind) * 1e12 == chip.peak_flops["bf16"]
    assert memory.fit(1.0, kind)["device_memory_gib"] == chip.hbm_gib
    assert set(chip.peak_flops) == {"bf16", "f32", "int8", "fp8"}
    assert chip.hbm_bytes_per_s > 0 and chip.link_bytes_per_s > 0 and chip.host_bytes_per_s > 0


def test_a_ring_uses_both_neighbours_links_of_each_torus_dimension_it_spans():
    """v5e: 400 GB/s bidirectional over 4 ports, 50 GB/s per port and direction; a ring over one
    dimension sends on two ports (100 GB/s), over both dimensions on four, never more. An H100
    sends on all its NVLinks to the switch, whatever the group: 450 GB/s."""
    v5e, h100 = devices.chip("TPU v5 lite"), devices.chip("NVIDIA H100 80GB HBM3")
    assert [v5e.ring_bytes_per_s(d) for d in (1, 2, 3)] == [100e9, 200e9, 200e9]
    assert h100.ring_bytes_per_s(1) == h100.ring_bytes_per_s(3) == 450e9
