"""The gated delta rule (maxtrain/kernels/gated_delta_rule.py): the chunked form against a
NumPy statement of the recurrence token by token (values) and against a plain lax.scan of it
(gradients), over packed rows whose documents start inside a chunk, on a chunk's edge and as a
one-token document, with T not a multiple of the chunk; and decoding's one-token step against
the chunked form. Each with the decay per head (Gated DeltaNet) and per head and key channel
(Kimi Delta Attention: the NumPy statement is transformers' recurrent_kimi_delta_attention's,
the state's rows decayed each by its own rate), and the second equal to the first where every
channel of a head decays alike."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.kernels.gated_delta_rule import chunked_gated_delta_rule, gated_delta_step

B, T, NK, NV, DK, DV = 2, 21, 2, 4, 4, 3
CHUNK = 8  # chunks 0-7, 8-15, 16-20 (partial)
# Row 0: documents start at 5 (inside the first chunk), 8 (the second chunk's first token) and
# 13; row 1: at 16 (a chunk edge), 17 (so 16 is a one-token document) and 19.
SEGMENT_IDS = np.array([[1] * 5 + [2] * 3 + [3] * 5 + [4] * 8, [1] * 16 + [2] + [3] * 2 + [4] * 2])


# Per value head, the scale of its log decays: three heads whose state outlives a chunk (the
# slowest halves in about 70 tokens), one that forgets within a few tokens.
DECAY_SCALES = np.array([0.02, 0.1, 0.3, 2.0])


GATES = ["head", "channel"]  # the decay's shape: [B, T, NV] or [B, T, NV, DK]


def _inputs(seed: int = 0, gate: str = "head") -> tuple[np.ndarray, ...]:
    """q, k, v, g, beta, initial state: unit q and k (as the layer gives them), decays from
    nearly none to strong (DECAY_SCALES; per channel, each channel its own draw under its
    head's scale), write strengths across (0, 1)."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.normal(size=(B, T, NK, DK)))
    k = unit(rng.normal(size=(B, T, NK, DK)))
    v = rng.normal(size=(B, T, NV, DV))
    if gate == "head":
        g = -rng.uniform(0.0, 1.0, size=(B, T, NV)) * DECAY_SCALES
    else:
        g = -rng.uniform(0.0, 1.0, size=(B, T, NV, DK)) * DECAY_SCALES[:, None]
    beta = rng.uniform(0.05, 1.0, size=(B, T, NV))
    state = rng.normal(size=(B, NV, DK, DV))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, state))


def _numpy_recurrence(q, k, v, g, beta, segment_ids, state):
    """The recurrence as transformers states it, token by token and head by head in float64:
    decay the state, write beta times the difference between v and what the state reads at
    k, read at q / sqrt(dk). A document start (a segment id unlike the previous token's)
    empties the state first. Value head n reads query/key head n // (NV / NK)."""
    q, k, v, g, beta, state = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    state = state.copy()
    out = np.zeros(v.shape)
    group = NV // NK
    for b in range(B):
        for t in range(T):
            if t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                state[b] = 0.0
            for n in range(NV):
                key, query = k[b, t, n // group], q[b, t, n // group] / np.sqrt(DK)
                decay = np.exp(g[b, t, n])  # a number, or one per key channel (row of s)
                s = state[b, n] * (decay[:, None] if decay.ndim else decay)
                s = s + np.outer(key, beta[b, t, n] * (v[b, t, n] - s.T @ key))
                state[b, n] = s
                out[b, t, n] = s.T @ query
    return out, state


def _scan_recurrence(q, k, v, g, beta, segment_ids, state):
    """The same recurrence as a plain lax.scan over tokens in jnp: what the chunked form's
    gradients are compared with (its values are the NumPy statement's, checked below)."""
    group = NV // NK
    q, k = jnp.repeat(q, group, axis=2) / np.sqrt(DK), jnp.repeat(k, group, axis=2)
    start = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))

    def token(s, inputs):
        q_t, k_t, v_t, g_t, beta_t, start_t = inputs
        decay = jnp.exp(g_t if g_t.ndim == 3 else g_t[..., None])[..., None]
        s = jnp.where(start_t[:, None, None, None], 0.0, s) * decay
        read = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + k_t[..., None] * (beta_t[..., None] * (v_t - read))[:, :, None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, start)]
    state, out = jax.lax.scan(token, state, time_major)
    return jnp.moveaxis(out, 0, 1), state


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("chunk", [CHUNK, 32])
def test_chunked_equals_the_recurrence_across_documents(chunk, gate):
    """Chunks of 8 (documents starting inside chunks and on their edges, a partial last chunk)
    and one chunk longer than the row: outputs and final state as the NumPy recurrence's."""
    q, k, v, g, beta, state = _inputs(gate=gate)
    want_out, want_state = _numpy_recurrence(q, k, v, g, beta, SEGMENT_IDS, state)
    rule = jax.jit(partial(chunked_gated_delta_rule, chunk=chunk))
    out, final = rule(q, k, v, g, beta, jnp.asarray(SEGMENT_IDS), state)
    assert np.abs(want_out).max() > 0.5  # the outputs are not vanishingly small
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    np.testing.assert_allclose(final, want_state, atol=2e-5)


