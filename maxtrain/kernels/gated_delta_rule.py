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

The decay is per head (g [..., Nv]: Gated DeltaNet) or per head and key channel (g [..., Nv,
dk]: Kimi Delta Attention, Kimi Linear's, whose a_t is a diagonal [dk, dk] that decays each
row of the state by its own rate: transformers' recurrent_kimi_delta_attention). The second is
the first's generalisation, and everything below holds for both with a_t, gamma_i and
Gamma_ij read as diagonals, a product such as Gamma_ij (q_i . k_j) as sum_c Gamma_ijc q_ic
k_jc. A per-head decay keeps a trailing channel axis of one, so that it costs what it did; a
per-channel one holds a [C, C, dk] decay per chunk and head, as transformers' chunked form does.

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
Gamma_js k_j . k_s strictly lower triangular (s < j). Its solution u = U - W S, with
[U | W] = (I + A)^-1 [beta v | beta gamma k] (the "UT transform"), turns the chunk into matmuls:

    o_i = gamma_i S^T q_i + sum_{j <= i} Gamma_ij (q_i . k_j) u_j
    S_next = gamma_C S + sum_j Gamma_Cj k_j u_j^T                       (C: the chunk's last token)

Everything but S is known from the chunk alone, so it is computed for every chunk at once
(`_within_chunk`): the outputs' part from the chunk, P U with P_ij = Gamma_ij (q_i . k_j); the
map from S to the outputs, gamma q - P W; and the chunk's effect on the state, S_next =
S - M S + K^T U with M = (1 - gamma_C) I + K^T W and K_j = Gamma_Cj k_j. What remains
sequential (`lax.scan` over the chunks) is that affine map of the state, one [dk, dk] x
[dk, dv] product per chunk, and the states entering the chunks then give every output in one
product. (I + A)^-1 is built in matmuls too (`_unit_lower_inverse`), not by a triangular
solve: XLA:CPU ran a batch of small solves through LAPACK one matrix at a time, which cost
more than the rest of the layer, and whose threads spun for seconds on a loaded machine
(docs/hybrid-models.md). Every decay is an exp of a
non-positive number, so nothing overflows however strong the decay.

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
    """One token of the recurrence, decoding's form: q/k [B, Nk, dk], v [B, Nv, dv], g [B, Nv]
    or [B, Nv, dk], beta [B, Nv], state [B, Nv, dk, dv] -> (output [B, Nv, dv] in v's dtype,
    next state, float32)."""
    nv, dk = v.shape[1], q.shape[-1]
    out_dtype = v.dtype
    q, k = (_value_heads(x, nv, axis=1).astype(jnp.float32) for x in (q, k))
    v, g, beta = (x.astype(jnp.float32) for x in (v, g, beta))
    g = _channels(g, beta)  # [B, Nv, 1 or dk]
    decayed = state.astype(jnp.float32) * jnp.exp(g)[..., None]
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
    [B, T, Nk, dk], v [B, T, Nv, dv], g [B, T, Nv] or [B, T, Nv, dk], beta [B, T, Nv],
    segment_ids [B, T] (None: one document per row), initial_state [B, Nv, dk, dv] (None:
    zeros) -> (output [B, T, Nv, dv] in v's dtype, the state after the last token [B, Nv, dk,
    dv], float32). T need not be a multiple of `chunk`: the last chunk is padded with tokens
    that neither decay nor write."""
    b, t, _, dk = q.shape
    nv, dv = v.shape[2:]
    out_dtype = v.dtype
    q, k = (_value_heads(x, nv, axis=2) for x in (q, k))
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    g = _channels(g, beta)  # [B, T, Nv, 1 or dk]
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
    own, reading, forgetting, writing = jax.vmap(_within_chunk)(*chunks)

    def across(state: jax.Array, chunk: tuple[jax.Array, jax.Array]):
        forget, write = chunk  # M, K^T U: S_next = S - M S + K^T U
        return state - jnp.einsum("bhkj,bhjv->bhkv", forget, state) + write, state

    state, entering = jax.lax.scan(across, state, (forgetting, writing))  # [n, B, h, dk, dv]
    out = own + jnp.einsum("nbhck,nbhkv->nbhcv", reading, entering)  # [n, B, h, C, dv]
    out = out.transpose(1, 0, 3, 2, 4).reshape(b, n * chunk, nv, dv)[:, :t]
    return out.astype(out_dtype), state


def _within_chunk(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, starts: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What one chunk computes without the state entering it (q/k [B, C, h, dk] with q scaled,
    v [B, C, h, dv], g [B, C, h, 1 or dk], beta [B, C, h], document starts [B, C]): (its
    outputs' own part P U [B, h, C, dv]; the map gamma q - P W [B, h, C, dk] that reads the
    entering state into them; M [B, h, dk, dk] and K^T U [B, h, dk, dv], the state's update;
    module docstring)."""
    size, dv = q.shape[1], v.shape[-1]
    decay, reach = _chunk_decays(g, starts)  # Gamma [B, h, c, s, 1|dk], gamma [B, c, h, 1|dk]
    a = _decayed_products(beta[..., None] * k, k, decay)
    a = jnp.where(jnp.tri(size, k=-1, dtype=bool), a, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * reach * k], axis=-1)
    solved = _unit_lower_solve(a, rhs.transpose(0, 2, 1, 3))  # [U | W]: [B, h, c, dv + dk]
    u, w = solved[..., :dv], solved[..., dv:]
    scores = _decayed_products(q, k, decay)  # P
    own = scores @ u
    reading = (reach * q).transpose(0, 2, 1, 3) - scores @ w
    to_end = jnp.swapaxes(decay[:, :, -1] * k.transpose(0, 2, 1, 3), -1, -2)  # K^T [B, h, k, s]
    lost = (1.0 - reach[:, -1])[..., None] * jnp.eye(k.shape[-1], dtype=k.dtype)  # diagonal
    return own, reading, lost + to_end @ w, to_end @ u


