"""Grouped-query self-attention with optional qk-norm and RoPE; the kernel lives in kernels/."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.model.kernels.attention import attention_kernel, cached_attention
from maxtrain.model.kv_cache import LayerCache
from maxtrain.model.layers.base import Projection
from maxtrain.model.layers.norms import RMSNorm
from maxtrain.model.layers.rope import Rope
from maxtrain.parallel.context import context_attention, context_degree
from maxtrain.parallel.mesh import constrain


@dataclass(frozen=True)
class AttentionCounts:
    """What one layer of an attention kind costs per token, declared by the kind itself so that
    the FLOP count (training/metrics.py) and the memory estimate (analysis/memory.py) need not know
    it."""

    matmul_params: int  # projection weights a token multiplies against
    qk_width: int  # heads x query/key head size: the score matmul's contraction per query
    v_width: int  # heads x value head size: the value matmul's output per query
    saved: int  # elements per token remat "minimal" keeps: projection and kernel outputs


class Attention(nnx.Module):
    @staticmethod
    def counts(cfg: ModelConfig) -> AttentionCounts:
        D, N, K, H = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        return AttentionCounts(
            matmul_params=2 * D * N * H + 2 * D * K * H,  # q and o; k and v
            qk_width=N * H,
            v_width=N * H,
            saved=2 * N * H + 2 * K * H + D,  # q, k, v, the kernel's output, o
        )

    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        D, N, K, H = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        kw = dict(
            init_std=cfg.init_std, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs
        )
        self.q = Projection("btd,dnh->btnh", (D, N, H), ("embed", "heads", "head_dim"), **kw)
        self.k = Projection("btd,dkh->btkh", (D, K, H), ("embed", "kv_heads", "head_dim"), **kw)
        self.v = Projection("btd,dkh->btkh", (D, K, H), ("embed", "kv_heads", "head_dim"), **kw)
        self.o = Projection("btnh,nhd->btd", (N, H, D), ("heads", "head_dim", "embed"), **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
            self.k_norm = RMSNorm(H, eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        self.rope = Rope(H, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleaved)
        self.attend = attention_kernel(cfg.attention)  # the kernel, picked once
        # ... and the exchange that runs it on a sequence split over mesh.context devices.
        self.attend_split = context_attention(cfg.context_exchange, cfg.context_layout)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        q, k, v = self._project(x, positions)
        split = context_degree() > 1
        out = (self.attend_split if split else self.attend)(q, k, v, segment_ids)  # [B, T, N, H]
        return self.o(out)

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: LayerCache
    ) -> tuple[jax.Array, LayerCache]:
        """Generation's path (maxtrain/inference/): the new tokens' keys and values are written
        into the layer's cache at their positions ([B, T], consecutive per row), and the queries
        attend over the cache. Same projections, norms and RoPE as the training path."""
        q, k, v = self._project(x, positions)
        cache = cache.write(k, v, positions)
        out = cached_attention(q, cache.k, cache.v, positions)  # [B, T, N, H]
        return self.o(out), cache

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """Queries, keys and values of x [B, T, D], qk-normed and rotated."""
        q = constrain(self.q(x), ("batch", "length", "heads", "head_dim"))  # [B, T, N, H]
        k = constrain(self.k(x), ("batch", "length", "kv_heads", "head_dim"))  # [B, T, K, H]
        v = constrain(self.v(x), ("batch", "length", "kv_heads", "head_dim"))  # [B, T, K, H]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, positions), self.rope(k, positions), v
