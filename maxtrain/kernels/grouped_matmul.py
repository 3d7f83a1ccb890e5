"""Grouped matmul: rows of x, sorted by group, each multiplied by their group's weight matrix.

This is the dropless MoE workhorse: after tokens are sorted by expert, ``x[M, K]`` holds
``group_sizes[e]`` consecutive rows for expert e, and row r is multiplied by ``w[e(r)]``.

Two implementations, one switch:
  * ``xla``: ``jax.lax.ragged_dot``. Exact and the CPU path, but on GPU it lowers to a dense
    computation over every group (E times the work) and at real sizes runs out of memory
    (../shared/notes/h100-measurements.md: 32 GiB for 64 experts).
  * ``tokamax``: ``tokamax.ragged_dot``, the Pallas Mosaic kernels on GPU/TPU, which touch only
    each row's own group.

Rows past ``sum(group_sizes)`` produce zeros in both; the MoE layer relies on that to park
dropped or padding rows at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import tokamax

IMPLEMENTATIONS = ("xla", "tokamax")


def resolve_implementation(name: str) -> str:
    """'auto' is tokamax on GPU/TPU and xla on CPU (tokamax's kernels do not run on CPU)."""
    if name == "auto":
        return "xla" if jax.default_backend() == "cpu" else "tokamax"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown grouped matmul {name!r}; expected auto or {IMPLEMENTATIONS}")
    return name


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str
) -> jax.Array:
    """x [M, K] (rows sorted by group), w [G, K, N], group_sizes [G] int32 -> [M, N] in x.dtype.

    Accumulates in float32 whatever the input dtype.
    """
    group_sizes = group_sizes.astype(jnp.int32)
    if implementation == "tokamax":
        out = tokamax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    else:
        out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
