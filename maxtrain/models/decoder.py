"""The decoder: embed -> L x (attention, SwiGLU or MoE) pre-norm blocks -> norm -> logits.

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
from maxtrain.layers.moe import MoE
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
    """Pre-norm attention then a feed-forward block: a SwiGLU (`mlp`) or experts (`moe`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        is_moe: bool,
        attention_impl: str,
        param_dtype,
        compute_dtype,
        rngs,
    ):
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
        ffn_kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        if is_moe:
            self.moe = MoE(cfg, **ffn_kw)
        else:
            self.mlp = SwiGLU(cfg.emb_dim, cfg.mlp_dim, init_std=cfg.init_std, **ffn_kw)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Returns the new residual stream [B, T, D] and the router statistics (MoE only)."""
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        if hasattr(self, "moe"):
            ffn_out, stats = self.moe(self.mlp_norm(x))
        else:
            ffn_out, stats = self.mlp(self.mlp_norm(x)), {}
        x = x + ffn_out
        return constrain(x, ("batch", "length", "act_embed")), stats


def layer_runs(moe_layers: tuple[bool, ...]) -> list[tuple[bool, int, int]]:
    """Consecutive layers of one kind: [(is_moe, start in that kind's stack, length)].

    Dense and MoE layers live in two stacks (`layers`, `moe_layers`); a model is run as the
    sequence of these runs. Llama is one dense run, Mixtral one MoE run, "first N dense" two.
    """
    runs: list[tuple[bool, int, int]] = []
    seen = {False: 0, True: 0}
    for is_moe in moe_layers:
        if runs and runs[-1][0] == is_moe:
            kind, start, length = runs[-1]
            runs[-1] = (kind, start, length + 1)
        else:
            runs.append((is_moe, seen[is_moe], 1))
        seen[is_moe] += 1
    return runs


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

        self.runs = tuple(layer_runs(cfg.moe_layers))

        def stack(count: int, is_moe: bool) -> DecoderBlock | None:
            if count == 0:
                return None

            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked_blocks(rngs: nnx.Rngs) -> DecoderBlock:
                return DecoderBlock(
                    cfg,
                    is_moe=is_moe,
                    attention_impl=attention_impl,
                    param_dtype=param_dtype,
                    compute_dtype=compute_dtype,
                    rngs=rngs,
                )

            return stacked_blocks(rngs)

        num_moe = sum(cfg.moe_layers)
        self.layers = stack(cfg.num_layers - num_moe, is_moe=False)
        self.moe_layers = stack(num_moe, is_moe=True)
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
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """tokens/positions/segment_ids: [B, T] int32 -> (logits [B, T, V] in compute dtype,
        router statistics of the MoE layers stacked in `moe_layers` order; {} if dense)."""
        table = self.embedding[...].astype(self.compute_dtype)
        # The lookup reads a table gathered whole, like every FSDP weight: rows looked up in a
        # sharded table make XLA reshard the activations instead (a full rematerialisation when
        # the batch is split over several mesh axes). The tied head keeps the sharded table.
        whole = constrain(table, (None, None))
        x = constrain(jnp.take(whole, tokens, axis=0), ("batch", "length", "act_embed"))
        moe_stats = []
        for is_moe, start, length in self.runs:
            x, stats = self._run_layers(
                self.moe_layers if is_moe else self.layers, start, length, x, positions, segment_ids
            )
            if is_moe:
                moe_stats.append(stats)
        x = self.final_norm(x)
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x, table)
        else:
            logits = self.lm_head(x)
        stats = jax.tree.map(lambda *runs: jnp.concatenate(runs), *moe_stats) if moe_stats else {}
        return constrain(logits, ("batch", "length", "vocab")), stats

    def _run_layers(
        self, blocks: DecoderBlock, start: int, length: int, x, positions, segment_ids
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Runs layers [start, start + length) of a stack; per-layer statistics come back
        stacked along a leading layer axis."""
        graphdef, stacked = nnx.split(blocks)
        if start != 0 or length != jax.tree.leaves(stacked)[0].shape[0]:
            stacked = jax.tree.map(lambda a: a[start : start + length], stacked)

        def apply_one(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions, segment_ids)

        policy = REMAT_POLICIES[self.remat]
        if self.remat != "none":
            apply_one = jax.checkpoint(apply_one, policy=policy, prevent_cse=not self.scan_layers)
        if self.scan_layers:
            return jax.lax.scan(apply_one, x, stacked)
        per_layer = []
        for i in range(length):
            x, stats = apply_one(x, jax.tree.map(lambda a, i=i: a[i], stacked))
            per_layer.append(stats)
        return x, jax.tree.map(lambda *layers: jnp.stack(layers), *per_layer)
