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
from collections.abc import Callable

import jax
import jax.numpy as jnp

# Queries per block of `by_query_blocks`: the indexer's largest array is [block, index heads, S]
# float32.
QUERY_BLOCK = 256


def by_query_blocks(
    fn: Callable[..., jax.Array], per_query: tuple[jax.Array, ...], block: int = QUERY_BLOCK
) -> jax.Array:
    """fn over `block` queries at a time: the arrays `per_query` ([B, T, ...] each) cut along T
    (padded to whole blocks), fn's outputs ([B, block, ...]) joined back into [B, T, ...]. Each
    block is recomputed in the backward (jax.checkpoint), so that only one block's
    intermediates are ever held: what a row-wise function of [T, ..., S] arrays needs."""
    b, t = per_query[0].shape[:2]
    size = min(block, t)

    def blocks(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [blocks, B, size, ...]
        x = jnp.pad(x, [(0, 0), (0, -t % size)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, -1, size, *x.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(blocks(x) for x in per_query))
    return out.swapaxes(0, 1).reshape(b, -1, *out.shape[3:])[:, :t]


def index_scores(q: jax.Array, k: jax.Array, w: jax.Array, block: int = QUERY_BLOCK) -> jax.Array:
    """The lightning indexer's scores (layers/indexer.py): queries q [B, T, I, H], one key per
    position k [B, S, H], head weights w [B, T, I] -> [B, T, S] float32,
    sum_i w_i relu(q_i . k / sqrt(H)), by blocks of queries: all heads' [T, I, S] logits at
    once (4 GiB per sequence of 2048 tokens at DeepSeek-V3.2's 64 heads, forward and backward)
    are never held, only a block's."""

    def scores(q_block: jax.Array, w_block: jax.Array) -> jax.Array:
        logits = jnp.einsum("btnh,bsh->btns", q_block, k, preferred_element_type=jnp.float32)
        relu = jax.nn.relu(logits / math.sqrt(q.shape[-1]))
        return jnp.einsum("btn,btns->bts", w_block.astype(jnp.float32), relu)

    return by_query_blocks(scores, (q, w), block)


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
