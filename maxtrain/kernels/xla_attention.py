"""Causal self-attention over packed sequences in plain XLA ("xla"): the CPU path and the
yardstick every fast kernel is tested against, in the forms its callers need.

Pre-training rows pack several documents back to back; `segment_ids` names each token's
document, and a query may only see earlier keys of its own document. Every form masks with
`visible_keys`, from each token's index in the original sequence (and its document): the whole
sequence (`reference_attention`), a sliding window in blocks (`banded_attention`), new queries
against a decode cache (`cached_attention`) and one block of a sequence split over devices
against any other block (`block_attention`, merged by `merge_blocks`: parallel/context.py).

Value heads may be smaller than query/key heads (multi-head latent attention: 128 against 192
in DeepSeek-V3): every form takes any value head size.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxtrain.kernels.sinks import with_sinks


def visible_keys(
    q_index: jax.Array,
    k_index: jax.Array,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    *,
    window: int | None = None,
    chunk: int | None = None,
) -> jax.Array:
    """Which keys each query may see: query and key indices in the original sequence
    ([..., Tq], [..., S], broadcast against each other) -> [..., Tq, S], True where the key
    holds a token (a negative index holds none: padding, an empty cache entry), is not after
    the query, and is within its last `window` keys, its `chunk` and its document (segment ids
    [..., Tq], [..., S])."""
    q, k = q_index[..., :, None], k_index[..., None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    if chunk is not None:
        mask &= k // chunk == q // chunk
    if q_segments is not None:
        mask &= q_segments[..., :, None] == k_segments[..., None, :]
    return mask


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    sinks: jax.Array | None = None,
    *,
    window: int | None = None,
    max_logit: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Plain-jnp causal, segment-masked attention; float32 scores, GQA without repeating K/V.
    With `window`, a query at index i sees keys i - window + 1 .. i only (sliding window).
    With `max_logit`, (output, each query's largest visible logit per head [B, T, N])."""
    index = jnp.arange(q.shape[1])
    mask = visible_keys(index, index, segment_ids, segment_ids, window=window)  # [B, T, S]
    return masked_attention(q, k, v, mask, sinks, with_max_logit=max_logit)


