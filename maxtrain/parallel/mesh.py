"""The device mesh, and the map from logical axis names to mesh axes.

Layer code names only logical axes (``embed``, ``heads``, ``mlp``, ``vocab``, ``batch``...);
``mesh.rules`` in the config says which mesh axes each one is sharded over. Changing a
parallelism strategy is therefore a config change, never a model change.

Sharding mode: every mesh axis is ``AxisType.Auto``. jax now defaults to Explicit axes, under
which every ambiguous op (embedding gathers, matmuls contracting a sharded dim) must carry an
``out_sharding``; that would spread mesh knowledge through every layer. With Auto axes the
layers stay single-device math, parameters get their shardings from their logical names, a few
activation constraints (`constrain`) pin the batch layout at layer boundaries, and XLA's
partitioner fills in the collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxtrain.config import MESH_AXES, ConfigError, MeshConfig

LogicalAxes = tuple[str | None, ...]


def _resolve_degrees(cfg: MeshConfig, devices_per_slice: int) -> list[int]:
    """ICI degree per mesh axis, with the one allowed -1 filled from the device count."""
    degrees = [getattr(cfg, axis) for axis in MESH_AXES]
    unknown = [axis for axis, d in zip(MESH_AXES, degrees, strict=True) if d == -1]
    bad = [axis for axis, d in zip(MESH_AXES, degrees, strict=True) if d == 0 or d < -1]
    if bad:
        raise ConfigError(
            f"mesh.{bad[0]} must be a positive degree or -1, got {getattr(cfg, bad[0])}"
        )
    if len(unknown) > 1:
        raise ConfigError(f"only one mesh axis may be -1, got -1 for {', '.join(unknown)}")
    known = math.prod(d for d in degrees if d != -1)
    shape = " x ".join(f"{a}={d}" for a, d in zip(MESH_AXES, degrees, strict=True) if d != 1)
    if unknown:
        if devices_per_slice % known:
            # Named by the degrees set (a user's mesh.tensor=3), not by the -1 that fills the
            # rest, which is usually the default's mesh.fsdp.
            given = " x ".join(part for part in shape.split(" x ") if not part.endswith("=-1"))
            raise ConfigError(
                f"mesh ICI degrees ({given}) need a multiple of {known} devices per slice, but "
                f"{devices_per_slice} {'is' if devices_per_slice == 1 else 'are'} available "
                f"(mesh.{unknown[0]}=-1 takes the devices the others leave)"
            )
        degrees[MESH_AXES.index(unknown[0])] = devices_per_slice // known
    elif known != devices_per_slice:
        raise ConfigError(
            f"mesh ICI degrees ({shape or 'all 1'}) use {known} devices per slice but "
            f"{devices_per_slice} are available; set one axis to -1 or fix the degrees"
        )
    return degrees


def _slices(devices: Sequence[jax.Device], num_slices: int) -> list[list[jax.Device]]:
    """Groups TPU devices by their slice; other devices (GPU, CPU) are cut in order.

    jax.devices() lists devices process by process, so on a GPU cluster each cut is a group of
    whole hosts joined by the data-center network, and simulated CPU devices (one process or
    several) exercise the DCN path in tests.
    """
    if devices[0].platform == "tpu":
        groups: dict[int, list[jax.Device]] = {}
        for d in devices:
            # Compile-only devices of a one-slice topology (maxtrain/parallel/topology.py) have no
            # slice_index; those of several slices do.
            groups.setdefault(getattr(d, "slice_index", 0), []).append(d)
        if len(groups) != num_slices:
            raise ConfigError(
                f"mesh.num_slices={num_slices} but the devices span {len(groups)} slices"
            )
        return [groups[k] for k in sorted(groups)]
    if len(devices) % num_slices:
        raise ConfigError(
            f"mesh.num_slices={num_slices} does not divide the {len(devices)} devices"
        )
    per = len(devices) // num_slices
    return [list(devices[i * per : (i + 1) * per]) for i in range(num_slices)]


def mesh_platform(mesh: Mesh) -> str:
    """The platform ("cpu", "gpu", "tpu") of the mesh's devices: what kernels and exchanges are
    chosen for (training/run_model.py for_platform), which is not the process's default
    backend when the devices are a TPU topology compiled for on a CPU host."""
    return mesh.devices.flat[0].platform


def device_slices(mesh: Mesh, num_slices: int) -> list[int]:
    """The slice of each of the mesh's devices, in its flat order: the device order of a program
    compiled over the mesh, which its collectives' replica groups index."""
    devices = sorted(mesh.devices.flat, key=lambda d: d.id)
    slice_of = {d.id: i for i, group in enumerate(_slices(devices, num_slices)) for d in group}
    return [slice_of[d.id] for d in mesh.devices.flat]


