"""Grouped matmul: rows of x, sorted by group, each multiplied by their group's weight matrix.

This is the dropless MoE workhorse: after tokens are sorted by expert, ``x[M, K]`` holds
``group_sizes[e]`` consecutive rows for expert e, and row r is multiplied by ``w[e(r)]``.

Two implementations, picked once by `expert_matmuls` (the MoE layer keeps the functions):
  * ``xla``: ``jax.lax.ragged_dot``. Exact and the CPU path, but on GPU it lowers to a dense
    computation over every group (E times the work) and at real sizes runs out of memory (a
    64-expert MoE on an H100: recipes/h100/README.md).
  * ``tokamax``: ``tokamax.ragged_dot``, the Pallas Mosaic kernels on GPU/TPU, which touch only
    each row's own group.

Both look their op up on its module when called, not when picked: quantized training
(quantization/training.py) intercepts `jax.lax.ragged_dot` and `tokamax.ragged_dot` by name
while the model runs. Rows past ``sum(group_sizes)`` produce zeros in both; the MoE layer relies
on that to park dropped or padding rows at the end.

The experts run two grouped matmuls of different shapes, gate-up and down (`ExpertMatmuls`),
each with its own tokamax tiling where `compute.grouped_matmul_tiles` names one
(`tiled_tokamax_grouped_matmul`): per pass, forward, input gradient and weight gradient, the
fields of the platform's tokamax kernel config. Unnamed, tokamax chooses: its autotuning cache
for the exact shape, else its heuristics (on an H100, its default tiles for every grouped
matmul of the moe-64e recipe: recipes/h100/README.md).

Both run under the name scope `SCOPE`, which the compiled program's instructions carry in their
metadata, backward ones included: on CPU ragged_dot lowers to a plain dot, and the scope is what
tells it from the model's other dots (analysis/program.py grouped_matmuls).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import pydantic

# (x [M, K] rows sorted by group, w [G, K, N], group_sizes [G] int32) -> [M, N] in x.dtype,
# accumulated in float32 whatever the input dtype.
type GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

SCOPE = "grouped_matmul"


def _scoped(gmm: GroupedMatmul) -> GroupedMatmul:
    @functools.wraps(gmm)
    def scoped(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        with jax.named_scope(SCOPE):
            return gmm(x, w, group_sizes)

    return scoped


@_scoped
def xla_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    out = jax.lax.ragged_dot(
        x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32
    )
    return out.astype(x.dtype)


@_scoped
def tokamax_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    import tokamax  # when first traced: its import takes seconds, and CPU runs never need it

    # Output in x.dtype straight from the kernel, which accumulates in float32 anyway: a float32
    # output would hand tokamax's backward a float32 cotangent to multiply with the bf16
    # weights, and its GPU kernels take only operands of one dtype.
    return tokamax.ragged_dot(
        x, w, group_sizes.astype(jnp.int32), manual_axis_type=manual_axis_type(x, w)
    )


def manual_axis_type(*operands: jax.Array) -> jax.sharding.ManualAxisType | None:
    """Inside `shard_map` (the MoE's experts run there), a Pallas kernel's output must say which
    mesh axes it varies over, or tracing refuses it: those any operand varies over. None
    outside shard_map, where there is nothing to say."""
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return None
    varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in operands))
    return jax.sharding.ManualAxisType(varying=varying)


def grouped_bias(bias: jax.Array, group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[M, N]: each of num_rows sorted rows' group's bias (bias [G, N]); zeros past
    sum(group_sizes), as a grouped matmul leaves those rows. A row's group is the number of
    groups ending at or before it: a count, not a search (see rank_in_group in
    layers/routed_experts.py)."""
    ends = jnp.zeros(num_rows + 1, jnp.int32).at[jnp.cumsum(group_sizes)].add(1)
    group = jnp.cumsum(ends)[:num_rows]  # G past the last group
    return jnp.concatenate([bias, jnp.zeros_like(bias[:1])])[group]


# One projection's tiles per pass (compute.grouped_matmul_tiles): forward, input_grad and
# weight_grad, the product and the gradients of its rows and of its weights, which tokamax runs
# as kernels of their own.
TilesPerPass = Mapping[str, Mapping[str, Any]]


def _tokamax_kernel(platform: str) -> tuple[type, type]:
    """(kernel op class, its config class) of tokamax's grouped matmul on `platform`.

    From tokamax's own modules: its public `tokamax.ops.gpu` also imports jax_triton, which
    the Mosaic GPU kernel does not need and the pinned stack does not have."""
    if platform == "tpu":
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as kernel

        return kernel.PallasMosaicTpuRaggedDot, kernel.Config
    if platform == "gpu":
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as kernel

        return kernel.PallasMosaicGpuRaggedDot, kernel.Config
    raise ValueError(f"tokamax's grouped matmul has no kernel on {platform}")


def tile_problem(tiles: TilesPerPass, platform: str) -> str | None:
    """What is wrong with one projection's tiles for tokamax's kernel on `platform` (a field it
    does not have, a value it refuses, a required one missing), or None."""
    _, config = _tokamax_kernel(platform)
    fields = [f.name for f in dataclasses.fields(config)]
    for name, chosen in tiles.items():
        unknown = sorted(set(chosen) - set(fields))
        if unknown:
            return f"{name}: {unknown} are not fields of tokamax's {platform} kernel ({fields})"
        try:
            config(**chosen)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            return f"{name}.{where}: {first['msg']}"
    return None


def tiles_platform(tiles: TilesPerPass) -> str:
    """The platform whose tokamax kernel the tiles are for, by their fields (disjoint: the TPU
    kernel's tile_m, tile_k, tile_n; the GPU kernel's block_m, block_n, block_k, ...)."""
    named = {field for chosen in tiles.values() for field in chosen}
    _, tpu_config = _tokamax_kernel("tpu")
    return "tpu" if named <= {f.name for f in dataclasses.fields(tpu_config)} else "gpu"


def tiled_tokamax_grouped_matmul(tiles: TilesPerPass) -> GroupedMatmul:
    """tokamax's grouped matmul with the tiles named per pass (a pass not named keeps
    tokamax's choice): its kernel op configured for the forward, and its backward's two kernels
    (tokamax's ragged-dot VJP, which runs the input and weight gradients as grouped matmuls of
    their own) for theirs. The platform follows from the tiles' fields (`tiles_platform`;
    models/build.py platform_choices has checked them against the devices' platform)."""
    from tokamax._src.ops.ragged_dot import base

    op, config = _tokamax_kernel(tiles_platform(tiles))

    def kernel(name: str, **kwargs: Any):
        chosen = tiles.get(name)
        return op(config=config(**chosen) if chosen else None, **kwargs)

    backward = functools.partial(
        base.vjp, dlhs_ragged_dot=kernel("input_grad"), drhs_ragged_dot=kernel("weight_grad")
    )
    forward = kernel("forward", vjp=backward)

    @_scoped
    def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        import tokamax

        return tokamax.ragged_dot(
            x,
            w,
            group_sizes.astype(jnp.int32),
            manual_axis_type=manual_axis_type(x, w),
            implementation=[forward],
        )

    return grouped_matmul


class ExpertMatmuls(NamedTuple):
    """The experts' two grouped matmuls: gate and up as one [D, 2F] product, then down."""

    gate_up: GroupedMatmul
    down: GroupedMatmul


IMPLEMENTATIONS: dict[str, GroupedMatmul] = {
    "xla": xla_grouped_matmul,
    "tokamax": tokamax_grouped_matmul,
}


def grouped_matmul_implementation(name: str, platform: str | None = None) -> str:
    """'auto' is tokamax on GPU/TPU and xla on CPU (tokamax's kernels do not run on CPU), for
    `platform`, that of the devices the program is built for (None: the default backend)."""
    if name == "auto":
        return "xla" if (platform or jax.default_backend()) == "cpu" else "tokamax"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown grouped matmul {name!r}; expected auto or {(*IMPLEMENTATIONS,)}")
    return name


def expert_matmuls(name: str, tiles: Mapping[str, TilesPerPass] | None = None) -> ExpertMatmuls:
    """The experts' grouped matmuls a configured name picks on this backend, each projection
    (gate_up, down) with the tiles `tiles` names for it where tokamax's kernels run."""
    resolved = grouped_matmul_implementation(name)
    tiles = tiles or {}

    def pick(projection: str) -> GroupedMatmul:
        if resolved == "tokamax" and any(tiles.get(projection, {}).values()):
            return tiled_tokamax_grouped_matmul(tiles[projection])
        return IMPLEMENTATIONS[resolved]

    return ExpertMatmuls(pick("gate_up"), pick("down"))