@pytest.mark.parametrize("gate", GATES)
def test_a_document_sees_nothing_of_the_one_before(gate):
    """Row 0's last document (tokens 13..20) gives the same outputs inside the packed row as
    alone, from an empty state: what came before it, the initial state included, is gone."""
    q, k, v, g, beta, state = _inputs(1, gate)
    rule = jax.jit(partial(chunked_gated_delta_rule, chunk=CHUNK))
    packed, _ = rule(q, k, v, g, beta, jnp.asarray(SEGMENT_IDS), state)
    alone, _ = rule(*(x[:1, 13:] for x in (q, k, v, g, beta)))
    np.testing.assert_allclose(packed[:1, 13:], alone, atol=1e-6)
    unpacked, _ = rule(q, k, v, g, beta, None, state)  # what the history would have changed
    assert np.abs(unpacked[:1, 13:] - alone).max() > 0.1


@pytest.mark.parametrize("gate", GATES)
def test_chunked_gradients_equal_the_scan_of_the_recurrence(gate):
    """Gradients of a random projection of (outputs, final state) with respect to every
    input, initial state included: the chunked form's against the token-by-token scan's,
    whose values are checked against the NumPy statement first."""
    inputs = _inputs(2, gate)
    segments = jnp.asarray(SEGMENT_IDS)
    scan_out, scan_state = jax.jit(_scan_recurrence)(*inputs[:5], segments, inputs[5])
    want_out, want_state = _numpy_recurrence(*inputs[:5], SEGMENT_IDS, inputs[5])
    np.testing.assert_allclose(scan_out, want_out, atol=2e-5)
    np.testing.assert_allclose(scan_state, want_state, atol=2e-5)

    rng = np.random.default_rng(3)
    out_weights = rng.normal(size=scan_out.shape).astype(np.float32)
    state_weights = rng.normal(size=scan_state.shape).astype(np.float32)

    def objective(rule):
        def f(q, k, v, g, beta, state):
            out, final = rule(q, k, v, g, beta, segments, state)
            return jnp.sum(out * out_weights) + jnp.sum(final * state_weights)

        return jax.jit(jax.grad(f, argnums=range(6)))

    got = objective(partial(chunked_gated_delta_rule, chunk=CHUNK))(*inputs)
    want = objective(_scan_recurrence)(*inputs)
    for name, x, y in zip(("q", "k", "v", "g", "beta", "state"), got, want, strict=True):
        assert np.abs(y).max() > 0.1, name  # every input matters to the objective
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("gate", GATES)
def test_decoding_step_by_step_equals_the_chunked_form(gate):
    """From the same initial state, one token at a time (decoding's form) gives the chunked
    form's outputs over one document per row, and its final state."""
    q, k, v, g, beta, state = _inputs(4, gate)
    want_out, want_state = jax.jit(partial(chunked_gated_delta_rule, chunk=CHUNK))(
        q, k, v, g, beta, initial_state=state
    )
    step = jax.jit(gated_delta_step)
    outs = []
    for t in range(T):
        out, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out)
    np.testing.assert_allclose(np.stack(outs, axis=1), want_out, atol=2e-5)
    np.testing.assert_allclose(state, want_state, atol=2e-5)


def test_a_per_channel_decay_alike_in_every_channel_is_the_per_head_one():
    """Kimi Delta Attention's gate generalises Gated DeltaNet's: a head whose channels all
    decay at its per-head rate gives the per-head outputs and state, and a per-channel gate
    that differs across channels gives others."""
    q, k, v, g, beta, state = _inputs(5)
    rule = jax.jit(partial(chunked_gated_delta_rule, chunk=CHUNK))
    segments = jnp.asarray(SEGMENT_IDS)
    per_head = rule(q, k, v, g, beta, segments, state)
    alike = np.repeat(g[..., None], DK, axis=-1)
    per_channel = rule(q, k, v, alike, beta, segments, state)
    for want, got in zip(per_head, per_channel, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    varied = alike * np.linspace(0.5, 1.5, DK, dtype=np.float32)
    assert np.abs(rule(q, k, v, varied, beta, segments, state)[0] - per_head[0]).max() > 0.01
