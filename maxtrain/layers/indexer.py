"""The lightning indexer of DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): cheap scores that
pick the keys each query's multi-head latent attention reads (layers/mla.py).

    queries  q_resid (the query latent) -> q    [B, T, I, Hi]   I index heads
    key      x -> k -> LayerNorm                [B, T, Hi]      one key for all index heads
    weights  x -> weights * I^-1/2              [B, T, I]
    score    s[t, s'] = sum_i w[t, i] relu(q[t, i] . k[s'] / sqrt(Hi))

The first qk_rope_head_dim dims of q and k are rotated (by halves in DeepSeek-V3.2, interleaved
pairs in GLM-5: model.mla.indexer.rope_interleaved), the rest carry no position. Scoring is
T x S like dense attention's, but with a few small heads and no softmax or value; the expensive
attention then runs over each query's top_k keys only (kernels/sparse_attention.py).

The scores follow transformers' DeepseekV32Indexer in float32; the FP8 quantisation and the
Hadamard rotation of DeepSeek's kernels are left out (the rotation preserves dot products).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.kernels.sparse_attention import by_query_blocks, index_scores
from maxtrain.layers.base import Projection
from maxtrain.layers.norms import LayerNorm
from maxtrain.layers.rope import Rope
from maxtrain.layers.spec import ModelSpec
from maxtrain.parallel.mesh import constrain

# The key LayerNorm's epsilon, fixed in DeepSeek's reference code and transformers.
KEY_NORM_EPS = 1e-6
# A layer's training statistics (models/indexer_training.py): its KL summed over the real
# tokens, and their count.
INDEXER_KL, INDEXER_TOKENS = "indexer_kl", "indexer_tokens"


class LightningIndexer(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        cfg = spec.model
        m = cfg.mla
        assert m is not None and m.indexer is not None and m.q_lora_rank is not None
        heads, dim = m.indexer.heads, m.indexer.head_dim
        kw = spec.projection(rngs)
        self.q = Projection(
            "btr,rnh->btnh", (m.q_lora_rank, heads, dim), ("latent", "heads", "head_dim"), **kw
        )
        self.k = Projection("btd,dh->bth", (cfg.emb_dim, dim), ("embed", "head_dim"), **kw)
        self.k_norm = LayerNorm(dim, eps=KEY_NORM_EPS, param_dtype=spec.param_dtype)
        self.weights = Projection("btd,dn->btn", (cfg.emb_dim, heads), ("embed", "heads"), **kw)
        self.rope = Rope(
            m.qk_rope_head_dim, cfg.rope.theta, cfg.rope.scaling, m.indexer.rope_interleaved
        )
        self.top_k = m.indexer.top_k

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, T, D] -> each token's index key [B, T, Hi], normalised and rotated: what
        generation caches beside the latents."""
        k = self.k_norm(self.k(x))
        return self.rope(k[:, :, None, :], positions)[:, :, 0]

    def scores(
        self, x: jax.Array, q_resid: jax.Array, positions: jax.Array, keys: jax.Array
    ) -> jax.Array:
        """Index scores [B, T, S] (float32) of queries x [B, T, D] with query latent q_resid
        [B, T, r] at positions [B, T] against index keys [B, S, Hi]."""
        q = self.rope(self.q(q_resid), positions)  # [B, T, I, Hi]
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        weights = self.weights(x).astype(jnp.float32) / math.sqrt(q.shape[-2])
        return index_scores(q, keys.astype(q.dtype), weights)


def attention_target(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """What the indexer learns (DeepSeek-V3.2, sec. 2.1): the attention's probabilities from
    its scores [B, T, N, S] (float32, scaled) over the keys `mask` [B, T, S] allows, summed
    over heads and L1-normalised (the heads' mean) -> [B, T, S], a constant."""
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    return jax.lax.stop_gradient(jnp.mean(jax.nn.softmax(scores, axis=-1), axis=2))


def indexer_kl(target: jax.Array, index_scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Per query [B, T]: KL(target || softmax of the index scores) over the keys `mask`
    [B, T, S] allows (target and scores [B, T, S], float32); keys the target gives no weight
    add nothing."""
    log_q = jax.nn.log_softmax(jnp.where(mask, index_scores, jnp.finfo(jnp.float32).min), -1)
    terms = target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_q)
    return jnp.sum(jnp.where(mask & (target > 0), terms, 0.0), axis=-1)


def dense_kl(
    query: jax.Array, key: jax.Array, scores: jax.Array, visible: jax.Array, scale: float
) -> jax.Array:
    """The warm-up's KL per query [B, T]: from the attention of queries query [B, T, N, W] over
    keys key [B, S, W] (one key head, logits times `scale`), every visible key ([B, T, S]), to
    the index scores [B, T, S], by blocks of queries (kernels/sparse_attention.py): the
    attention's [N, T, S] float32 logits are never held at once."""

    def one(query: jax.Array, scores: jax.Array, visible: jax.Array) -> jax.Array:
        logits = jnp.einsum("btnr,bsr->btns", query, key, preferred_element_type=jnp.float32)
        return indexer_kl(attention_target(logits * scale, visible), scores, visible)

    return by_query_blocks(one, (query, scores, visible))
