"""DeepSeek sparse attention's kernels (kernels/sparse_attention.py): the indexer's blocked
scores against their formula (and the memory the blocks save), the top-k choice over causal,
same-document keys (fewer than k at a document's start), the gathered attention against the
dense reference masked to the same keys, values and gradients, and its compiled cost, which
grows with T x k, not T x T."""

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.kernels.sparse_attention import gathered_attention, index_scores, top_k_keys
from maxtrain.kernels.xla_attention import masked_attention, visible_keys

B, T, N, K, H, HV, TOP = 2, 16, 4, 1, 8, 6, 4
# Packed documents, some shorter than TOP; the second row ends in padding (id 0).
SEGMENT_IDS = np.array(
    [
        [1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 4, 4, 4, 4, 4, 4],
        [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0],
    ],
    dtype=np.int32,
)


def _visible() -> jax.Array:
    index = jnp.arange(T)
    seg = jnp.asarray(SEGMENT_IDS)
    return visible_keys(index, index, seg, seg)


def _selection_mask(indices: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, T, S]: True at each query's valid chosen keys, the dense reference's mask."""
    one_hot = jax.nn.one_hot(indices, T, dtype=jnp.bool_) & valid[..., None]
    return jnp.any(one_hot, axis=-2)


def test_top_k_picks_the_best_visible_keys_and_all_of_a_short_prefix():
    scores = jax.random.normal(jax.random.key(0), (B, T, T))
    visible = _visible()
    indices, valid = top_k_keys(scores, visible, TOP)
    assert indices.shape == (B, T, TOP)
    chosen = np.asarray(_selection_mask(indices, valid))
    vis, s = np.asarray(visible), np.asarray(scores)
    for b in range(B):
        for t in range(T):
            keys = np.flatnonzero(vis[b, t])
            # a query with fewer than TOP visible keys (a document's start) keeps all of them
            want = keys[np.argsort(-s[b, t, keys])[:TOP]]
            np.testing.assert_array_equal(np.flatnonzero(chosen[b, t]), np.sort(want))
    assert not np.any(chosen & ~vis)  # never a later key or another document's


def test_gathered_attention_equals_the_dense_masked_reference():
    kq, kk, kv, ks, kc = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, T, K, H))
    v = jax.random.normal(kv, (B, T, K, HV))
    cot = jax.random.normal(kc, (B, T, N, HV))
    indices, valid = top_k_keys(jax.random.normal(ks, (B, T, T)), _visible(), TOP)
    mask = _selection_mask(indices, valid)

    def value_and_grads(fn):
        out, vjp = jax.vjp(jax.jit(fn), q, k, v)
        return out, *vjp(cot)

    got = value_and_grads(lambda q, k, v: gathered_attention(q, k, v, indices, valid))
    want = value_and_grads(lambda q, k, v: masked_attention(q, k, v, mask))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def _compiled_costs(length: int, top: int) -> np.ndarray:
    """(FLOPs, bytes accessed) of the compiled CPU program of the gathered attention's forward
    and backward at `length` tokens, `top` keys per query (the choice given)."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    loss = lambda q, k, v, i, m: jnp.sum(gathered_attention(q, k, v, i, m))  # noqa: E731
    args = (
        f32(1, length, N, 64),
        f32(1, length, 1, 64),
        f32(1, length, 1, 48),
        jax.ShapeDtypeStruct((1, length, top), jnp.int32),
        jax.ShapeDtypeStruct((1, length, top), jnp.bool_),
    )
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    cost = compiled.cost_analysis()
    return np.array([cost["flops"], cost["bytes accessed"]])


def test_gathered_attention_does_sequence_times_top_k_work():
    """XLA's cost analysis of the compiled program (as the banded kernel's test reads it): at
    twice the sequence with k = 256 the FLOPs and bytes accessed grow at most 2.2x (T x k),
    where dense attention's quadruple (tests/kernels/test_attention.py)."""
    ratio = _compiled_costs(2048, 256) / _compiled_costs(1024, 256)
    print("FLOPs, bytes accessed at T=2048 / T=1024, k=256:", ratio)
    assert np.all(ratio <= 2.2), ratio
    assert np.all(ratio >= 1.8), ratio  # and the program does grow with T: nothing skipped


def _index_scores_whole(q, k, w):
    """The indexer's formula over all queries and heads at once."""
    logits = jnp.einsum("btnh,bsh->btns", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("btn,btns->bts", w, jax.nn.relu(logits))


def test_blocked_index_scores_equal_the_formula():
    """10 queries in blocks of 4 (the last one partial), values and gradients."""
    kq, kk, kw, kc = jax.random.split(jax.random.key(2), 4)
    q, k = jax.random.normal(kq, (B, 10, 3, H)), jax.random.normal(kk, (B, 12, H))
    w, cot = jax.random.normal(kw, (B, 10, 3)), jax.random.normal(kc, (B, 10, 12))
    blocked = lambda q, k, w: index_scores(q, k, w, block=4)  # noqa: E731
    out_a, vjp_a = jax.vjp(jax.jit(blocked), q, k, w)
    out_b, vjp_b = jax.vjp(jax.jit(_index_scores_whole), q, k, w)
    for a, b in zip((out_a, *vjp_a(cot)), (out_b, *vjp_b(cot)), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_blocked_index_scores_hold_a_block_of_logits_not_all():
    """The compiled forward and backward's temporaries at 2048 tokens and 16 index heads:
    blocks of 256 queries hold under a quarter of what all heads' [T, I, S] logits take."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (f32(1, 2048, 16, 32), f32(1, 2048, 32), f32(1, 2048, 16))

    def temp(fn):
        grad = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))
        return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

    blocked, whole = temp(index_scores), temp(_index_scores_whole)
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    print(f"index scores' temporaries: blocked {mib(blocked)}, whole {mib(whole)}")
    assert blocked < whole / 4