def axis_sizes(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Size of every mesh axis (ICI x DCN) for a device count, without needing the devices."""
    if num_devices % cfg.num_slices:
        raise ConfigError(f"mesh.num_slices={cfg.num_slices} does not divide {num_devices} devices")
    ici = _resolve_degrees(cfg, num_devices // cfg.num_slices)
    return {axis: d * getattr(cfg.dcn, axis) for axis, d in zip(MESH_AXES, ici, strict=True)}


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all axes in MESH_AXES; its shape is ICI degree x DCN degree per axis."""
    devices = list(devices if devices is not None else jax.devices())
    dcn = [getattr(cfg.dcn, axis) for axis in MESH_AXES]
    if math.prod(dcn) != cfg.num_slices:
        raise ConfigError(
            f"mesh.dcn degrees multiply to {math.prod(dcn)} but mesh.num_slices={cfg.num_slices}"
        )
    slices = _slices(devices, cfg.num_slices)
    ici = _resolve_degrees(cfg, len(slices[0]))
    # A mesh axis that is no product of the slice's physical axes (expert 8 on a 16x16 v5e
    # slice) splits a physical axis; jax does that only when no exact assignment exists.
    per_slice = [
        mesh_utils.create_device_mesh(ici, devices=s, allow_split_physical_axes=True)
        for s in slices
    ]
    grid = np.empty(dcn + ici, dtype=object)  # [dcn axes..., ici axes...]
    for index, slice_mesh in zip(np.ndindex(*dcn), per_slice, strict=True):
        grid[index] = slice_mesh
    # Interleave to (dcn_0, ici_0, dcn_1, ici_1, ...) then merge pairs: DCN is the outer
    # (slower) part of every axis, so collectives along an axis stay inside a slice first.
    n = len(MESH_AXES)
    order = [i for pair in zip(range(n), range(n, 2 * n), strict=True) for i in pair]
    shape = [d * i for d, i in zip(dcn, ici, strict=True)]
    grid = grid.transpose(order).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * n)


# ---- logical axes -> PartitionSpec ------------------------------------------------------------


def logical_to_spec(
    axes: LogicalAxes, rules: dict[str, list[str]], mesh: Mesh, shape: Sequence[int] | None = None
) -> P:
    """PartitionSpec for an array whose dims carry the given logical names.

    A mesh axis is used at most once per array (first dim wins), axes of size 1 are dropped, and
    a dim that the mesh axes do not divide stays replicated rather than failing to compile
    (e.g. 2 kv heads on a tensor axis of 4).
    """
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(axes):
        mesh_axes = [
            a for a in (rules.get(name, []) if name else []) if a not in used and mesh.shape[a] > 1
        ]
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if shape is not None and shape[dim] % size:
            mesh_axes = []
        used.update(mesh_axes)
        spec.append(
            None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)
        )
    return P(*spec)


def spec_axes(part: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names (None: none)."""
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)


def batch_degree(rules: dict[str, list[str]], mesh: Mesh) -> int:
    """How many ways the batch dimension is split (data-parallel degree)."""
    return math.prod(mesh.shape[a] for a in rules.get("batch", []))


# ---- activation constraints --------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, dict[str, list[str]]] | None] = contextvars.ContextVar(
    "maxtrain_sharding_rules", default=None
)


@contextlib.contextmanager
def sharding_rules(mesh: Mesh, rules: dict[str, list[str]]) -> Iterator[None]:
    """Makes `constrain` active while tracing model code for this mesh."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[Mesh, dict[str, list[str]]] | None:
    """The (mesh, rules) being traced for, or None outside `sharding_rules` (single device)."""
    return _ACTIVE.get()


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Pins an activation's layout by logical axis names; a no-op outside `sharding_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(axes, rules, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