def _decayed_products(x: jax.Array, y: jax.Array, decay: jax.Array) -> jax.Array:
    """sum_k x_ck y_sk Gamma_csk, [B, h, c, s], of x/y [B, C, h, dk] and Gamma [B, h, c, s,
    1 or dk]: a per-head decay scales the dot products, a per-channel one enters them."""
    if decay.shape[-1] == 1:
        return jnp.einsum("bchk,bshk->bhcs", x, y) * decay[..., 0]
    return jnp.einsum("bchk,bshk,bhcsk->bhcs", x, y, decay)


@jax.custom_vjp
def _unit_lower_solve(a: jax.Array, rhs: jax.Array) -> jax.Array:
    """(I + A)^-1 rhs for A [..., C, C] strictly lower triangular, rhs [..., C, d]."""
    return _matmul(_unit_lower_inverse(a), rhs)


def _solve_forward(a: jax.Array, rhs: jax.Array):
    inverse = _unit_lower_inverse(a)
    solved = _matmul(inverse, rhs)
    return solved, (inverse, solved)


def _solve_backward(residuals, grad):
    """Y = (I + A)^-1 R gives dR = (I + A)^-T dY and dA = -dR Y^T (its strictly lower part),
    two matmuls, instead of the transposes of every step that built the inverse."""
    inverse, solved = residuals
    grad_rhs = _matmul(jnp.swapaxes(inverse, -1, -2), grad)
    grad_a = -_matmul(grad_rhs, jnp.swapaxes(solved, -1, -2))
    return jnp.tril(grad_a, k=-1), grad_rhs