def banded_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    sinks: jax.Array | None = None,
    *,
    window: int,
    max_logit: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`reference_attention` with a sliding window, in O(T x window) work and memory: the
    sequence cut into blocks of `window` queries, each against the keys of its own block and
    of the one before (all a window reaches), masked by original index and document. Scores
    are [T, 2 x window] per head instead of [T, T]: the plain-XLA path of local layers. A
    window of half the sequence or more gains nothing and takes the reference's whole mask."""
    b, t, n, h = q.shape
    if banded_keys(window, t) == t:
        return reference_attention(q, k, v, segment_ids, sinks, window=window, max_logit=max_logit)
    blocks = -(-t // window)
    # Padding keys sit past every real query: the causal mask hides them, as it hides the
    # zero block before the first (negative indices).
    pad = lambda x: jnp.pad(x, [(0, 0), (0, blocks * window - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731

    def with_previous(x):  # [B, T', ...] -> [B, blocks, 2 * window, ...]
        x = pad(x).reshape(b, blocks, window, *x.shape[2:])
        previous = jnp.pad(x[:, :-1], [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))
        return jnp.concatenate([previous, x], axis=2)

    q_index = jnp.arange(blocks * window).reshape(blocks, window)
    k_index = jnp.concatenate([q_index - window, q_index], axis=1)  # [blocks, 2 * window]
    q_segments = pad(segment_ids).reshape(b, blocks, window)
    mask = visible_keys(q_index, k_index, q_segments, with_previous(segment_ids), window=window)
    as_rows = lambda x: x.reshape(b * blocks, *x.shape[2:])  # noqa: E731  blocks as rows
    out = masked_attention(
        as_rows(pad(q).reshape(b, blocks, window, n, h)),
        as_rows(with_previous(k)),
        as_rows(with_previous(v)),
        as_rows(mask),
        sinks,
        with_max_logit=max_logit,
    )
    unblock = lambda x: x.reshape(b, blocks * window, n, -1)[:, :t]  # noqa: E731
    if not max_logit:
        return unblock(out)
    out, row_max = out  # the padding queries past t, sliced off, score zero: left out
    return unblock(out), unblock(row_max[..., None])[..., 0]


def banded_keys(window: int | None, length: int) -> int:
    """The keys per query of the score array the plain-XLA kernel of a layer holds: all
    `length`, or a banded window's two blocks."""
    return 2 * window if window is not None and 2 * window < length else length


def head_max_logit(row_max: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each query's largest logit [B, T, N] -> each head's over the batch [N] (float32),
    padding queries (segment id 0 in the batch's own ids, not a chunked layer's) left out: the
    statistic QK-clip reads (models/qk_clip.py). A batch of padding only gives finfo.min."""
    real = (segment_ids != 0)[:, :, None]
    lowest = jnp.finfo(jnp.float32).min
    return jnp.max(jnp.where(real, row_max, lowest), axis=(0, 1))


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    sinks: jax.Array | None = None,
    *,
    window: int | None = None,
    chunk: int | None = None,
    k_positions: jax.Array | None = None,
) -> jax.Array:
    """Attention of new queries [B, T, N, H] over a key/value cache [B, S, K, H] whose entry s
    holds position s: a query at position p sees the entries 0..p (generation's cache path,
    maxtrain/inference/), of them only the last `window` or those of its `chunk`. Entries beyond
    p may hold anything; they are masked out exactly. k_positions [B, S]: each entry's position
    instead (a local layer's ring, layers/kv_cache.py), negative where it holds none."""
    if k_positions is None:
        k_positions = jnp.arange(k.shape[1], dtype=q_positions.dtype)
    mask = visible_keys(q_positions, k_positions, window=window, chunk=chunk)  # [B, T, S]
    return masked_attention(q, k, v, mask, sinks)


def block_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array,
    k_segment_ids: jax.Array,
    q_index: jax.Array,
    k_index: jax.Array,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One block of a split attention: queries [B, Tq, N, H] against keys/values [B, S, K, H]
    that may be any part of the sequence, in any order.

    The mask comes from each token's index in the original sequence (q_index [Tq], k_index [S])
    and its document (segment ids [B, Tq], [B, S]), not from where it sits in the block, so a
    load-balanced or rotated split masks exactly as the whole sequence does; so does a sliding
    `window` (keys i - window + 1 .. i by original index). Returns the
    normalised output [B, Tq, N, Hv] and the log-sum-exp of the scores [B, Tq, N] (both
    float32): blocks of the same queries merge exactly with `merge_blocks`. The plain-XLA path
    of the context-parallel exchanges (parallel/context.py); its math is `reference_attention`'s.
    """
    b, t, n, _ = q.shape
    mask = visible_keys(q_index, k_index, q_segment_ids, k_segment_ids, window=window)
    # A query may see no key of this block: finfo.min keeps it finite, and its log-sum-exp
    # (about finfo.min) gives the block zero weight when merged with the block holding its key.
    scores = _masked_scores(_grouped(q, k.shape[2]), k, mask)  # [B, K, G, Tq, S]
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, K, G, Tq]
    probs = jnp.exp(scores - lse[..., None])
    out = jnp.einsum("bkgts,bksh->bkgth", probs, _kv_heads_major(v).astype(jnp.float32))
    return _ungrouped(out), lse.transpose(0, 3, 1, 2).reshape(b, t, n)


def merge_blocks(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Two `block_attention` results of the same queries over disjoint keys -> the result over
    both (online softmax): each output weighted by its share of the total exp-score mass."""
    lse = jnp.logaddexp(lse_a, lse_b)
    weight_a, weight_b = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    sinks: jax.Array | None = None,
    *,
    with_max_logit: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S] (True: may attend) -> [B, T, N, Hv]:
    softmax(q k^T / sqrt(H), masked) v, with float32 scores and softmax statistics.

    `sinks` [N] (GPT-OSS's attention sinks): a learned logit per head that joins every query's
    softmax denominator and carries no value. With the scores' log-sum-exp L, the sink only
    rescales the output, by exp(L) / (exp(L) + exp(sink)) = sigmoid(L - sink): applied to the
    output here, it needs nothing from the kernel but L.

    What it writes to memory is what a flash kernel keeps in registers: each [T, S] array of a
    layer is stored once, in the compute dtype. The forward keeps only the output and the
    softmax's log-sum-exp (per query) for the backward, which recomputes the probabilities from
    q and k (the standard attention gradient: dS = P * (dP - rowsum(dO * O) + dL), dP = dO v^T,
    dL the cotangent of the log-sum-exp, which only the sinks give).
    Autodiff of the plain formula stores the float32 scores and probabilities and their
    gradients instead: the compiled v5e:4x4 step of a 1.5B model at 2048 tokens accessed
    26.79 GB per chip that way, 24.80 GB this way (docs/tpu.md).

    With `with_max_logit`, also each query's largest visible logit [B, T, N] (float32, no
    gradient): the reduction runs over the scores the forward computes anyway, the max the
    log-sum-exp takes (QK-clip's statistic, models/qk_clip.py).
    """
    out, lse, row_max = _attention_forward(q, k, v, mask)
    b, t, n, _ = q.shape
    per_query = lambda x: x.transpose(0, 3, 1, 2).reshape(b, t, n)  # noqa: E731  [B, K, G, T] ->
    if sinks is not None:
        out = with_sinks(out, per_query(lse), sinks)
    return (out, per_query(row_max)) if with_max_logit else out


# Inside the kernel every array is heads-major: queries and outputs [B, K, G, T, H], keys and
# values [B, K, S, H], scores [B, K, G, T, S]. Each product is then a matmul batched over
# (B, K) with its operands in the order XLA's dot takes them, so the compiler transposes q, k,
# v and the output once per pass instead of transposing the [T, S] probabilities and their
# gradient for the products that read them (the compiled dense CPU step of docs/benchmarks.md:
# 71 copies with token-major einsums, 61 this way).


def _grouped(q: jax.Array, num_kv: int) -> jax.Array:
    """[B, T, N, H] -> [B, K, G, T, H]: query head n reads kv head n // G."""
    b, t, n, h = q.shape
    return q.reshape(b, t, num_kv, n // num_kv, h).transpose(0, 2, 3, 1, 4)


def _ungrouped(x: jax.Array) -> jax.Array:
    """[B, K, G, T, H] -> [B, T, N, H], `_grouped`'s inverse."""
    b, k, g, t, h = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, h)


def _kv_heads_major(x: jax.Array) -> jax.Array:
    """Keys or values [B, S, K, H] -> [B, K, S, H], and back: the transpose is its own inverse."""
    return x.transpose(0, 2, 1, 3)


def _masked_scores(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped q [B, K, G, T, H], k [B, S, K, H], mask [B, T, S] -> the scaled scores
    [B, K, G, T, S] in float32, finfo.min where masked: never NaN (unlike -inf), and a row
    with no visible key stays finite."""
    scores = jnp.einsum(
        "bkgth,bksh->bkgts", q, _kv_heads_major(k), preferred_element_type=jnp.float32
    )
    scores = scores / math.sqrt(q.shape[-1])
    return jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)


def _probabilities(q, k, mask, lse=None):
    """(P [B, K, G, T, S] in q's dtype, log-sum-exp [B, K, G, T] float32, the row max of the
    masked scores [B, K, G, T]) of grouped q."""
    scores = _masked_scores(q, k, mask)
    row_max = jnp.max(scores, axis=-1)
    if lse is None:
        lse = jax.nn.logsumexp(scores, axis=-1)
    return jnp.exp(scores - lse[..., None]).astype(q.dtype), lse, row_max


@jax.custom_vjp
def _attention_forward(q, k, v, mask):
    probs, lse, row_max = _probabilities(_grouped(q, k.shape[2]), k, mask)
    out = jnp.einsum(
        "bkgts,bksh->bkgth",
        probs.astype(v.dtype),
        _kv_heads_major(v),
        preferred_element_type=jnp.float32,
    )
    return _ungrouped(out).astype(q.dtype), lse, row_max


def _attention_fwd_rule(q, k, v, mask):
    out, lse, row_max = _attention_forward(q, k, v, mask)
    return (out, lse, row_max), (q, k, v, mask, out, lse)


def attention_backward(residuals, cotangents):
    """The VJP of the masked attention: residuals (q, k, v, mask, out, the log-sum-exp
    [B, K, G, T]), cotangents (of out, of the log-sum-exp, ...) -> (dq, dk, dv, None). Also
    the backward of tokamax's plain-XLA kernel, which has none of its own that reads `out`
    (kernels/tokamax_attention.py)."""
    q, k, v, mask, out, lse = residuals
    # d_lse: zero unless sinks use the log-sum-exp; the row max is a statistic, no gradient
    d_out, d_lse = cotangents[:2]
    num_kv = k.shape[2]
    gq = _grouped(q, num_kv)
    g_out = _grouped(d_out, num_kv)  # [B, K, G, T, Hv]
    probs, _, _ = _probabilities(gq, k, mask, lse)  # recomputed: P [B, K, G, T, S]
    # rowsum(dO * O) per query: the softmax's own term in dS
    delta = jnp.einsum(
        "bkgth,bkgth->bkgt", g_out.astype(jnp.float32), _grouped(out, num_kv).astype(jnp.float32)
    )
    kh, vh = _kv_heads_major(k), _kv_heads_major(v)
    d_probs = jnp.einsum("bkgth,bksh->bkgts", g_out, vh, preferred_element_type=jnp.float32)
    d_scores = probs.astype(jnp.float32) * (d_probs - delta[..., None] + d_lse[..., None])
    d_scores = d_scores.astype(q.dtype)
    d_scores = d_scores / math.sqrt(q.shape[-1])
    dq = jnp.einsum("bkgts,bksh->bkgth", d_scores, kh, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgts,bkgth->bksh", d_scores, gq, preferred_element_type=jnp.float32)
    dv = jnp.einsum(
        "bkgts,bkgth->bksh", probs.astype(v.dtype), g_out, preferred_element_type=jnp.float32
    )
    dk, dv = _kv_heads_major(dk).astype(k.dtype), _kv_heads_major(dv).astype(v.dtype)
    return _ungrouped(dq).astype(q.dtype), dk, dv, None


_attention_forward.defvjp(_attention_fwd_rule, attention_backward)
