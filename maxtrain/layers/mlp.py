"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
from flax import nnx

from maxtrain.layers.base import Projection


class SwiGLU(nnx.Module):
    def __init__(self, emb_dim: int, mlp_dim: int, *, rngs: nnx.Rngs, **proj_kwargs):
        self.gate = Projection(
            "btd,df->btf", (emb_dim, mlp_dim), ("embed", "mlp"), rngs=rngs, **proj_kwargs
        )
        self.up = Projection(
            "btd,df->btf", (emb_dim, mlp_dim), ("embed", "mlp"), rngs=rngs, **proj_kwargs
        )
        self.down = Projection(
            "btf,fd->btd", (mlp_dim, emb_dim), ("mlp", "embed"), rngs=rngs, **proj_kwargs
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
