"""The key/value cache of generation: per layer stack, the keys and values of every position.

Entry s of a row holds position s of that row, so prompts of different lengths share one batch
without left padding: each row's new tokens are written at its own positions, and attention
masks by position (model/kernels/attention.py cached_attention). Layers are stored stacked, as their
parameters are ([L, B, S, K, H] per stack, model/stacks.py), so the decoder scans over
parameters and cache together. On a mesh the cache is split like the activations it comes from:
the batch over the data-parallel axes, the key/value heads over `tensor`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from maxtrain.parallel.mesh import constrain, logical_to_spec

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")  # [L, B, S, K, H]


class LayerCache(NamedTuple):
    """Keys and values of one layer ([B, S, K, H]), or of a stack of them ([L, B, S, K, H])."""

    k: jax.Array
    v: jax.Array

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> LayerCache:
        """The cache with k/v [B, T, K, H] stored at positions [B, T] (consecutive per row)."""

        def put(cache: jax.Array, new: jax.Array) -> jax.Array:
            row = lambda c, n, start: jax.lax.dynamic_update_slice_in_dim(c, n, start, axis=0)
            out = jax.vmap(row)(cache, new.astype(cache.dtype), positions[:, 0])
            return constrain(out, CACHE_AXES[1:])

        return LayerCache(put(self.k, k), put(self.v, v))


def init_cache(
    stacks: dict[str, int], batch: int, length: int, kv_heads: int, head_dim: int, dtype
) -> dict[str, LayerCache]:
    """Zeroed caches for `stacks` (params key -> layers in it) of `length` positions."""
    shape = lambda layers: (layers, batch, length, kv_heads, head_dim)
    return {
        stack: LayerCache(jnp.zeros(shape(n), dtype), jnp.zeros(shape(n), dtype))
        for stack, n in stacks.items()
    }


def cache_shardings(
    cache: dict[str, LayerCache], mesh: Mesh, rules: dict[str, list[str]]
) -> dict[str, LayerCache]:
    def sharding(a: jax.Array) -> NamedSharding:
        return NamedSharding(mesh, logical_to_spec(CACHE_AXES, rules, mesh, a.shape))

    return jax.tree.map(sharding, cache)
