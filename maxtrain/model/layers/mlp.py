"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), and the dense layers' block built on it."""

from __future__ import annotations

import jax
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.model.layers.base import Projection


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


class MLP(SwiGLU):
    """A dense layer's feed-forward block: a SwiGLU of width model.mlp_dim.

    It answers like the MoE layer, (output, statistics), so a decoder block calls whichever
    feed-forward it was built with the same way; a dense block has no statistics.
    """

    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        super().__init__(
            cfg.emb_dim,
            cfg.mlp_dim,
            init_std=cfg.init_std,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return super().__call__(x), {}
