"""Mesh construction (ICI and DCN degrees) and logical-axis rules."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxtrain.config import ConfigError, MeshConfig
from maxtrain.parallel.mesh import build_mesh, logical_to_spec


def test_minus_one_fills_remaining_devices():
    mesh = build_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {
        "data": 2,
        "stage": 1,
        "fsdp": 2,
        "context": 1,
        "tensor": 2,
        "expert": 1,
    }
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (MeshConfig(fsdp=4), "use 4 devices per slice but 8 are available"),
        (MeshConfig(data=-1, fsdp=-1), "only one mesh axis may be -1"),
        # named by the degree set, not by the default's fsdp=-1 (the user typed tensor=3)
        (MeshConfig(fsdp=-1, tensor=3), r"degrees \(tensor=3\) need a multiple of 3 devices"),
        (MeshConfig(num_slices=2), "mesh.dcn degrees multiply to 1 but mesh.num_slices=2"),
    ],
)
def test_bad_mesh_is_a_config_error(cfg, message):
    with pytest.raises(ConfigError, match=message):
        build_mesh(cfg)


def test_dcn_axis_spans_slices_and_ici_stays_inside_one():
    """Two simulated slices of 4 devices, data parallel across them, fsdp within each."""
    cfg = MeshConfig(fsdp=-1, num_slices=2, dcn={"data": 2})
    mesh = build_mesh(cfg)
    assert mesh.shape["data"] == 2 and mesh.shape["fsdp"] == 4
    devices = mesh.devices.squeeze()  # [data, fsdp]
    slice_of = {d.id: d.id // 4 for d in jax.devices()}  # contiguous groups of 4 = one slice
    for row in range(2):
        assert {slice_of[d.id] for d in devices[row]} == {row}  # an fsdp group is one slice


def test_logical_rules_map_to_partition_specs():
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = {
        "batch": ["data", "fsdp"],
        "embed": ["fsdp"],
        "mlp": ["tensor"],
        "kv_heads": ["tensor"],
    }
    assert logical_to_spec(("embed", "mlp"), rules, mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", None, "embed"), rules, mesh) == P(("data", "fsdp"), None, None)
    # a dim the mesh axes do not divide stays replicated instead of failing to compile
    assert logical_to_spec(("embed", "kv_heads"), rules, mesh, shape=(8, 3)) == P("fsdp", None)
    assert np.prod(list(mesh.shape.values())) == 8
