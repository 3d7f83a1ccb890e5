"""The gated delta rule: Gated DeltaNet's linear attention (Qwen3-Next's linear layers), as a
recurrence for decoding and in chunks for training.

Per value head, a state S [dk, dv] maps keys to values. Token t decays it by a_t = exp(g_t)
(g_t <= 0, the log decay), then writes its value v_t under its key k_t with learning rate beta_t,
replacing what the decayed state predicted for k_t rather than adding to it (the delta rule):

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T,      o_t = S_t^T q_t / sqrt(dk)

exactly as transformers 5.23.0 computes it (torch_recurrent_gated_delta_rule, in float32; the
queries always divided by sqrt(dk) inside; the callers L2-normalise q and k beforehand, as
Qwen3-Next asks of that function). Query/key heads may be fewer than value heads: value head n
reads query/key head n // (Nv / Nk), transformers' repeat_interleave.

Packed documents: the state starts at zero at each document start (a token whose segment id
differs from the previous token's), which is the recurrence with a_t = 0 there. A row's first
token continues `initial_state` (zero when none is given).

`chunked_gated_delta_rule` computes the same in chunks of C tokens, so that training works in
matrix products and its time and memory grow linearly with T. Within a chunk, with S the state
entering it, G_i the cumulative log decay from the chunk's start to token i, Gamma_ij =
exp(G_i - G_j) the decay from token j to i (j <= i, same document; else 0) and gamma_i =
exp(G_i) what reaches token i of S (0 past a document start in the chunk), unrolling the
recurrence gives

    S_i = gamma_i S + sum_{j <= i} Gamma_ij k_j u_j^T,      u_j = beta_j (v_j - a_j S_{j-1}^T k_j)

and substituting S_{j-1} into u_j: (I + A) u = beta v - (beta gamma k) S, with A_js = beta_j
Gamma_js k_j . k_s strictly lower triangular (s < j). Its solution u = U - W S, U and W solved
from that unit lower triangular system (the "UT transform"), turns the chunk into matmuls:

    o_i = gamma_i S^T q_i + sum_{j <= i} Gamma_ij (q_i . k_j) u_j
    S_next = gamma_C S + sum_j Gamma_Cj k_j u_j^T                       (C: the chunk's last token)

with the state carried between chunks by `lax.scan`. Every decay is an exp of a non-positive
number, so nothing overflows however strong the decay. The scan's body (a whole chunk) is
rematerialised in the backward, which therefore keeps only the state entering each chunk
([T / C, B, Nv, dk, dv]) beside the inputs, never one per token nor a chunk's [C, C]
matrices for the whole sequence: at T = 4096, 4 value heads of 64 x 64, its CPU program's
temporaries are a quarter of those of computing every chunk's matrices at once outside the
scan, for 5% more matmul FLOPs.

Shape letters: the package's (maxtrain/__init__.py); here q/k heads are Nk and value heads Nv, dk
and dv their head sizes, C the chunk. In einsum strings h is a (value) head, c and s positions in
a chunk (a query's and a key's), k and v the key and value dims.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def gated_delta_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence, decoding's form: q/k [B, Nk, dk], v [B, Nv, dv], g/beta
    [B, Nv], state [B, Nv, dk, dv] -> (output [B, Nv, dv] in v's dtype, next state, float32)."""
    nv, dk = v.shape[1], q.shape[-1]
    out_dtype = v.dtype
    q, k = (_value_heads(x, nv, axis=1).astype(jnp.float32) for x in (q, k))
    v, g, beta = (x.astype(jnp.float32) for x in (v, g, beta))
    decayed = state.astype(jnp.float32) * jnp.exp(g)[:, :, None, None]
    predicted = jnp.einsum("bhk,bhkv->bhv", k, decayed)
    state = decayed + jnp.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - predicted))
    out = jnp.einsum("bhk,bhkv->bhv", q * dk**-0.5, state)
    return out.astype(out_dtype), state


