"""The decode cache of generation: per layer stack, what each position's attention keeps.

Entry s of a row holds position s of that row, so prompts of different lengths share one batch
without left padding: each row's new tokens are written at its own positions, and attention
masks by position (kernels/xla_attention.py cached_attention). Layers are stored stacked, as
their parameters are ([L, B, S, ...] per stack and kind, models/stacks.py), and the decoder's
scan over a stack's parameters carries them. On a mesh the cache is split like the activations
it comes from: the batch over the data-parallel axes, grouped-query attention's key/value heads
over `tensor`.

What a position keeps depends on the attention (`init_cache` picks by model.mla's presence):
grouped-query attention its keys and values (`LayerCache`), multi-head latent attention only the
compressed latent and the shared rotary key its keys and values are made from (`LatentCache`).

How many positions a layer keeps depends on its kind (layers/attention_pattern.py): a
global (or nope) layer every position of the generation, a sliding or chunked one only the last
`span` (its window or chunk: no query reaches further back), in a ring (`WindowCache`), so that
its memory is O(window), not O(length). A stack's layers may mix kinds (Gemma 3's 5 sliding : 1
global), so a stack's cache is one array per kind, {kind name: [L_kind, B, ...]}, each layer
owning the entry of its rank among the stack's layers of its kind (models/decoder.py
run_stack_cached). One array per layer of the stack would hold the same but be scanned over by no
lax.scan; both kinds at full length would spend the memory a window saves.

A linear-attention layer (Gated DeltaNet, layers/gated_deltanet.py) keeps no position at
all: its cache is its `DeltaNetState`, the convolution's last inputs and the recurrence's state,
the same size at any length. Its layers have no attention kind; a linear stack's caches are
one array per field under LINEAR, scanned like the others.

Padding: a prefill's rows are right-padded to the longest prompt, the padding's positions -1.
A full-length cache stores it (at the row's next positions, overwritten by its decode steps
before any query sees them); a ring drops it, which it must, as the padding would overwrite
the last prompt positions. A linear layer's state skips it (the layer's `cached`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from maxtrain.config import ModelConfig
from maxtrain.config.model import Mixer
from maxtrain.layers.attention_pattern import span
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
        shape = (layers, batch, length, cfg.resolved_kv_heads, cfg.resolved_head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def update(
        self, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[LayerCache, tuple[jax.Array, jax.Array, None]]:
        """The cache with k/v [B, T, K, H] stored at positions [B, T] (consecutive per row),
        and what the new queries attend over: all of it, entry s at position s."""
        written = LayerCache(
            _write_rows(self.k, k, positions, self.axes[1:]),
            _write_rows(self.v, v, positions, self.axes[1:]),
        )
        return written, (written.k, written.v, None)


def _ring_positions(last: jax.Array, size: int) -> jax.Array:
    """[B] -> [B, size]: the position entry s of a ring holds once positions 0..last[b] of row b
    have been written (the newest congruent to s modulo size); negative: none yet."""
    return last[:, None] - (last[:, None] - jnp.arange(size, dtype=last.dtype)) % size


class WindowCache(NamedTuple):
    """A sliding or chunked layer's keys and values of its last `size` positions ([B, size, K, H]
    each, or [L, ...] stacked): entry s holds the newest position p written with p % size == s.
    Which position an entry holds follows from the row's next position (`_ring_positions`), since a
    row's positions are written in order, each once: nothing records it."""

    k: jax.Array
    v: jax.Array

    axes = LayerCache.axes

    @classmethod
    def ring(cls, size: int, cfg: ModelConfig, layers: int, batch: int, length: int, dtype):
        """A ring of the `size` positions a query reaches back (a window or chunk), or of the
        whole generation if shorter."""
        return cls(*LayerCache.zeros(cfg, layers, batch, min(size, length), dtype))

    def update(
        self, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[WindowCache, tuple[jax.Array, jax.Array, jax.Array]]:
        """New keys/values [B, T, K, H] at positions [B, T] (consecutive per row from the
        row's next position; -1: padding) -> (the ring with them written, what their queries
        attend over: the ring's entries as they were and the new keys, side by side, with each
        one's position, [B, size + T], negative where empty or padding). A prefill longer than
        the ring keeps only the last `size` positions, yet its queries see every new key."""
        size = self.k.shape[1]
        k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        held = _ring_positions(positions[:, 0] - 1, size)
        keys = jnp.concatenate([self.k, k], axis=1)
        values = jnp.concatenate([self.v, v], axis=1)
        visible = (keys, values, jnp.concatenate([held, positions], axis=1))
        # Entry s takes the new token of the newest position congruent to s, if one is new.
        newest = _ring_positions(positions.max(axis=1), size)
        index = newest - positions[:, :1]  # into the new tokens; negative: keep the entry
        take = lambda new, old: jnp.where(
            (index >= 0)[:, :, None, None],
            jnp.take_along_axis(new, jnp.maximum(index, 0)[:, :, None, None], axis=1),
            old,
        )
        axes = self.axes[1:]
        ring = WindowCache(constrain(take(k, self.k), axes), constrain(take(v, self.v), axes))
        return ring, visible


class LatentCache(NamedTuple):
    """Multi-head latent attention's cache of one layer ([B, S, R + Rr]) or a stack ([L, ...]):
    per position the normalised key/value latent (R = kv_lora_rank) and the rotated rotary key
    all heads share (Rr = qk_rope_head_dim), side by side. Decoding attends from it directly,
    as one key/value head (layers/mla.py `cached`), so no per-head key or value is kept:
    R + Rr elements per position, against N x (qk_head_dim + v_head_dim) for keys and values.
    Not split over `tensor`: every head reads all of it. With DeepSeek sparse attention
    (model.mla.indexer) each position also keeps its index key (Hi = indexer.head_dim) after
    them, which the indexer scores new queries against (layers/indexer.py)."""

    # [..., B, S, R + Rr (+ Hi)]: [latent | rotary key (| index key)]; its first R dims are
    # the value
    key: jax.Array

    axes = ("layers", "batch", None, None)

    @classmethod
    def zeros(cls, cfg: ModelConfig, layers: int, batch: int, length: int, dtype) -> LatentCache:
        assert cfg.mla is not None  # built only for a model with model.mla
        width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        if cfg.mla.indexer is not None:
            width += cfg.mla.indexer.head_dim
        return cls(jnp.zeros((layers, batch, length, width), dtype))

    def write(self, key: jax.Array, positions: jax.Array) -> LatentCache:
        """The cache with key [B, T, width] stored at positions [B, T] (consecutive per row)."""
        return LatentCache(_write_rows(self.key, key, positions, self.axes[1:]))


class DeltaNetState(NamedTuple):
    """What a Gated DeltaNet layer (layers/gated_deltanet.py) carries from one generation
    step to the next, of one layer ([B, ...]) or a stack of them ([L, B, ...])."""

    # [B, conv_kernel - 1, C]: the convolution's last inputs, oldest first; channels q | k | v,
    # each head-major (C = 2 Nk dk + Nv dv), the order of transformers' conv1d and conv state.
    conv: jax.Array
    recurrent: jax.Array  # [B, Nv, dk, dv] float32: the delta rule's state

    # Logical axes of each array stacked on a leading layer axis, as the decode cache holds
    # them: rows like the activations, the rule's state split by value head like attention's
    # heads. The window's channels interleave q, k and v heads: not split.
    field_axes = (("layers", "batch", None, None), ("layers", "batch", "heads", None, None))

    @classmethod
    def zeros(
        cls, leading: tuple[int, ...], num_k_heads: int, num_v_heads: int, head_k_dim: int,
        head_v_dim: int, conv_kernel: int, dtype: jnp.dtype,
    ) -> DeltaNetState:  # fmt: skip
        """The state before a row's first token (nothing convolved, nothing remembered), for
        `leading` axes of rows (and layers): its size is independent of any length."""
        channels = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
        return cls(
            conv=jnp.zeros((*leading, conv_kernel - 1, channels), dtype),
            recurrent=jnp.zeros((*leading, num_v_heads, head_k_dim, head_v_dim), jnp.float32),
        )


def _linear_zeros(cfg: ModelConfig, layers: int, batch: int, length: int, dtype) -> DeltaNetState:
    """Linear layers' states, [L, B, ...]: nothing of `length` in them."""
    la = cfg.linear_attention
    assert la is not None  # a linear layer implies it (config validation)
    sizes = (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim)
    return DeltaNetState.zeros((layers, batch), *sizes, la.conv_kernel, dtype)


type Cache = LayerCache | LatentCache | WindowCache | DeltaNetState
# A layer stack's caches per cache kind: its attention kind's name (attention_pattern.KINDS), or
# LINEAR.
type StackCache = dict[str, Cache]
LINEAR = "linear"


def cache_kind(mixer: Mixer, kind: str) -> str:
    """The key of a layer's cache among its stack's: its attention kind's name, or LINEAR for a
    linear-attention layer, which has no attention kind."""
    return LINEAR if mixer == "linear" else kind


def init_cache(
    cfg: ModelConfig, stacks: dict[str, dict[str, int]], batch: int, length: int, dtype
) -> dict[str, StackCache]:
    """Zeroed caches for a generation of `length` positions: per params key of a layer stack,
    per cache kind of its layers ({stack: {cache_kind: layers of that kind}}), the model's
    attention's full-length cache for global and nope layers, a ring for sliding and chunked
    ones, the state for linear ones."""

    def zeros(kind: str, layers: int) -> Cache:
        if kind == LINEAR:
            return _linear_zeros(cfg, layers, batch, length, dtype)
        if (size := span(cfg, kind)) is not None:
            return WindowCache.ring(size, cfg, layers, batch, length, dtype)
        full = LatentCache if cfg.mla is not None else LayerCache
        return full.zeros(cfg, layers, batch, length, dtype)

    return {
        stack: {kind: zeros(kind, n) for kind, n in per.items()} for stack, per in stacks.items()
    }


def cache_shardings(
    cache: dict[str, StackCache], mesh: Mesh, rules: dict[str, list[str]]
) -> dict[str, StackCache]:
    def shardings(held: Cache) -> Cache:
        """Each array's: the class's `axes` for all of them, or per array its `field_axes`."""
        per_array = getattr(held, "field_axes", None) or (held.axes,) * len(held)
        spec = lambda axes, a: logical_to_spec(axes, rules, mesh, a.shape)
        pairs = zip(per_array, held, strict=True)
        return type(held)(*(NamedSharding(mesh, spec(axes, a)) for axes, a in pairs))

    return {
        stack: {kind: shardings(held) for kind, held in per.items()} for stack, per in cache.items()
    }
