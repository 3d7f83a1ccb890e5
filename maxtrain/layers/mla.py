"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values from a low-rank latent.

    query    x -> [q_a -> RMSNorm -> q_b | q]          -> per head [nope | rope]
    latent   x -> kv_a -> [c (kv_lora_rank) | k_rope]  c -> RMSNorm -> kv_b -> per head [k_nope | v]
    key      per head [k_nope | rope(k_rope)]          (the rotary part is shared by all heads)

The per-head parts carry no position; only the small `qk_rope_head_dim` part is rotated, so the
latent c, which is all inference has to cache, stays position-free. Training computes full keys
and values from it and runs the same attention kernel as grouped-query attention
(kernels/attention.py), with as many key/value heads as query heads. The value head size may
differ from the query/key one: the kernel's contract allows it (the tokamax kernels get V
zero-padded to the query/key head size, see kernels/tokamax_attention.py).

The softmax scale is 1/sqrt(qk head dim) times YaRN's `Rope.softmax_factor` (1 without YaRN);
the kernel applies the first, so the query is multiplied by the second.

Generation (`cached`) keeps only [c | k_rope] per position (layers/kv_cache.py LatentCache) and
attends from it in the "absorbed" form of DeepSeek-V2 (sec. 2.1.2): with kv_b's per-head key
and value maps W_uk [R, nope] and W_uv [R, V],

    q_nope . (c W_uk) = (W_uk q_nope) . c          sum_s p_s (c_s W_uv) = (sum_s p_s c_s) W_uv

so each head's query is taken into the latent's space (W_uk q_nope, beside q_rope) and scored
against [c | k_rope] as a single key head shared by all query heads, the probabilities weight
the latents themselves (the value head: c), and W_uv maps the result to the head's value size.
That is multi-query attention over R + Rr dims per position, and runs on the same cached kernel
as grouped-query attention. Nothing per head is ever made for the cached positions: a step
reads the cache once, not kv_b's N x (nope + V) outputs for every position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.kernels.attention import attention_kernel
from maxtrain.kernels.xla_attention import cached_attention, head_max_logit
from maxtrain.layers.attention import AttentionCounts
from maxtrain.layers.base import Projection
from maxtrain.layers.kv_cache import LatentCache
from maxtrain.layers.norms import RMSNorm
from maxtrain.layers.rope import Rope
from maxtrain.layers.spec import ModelSpec
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

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        cfg = spec.model
        m = cfg.mla
        assert m is not None  # an MLA layer is built only where the model has model.mla
        D, N, H = cfg.emb_dim, cfg.num_heads, m.qk_head_dim
        kw = spec.projection(rngs)
        norm_kw = dict(
            eps=LATENT_NORM_EPS,
            param_dtype=spec.param_dtype,
            rngs=rngs,
            plus_one=cfg.norm_scale_plus_one,
        )
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
        self.rope = Rope(m.qk_rope_head_dim, cfg.rope.theta, cfg.rope.scaling, cfg.rope.interleaved)
        self.rotates = m.rope
        # the kernel, picked once; with compute.attention_max_logit it gives each head's max logit
        self.max_logit = spec.compute.attention_max_logit
        self.attend = attention_kernel(spec.compute.attention, max_logit=self.max_logit)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, kind: int = 0
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> [B, T, D]. Every MLA layer is global (`kind` 0: the config refuses
        other attention kinds with model.mla). With compute.attention_max_logit: (that, each
        head's largest logit [N])."""
        _, nope = self.dims
        q = self._query(x, positions)  # [B, T, N, H]
        latent, k_rope = self._latent(x, positions)
        kv = self.kv_b(latent)  # [B, T, N, nope + V]
        kv = constrain(kv, ("batch", "length", "heads", "head_dim"))
        k_nope, v = jnp.split(kv, [nope], axis=-1)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], -1
        )
        out = self.attend(q, k, v, segment_ids)  # [B, T, N, V]
        if self.max_logit:  # each head's over the batch, padding left out
            out, row_max = out
            return self.o(out), head_max_logit(row_max, segment_ids)
        return self.o(out)

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: LatentCache, kind: int = 0
    ) -> tuple[jax.Array, LatentCache]:
        """Generation's path (maxtrain/inference/), prefill and decode alike: the new tokens'
        [latent | rotary key] are written into the layer's cache at their positions ([B, T],
        consecutive per row), and the queries attend over the cache in the absorbed form (module
        docstring). Same projections, norms and RoPE as the training path."""
        rank, nope = self.dims
        q = self._query(x, positions)  # [B, T, N, nope + Rr]
        latent, k_rope = self._latent(x, positions)
        cache = cache.write(jnp.concatenate([latent, k_rope[:, :, 0]], axis=-1), positions)
        w_uk, w_uv = jnp.split(self.kv_b.kernel[...].astype(q.dtype), [nope], axis=-1)
        q_latent = jnp.einsum("btnh,rnh->btnr", q[..., :nope], w_uk)  # [B, T, N, R]
        # The kernel divides scores by sqrt of the query's size, R + Rr; the model's scale is
        # 1/sqrt(nope + Rr).
        rescale = math.sqrt(q_latent.shape[-1] + k_rope.shape[-1]) / math.sqrt(q.shape[-1])
        query = jnp.concatenate([q_latent, q[..., nope:]], axis=-1) * jnp.asarray(rescale, q.dtype)
        query = constrain(query, ("batch", "length", "heads", None))
        key = cache.key[:, :, None, :]  # [B, S, 1, R + Rr]: one key head for all query heads
        out = cached_attention(query, key, key[..., :rank], positions)  # [B, T, N, R]
        return self.o(jnp.einsum("btnr,rnv->btnv", out, w_uv)), cache

    def _query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Queries [B, T, N, nope + Rr] of x [B, T, D]: the rotary part rotated, the whole
        scaled by YaRN's softmax factor."""
        _, nope = self.dims
        if self.q is not None:
            q = self.q(x)
        else:
            q = self.q_b(self.q_norm(self.q_a(x)))
        q = constrain(q, ("batch", "length", "heads", "head_dim"))  # [B, T, N, H]
        q = jnp.concatenate([q[..., :nope], self._rotate(q[..., nope:], positions)], axis=-1)
        if self.rope.softmax_factor != 1.0:
            q = q * jnp.asarray(self.rope.softmax_factor, q.dtype)
        return q

    def _latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(normalised latent c [B, T, R], rotated rotary key [B, T, 1, Rr], one for all
        heads) of x [B, T, D]: what keys and values are made from."""
        rank, _ = self.dims
        latent, k_rope = jnp.split(self.kv_a(x), [rank], axis=-1)
        return self.kv_norm(latent), self._rotate(k_rope[:, :, None, :], positions)

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the rotary part, or nothing with model.mla.rope false (NoPE)."""
        return self.rope(x, positions) if self.rotates else x
