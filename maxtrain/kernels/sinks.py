"""Attention sinks (GPT-OSS) around any attention kernel that gives its log-sum-exp.

A sink is a learned logit per head that joins every query's softmax denominator and carries no
value. With the scores' log-sum-exp L it only rescales the output, by
w = exp(L) / (exp(L) + exp(sink)) = sigmoid(L - sink), so a kernel that returns L supports sinks
from outside, in the forward and in the backward:

  forward   y = out * w
  backward  the sink softmax's probabilities are the kernel's own times w, so its gradient is
            the kernel's own backward (which recomputes the probabilities from the saved L)
            called with dO' = dO * w and with y in place of out: dV = P^T dO' and
            dS = P * (dO' v^T - rowsum(dO' * y)) = P w * (dO v^T - rowsum(dO * y)), exactly the
            sink softmax's. The sink's own gradient is -sum over queries of
            rowsum(dO * y) * (1 - w) (its probability is 1 - w, its value zero).

tokamax's kernels return L (as softmax residuals) from their forward but drop the residuals'
cotangent in their VJP, so differentiating y = out * w through them would silently lose the
sink's path through L; `kernel_with_sinks` is this identity as a custom VJP instead, around a
kernel's forward and backward (kernels/tokamax_attention.py). Splash attention has
sinks inside its kernels (kernels/splash.py); the reference and the context-parallel
exchanges differentiate `with_sinks` through their own log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# forward(q, k, v, segment_ids) -> (out [B, T, N, Hv], lse [B, T, N] float32, residuals);
# backward(residuals, out, d_out) -> (dq, dk, dv): a kernel's own pieces
type Forward = Callable[..., tuple[jax.Array, jax.Array, Any]]
type Backward = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def sink_weight(lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """[B, T, N] log-sum-exp, [N] sink logits -> w = sigmoid(lse - sink), float32."""
    return jax.nn.sigmoid(lse.astype(jnp.float32) - sinks.astype(jnp.float32))


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """An attention output [B, T, N, Hv] and its scores' log-sum-exp [B, T, N] -> the output
    with each head's sink logit [N] added to the softmax denominator (in out's dtype)."""
    return _scaled(out, sink_weight(lse, sinks))


def _scaled(x: jax.Array, weight: jax.Array) -> jax.Array:
    return (x.astype(jnp.float32) * weight[..., None]).astype(x.dtype)


def kernel_with_sinks(forward: Forward, backward: Backward) -> Callable[..., jax.Array]:
    """A kernel's forward and backward -> (q, k, v, segment_ids, sinks [N]) -> the attention
    output with sinks, differentiable in q, k, v and sinks (module docstring)."""

    @jax.custom_vjp
    def attend(q, k, v, segment_ids, sinks):
        return _forward(q, k, v, segment_ids, sinks)[0]

    def _forward(q, k, v, segment_ids, sinks):
        out, lse, residuals = forward(q, k, v, segment_ids)
        weight = sink_weight(lse, sinks)
        y = _scaled(out, weight)
        return y, (residuals, y, weight, sinks)

    def _backward(saved, d_y):
        residuals, y, weight, sinks = saved
        dq, dk, dv = backward(residuals, y, _scaled(d_y, weight))
        per_query = jnp.einsum(
            "btnh,btnh->btn", d_y.astype(jnp.float32), y.astype(jnp.float32)
        )  # rowsum(dO * y)
        d_sinks = -jnp.sum(per_query * (1.0 - weight), axis=(0, 1))
        return dq, dk, dv, None, d_sinks.astype(sinks.dtype)

    attend.defvjp(_forward, _backward)
    return attend
