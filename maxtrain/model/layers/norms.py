"""RMSNorm, computed in float32 whatever the compute dtype (variance of bf16 is too coarse)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.model.layers.base import make_param


class RMSNorm(nnx.Module):
    """x / rms(x), times a learned scale unless `scaled` is false (Llama 4's qk-norm has none)."""

    def __init__(
        self, dim: int, *, eps: float, param_dtype: jnp.dtype, rngs: nnx.Rngs, scaled: bool = True
    ):
        self.eps = eps
        self.scale = (
            make_param(rngs, (dim,), ("norm",), std=None, dtype=param_dtype) if scaled else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.scale is not None:
            normed = normed * self.scale[...].astype(jnp.float32)
        return normed.astype(x.dtype)
