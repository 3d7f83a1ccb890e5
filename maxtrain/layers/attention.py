"""Grouped-query self-attention with optional qk-norm and RoPE; the kernel lives in kernels/."""

from __future__ import annotations

import jax
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.kernels.attention import attention_kernel
from maxtrain.layers.base import Projection
from maxtrain.layers.context_parallel import context_attention, context_degree
from maxtrain.layers.norms import RMSNorm
from maxtrain.layers.rope import apply_rope, inverse_frequencies
from maxtrain.mesh import constrain


class Attention(nnx.Module):
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
        self.rope = (H, cfg.rope_theta, cfg.rope_scaling)  # static: frequencies built at trace
        self.attend = attention_kernel(cfg.attention)  # the kernel, picked once
        # ... and the exchange that runs it on a sequence split over mesh.context devices.
        self.attend_split = context_attention(cfg.context_exchange, cfg.context_layout)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        q = constrain(self.q(x), ("batch", "length", "heads", "head_dim"))  # [B, T, N, H]
        k = constrain(self.k(x), ("batch", "length", "kv_heads", "head_dim"))  # [B, T, K, H]
        v = constrain(self.v(x), ("batch", "length", "kv_heads", "head_dim"))  # [B, T, K, H]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = inverse_frequencies(*self.rope)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        split = context_degree() > 1
        out = (self.attend_split if split else self.attend)(q, k, v, segment_ids)  # [B, T, N, H]
        return self.o(out)
