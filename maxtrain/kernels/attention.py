"""Causal self-attention over packed sequences, with one switch for the implementation.

Pre-training rows pack several documents back to back; `segment_ids` names each token's document,
and a query may only see earlier keys of its own document. `reference_attention` ("xla") spells
that out in plain jnp: it is the CPU path and the yardstick the fast kernels are tested against.
On GPU/TPU the tokamax kernels do the work. tokamax has no segment-id argument, but because packed
documents are contiguous, "same document and causal" equals "causal and key index >= the first
index of the query's document" -- a per-query `k_start`, which tokamax's Mask takes natively and
lets the flash kernels skip whole key blocks instead of reading a [T, T] mask from memory.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

# tokamax's public `dot_product_attention` only exposes a dense mask or sequence lengths, not
# `k_start`, so we build the Mask and call the kernel objects through the private modules (the
# same objects and call the public API makes, see tokamax/_src/ops/attention/api.py).
from tokamax._src.ops.attention import api as tokamax_api
from tokamax._src.ops.attention import base as tokamax_base

type AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def reference_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array
) -> jax.Array:
    """Plain-jnp causal, segment-masked attention; float32 scores, GQA without repeating K/V."""
    b, t, n, h = q.shape
    num_kv = k.shape[2]
    q = q.reshape(b, t, num_kv, n // num_kv, h)  # [B, T, K, G, H]; q head n -> kv head n // G
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) / math.sqrt(h)  # [B, K, G, T, S]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, S]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    mask = (causal & same_doc)[:, None, None]  # [B, 1, 1, T, S]
    # finfo.min rather than -inf: never NaN, and every row keeps at least its own key anyway.
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32))  # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, T]: index of the first token of each token's (contiguous) segment.

    A boundary is where the id changes; the running max of boundary positions is the start of the
    current run. Non-contiguous reuse of an id (1,1,2,1) counts as a new document here.
    """
    t = segment_ids.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)  # [T]
    # [B, T]; token 0 needs no flag: a row's first run starts at 0, the cummax's floor anyway.
    changed = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
    return jax.lax.cummax(jnp.where(changed, pos, 0), axis=1)


def _k_start_mask(segment_ids: jax.Array) -> tokamax_base.Mask:
    # k_start is typed "*#B #h #T" (h = K/V heads, T = query positions); broadcast over heads.
    return tokamax_base.Mask(k_start=segment_starts(segment_ids)[:, None, :], is_causal=True)


def _dense_mask(segment_ids: jax.Array) -> tokamax_base.Mask:
    # Mosaic TPU (splash) raises NotImplementedError on k_start; it does take a [B, 1, T, S] bool
    # mask (as a dynamic splash mask), at the cost of materialising it.
    same_doc = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B, 1, T, S]
    return tokamax_base.Mask(same_doc, is_causal=True)


def _tokamax(kernel: str, make_mask: Callable[[jax.Array], tokamax_base.Mask]) -> AttentionFn:
    """Wraps tokamax kernel `kernel` (a key of tokamax's IMPLEMENTATIONS) with a segment mask."""

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
        impl = tokamax_api.IMPLEMENTATIONS[kernel]  # looked up at call time: not all exist on CPU
        return impl(
            q,
            k,
            v,
            bias=None,
            mask=make_mask(segment_ids),
            logits_scale=1.0 / math.sqrt(q.shape[-1]),
            precision=None,
            logits_soft_cap=None,
            q_sharding=None,
        )

    return fn


_MOSAIC = {"gpu": _tokamax("mosaic_gpu", _k_start_mask), "tpu": _tokamax("mosaic_tpu", _dense_mask)}


def _mosaic(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """tokamax's Pallas Mosaic flash attention for the current backend (GPU or TPU)."""
    backend = jax.default_backend()
    if backend not in _MOSAIC:
        raise NotImplementedError(f"'mosaic' attention needs a gpu or tpu backend, not {backend}")
    return _MOSAIC[backend](q, k, v, segment_ids)


_IMPLEMENTATIONS: dict[str, AttentionFn] = {
    "xla": reference_attention,
    "mosaic": _mosaic,
    "mosaic_gpu": _MOSAIC["gpu"],
    "mosaic_tpu": _MOSAIC["tpu"],
    "cudnn": _tokamax("cudnn", _k_start_mask),
    "triton": _tokamax("triton", _k_start_mask),
    "xla_chunked": _tokamax("xla_chunked", _k_start_mask),
    # tokamax's plain-XLA kernel through the k_start path: runs on CPU, so tests cover the exact
    # mask construction the GPU kernels receive.
    "tokamax_xla": _tokamax("xla", _k_start_mask),
}
_AUTO = {"gpu": "mosaic", "tpu": "mosaic", "cpu": "xla"}


def resolve_implementation(name: str) -> str:
    """Maps "auto" to the best implementation for `jax.default_backend()`; validates the name."""
    if name == "auto":
        name = _AUTO.get(jax.default_backend(), "xla")
    if name not in _IMPLEMENTATIONS:
        valid = ", ".join(["auto", *_IMPLEMENTATIONS])
        raise ValueError(f"unknown attention implementation {name!r}; valid: {valid}")
    return name


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    implementation: str = "xla",
) -> jax.Array:
    """Causal attention within packed documents, scale 1/sqrt(H).

    q: [B, T, N, H]; k, v: [B, T, K, H] with N % K == 0 (q head n uses kv head n // (N // K));
    segment_ids: [B, T] int32, documents contiguous. Returns [B, T, N, H] in q.dtype.
    """
    return _IMPLEMENTATIONS[resolve_implementation(implementation)](q, k, v, segment_ids)
