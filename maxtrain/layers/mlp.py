"""Gated feed-forward: down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh-approximated gelu
(GeGLU, Gemma), and the dense layers' block built on it."""

from __future__ import annotations

import jax
from flax import nnx

from maxtrain.layers.base import Projection
from maxtrain.layers.spec import ModelSpec

# model.mlp_activation -> the gate's activation. gelu_tanh is transformers' gelu_pytorch_tanh.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class SwiGLU(nnx.Module):
    def __init__(
        self, emb_dim: int, mlp_dim: int, *, rngs: nnx.Rngs, activation="silu", **proj_kwargs
    ):
        self.activation = activation
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
        return self.down(ACTIVATIONS[self.activation](self.gate(x)) * self.up(x))


class MLP(SwiGLU):
    """A dense layer's feed-forward block: a SwiGLU (or GeGLU) of width model.mlp_dim.

    It answers like the MoE layer, (output, statistics), so a decoder block calls whichever
    feed-forward it was built with the same way; a dense block has no statistics.
    """

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        cfg = spec.model
        assert cfg.mlp_dim is not None  # a dense layer implies it (config validation)
        super().__init__(
            cfg.emb_dim, cfg.mlp_dim, activation=cfg.mlp_activation, **spec.projection(rngs)
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return super().__call__(x), {}
