"""The Llama-family decoder: embed -> L x (attention, SwiGLU) pre-norm blocks -> norm -> logits.

Layer parameters are stored stacked, with a leading `layers` axis, whether the layers run under
`jax.lax.scan` (compile time independent of depth) or in an unrolled Python loop. One
parameter layout for both means checkpoints, converters and the upcycling/depth-upscaling tools
see the same tree either way.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.layers.attention import Attention
from maxtrain.layers.base import Projection, make_param
from maxtrain.layers.mlp import SwiGLU
from maxtrain.layers.norms import RMSNorm
from maxtrain.mesh import constrain

# Primitives of the fused attention kernels. Their outputs (attention output plus the small
# softmax statistics the kernel's backward needs) are cheap to keep and costly to recompute.
_KERNEL_PRIMITIVES = frozenset({"pallas_call", "remat_opt"})


def _save_matmuls_and_kernels(prim, *args, **params) -> bool:
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return prim.name in _KERNEL_PRIMITIVES or dots(prim, *args, **params)


# What the backward pass may keep instead of recomputing, by config name.
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,  # no rematerialisation: keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "minimal": _save_matmuls_and_kernels,  # keep projection outputs and attention kernel outputs
}


class DecoderBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, attention_impl: str, param_dtype, compute_dtype, rngs):
        norm_kw = dict(eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.emb_dim, **norm_kw)
        self.attn = Attention(
            cfg,
            implementation=attention_impl,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )
        self.mlp_norm = RMSNorm(cfg.emb_dim, **norm_kw)
        self.mlp = SwiGLU(
            cfg.emb_dim,
            cfg.mlp_dim,
            init_std=cfg.init_std,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "act_embed"))  # [B, T, D]


class Decoder(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        attention_impl: str,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        D, V = cfg.emb_dim, cfg.vocab_size
        self.compute_dtype = compute_dtype
        self.scan_layers = cfg.scan_layers
        self.remat = cfg.remat
        self.embedding = make_param(
            rngs, (V, D), ("vocab", "embed"), std=cfg.init_std, dtype=param_dtype
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs: nnx.Rngs) -> DecoderBlock:
            return DecoderBlock(
                cfg,
                attention_impl=attention_impl,
                param_dtype=param_dtype,
                compute_dtype=compute_dtype,
                rngs=rngs,
            )

        self.layers = stacked_blocks(rngs)
        self.final_norm = RMSNorm(D, eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Projection(
                "btd,dv->btv",
                (D, V),
                ("embed", "vocab"),
                init_std=cfg.init_std,
                param_dtype=param_dtype,
                compute_dtype=compute_dtype,
                rngs=rngs,
            )
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """tokens/positions/segment_ids: [B, T] int32 -> logits [B, T, V] in compute dtype."""
        table = self.embedding[...].astype(self.compute_dtype)
        x = constrain(jnp.take(table, tokens, axis=0), ("batch", "length", "act_embed"))
        x = self._run_layers(x, positions, segment_ids)
        x = self.final_norm(x)
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x, table)
        else:
            logits = self.lm_head(x)
        return constrain(logits, ("batch", "length", "vocab"))

    def _run_layers(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        graphdef, stacked = nnx.split(self.layers)

        def apply_one(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions, segment_ids), None

        policy = REMAT_POLICIES[self.remat]
        if self.remat != "none":
            apply_one = jax.checkpoint(apply_one, policy=policy, prevent_cse=not self.scan_layers)
        if self.scan_layers:
            x, _ = jax.lax.scan(apply_one, x, stacked)
            return x
        num_layers = jax.tree.leaves(stacked)[0].shape[0]
        for i in range(num_layers):
            x, _ = apply_one(x, jax.tree.map(lambda a, i=i: a[i], stacked))
        return x
