"""RMSNorm (and the indexer's LayerNorm), computed in float32 whatever the compute dtype
(variance of bf16 is too coarse).

Gemma's variant (`plus_one`, model.norm_scale_plus_one) scales by 1 + w with w starting at 0,
where Llama's scales by w starting at 1: the same function at initialisation, different stored
weights (a checkpoint's norms convert as they are). Both take the product in float32 and cast
after, as transformers' Gemma3RMSNorm does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """x / rms(x), times a learned scale: w, or 1 + w with `plus_one` (Gemma), or none when
    `scaled` is false (Llama 4's qk-norm)."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,  # unused (the scale starts constant); every layer takes one
        scaled: bool = True,
        plus_one: bool = False,
    ):
        self.eps = eps
        self.offset = 1.0 if plus_one else 0.0
        self.scale = (
            nnx.Param(
                jnp.full((dim,), 1.0 - self.offset, param_dtype),
                out_sharding=("norm",),
                eager_sharding=False,
            )
            if scaled
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.scale is not None:
            normed = normed * (self.offset + self.scale[...].astype(jnp.float32))
        return normed.astype(x.dtype)


class LayerNorm(nnx.Module):
    """(x - mean) / std times a learned scale plus a learned bias, in float32 (torch's
    nn.LayerNorm): the lightning indexer's key norm (layers/indexer.py), where RMSNorm is
    everyone else's."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.eps = eps
        self.scale = nnx.Param(
            jnp.ones((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False
        )
        self.bias = nnx.Param(
            jnp.zeros((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.mean(centred * centred, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(variance + self.eps)
        scaled = normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return scaled.astype(x.dtype)
