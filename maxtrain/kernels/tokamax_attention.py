"""tokamax's attention kernels (GPU: Mosaic GPU, cuDNN, Triton; TPU: Mosaic TPU; its plain-XLA
ones) over packed documents.

tokamax has no segment-id argument, but because packed documents are contiguous, "same
document and causal" equals "causal and key index >= the first index of the query's document"
-- a per-query `k_start`, which tokamax's Mask takes natively and lets the flash kernels skip
whole key blocks instead of reading a [T, T] mask from memory. A sliding window moves k_start
up to i - window + 1: the kernels skip the work outside it too.

Value heads may be smaller than query/key heads (multi-head latent attention). The kernels are
given V zero-padded to the query/key head size and the padding is sliced off the output
(exact: zero value dims give zero output dims), because not every one of them accepts
differing sizes; this costs (H_qk - H_v) / H_qk of the value matmul.

Attention sinks go around the kernels' forward and backward (kernels/sinks.py). One call runs
one device's share: kernels/attention.py puts it inside `shard_map` (parallel/per_device.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from maxtrain.kernels.sinks import kernel_with_sinks
from maxtrain.kernels.xla_attention import attention_backward

if TYPE_CHECKING:
    from tokamax._src.ops.attention import base as tokamax_base

type AttentionFn = Callable[..., jax.Array]  # (q, k, v, segment_ids, sinks=None) -> output


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


# The mask each kernel takes: k_start, but a dense one for the TPU kernel.
_MASKS = {"mosaic_tpu": _dense_mask}


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
# What each kernel's calls are named in a compiled program (analysis/program.py kernels); the
# plain-XLA ones have none.
PROGRAM_CALLS = {
    "mosaic_tpu": r"^splash_mha",  # tokamax's TPU kernel is splash attention too
    "mosaic_gpu": r"^mosaic_gpu",
    "triton": r"triton",
    "cudnn": r"^__cudnn",
}


def tokamax_attention(kernel: str, window: int | None) -> AttentionFn:
    """tokamax kernel `kernel` (a key of tokamax's IMPLEMENTATIONS) with a segment mask:
    (q, k, v, segment_ids, sinks=None) -> [B, T, N, Hv].

    tokamax's public `dot_product_attention` only exposes a dense mask or sequence lengths, not
    `k_start`, so this builds the Mask and calls the kernel objects through the private modules
    (the same objects and call the public API makes: tokamax/_src/ops/attention/api.py). tokamax
    is imported when a kernel is first traced: its import takes seconds, and CPU runs never
    need it.

    Sinks: the kernel's forward with its softmax residuals (the log-sum-exp) and its own VJP op
    (the plain-XLA reference's for tokamax's XLA kernel, which has none that reads the output),
    called with the residuals the forward saved.
    """
    make_mask = _MASKS.get(kernel, _k_start_mask)

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
        forward, backward = _forward_and_backward(impl, options, _RESIDUALS_LSE.get(kernel))
        return kernel_with_sinks(forward, backward)(q, k, v, segment_ids, sinks)[..., :value_dim]

    return fn


def _forward_and_backward(impl, options, lse_of=None):
    """A tokamax kernel's forward with its log-sum-exp and residuals, and its backward from
    them (kernels/sinks.py Forward, Backward)."""
    lse_of = lse_of or _max_and_sum_lse  # [B, N, T]

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
            return attention_backward(residuals, (d_out, jnp.zeros_like(lse)))[:3]
        grads = impl.vjp(residuals, out, d_out, q, k, v, **bound)
        return grads["q"], grads["k"], grads["v"]

    return forward, backward