def chunked_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    segment_ids: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    *,
    chunk: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence over a sequence, in chunks of `chunk` tokens (module docstring): q/k
    [B, T, Nk, dk], v [B, T, Nv, dv], g/beta [B, T, Nv], segment_ids [B, T] (None: one
    document per row), initial_state [B, Nv, dk, dv] (None: zeros) -> (output [B, T, Nv, dv]
    in v's dtype, the state after the last token [B, Nv, dk, dv], float32). T need not be a
    multiple of `chunk`: the last chunk is padded with tokens that neither decay nor write."""
    b, t, _, dk = q.shape
    nv, dv = v.shape[2:]
    out_dtype = v.dtype
    q, k = (_value_heads(x, nv, axis=2) for x in (q, k))
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    q = q * dk**-0.5
    starts = jnp.zeros((b, t), jnp.int32) if segment_ids is None else document_starts(segment_ids)
    pad = -t % chunk
    n = (t + pad) // chunk

    def as_chunks(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, C, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    state = (
        jnp.zeros((b, nv, dk, dv), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )
    chunks = tuple(map(as_chunks, (q, k, v, g, beta, starts)))
    state, out = jax.lax.scan(_chunk_step, state, chunks)  # out [n, B, h, C, dv]
    out = out.transpose(1, 0, 3, 2, 4).reshape(b, n * chunk, nv, dv)[:, :t]
    return out.astype(out_dtype), state


@partial(jax.checkpoint, prevent_cse=False)
def _chunk_step(state: jax.Array, chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """One chunk (q/k [B, C, h, dk] with q scaled, v [B, C, h, dv], g/beta [B, C, h], document
    starts [B, C]) from the state entering it -> (the state leaving it, its outputs [B, h, C,
    dv]). Rematerialised in the backward, so that only the entering states are kept."""
    q, k, v, g, beta, starts = chunk
    size, dv = q.shape[1], v.shape[-1]
    decay, reach = _chunk_decays(g, starts)  # Gamma [B, h, c, s], gamma [B, c, h]
    # The UT transform: (I + A) [U | W] = [beta v | beta gamma k], A strictly lower triangular.
    a = jnp.einsum("bchk,bshk->bhcs", beta[..., None] * k, k) * decay
    a = jnp.where(jnp.tri(size, k=-1, dtype=bool), a, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * reach)[..., None] * k], axis=-1)
    solved = jax.lax.linalg.triangular_solve(
        a,  # read as I + A: its unit diagonal is the solve's own
        rhs.transpose(0, 2, 1, 3),  # [B, h, c, dv + dk]
        left_side=True,
        lower=True,
        unit_diagonal=True,
    )
    u = solved[..., :dv] - jnp.einsum("bhck,bhkv->bhcv", solved[..., dv:], state)
    scores = jnp.einsum("bchk,bshk->bhcs", q, k) * decay
    out = jnp.einsum("bchk,bhkv->bhcv", reach[..., None] * q, state)
    out = out + jnp.einsum("bhcs,bhsv->bhcv", scores, u)
    to_end = jnp.einsum("bhs,bshk->bhsk", decay[:, :, -1], k)  # keys decayed to the chunk's end
    state = reach[:, -1, :, None, None] * state + jnp.einsum("bhsk,bhsv->bhkv", to_end, u)
    return state, out


def _chunk_decays(g: jax.Array, starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """g [B, C, h] and document starts [B, C] of a chunk -> (Gamma [B, h, c, s]: the decay from
    key s to query c, zero unless s <= c in one document; gamma [B, c, h]: the decay from the
    chunk's start to c, zero past a document start in the chunk). Masked before the exp, so
    that no positive exponent is ever taken and no gradient flows through a masked pair."""
    cumulative = jnp.cumsum(g, axis=1)  # G_c
    document = jnp.cumsum(starts, axis=1)  # starts up to c: the chunk's document index of c
    size = g.shape[1]
    visible = (document[:, :, None] == document[:, None, :]) & jnp.tri(size, dtype=bool)
    exponent = cumulative.transpose(0, 2, 1)  # [B, h, C]
    exponent = exponent[..., :, None] - exponent[..., None, :]
    decay = jnp.exp(jnp.where(visible[:, None], exponent, -jnp.inf))
    reach = jnp.exp(jnp.where((document == 0)[..., None], cumulative, -jnp.inf))
    return decay, reach


def document_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, T] int32: 1 where a token's segment id differs from the previous token's (a
    document start past the row's first token), else 0."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed, ((0, 0), (1, 0))).astype(jnp.int32)


def _value_heads(x: jax.Array, num_value_heads: int, *, axis: int) -> jax.Array:
    """Query/key heads repeated to one per value head: value head n reads head n // (Nv / Nk)."""
    return jnp.repeat(x, num_value_heads // x.shape[axis], axis=axis)
