"""The decode cache of generation: per layer stack, what each position's attention keeps.

Entry s of a row holds position s of that row, so prompts of different lengths share one batch
without left padding: each row's new tokens are written at its own positions, and attention
masks by position (model/kernels/attention.py cached_attention). Layers are stored stacked, as their
parameters are ([L, B, S, ...] per stack, model/stacks.py), so the decoder scans over
parameters and cache together. On a mesh the cache is split like the activations it comes from:
the batch over the data-parallel axes, grouped-query attention's key/value heads over `tensor`.

What a position keeps depends on the attention (`init_cache` picks by model.attention_type):
grouped-query attention its keys and values (`LayerCache`), multi-head latent attention only the
compressed latent and the shared rotary key its keys and values are made from (`LatentCache`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from maxtrain.config import ModelConfig
from maxtrain.parallel.mesh import constrain, logical_to_spec


def _write_rows(cache: jax.Array, new: jax.Array, positions: jax.Array, axes) -> jax.Array:
    """cache [B, S, ...] with new [B, T, ...] stored at positions [B, T] (consecutive per row)."""
    row = lambda c, n, start: jax.lax.dynamic_update_slice_in_dim(c, n, start, axis=0)
    return constrain(jax.vmap(row)(cache, new.astype(cache.dtype), positions[:, 0]), axes)


class LayerCache(NamedTuple):
    """Grouped-query attention's keys and values of one layer ([B, S, K, H]), or of a stack
    of them ([L, B, S, K, H])."""

    k: jax.Array
    v: jax.Array

    axes = ("layers", "batch", None, "kv_heads", "head_dim")  # of each array, stacked

    @classmethod
    def zeros(cls, cfg: ModelConfig, layers: int, batch: int, length: int, dtype) -> LayerCache:
        shape = (layers, batch, length, cfg.num_kv_heads, cfg.resolved_head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> LayerCache:
        """The cache with k/v [B, T, K, H] stored at positions [B, T] (consecutive per row)."""
        return LayerCache(
            _write_rows(self.k, k, positions, self.axes[1:]),
            _write_rows(self.v, v, positions, self.axes[1:]),
        )


class LatentCache(NamedTuple):
    """Multi-head latent attention's cache of one layer ([B, S, R + Rr]) or a stack ([L, ...]):
    per position the normalised key/value latent (R = kv_lora_rank) and the rotated rotary key
    all heads share (Rr = qk_rope_head_dim), side by side. Decoding attends from it directly,
    as one key/value head (model/layers/mla.py `cached`), so no per-head key or value is kept:
    R + Rr elements per position, against N x (qk_head_dim + v_head_dim) for keys and values.
    Not split over `tensor`: every head reads all of it."""

    key: jax.Array  # [..., B, S, R + Rr]: [latent | rotary key]; its first R dims are the value

    axes = ("layers", "batch", None, None)

    @classmethod
    def zeros(cls, cfg: ModelConfig, layers: int, batch: int, length: int, dtype) -> LatentCache:
        assert cfg.mla is not None  # attention_type mla implies it (config validation)
        width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        return cls(jnp.zeros((layers, batch, length, width), dtype))

    def write(self, key: jax.Array, positions: jax.Array) -> LatentCache:
        """The cache with key [B, T, R + Rr] stored at positions [B, T] (consecutive per row)."""
        return LatentCache(_write_rows(self.key, key, positions, self.axes[1:]))


type Cache = LayerCache | LatentCache
CACHES: dict[str, type[LayerCache] | type[LatentCache]] = {"gqa": LayerCache, "mla": LatentCache}


def init_cache(
    cfg: ModelConfig, stacks: dict[str, int], batch: int, length: int, dtype
) -> dict[str, Cache]:
    """Zeroed caches of the model's attention for `stacks` (params key -> layers in it) of
    `length` positions."""
    kind = CACHES[cfg.attention_type]
    return {stack: kind.zeros(cfg, n, batch, length, dtype) for stack, n in stacks.items()}


def cache_shardings(
    cache: dict[str, Cache], mesh: Mesh, rules: dict[str, list[str]]
) -> dict[str, Cache]:
    def shardings(stack: Cache) -> Cache:
        spec = lambda a: logical_to_spec(stack.axes, rules, mesh, a.shape)
        return type(stack)(*(NamedSharding(mesh, spec(a)) for a in stack))

    return {name: shardings(stack) for name, stack in cache.items()}
