"""Causal self-attention over packed sequences: the reference and tokamax's kernels, picked once.

Pre-training rows pack several documents back to back; `segment_ids` names each token's document,
and a query may only see earlier keys of its own document. `reference_attention` ("xla") spells
that out in plain jnp: it is the CPU path and the yardstick the fast kernels are tested against.
On GPU/TPU the tokamax kernels do the work. tokamax has no segment-id argument, but because packed
documents are contiguous, "same document and causal" equals "causal and key index >= the first
index of the query's document" -- a per-query `k_start`, which tokamax's Mask takes natively and
lets the flash kernels skip whole key blocks instead of reading a [T, T] mask from memory.

`attention_kernel(name, window)` returns the function for a configured name and a layer's
sliding window; the attention layer calls it at construction and keeps the function, so
nothing is looked up by name while tracing. Every kernel skips the work outside the window:
the reference's local layers run `banded_attention` (blocks of `window` queries against two
blocks of keys), splash its LocalMask's block tables, tokamax's flash kernels their k_start
ranges. Attention sinks: the reference and splash have them inside, tokamax's kernels around
their forward and backward (kernels/sinks.py).

Value heads may be smaller than query/key heads (multi-head latent attention: 128 against 192
in DeepSeek-V3). The reference takes any value head size. The tokamax kernels are given V
zero-padded to the query/key head size and the padding is sliced off the output (exact: zero
value dims give zero output dims), because not every one of them accepts differing sizes; this
costs (H_qk - H_v) / H_qk of the value matmul.

A Pallas kernel is a custom call that XLA's partitioner cannot split: on a mesh, the kernels run
inside `shard_map` (`per_device`), each device on its own rows and heads, over the mesh axes
the batch and heads are split on (mesh.rules); the reference is plain jnp and is partitioned
like any other op.

`block_attention` and `merge_blocks` are the pieces of a sequence split over devices
(parallel/context.py): a block of queries against any block of keys, masked by original
token indices, and the online-softmax merge of two such blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.kernels.sinks import kernel_with_sinks, with_sinks
from maxtrain.kernels.splash import splash_attention
from maxtrain.parallel.mesh import active_rules, logical_to_spec, spec_axes

if TYPE_CHECKING:
    from tokamax._src.ops.attention import base as tokamax_base

type AttentionFn = Callable[..., jax.Array]  # (q, k, v, segment_ids, sinks=None) -> output


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
    t = q.shape[1]
    index = jnp.arange(t)
    causal = index[None, :] <= index[:, None]  # [T, S]
    if window is not None:
        causal &= index[:, None] - index[None, :] < window
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    if not max_logit:
        return masked_attention(q, k, v, causal & same_doc, sinks)
    return masked_attention(q, k, v, causal & same_doc, sinks, with_max_logit=True)


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

    def with_previous(x):  # [B, T', ...] -> [B * blocks, 2 * window, ...]
        x = pad(x).reshape(b, blocks, window, *x.shape[2:])
        previous = jnp.pad(x[:, :-1], [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))
        return jnp.concatenate([previous, x], axis=2).reshape(b * blocks, 2 * window, *x.shape[3:])

    q_index = jnp.arange(blocks * window).reshape(blocks, window)
    k_index = jnp.concatenate([q_index - window, q_index], axis=1)  # [blocks, 2 * window]
    delta = q_index[:, :, None] - k_index[:, None, :]  # [blocks, window, 2 * window]
    visible = (delta >= 0) & (delta < window) & (k_index[:, None, :] >= 0)
    q_segments = pad(segment_ids).reshape(b * blocks, window)
    same_doc = q_segments[:, :, None] == with_previous(segment_ids)[:, None, :]
    mask = same_doc & jnp.tile(visible, (b, 1, 1))
    blocked_q = pad(q).reshape(b * blocks, window, n, h)
    out = masked_attention(
        blocked_q, with_previous(k), with_previous(v), mask, sinks, with_max_logit=max_logit
    )
    unblock = lambda x: x.reshape(b, blocks * window, n, -1)[:, :t]  # noqa: E731
    if not max_logit:
        return unblock(out)
    out, row_max = out  # the padding queries past t, sliced off, score zero: left out
    return unblock(out), unblock(row_max[..., None])[..., 0]


def head_max_logit(row_max: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each query's largest logit [B, T, N] -> each head's over the batch [N] (float32),
    padding queries (segment id 0 in the batch's own ids, not a chunked layer's) left out: the
    statistic QK-clip reads (models/qk_clip.py). A batch of padding only gives finfo.min."""
    real = (segment_ids != 0)[:, :, None]
    lowest = jnp.finfo(jnp.float32).min
    return jnp.max(jnp.where(real, row_max, lowest), axis=(0, 1))


