"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values from a low-rank latent.

    query    x -> [q_a -> RMSNorm -> q_b | q]          -> per head [nope | rope]
    latent   x -> kv_a -> [c (kv_lora_rank) | k_rope]  c -> RMSNorm -> kv_b -> per head [k_nope | v]
    key      per head [k_nope | rope(k_rope)]          (the rotary part is shared by all heads)

The per-head parts carry no position; only the small `qk_rope_head_dim` part is rotated, so the
latent c, which is all inference has to cache, stays position-free. Training computes full keys
and values from it and runs the same attention kernel as grouped-query attention
(model/kernels/attention.py), with as many key/value heads as query heads. The value head size may
differ from the query/key one: the kernel's contract allows it (the tokamax kernels get V
zero-padded to the query/key head size, see model/kernels/attention.py).

The softmax scale is 1/sqrt(qk head dim) times YaRN's `Rope.softmax_factor` (1 without YaRN);
the kernel applies the first, so the query is multiplied by the second.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.model.kernels.attention import attention_kernel
from maxtrain.model.layers.attention import AttentionCounts
from maxtrain.model.layers.base import Projection
from maxtrain.model.layers.norms import RMSNorm
from maxtrain.model.layers.rope import Rope
from maxtrain.parallel.mesh import constrain

# The latents' RMSNorm epsilon: DeepSeek's reference code and transformers fix it, whatever
# the model's norm_eps.
LATENT_NORM_EPS = 1e-6


class MLA(nnx.Module):
    @staticmethod
    def counts(cfg: ModelConfig) -> AttentionCounts:
        m = cfg.mla
        assert m is not None
        D, N, H, V = cfg.emb_dim, cfg.num_heads, m.qk_head_dim, m.v_head_dim
        q = D * N * H if m.q_lora_rank is None else m.q_lora_rank * (D + N * H)
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        kv_b = N * (m.qk_nope_head_dim + V)
        return AttentionCounts(
            matmul_params=q + D * latent + m.kv_lora_rank * kv_b + N * V * D,
            qk_width=N * H,
            v_width=N * V,
            # q (and its latent), kv_a's latent, kv_b's keys and values, the kernel's
            # output, o
            saved=N * H + (m.q_lora_rank or 0) + latent + kv_b + N * V + D,
        )

    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        m = cfg.mla
        assert m is not None  # attention_type mla implies it (config validation)
        D, N, H = cfg.emb_dim, cfg.num_heads, m.qk_head_dim
        kw = dict(
            init_std=cfg.init_std, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs
        )
        norm_kw = dict(eps=LATENT_NORM_EPS, param_dtype=param_dtype, rngs=rngs)
        heads = ("heads", "head_dim")
        if m.q_lora_rank is None:
            self.q = Projection("btd,dnh->btnh", (D, N, H), ("embed", *heads), **kw)
            self.q_a = self.q_norm = self.q_b = None
        else:
            r = m.q_lora_rank
            self.q = None
            self.q_a = Projection("btd,dr->btr", (D, r), ("embed", "latent"), **kw)
            self.q_norm = RMSNorm(r, **norm_kw)
            self.q_b = Projection("btr,rnh->btnh", (r, N, H), ("latent", *heads), **kw)
        # One projection for the latent and the shared rotary key, as checkpoints store it.
        self.kv_a = Projection(
            "btd,dr->btr", (D, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "latent"), **kw
        )
        self.kv_norm = RMSNorm(m.kv_lora_rank, **norm_kw)
        self.kv_b = Projection(
            "btr,rnh->btnh",
            (m.kv_lora_rank, N, m.qk_nope_head_dim + m.v_head_dim),
            ("latent", *heads),
            **kw,
        )
        self.o = Projection("btnh,nhd->btd", (N, m.v_head_dim, D), (*heads, "embed"), **kw)
        self.dims = (m.kv_lora_rank, m.qk_nope_head_dim)  # where the fused outputs split
        self.rope = Rope(m.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleaved)
        self.attend = attention_kernel(cfg.attention)  # the kernel, picked once

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, kind: int = 0
    ) -> jax.Array:
        """x [B, T, D] -> [B, T, D]. Every MLA layer is global (`kind` 0: the config refuses a
        local layer_pattern with MLA)."""
        kv_lora_rank, nope = self.dims
        if self.q is not None:
            q = self.q(x)
        else:
            q = self.q_b(self.q_norm(self.q_a(x)))
        q = constrain(q, ("batch", "length", "heads", "head_dim"))  # [B, T, N, H]
        latent, k_rope = jnp.split(self.kv_a(x), [kv_lora_rank], axis=-1)
        kv = self.kv_b(self.kv_norm(latent))  # [B, T, N, nope + V]
        kv = constrain(kv, ("batch", "length", "heads", "head_dim"))
        k_nope, v = jnp.split(kv, [nope], axis=-1)
        k_rope = self.rope(k_rope[:, :, None, :], positions)  # [B, T, 1, R]: one for all heads
        q_rope = self.rope(q[..., nope:], positions)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], -1
        )
        q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
        if self.rope.softmax_factor != 1.0:
            q = q * jnp.asarray(self.rope.softmax_factor, q.dtype)
        out = self.attend(q, k, v, segment_ids)  # [B, T, N, V]
        return self.o(out)
