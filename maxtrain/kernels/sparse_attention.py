"""Top-k sparse attention (DeepSeek sparse attention, DSA): each query attends to the k keys an
indexer chose for it (layers/indexer.py), gathered, so the work is T x k, not T x T.

`top_k_keys` picks, per query, the k best-scoring keys among those it may see (causal, same
document: xla_attention.visible_keys). A query with fewer than k visible keys (the first k - 1
tokens of a document) gets all of them, and the rest of its k slots hold keys it may not see,
marked invalid and masked out of its softmax: it attends to exactly its visible keys, as dense
attention would. transformers' eager DeepSeek-V3.2 does the same (its top-k runs over -inf
scores there, and the causal mask removes them).

`gathered_attention` is the plain-XLA kernel: the chosen keys and values are gathered per query
([B, T, k, K, H]) and attended with float32 scores; its gradient scatters back into the keys
and values. Its dense equivalent, `masked_attention` with the selection as a [T, S] mask, is
the reference the tests hold it to; the compiled program's FLOPs and bytes grow with T at
fixed k (tests/kernels/test_sparse_attention.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def top_k_keys(scores: jax.Array, visible: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """scores [B, T, S] (float32), visible [B, T, S] -> (indices [B, T, min(k, S)] int32 of each
    query's best visible keys, best first; valid [B, T, min(k, S)]: the index is a visible
    key). No gradient flows through the choice."""
    masked = jnp.where(visible, jax.lax.stop_gradient(scores), -jnp.inf)
    _, indices = jax.lax.top_k(masked, min(k, scores.shape[-1]))
    return indices.astype(jnp.int32), jnp.take_along_axis(visible, indices, axis=-1)


def gather_keys(x: jax.Array, indices: jax.Array) -> jax.Array:
    """x [B, S, ...] -> [B, T, k, ...]: row indices[b, t, j] of x[b]."""
    return jax.vmap(lambda rows, index: rows[index])(x, indices)


def gathered_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, indices: jax.Array, valid: jax.Array
) -> jax.Array:
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], indices/valid [B, T, k] (top_k_keys)
    -> [B, T, N, Hv]: softmax(q k^T / sqrt(H)) v over each query's valid chosen keys only,
    float32 scores, query head n reading key head n // (N / K)."""
    b, t, n, h = q.shape
    heads = k.shape[2]
    grouped = q.reshape(b, t, heads, n // heads, h)
    keys, values = gather_keys(k, indices), gather_keys(v, indices)  # [B, T, k, K, H(v)]
    scores = jnp.einsum("btkgh,btjkh->btkgj", grouped, keys, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(h)
    scores = jnp.where(valid[:, :, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("btkgj,btjkh->btkgh", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, -1).astype(q.dtype)