def banded_keys(window: int | None, length: int) -> int:
    """The keys per query of the score array the plain-XLA kernel of a layer holds: all
    `length`, or a banded window's two blocks."""
    return 2 * window if window is not None and 2 * window < length else length


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
        key_positions = jnp.arange(k.shape[1], dtype=q_positions.dtype)[None, None, :]
    else:
        key_positions = k_positions[:, None, :]
    q_positions = q_positions[:, :, None]
    mask = (key_positions >= 0) & (key_positions <= q_positions)
    if window is not None:
        mask &= q_positions - key_positions < window
    if chunk is not None:
        mask &= key_positions // chunk == q_positions // chunk
    return masked_attention(q, k, v, mask, sinks)


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


def _grouped(q: jax.Array, num_kv: int) -> jax.Array:
    b, t, n, h = q.shape
    return q.reshape(b, t, num_kv, n // num_kv, h)  # [B, T, K, G, H]; q head n -> kv head n // G


def _probabilities(q, k, mask, lse=None):
    """(P [B, K, G, T, S] in q's dtype, log-sum-exp [B, K, G, T] float32, the row max of the
    masked scores [B, K, G, T]) of grouped q."""
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    # finfo.min rather than -inf: never NaN, and every row keeps at least its own key anyway.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    row_max = jnp.max(scores, axis=-1)
    if lse is None:
        lse = jax.nn.logsumexp(scores, axis=-1)
    return jnp.exp(scores - lse[..., None]).astype(q.dtype), lse, row_max


@jax.custom_vjp
def _attention_forward(q, k, v, mask):
    b, t, n, _ = q.shape
    probs, lse, row_max = _probabilities(_grouped(q, k.shape[2]), k, mask)
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype), lse, row_max


def _attention_fwd_rule(q, k, v, mask):
    out, lse, row_max = _attention_forward(q, k, v, mask)
    return (out, lse, row_max), (q, k, v, mask, out, lse)


