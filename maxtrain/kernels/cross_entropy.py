"""Softmax cross-entropy over a large vocabulary without a float32 copy of the logits.

The logits are the largest activation of a language model ([B, T, V]: 4 GiB in bf16 for 16k
tokens and a 128k vocabulary). `logits.astype(float32)` followed by logsumexp and its autodiff
writes and re-reads an 8 GiB float32 copy. Here the float32 math happens inside the fused
reductions, and the backward pass writes the logits gradient once, in the logits' dtype, from
the saved bf16 logits and log Z: three reads and one write of the bf16 array in all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_cross_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain autodiff version: (nll [B, T], log Z [B, T]), both float32."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def _forward(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    peak = jnp.max(logits, axis=-1, keepdims=True).astype(jnp.float32)  # [B, T, 1]
    sum_exp = jnp.sum(jnp.exp(logits.astype(jnp.float32) - peak), axis=-1)  # [B, T]
    log_z = peak[..., 0] + jnp.log(sum_exp)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit.astype(jnp.float32), log_z


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(nll, log Z), each [B, T] float32, for logits [B, T, V] (any float dtype)."""
    return _forward(logits, targets)


def _cross_entropy_fwd(logits, targets):
    nll, log_z = _forward(logits, targets)
    return (nll, log_z), (logits, targets, log_z)


def _cross_entropy_bwd(residuals, cotangents):
    logits, targets, log_z = residuals
    d_nll, d_log_z = cotangents  # [B, T] each
    probs = jnp.exp(logits.astype(jnp.float32) - log_z[..., None])  # softmax, recomputed
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]  # [B, T, V], fused iota
    d_logits = probs * (d_nll + d_log_z)[..., None] - jnp.where(is_target, d_nll[..., None], 0.0)
    return d_logits.astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
