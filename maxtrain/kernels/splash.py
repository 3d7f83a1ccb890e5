"""TPU flash attention: jax's splash attention kernel, with packed documents as segment ids.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) is the Pallas/Mosaic flash
kernel the TPU frameworks train with. It takes the causal mask as a static block structure, so
the kernel skips every key block above the diagonal instead of reading a mask, and packed
documents as segment ids (a query sees keys of its own segment only), which it checks per
block from two [T] vectors. tokamax's TPU kernel ("mosaic_tpu", kernels/tokamax_attention.py)
reaches the same kernel only through a dense [B, T, T] mask, materialised in memory and read
per block; packed pre-training rows need the segment ids, hence this module.

A sliding window is splash's own static LocalMask (keys i - window + 1 .. i), which is causal
too: the kernel's block tables then list only the key blocks inside the window, so its grid
shrinks to O(T x window) steps (tests/parallel/test_tpu_compile.py reads them from the TPU
program). Attention sinks (GPT-OSS) are splash's own too: the forward starts each query's
running max and denominator at the head's sink logit, so its log-sum-exp includes the sink,
and the backward kernels, given that log-sum-exp and the sink-scaled output, compute the
sink-softmax's gradient; the sinks' gradient is -sum(exp(sink - lse) * out * dout).

One call runs one device's share: the caller (kernels/attention.py) puts it inside `shard_map`
(parallel/per_device.py). `interpret=True` runs the same kernel in Pallas's interpreter, on any
backend: the CPU tests check it against the reference that way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

# Tile of queries and keys per kernel step (forward and both backward kernels). 512 is what
# MaxText's TPU configs use; shorter sequences take one tile of their whole length.
BLOCK = 512
_LANES = 128  # the TPU's vector lane width: tiles are multiples of it
# What the kernel's calls are named in a compiled program (analysis/program.py kernels).
PROGRAM_CALL = r"^splash_mha"


def block_size(length: int) -> int:
    """The tile for a sequence of `length` tokens: BLOCK, or the whole sequence if shorter."""
    return min(BLOCK, length)


def check_length(length: int) -> None:
    """Raises ValueError unless the kernel can tile a sequence of `length` tokens."""
    block = block_size(length)
    if length % _LANES or length % block:
        raise ValueError(
            f"splash attention needs the sequence length to be a multiple of {_LANES} "
            f"(and of {BLOCK} beyond it), got {length}; use compute.attention=xla"
        )


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    sinks: jax.Array | None = None,
    *,
    window: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q [B, T, N, H], k/v [B, T, K, H|Hv], segment_ids [B, T], sinks [N] | None ->
    [B, T, N, Hv] in q.dtype: causal within packed documents (and within the last `window`
    keys), scale 1/sqrt(H), query head n on K/V head n // (N / K)."""
    b, t, n, h = q.shape
    if not interpret:
        check_length(t)
    block = block_size(t)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # The mask's structure is static: built while tracing, its block tables become constants.
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([_mask(t, window)] * n),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, heads, H] -> [B, heads, T, H]
    scaled = (q * (1.0 / math.sqrt(h))).astype(q.dtype)  # splash takes no scale: fold it into q

    if sinks is not None:
        # In the compute dtype: the kernel returns the sinks' gradient in the output's dtype,
        # which the cast's transpose turns back into the sinks' own.
        sinks = sinks.astype(q.dtype)

    def one_row(q, k, v, segments):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=segments, kv=segments), sinks=sinks)

    out = jax.vmap(one_row)(heads_first(scaled), heads_first(k), heads_first(v), segment_ids)
    return heads_first(out).astype(q.dtype)


def _mask(length: int, window: int | None) -> splash.Mask:
    """Causal, or causal within the last `window` keys (a window as long as the sequence is
    plain causal)."""
    if window is None or window >= length:
        return splash.CausalMask((length, length))
    return splash.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