def _attention_bwd_rule(residuals, cotangents):
    q, k, v, mask, out, lse = residuals
    # d_lse: zero unless sinks use the log-sum-exp; the row max is a statistic, no gradient
    d_out, d_lse = cotangents[:2]
    b, t, n, h = q.shape
    num_kv = k.shape[2]
    gq = _grouped(q, num_kv)
    g_out = _grouped(d_out, num_kv)  # [B, T, K, G, Hv]
    probs, _, _ = _probabilities(gq, k, mask, lse)  # recomputed: P [B, K, G, T, S]
    # rowsum(dO * O) per query: the softmax's own term in dS
    delta = jnp.einsum(
        "btkgh,btkgh->bkgt", g_out.astype(jnp.float32), _grouped(out, num_kv).astype(jnp.float32)
    )
    d_probs = jnp.einsum("btkgh,bskh->bkgts", g_out, v, preferred_element_type=jnp.float32)
    d_scores = probs.astype(jnp.float32) * (d_probs - delta[..., None] + d_lse[..., None])
    d_scores = d_scores.astype(q.dtype)
    d_scores = d_scores / math.sqrt(h)
    dq = jnp.einsum("bkgts,bskh->btkgh", d_scores, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgts,btkgh->bskh", d_scores, gq, preferred_element_type=jnp.float32)
    dv = jnp.einsum(
        "bkgts,btkgh->bskh", probs.astype(v.dtype), g_out, preferred_element_type=jnp.float32
    )
    return (dq.reshape(b, t, n, h).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None)


_attention_forward.defvjp(_attention_fwd_rule, _attention_bwd_rule)


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


def first_visible_key(segment_ids: jax.Array, window: int | None) -> jax.Array:
    """[B, T] -> [B, T]: the first key index each query sees: its document's start, or with a
    sliding window the later of that and i - window + 1."""
    starts = segment_starts(segment_ids)
    if window is None:
        return starts
    index = jnp.arange(segment_ids.shape[1], dtype=starts.dtype)
    return jnp.maximum(starts, index - window + 1)


def _k_start_mask(segment_ids: jax.Array, window: int | None) -> tokamax_base.Mask:
    from tokamax._src.ops.attention import base as tokamax_base

    # k_start is typed "*#B #h #T" (h = K/V heads, T = query positions); broadcast over heads.
    k_start = first_visible_key(segment_ids, window)[:, None, :]
    return tokamax_base.Mask(k_start=k_start, is_causal=True)


def _dense_mask(segment_ids: jax.Array, window: int | None) -> tokamax_base.Mask:
    # Mosaic TPU (splash) raises NotImplementedError on k_start; it does take a [B, 1, T, S] bool
    # mask (as a dynamic splash mask), at the cost of materialising it.
    from tokamax._src.ops.attention import base as tokamax_base

    index = jnp.arange(segment_ids.shape[1])
    visible = first_visible_key(segment_ids, window)[:, None, :, None] <= index  # [B, 1, T, S]
    return tokamax_base.Mask(visible, is_causal=True)


type MaskFn = Callable[[jax.Array, int | None], tokamax_base.Mask]


def _tokamax(kernel: str, make_mask: MaskFn, window: int | None) -> AttentionFn:
    """Wraps tokamax kernel `kernel` (a key of tokamax's IMPLEMENTATIONS) with a segment mask.

    tokamax's public `dot_product_attention` only exposes a dense mask or sequence lengths, not
    `k_start`, so this builds the Mask and calls the kernel objects through the private modules
    (the same objects and call the public API makes: tokamax/_src/ops/attention/api.py). tokamax
    is imported when a kernel is first traced: its import takes seconds, and CPU runs never
    need it.

    Sinks go through kernels/sinks.py: the kernel's forward with its softmax residuals
    (the log-sum-exp) and its own VJP op (tokamax's plain-XLA one for the XLA kernel, which has
    none of its own), called with the residuals the forward saved.
    """

    def fn(q, k, v, segment_ids, sinks=None):
        from tokamax._src.ops.attention import api as tokamax_api

        impl = tokamax_api.IMPLEMENTATIONS[kernel]  # looked up at call time: not all exist on CPU
        value_dim = v.shape[-1]
        if value_dim > q.shape[-1]:
            raise ValueError(f"value head size {value_dim} exceeds the query/key's {q.shape[-1]}")
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, q.shape[-1] - value_dim)])

        def options(segment_ids):
            return dict(
                bias=None,
                mask=make_mask(segment_ids, window),
                logits_scale=1.0 / math.sqrt(q.shape[-1]),
                precision=None,
                logits_soft_cap=None,
            )

        if sinks is None:
            out = impl(q, k, v, q_sharding=None, **options(segment_ids))
            return out[..., :value_dim]
        if kernel in _NO_RESIDUALS:
            raise NotImplementedError(
                f"attention sinks need the kernel's log-sum-exp, which tokamax's {kernel!r} does "
                f"not return; use compute.attention={_NO_RESIDUALS[kernel]}"
            )

        lse_of = _RESIDUALS_LSE.get(kernel, _max_and_sum_lse)  # [B, N, T]

        def forward(q, k, v, segment_ids):
            out, residuals = impl(q, k, v, return_residuals=True, **options(segment_ids))
            return out, jnp.swapaxes(lse_of(residuals), 1, 2), (q, k, v, segment_ids, residuals)

        def backward(saved, out, d_out):
            q, k, v, segment_ids, residuals = saved
            bound = dict(impl.bind(q, k, v, **options(segment_ids)).kwargs)
            del bound["return_residuals"]
            if impl.vjp is None:
                # tokamax's XLA kernel: its VJP is autodiff of the forward, which recomputes the
                # output rather than reading `out`; the reference's backward reads it, over the
                # same mask.
                b, t, n, h = q.shape
                mask = bound["mask"].as_array(t, k.shape[1])[:, 0]  # [B, T, S]
                lse = lse_of(residuals).reshape(b, k.shape[2], n // k.shape[2], t)
                residuals = (q, k, v, mask, out, lse)
                return _attention_bwd_rule(residuals, (d_out, jnp.zeros_like(lse)))[:3]
            grads = impl.vjp(residuals, out, d_out, q, k, v, **bound)
            return grads["q"], grads["k"], grads["v"]

        out = kernel_with_sinks(forward, backward)(q, k, v, segment_ids, sinks)
        return out[..., :value_dim]

    return fn


def _max_and_sum_lse(residuals: tuple[jax.Array, jax.Array]) -> jax.Array:
    maximum, denominator = residuals  # of the scores, per query: (max, sum of exp(s - max))
    return maximum + jnp.log(denominator)


# How a tokamax kernel's softmax residuals hold the log-sum-exp: (max, denominator) in all but
# the TPU kernel, which keeps splash's (max, log-sum-exp) (tokamax's pallas_mosaic_*.py).
_RESIDUALS_LSE: dict[str, Callable[[tuple[jax.Array, jax.Array]], jax.Array]] = {
    "mosaic_tpu": lambda residuals: residuals[1]
}
# Kernels whose forward returns no residuals (return_residuals=True raises in tokamax: jax.nn's
# cuDNN call and the chunked XLA loop keep their statistics to themselves) -> one that has sinks.
_NO_RESIDUALS = {"cudnn": "mosaic_gpu", "xla_chunked": "tokamax_xla"}


def per_device(kernel: AttentionFn) -> AttentionFn:
    """The kernel run per device inside `shard_map` when traced for a mesh (mesh.sharding_rules
    active), else called as it is.

    Every mesh axis is manual: the batch is split as `batch` says, query heads as `heads`, key
    and value heads as `kv_heads`; the sequence is whole on each device (a sequence split over
    `context` goes through parallel/context.py instead), and so is head_dim. An axis that
    splits none of them (e.g. `tensor` over a model whose heads it does not divide) leaves each
    of its devices computing the same attention.

    Where the query heads are split and the key/value heads are not split alike (fewer K/V
    heads than the tensor degree: 8 of them over 16 devices), each device takes the K/V heads
    its own query heads use: query head n reads K/V head n // G. If its query heads are whole
    groups (a multiple of G), those are their groups' K/V heads; otherwise one K/V head per
    query head (the kernel then runs as multi-head attention, exact either way).

    The gradient flows through shard_map's transpose: a K/V head several devices read gets the
    sum of their contributions (shard_map sums the cotangent of an input over the axes its spec
    does not split).
    """

    def fn(q, k, v, segment_ids, sinks=None):
        active = active_rules()
        if active is None:
            return kernel(q, k, v, segment_ids, sinks)
        mesh, rules = active
        q_spec = logical_to_spec(("batch", None, "heads", None), rules, mesh, q.shape)
        kv_spec = logical_to_spec(("batch", None, "kv_heads", None), rules, mesh, k.shape)
        head_axes = spec_axes(q_spec[2])
        split_alike = spec_axes(kv_spec[2]) == head_axes
        if not split_alike:  # K/V heads whole on every device; each takes its own below
            kv_spec = P(kv_spec[0], None, None, None)
        rows = P(q_spec[0], None)
        groups = q.shape[2] // k.shape[2]  # G: query heads per K/V head

        def local(q, k, v, segment_ids, sinks):
            if not split_alike:
                n_local = q.shape[2]
                first = jax.lax.axis_index(head_axes) * n_local  # global index of my first head
                if n_local % groups == 0:
                    heads = first // groups + jnp.arange(n_local // groups)
                else:
                    heads = (first + jnp.arange(n_local)) // groups
                k, v = jnp.take(k, heads, axis=2), jnp.take(v, heads, axis=2)
            return kernel(q, k, v, segment_ids, sinks)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, rows, None if sinks is None else P(q_spec[2])),
            out_specs=P(*q_spec[:3], None),
            # Pallas calls carry no varying-axes types; the transpose's sums above are what
            # check_vma=False does (jax's shard_map transpose).
            check_vma=False,
        )(q, k, v, segment_ids, sinks)

    return fn