_unit_lower_solve.defvjp(_solve_forward, _solve_backward)


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + A)^-1 for A [..., C, C] strictly lower triangular, in matmuls: blocked forward
    substitution (LAPACK's trtri, FLA's chunk kernels), with C padded to a power of two by
    identity rows. The inverse of [[L1, 0], [L21, L2]] is [[X1, 0], [-X2 L21 X1, X2]] with X1,
    X2 the inverses of the diagonal blocks, which are found the same way, both at once, down
    to 1 x 1 blocks: log2(C) rounds, each on one batch."""
    size = a.shape[-1]
    padded = 1 << (size - 1).bit_length()
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, padded - size)] * 2)
    return _blocked_inverse(a)[..., :size, :size]


def _blocked_inverse(a: jax.Array) -> jax.Array:
    size = a.shape[-1]
    if size == 1:
        return jnp.ones_like(a)
    half = size // 2
    diagonal = _blocked_inverse(jnp.stack([a[..., :half, :half], a[..., half:, half:]]))
    first, second = diagonal[0], diagonal[1]
    corner = -_product(_product(second, a[..., half:, :half]), first)
    top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([corner, second], axis=-1)], axis=-2)


def _product(x: jax.Array, y: jax.Array) -> jax.Array:
    """x @ y for a batch of square blocks. Below 8 x 8 summed elementwise: XLA:CPU runs a batch
    of tiny matmuls one block at a time, slower than the rest of the inverse together."""
    if x.shape[-1] >= 8:
        return _matmul(x, y)
    return jnp.sum(x[..., :, :, None] * y[..., None, :, :], axis=-2)


# The solve's matmuls at full float32 precision: the TPU's default would round their operands
# to bfloat16, and errors of the inverse's rounds compound.
_matmul = partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)


def _chunk_decays(g: jax.Array, starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """g [B, C, h, K] (K: 1 or dk) and document starts [B, C] of a chunk -> (Gamma [B, h, c, s,
    K]: the decay from key s to query c, zero unless s <= c in one document; gamma [B, c, h,
    K]: the decay from the chunk's start to c, zero past a document start in the chunk).
    Masked before the exp, so that no positive exponent is ever taken and no gradient flows
    through a masked pair.

    The running sums are matmuls with a lower-triangular matrix of ones, not cumsums: XLA:CPU
    fused a cumsum into the [C, C] exponent that reads it, summing it anew for every pair (4x
    this function's time), and the TPU's matrix unit does it in one pass (at full float32
    precision: the log decays are exponentiated)."""
    size = g.shape[1]
    running_sum = partial(
        jnp.einsum, "cs,bs...->bc...", jnp.tri(size), precision=jax.lax.Precision.HIGHEST
    )
    cumulative = running_sum(g)  # G_c
    document = running_sum(starts.astype(jnp.float32))  # the chunk's document index of c
    visible = (document[:, :, None] == document[:, None, :]) & jnp.tri(size, dtype=bool)
    exponent = cumulative.transpose(0, 2, 1, 3)  # [B, h, C, K]
    exponent = exponent[:, :, :, None] - exponent[:, :, None, :]
    decay = jnp.exp(jnp.where(visible[:, None, :, :, None], exponent, -jnp.inf))
    reach = jnp.exp(jnp.where((document == 0)[..., None, None], cumulative, -jnp.inf))
    return decay, reach


def document_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, T] int32: 1 where a token's segment id differs from the previous token's (a
    document start past the row's first token), else 0."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed, ((0, 0), (1, 0))).astype(jnp.int32)


def _channels(g: jax.Array, beta: jax.Array) -> jax.Array:
    """The log decay with a trailing channel axis: [..., Nv] (per head: beta's shape) -> [...,
    Nv, 1]; [..., Nv, dk] (per key channel) as it is."""
    return g[..., None] if g.shape == beta.shape else g


def _value_heads(x: jax.Array, num_value_heads: int, *, axis: int) -> jax.Array:
    """Query/key heads repeated to one per value head: value head n reads head n // (Nv / Nk)."""
    return jnp.repeat(x, num_value_heads // x.shape[axis], axis=axis)
