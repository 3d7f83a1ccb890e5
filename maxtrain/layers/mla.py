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

DeepSeek sparse attention (model.mla.indexer: DeepSeek-V3.2, GLM-5): a lightning indexer
(layers/indexer.py) scores every visible key per query and each query attends to its top_k
only. Training and generation alike then run the absorbed form over the gathered
[c | k_rope] of the chosen positions (kernels/sparse_attention.py): T x top_k x (R + Rr) per
head, where expanding per-head keys first would make N x (nope + V) per chosen key.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.kernels.attention import attention_kernel
from maxtrain.kernels.sparse_attention import gather_keys, gathered_attention, top_k_keys
from maxtrain.kernels.xla_attention import cached_attention, head_max_logit, visible_keys
from maxtrain.layers.attention import AttentionCounts
from maxtrain.layers.base import Projection
from maxtrain.layers.indexer import (
    INDEXER_KL,
    INDEXER_TOKENS,
    LightningIndexer,
    attention_target,
    dense_kl,
    indexer_kl,
)
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
        if m.indexer is not None:  # its query, key and head weights
            i = m.indexer
            q += (m.q_lora_rank or 0) * i.heads * i.head_dim + D * (i.head_dim + i.heads)
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
        self.indexer = LightningIndexer(spec, rngs=rngs) if m.indexer is not None else None
        self.warmup = m.indexer is not None and m.indexer.stage == "warmup"
        self.rotates = m.rope
        # the kernel, picked once; with compute.attention_max_logit it gives each head's max logit
        self.max_logit = spec.compute.attention_max_logit
        self.attend = attention_kernel(spec.compute.attention, max_logit=self.max_logit)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, kind: int = 0
    ) -> jax.Array | tuple[jax.Array, jax.Array | dict[str, jax.Array]]:
        """x [B, T, D] -> [B, T, D]. Every MLA layer is global (`kind` 0: the config refuses
        other attention kinds with model.mla). With compute.attention_max_logit: (that, each
        head's largest logit [N]); with model.mla.indexer: (that, the indexer's statistics)."""
        q, q_resid = self._query(x, positions)  # [B, T, N, H]
        latent, k_rope = self._latent(x, positions)
        if self.indexer is not None:
            return self._indexed(x, q, q_resid, latent, k_rope, positions, segment_ids)
        out = self._dense(q, latent, k_rope, segment_ids)
        if self.max_logit:  # each head's over the batch, padding left out
            out, row_max = out
            return self.o(out), head_max_logit(row_max, segment_ids)
        return self.o(out)

    def _dense(
        self, q: jax.Array, latent: jax.Array, k_rope: jax.Array, segment_ids: jax.Array
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Every head's keys and values from the latent, and the attention kernel over all
        visible keys -> [B, T, N, V] (and the kernel's row max with attention_max_logit)."""
        _, nope = self.dims
        kv = self.kv_b(latent)  # [B, T, N, nope + V]
        kv = constrain(kv, ("batch", "length", "heads", "head_dim"))
        k_nope, v = jnp.split(kv, [nope], axis=-1)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], -1
        )
        return self.attend(q, k, v, segment_ids)  # [B, T, N, V]

    def _indexed(self, x, q, q_resid, latent, k_rope, positions, segment_ids):
        """Training's DeepSeek sparse attention -> (output [B, T, D], the indexer's KL summed
        over the real tokens and their count). The indexer reads x and the query latent
        detached, so that its loss alone trains it. Stage warmup: the attention dense, the
        KL to its distribution over every visible key; sparse: the attention over the top_k
        keys, the KL over them."""
        assert self.indexer is not None
        index = jnp.arange(x.shape[1])
        visible = visible_keys(index, index, segment_ids, segment_ids)  # [B, T, T]
        key = jnp.concatenate([latent, k_rope[:, :, 0]], axis=-1)  # [B, T, R + Rr]
        x_in, q_in = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_resid)
        index_keys = self.indexer.keys(x_in, positions)
        scores = self.indexer.scores(x_in, q_in, positions, index_keys)  # [B, T, T]
        query, w_uv = self._absorbed(q)
        scale = 1.0 / math.sqrt(query.shape[-1])  # the kernels' (_absorbed)
        if self.warmup:
            out = self._dense(q, latent, k_rope, segment_ids)
            kl = dense_kl(query, key, scores, visible, scale)
        else:
            indices, valid = top_k_keys(scores, visible, self.indexer.top_k)
            out = self._gathered(query, w_uv, key, indices, valid)
            chosen = gather_keys(key, indices)  # [B, T, k, R + Rr]
            logits = jnp.einsum(
                "btnr,btjr->btnj", query, chosen, preferred_element_type=jnp.float32
            )
            target = attention_target(logits * scale, valid)
            kl = indexer_kl(target, jnp.take_along_axis(scores, indices, -1), valid)
        real = (segment_ids != 0).astype(jnp.float32)
        stats = {INDEXER_KL: jnp.sum(kl * real), INDEXER_TOKENS: jnp.sum(real)}
        return self.o(out), stats

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: LatentCache, kind: int = 0
    ) -> tuple[jax.Array, LatentCache]:
        """Generation's path (maxtrain/inference/), prefill and decode alike: the new tokens'
        [latent | rotary key] are written into the layer's cache at their positions ([B, T],
        consecutive per row), and the queries attend over the cache in the absorbed form (module
        docstring). Same projections, norms and RoPE as the training path."""
        rank, _ = self.dims
        q, q_resid = self._query(x, positions)  # [B, T, N, nope + Rr]
        latent, k_rope = self._latent(x, positions)
        new = [latent, k_rope[:, :, 0]]
        if self.indexer is not None:
            new.append(self.indexer.keys(x, positions))
        cache = cache.write(jnp.concatenate(new, axis=-1), positions)
        width = rank + k_rope.shape[-1]
        key, index_keys = cache.key[..., :width], cache.key[..., width:]
        if self.indexer is not None:
            stored = jnp.arange(key.shape[1], dtype=positions.dtype)
            visible = visible_keys(positions, stored)  # [B, T, S]
            return self._sparse(x, q, q_resid, positions, key, index_keys, visible), cache
        query, w_uv = self._absorbed(q)
        key = key[:, :, None, :]  # [B, S, 1, R + Rr]: one key head for all query heads
        out = cached_attention(query, key, key[..., :rank], positions)  # [B, T, N, R]
        return self.o(jnp.einsum("btnr,rnv->btnv", out, w_uv)), cache

    def _sparse(
        self,
        x: jax.Array,
        q: jax.Array,
        q_resid: jax.Array,
        positions: jax.Array,
        key: jax.Array,
        index_keys: jax.Array,
        visible: jax.Array,
    ) -> jax.Array:
        """DeepSeek sparse attention, training's and generation's: queries q [B, T, N, H]
        (query latent q_resid) over keys key [B, S, R + Rr] ([latent | rotary key]) with index
        keys [B, S, Hi], each query reading only the top_k of its `visible` [B, T, S] keys the
        indexer scores highest, in the absorbed form (module docstring) -> [B, T, D]."""
        assert self.indexer is not None
        scores = self.indexer.scores(x, q_resid, positions, index_keys)  # [B, T, S]
        indices, valid = top_k_keys(scores, visible, self.indexer.top_k)
        query, w_uv = self._absorbed(q)
        return self.o(self._gathered(query, w_uv, key, indices, valid))

    def _gathered(self, query, w_uv, key, indices, valid) -> jax.Array:
        """Absorbed queries [B, T, N, R + Rr] over the chosen of key [B, S, R + Rr] (one key
        head for all query heads, its latent the value) -> each head's values [B, T, N, V]."""
        rank, _ = self.dims
        key = key[:, :, None, :]
        out = gathered_attention(query, key, key[..., :rank], indices, valid)  # [B, T, N, R]
        return jnp.einsum("btnr,rnv->btnv", out, w_uv)

    def _absorbed(self, q: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Queries q [B, T, N, nope + Rr] -> (the absorbed queries [B, T, N, R + Rr] that score
        [latent | rotary key] directly, W_uv [R, N, V] that takes the attended latents to each
        head's values): the module docstring's form."""
        rank, nope = self.dims
        w_uk, w_uv = jnp.split(self.kv_b.kernel[...].astype(q.dtype), [nope], axis=-1)
        q_latent = jnp.einsum("btnh,rnh->btnr", q[..., :nope], w_uk)  # [B, T, N, R]
        # The kernels divide scores by sqrt of the query's size, R + Rr; the model's scale is
        # 1/sqrt(nope + Rr).
        rope_dims = q.shape[-1] - nope
        rescale = math.sqrt(rank + rope_dims) / math.sqrt(q.shape[-1])
        query = jnp.concatenate([q_latent, q[..., nope:]], axis=-1) * jnp.asarray(rescale, q.dtype)
        return constrain(query, ("batch", "length", "heads", None)), w_uv

    def _query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(queries [B, T, N, nope + Rr] of x [B, T, D]: the rotary part rotated, the whole
        scaled by YaRN's softmax factor; the normalised query latent [B, T, r] the indexer
        reads, None without q_lora_rank)."""
        _, nope = self.dims
        if self.q is not None:
            q, q_resid = self.q(x), None
        else:
            q_resid = self.q_norm(self.q_a(x))
            q = self.q_b(q_resid)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))  # [B, T, N, H]
        q = jnp.concatenate([q[..., :nope], self._rotate(q[..., nope:], positions)], axis=-1)
        if self.rope.softmax_factor != 1.0:
            q = q * jnp.asarray(self.rope.softmax_factor, q.dtype)
        return q, q_resid

    def _latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(normalised latent c [B, T, R], rotated rotary key [B, T, 1, Rr], one for all
        heads) of x [B, T, D]: what keys and values are made from."""
        rank, _ = self.dims
        latent, k_rope = jnp.split(self.kv_a(x), [rank], axis=-1)
        return self.kv_norm(latent), self._rotate(k_rope[:, :, None, :], positions)

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the rotary part, or nothing with model.mla.rope false (NoPE)."""
        return self.rope(x, positions) if self.rotates else x