def _unavailable(name: str, backend: str) -> AttentionFn:
    """Stands in for a kernel this backend cannot run. Raising when called rather than when the
    model is built lets a CPU host still build (and dry-run) a GPU/TPU recipe's model."""

    def fn(q, k, v, segment_ids, sinks=None):
        raise NotImplementedError(f"{name!r} attention needs a gpu or tpu backend, not {backend}")

    return fn


def _splash(window: int | None) -> AttentionFn:
    return partial(splash_attention, window=window)


def _on_devices(kernel: str, make_mask: MaskFn) -> Callable[[int | None], AttentionFn]:
    """tokamax kernel `kernel` for a window, run per device."""
    return lambda window: per_device(_tokamax(kernel, make_mask, window))


def _reference(window: int | None) -> AttentionFn:
    return reference_attention if window is None else partial(banded_attention, window=window)


# name -> (window -> the attention function): each kernel built for a layer's mask.
IMPLEMENTATIONS: dict[str, Callable[[int | None], AttentionFn]] = {
    "xla": _reference,
    "splash": lambda window: per_device(_splash(window)),
    "mosaic_gpu": _on_devices("mosaic_gpu", _k_start_mask),
    "mosaic_tpu": _on_devices("mosaic_tpu", _dense_mask),
    "cudnn": _on_devices("cudnn", _k_start_mask),
    "triton": _on_devices("triton", _k_start_mask),
    "xla_chunked": _on_devices("xla_chunked", _k_start_mask),
    # tokamax's plain-XLA kernel through the k_start path and the per-device wrapper: runs on
    # CPU, so tests cover the exact mask and sharding the GPU/TPU kernels receive.
    "tokamax_xla": _on_devices("xla", _k_start_mask),
}
# on every other platform: the reference
_AUTO = {"gpu": "mosaic_gpu", "tpu": "splash"}


