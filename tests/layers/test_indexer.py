"""The lightning indexer's training target and loss (layers/indexer.py): the warm-up's KL by
blocks of queries equals it over all queries at once, values and gradients, with packed
documents; and it is zero exactly when the indexer's softmax is the attention's head-averaged
distribution."""

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.kernels.xla_attention import visible_keys
from maxtrain.layers.indexer import attention_target, dense_kl, indexer_kl

B, T, N, W = 2, 300, 3, 8  # 300 queries: a whole block of 256 and a partial one
SCALE = 1 / np.sqrt(W)


def _inputs():
    kq, kk, ks = jax.random.split(jax.random.key(0), 3)
    query, key = jax.random.normal(kq, (B, T, N, W)), jax.random.normal(kk, (B, T, W))
    segments = jnp.asarray(np.repeat([[1, 2, 3], [1, 1, 0]], [100, 100, 100], axis=1))
    index = jnp.arange(T)
    visible = visible_keys(index, index, segments, segments)
    return query, key, jax.random.normal(ks, (B, T, T)), visible


def _whole_kl(query, key, scores, visible):
    logits = jnp.einsum("btnr,bsr->btns", query, key) * SCALE
    return indexer_kl(attention_target(logits, visible), scores, visible)


def test_blocked_warmup_kl_equals_it_over_all_queries():
    query, key, scores, visible = _inputs()
    cot = jax.random.normal(jax.random.key(1), (B, T))
    blocked = lambda s: dense_kl(query, key, s, visible, SCALE)  # noqa: E731
    whole = lambda s: _whole_kl(query, key, s, visible)  # noqa: E731
    (got, grad_got), (want, grad_want) = (
        (out, vjp(cot)[0]) for out, vjp in (jax.vjp(jax.jit(f), scores) for f in (blocked, whole))
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_got, grad_want, rtol=1e-5, atol=1e-6)


def test_kl_is_zero_when_the_indexer_matches_the_attention():
    query, key, scores, visible = _inputs()
    logits = jnp.einsum("btnr,bsr->btns", query, key) * SCALE
    target = attention_target(logits, visible)
    matching = jnp.log(jnp.where(visible, target, 1.0))
    np.testing.assert_allclose(dense_kl(query, key, matching, visible, SCALE), 0.0, atol=1e-5)
    kl = np.asarray(dense_kl(query, key, scores, visible, SCALE))
    several = np.asarray(visible.sum(-1) > 1)  # a document's first query has one key: KL 0
    assert np.all(kl[several] > 0) and np.all(kl[~several] == 0)
