"""Grouped matmul: rows of x, sorted by group, each multiplied by their group's weight matrix.

This is the dropless MoE workhorse: after tokens are sorted by expert, ``x[M, K]`` holds
``group_sizes[e]`` consecutive rows for expert e, and row r is multiplied by ``w[e(r)]``.

Two implementations, picked once by `grouped_matmul_kernel` (the MoE layer keeps the function):
  * ``xla``: ``jax.lax.ragged_dot``. Exact and the CPU path, but on GPU it lowers to a dense
    computation over every group (E times the work) and at real sizes runs out of memory (a
    64-expert MoE on an H100: recipes/h100/README.md).
  * ``tokamax``: ``tokamax.ragged_dot``, the Pallas Mosaic kernels on GPU/TPU, which touch only
    each row's own group.

Both look their op up on its module when called, not when picked: quantized training
(quantization/training.py) intercepts `jax.lax.ragged_dot` and `tokamax.ragged_dot` by name
while the model runs. Rows past ``sum(group_sizes)`` produce zeros in both; the MoE layer relies
on that to park dropped or padding rows at the end.

Both run under the name scope `SCOPE`, which the compiled program's instructions carry in their
metadata, backward ones included: on CPU ragged_dot lowers to a plain dot, and the scope is what
tells it from the model's other dots (analysis/program.py grouped_matmuls).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

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
    groups ending at or before it: a count, not a search (see moe_dispatch.rank_in_group)."""
    ends = jnp.zeros(num_rows + 1, jnp.int32).at[jnp.cumsum(group_sizes)].add(1)
    group = jnp.cumsum(ends)[:num_rows]  # G past the last group
    return jnp.concatenate([bias, jnp.zeros_like(bias[:1])])[group]


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


def grouped_matmul_kernel(name: str) -> GroupedMatmul:
    """The grouped matmul a configured name picks on this backend."""
    return IMPLEMENTATIONS[grouped_matmul_implementation(name)]