def attention_implementation(name: str, platform: str | None = None) -> str:
    """The kernel a configured name means on `platform`, that of the devices the program is
    built for (None: this process's default backend): "auto" is splash attention on TPU
    (kernels/splash.py), tokamax's Mosaic flash kernel on GPU and the reference ("xla")
    elsewhere; "mosaic" is tokamax's "mosaic_<platform>". Raises ValueError for a name that is
    no kernel."""
    platform = platform or jax.default_backend()
    if name == "auto":
        return _AUTO.get(platform, "xla")
    if name == "mosaic":
        return f"mosaic_{platform}"
    if name not in IMPLEMENTATIONS:
        valid = ", ".join(["auto", "mosaic", *IMPLEMENTATIONS])
        raise ValueError(f"unknown attention implementation {name!r}; valid: {valid}")
    return name


def attention_kernel(name: str, window: int | None = None, max_logit: bool = False) -> AttentionFn:
    """The attention function a configured name picks, chosen once (layers store it):
    (q, k [B, T, N|K, H], v [B, T, K, Hv], segment_ids [B, T], sinks [N] | None) -> [B, T, N, Hv]
    in q.dtype, causal within packed documents (and within the last `window` keys), scale
    1/sqrt(H); N % K == 0, query head n uses kv head n // G; Hv <= H.

    With `max_logit`, the function returns (output, each query's largest logit [B, T, N]):
    only the plain-XLA kernel gives it (the fused kernels keep their scores to themselves), so
    any other name raises ValueError (the config refuses it first: compute.attention_max_logit)."""
    resolved = attention_implementation(name)
    if max_logit:
        if resolved != "xla":
            raise ValueError(f"the attention's max logit needs the xla kernel, not {resolved!r}")
        return partial(_reference(window), max_logit=True)
    if resolved in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[resolved](window)
    return _unavailable(name, jax.default_backend())


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
    normalised output [B, Tq, N, H] and the log-sum-exp of the scores [B, Tq, N] (both float32):
    blocks of the same queries merge exactly with `merge_blocks`. The plain-XLA path of the
    context-parallel exchanges (parallel/context.py); its math is `reference_attention`'s.
    """
    b, t, n, h = q.shape
    num_kv = k.shape[2]
    q = q.reshape(b, t, num_kv, n // num_kv, h)  # [B, Tq, K, G, H]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) / math.sqrt(h)  # [B, K, G, Tq, S]
    causal = k_index[None, :] <= q_index[:, None]  # [Tq, S]
    if window is not None:
        causal &= q_index[:, None] - k_index[None, :] < window
    same_doc = q_segment_ids[:, :, None] == k_segment_ids[:, None, :]  # [B, Tq, S]
    mask = (causal & same_doc)[:, None, None]
    # A query may see no key of this block: finfo.min keeps it finite, and its log-sum-exp
    # (about finfo.min) gives the block zero weight when merged with the block holding its key.
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, K, G, Tq]
    probs = jnp.exp(scores - lse[..., None])
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32)).reshape(b, t, n, h)
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, n)


def merge_blocks(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Two `block_attention` results of the same queries over disjoint keys -> the result over
    both (online softmax): each output weighted by its share of the total exp-score mass."""
    lse = jnp.logaddexp(lse_a, lse_b)
    weight_a, weight_b = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    return out_a * weight_a + out_b * weight_b, lse
