"""Gated DeltaNet: Qwen3-Next's linear-attention layer, a fixed-size state in place of a KV cache.

    q, k, v   x -> projection -> causal depthwise convolution (`conv_kernel` taps) -> SiLU,
              q and k then L2-normalised per head
    g, beta   x -> per value head a, b:  g = -exp(a_log) softplus(a + dt_bias), beta = sigmoid(b)
    mix       the gated delta rule over (q, k, v, g, beta) (kernels/gated_delta_rule.py)
    out       RMSNorm(mix) * silu(z) per value head (z = x -> projection), then the output map

as transformers 5.23.0's Qwen3NextGatedDeltaNet computes it. With `channel_decay`, Kimi Delta
Attention (transformers' KimiLinearDeltaAttention, Kimi Linear's): the decay per value head and
key channel, g = -exp(a_log) softplus(a + dt_bias) with a = x -> rank-dk projection -> [Nv, dk]
and dt_bias [Nv, dk]; z from a rank-dv projection; the output RMSNorm(mix) * sigmoid(z). The
kernel takes a decay of either shape. Query/key heads (Nk) may be fewer
than value heads (Nv, a multiple): value head n reads query/key head n // (Nv / Nk). On a mesh
they split like attention's: value heads are the layer's `heads`, query/key heads its
`kv_heads` (mesh.rules), so that a device's value heads read only its own query/key heads.

Training (`__call__`) runs the chunked form over packed rows: both the convolution and the delta
rule start afresh at each document (a token whose segment id differs from the previous
token's), so nothing leaks from one document into the next. Generation (`step`) carries a
`DeltaNetState` instead (layers/kv_cache.py, beside attention's caches): the convolution's last
`conv_kernel - 1` inputs and the rule's state, O(1) in the length. `cached` is `step` under the
decoder's decode contract (the attention layers' `cached`, models/decoder.py): the state is the
layer's decode cache, and a right-padded prefill's padding (position -1) leaves it as the
row's last real token left it. transformers' fused checkpoint tensors map to these parameters in
maxtrain/hf/families/qwen3_next.py.

Shape letters: the package's; Nk/Nv the query/key and value heads, dk/dv their head sizes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.kernels.gated_delta_rule import (
    chunked_gated_delta_rule,
    document_starts,
    gated_delta_step,
)
from maxtrain.layers.attention import AttentionCounts
from maxtrain.layers.base import Projection, make_param
from maxtrain.layers.kv_cache import DeltaNetState
from maxtrain.layers.norms import RMSNorm
from maxtrain.parallel.mesh import constrain

# transformers' l2norm: x / sqrt(sum(x^2) + eps), what the chunked kernels it mirrors (FLA) use.
L2_NORM_EPS = 1e-6
KEY_AXES = ("batch", "length", "kv_heads", "head_dim")
VALUE_AXES = ("batch", "length", "heads", "head_dim")


class GatedDeltaNet(nnx.Module):
    @staticmethod
    def counts(cfg: ModelConfig) -> AttentionCounts:
        """A linear layer's cost per token (attention's kinds declare theirs alike): its
        projections and convolution taps; no keys attended, so no score or value matmuls; the
        recurrence's model FLOPs, those of its step form (per value head: S k, S q and the
        rank-one write, dk dv multiply-adds each), not the chunked kernel's extra work."""
        la = cfg.linear_attention
        assert la is not None  # a linear layer implies it
        D, heads = cfg.emb_dim, la.num_value_heads
        key, value = la.num_key_heads * la.key_head_dim, heads * la.value_head_dim
        state = heads * la.key_head_dim * la.value_head_dim
        dk, dv = la.key_head_dim, la.value_head_dim  # z and a: direct, or through ranks dv, dk
        gates = (
            (D + heads) * dv + (D + heads * dk) * dk if la.channel_decay else D * (value + heads)
        )
        return AttentionCounts(
            # q, k, v; z and a; b; o; the taps over q, k and v
            matmul_params=D * (2 * key + value)
            + gates
            + D * heads
            + value * D
            + la.conv_kernel * (2 * key + value),
            qk_width=0,
            v_width=0,
            # q, k, v and their convolutions, z, b and a, the kernel's output, o
            saved=2 * (2 * key + value) + value + 2 * heads + value + D,
            recurrence_flops=2 * 3 * state,
            state_bytes=4 * state / la.chunk,
        )

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        *,
        conv_kernel: int = 4,
        chunk: int = 64,
        channel_decay: bool = False,
        norm_eps: float = 1e-6,
        init_std: float,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"value heads ({num_v_heads}) must be a multiple of query/key heads ({num_k_heads})"
            )
        D, Nk, Nv, dk, dv = hidden, num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.chunk = chunk
        self.channel_decay = channel_decay
        self.compute_dtype = compute_dtype
        kw = dict(
            init_std=init_std, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs
        )
        key, value = ("embed", "kv_heads", "head_dim"), ("embed", "heads", "head_dim")
        self.q = Projection("btd,dkh->btkh", (D, Nk, dk), key, **kw)
        self.k = Projection("btd,dkh->btkh", (D, Nk, dk), key, **kw)
        self.v = Projection("btd,dnh->btnh", (D, Nv, dv), value, **kw)
        self._gates(D, Nv, dk, dv, **kw)
        # Depthwise taps [conv_kernel, heads, head dim], oldest input first (transformers'
        # conv1d.weight[c, 0, :]); the spread of PyTorch's default Conv1d init, U(+-1/sqrt(K)).
        conv = dict(std=(3 * conv_kernel) ** -0.5, dtype=param_dtype)
        self.q_conv = make_param(rngs, (conv_kernel, Nk, dk), (None, *key[1:]), **conv)
        self.k_conv = make_param(rngs, (conv_kernel, Nk, dk), (None, *key[1:]), **conv)
        self.v_conv = make_param(rngs, (conv_kernel, Nv, dv), (None, *value[1:]), **conv)
        # Per value head decay rate exp(a_log) and time-step bias (per key channel with
        # channel_decay), initialised as transformers does: exp(a_log) uniform in [0.01, 16],
        # dt_bias 1.
        a = jax.random.uniform(rngs.params(), (Nv,), jnp.float32, 0.01, 16.0)
        self.a_log = nnx.Param(
            jnp.log(a).astype(param_dtype), out_sharding=("heads",), eager_sharding=False
        )
        shape, axes = ((Nv, dk), value[1:]) if channel_decay else ((Nv,), ("heads",))
        self.dt_bias = nnx.Param(
            jnp.ones(shape, param_dtype), out_sharding=axes, eager_sharding=False
        )
        self.norm = RMSNorm(dv, eps=norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.o = Projection("btnh,nhd->btd", (Nv, dv, D), ("heads", "head_dim", "embed"), **kw)

    def _gates(self, D: int, Nv: int, dk: int, dv: int, **kw) -> None:
        """The output gate z, the write strength's b and the decay's a (in that order, the
        random draws' of every checkpoint before): per value head from x (Gated DeltaNet), or
        with channel_decay z and a through ranks dv and dk, a per key channel."""
        value, per_head = ("embed", "heads", "head_dim"), ("embed", "heads")
        if self.channel_decay:  # x -> [rank] -> [Nv, dv] or [Nv, dk]
            self.z_down = Projection("btd,dr->btr", (D, dv), ("embed", "latent"), **kw)
            self.z = Projection("btr,rnh->btnh", (dv, Nv, dv), ("latent", *value[1:]), **kw)
        else:
            self.z = Projection("btd,dnh->btnh", (D, Nv, dv), value, **kw)
        self.b = Projection("btd,dn->btn", (D, Nv), per_head, **kw)
        if self.channel_decay:
            self.a_down = Projection("btd,dr->btr", (D, dk), ("embed", "latent"), **kw)
            self.a = Projection("btr,rnh->btnh", (dk, Nv, dk), ("latent", *value[1:]), **kw)
        else:
            self.a = Projection("btd,dn->btn", (D, Nv), per_head, **kw)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, kind: int = 0
    ) -> jax.Array:
        """Training's path: x [B, T, D] of packed documents (segment_ids [B, T]) -> [B, T, D].
        `positions` and `kind` are the token mixers' common arguments (models/decoder.py): the
        recurrence reads neither, its order is the sequence's."""
        q, k, v, z, g, beta = self._project(x)
        documents = jnp.cumsum(document_starts(segment_ids), axis=1)
        convolved = []
        for stream, taps in ((q, self.q_conv), (k, self.k_conv), (v, self.v_conv)):
            history = jnp.zeros((x.shape[0], taps.shape[0] - 1, *stream.shape[2:]), stream.dtype)
            convolved.append(_causal_conv(stream, taps[...], history, documents)[0])
        q, k, v = convolved
        out, _ = chunked_gated_delta_rule(
            _l2_normalize(q), _l2_normalize(k), v, g, beta, segment_ids, chunk=self.chunk
        )
        return self._output(out, z)

    def init_state(self, batch: int) -> DeltaNetState:
        """The state before a row's first token: nothing convolved, nothing remembered."""
        taps, nk, dk = self.q_conv.shape
        nv, dv = self.v_conv.shape[1:]
        return DeltaNetState.zeros((batch,), nk, nv, dk, dv, taps, self.compute_dtype)

    def step(
        self, x: jax.Array, state: DeltaNetState, real: jax.Array | None = None
    ) -> tuple[jax.Array, DeltaNetState]:
        """Generation's path: x [B, T, D], the tokens following `state` in one document per row
        -> (output [B, T, D], the state after them). T = 1 (a decode step) runs the recurrence
        itself; more tokens (a prefill) run in chunks from the state. `real` [B, T] (None: all
        real) marks each row's tokens, False on a right-padded row's padding, whose tokens
        neither decay nor write the rule's state (g = 0, beta = 0) and which the convolution's
        window skips, ending at the row's last real token; their outputs mean nothing."""
        q, k, v, z, g, beta = self._project(x)
        if real is not None:
            per_token = real.reshape(*real.shape, *(1,) * (g.ndim - 2))  # over g's heads, dims
            g, beta = jnp.where(per_token, g, 0.0), jnp.where(real[..., None], beta, 0.0)
        ends = None if real is None else jnp.sum(real, axis=1)  # real tokens per row
        convolved, windows = [], []
        streams = ((q, self.q_conv), (k, self.k_conv), (v, self.v_conv))
        for (stream, taps), history in zip(streams, self._histories(state.conv), strict=True):
            mixed, window = _causal_conv(stream, taps[...], history.astype(stream.dtype), ends=ends)
            convolved.append(mixed)
            windows.append(window.reshape(*window.shape[:2], -1))
        q, k, v = _l2_normalize(convolved[0]), _l2_normalize(convolved[1]), convolved[2]
        if x.shape[1] == 1:
            out, recurrent = gated_delta_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent
            )
            out = out[:, None]
        else:
            out, recurrent = chunked_gated_delta_rule(
                q, k, v, g, beta, initial_state=state.recurrent, chunk=self.chunk
            )
        conv = jnp.concatenate(windows, axis=-1).astype(state.conv.dtype)
        return self._output(out, z), DeltaNetState(conv, recurrent)

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: DeltaNetState, kind: int = 0
    ) -> tuple[jax.Array, DeltaNetState]:
        """The decoder's decode contract (as attention's `cached`, models/decoder.py): new tokens
        x [B, T, D] at positions [B, T] (-1: a prefill's right padding) continuing the layer's
        cache, its state -> (output [B, T, D], the state after each row's last real token).
        The recurrence reads no position but their order; `kind` is attention's, none here."""
        return self.step(x, cache, positions >= 0)

    def _project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [B, T, D] -> q/k [B, T, Nk, dk], v/z [B, T, Nv, dv] in compute dtype, the log
        decay g [B, T, Nv] (with channel_decay [B, T, Nv, dk]) and the write strength beta
        [B, T, Nv] in float32."""
        q = constrain(self.q(x), KEY_AXES)
        k = constrain(self.k(x), KEY_AXES)
        v = constrain(self.v(x), VALUE_AXES)
        b = constrain(self.b(x), VALUE_AXES[:3]).astype(jnp.float32)
        rate = jnp.exp(self.a_log[...].astype(jnp.float32))
        if self.channel_decay:
            z = constrain(self.z(self.z_down(x)), VALUE_AXES)
            a = constrain(self.a(self.a_down(x)), VALUE_AXES).astype(jnp.float32)
            rate = rate[:, None]
        else:
            z = constrain(self.z(x), VALUE_AXES)
            a = constrain(self.a(x), VALUE_AXES[:3]).astype(jnp.float32)
        g = -rate * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        return q, k, v, z, g, jax.nn.sigmoid(b)

    def _histories(self, conv: jax.Array) -> list[jax.Array]:
        """A state's convolution window [B, K - 1, C] as q, k, v windows [B, K - 1, heads, dim]."""
        shapes = [w.shape[1:] for w in (self.q_conv, self.k_conv, self.v_conv)]
        bounds = [math.prod(shapes[0]), 2 * math.prod(shapes[0])]
        parts = jnp.split(conv, bounds, axis=-1)
        return [p.reshape(*p.shape[:2], *s) for p, s in zip(parts, shapes, strict=True)]

    def _output(self, mixed: jax.Array, z: jax.Array) -> jax.Array:
        """The gated RMSNorm, RMSNorm(mixed) * silu(z) per value head (sigmoid(z) with
        channel_decay), then the output map."""
        mixed = constrain(mixed.astype(self.compute_dtype), VALUE_AXES)
        gate = (jax.nn.sigmoid if self.channel_decay else jax.nn.silu)(z.astype(jnp.float32))
        return self.o((self.norm(mixed).astype(jnp.float32) * gate).astype(self.compute_dtype))


def _causal_conv(
    x: jax.Array,
    taps: jax.Array,
    history: jax.Array,
    documents: jax.Array | None = None,
    *,
    ends: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """silu of the causal depthwise convolution of x [B, T, h, d] with taps [K, h, d] (tap K - 1
    on the current input), `history` [B, K - 1, h, d] the inputs before x. With documents
    [B, T] (each token's document index in its row, from 0), an input of another document
    than the output's counts as zero; history belongs to the row's first document. Returns
    (output [B, T, h, d], the last K - 1 inputs, or with ends [B] those up to each row's
    token ends - 1: the window the row's next token needs)."""
    size, t = taps.shape[0], x.shape[1]
    full = jnp.concatenate([history, x], axis=1)
    if documents is not None:
        padded = jnp.pad(documents, ((0, 0), (size - 1, 0)))
    out = jnp.zeros_like(x)
    for i in range(size):
        term = full[:, i : i + t]
        if documents is not None:
            same = padded[:, i : i + t] == documents
            term = jnp.where(same[:, :, None, None], term, 0)
        out = out + term * taps[i].astype(x.dtype)
    if ends is None:
        window = full[:, t:]
    else:  # per row: full's entries ends .. ends + K - 2 (x's token ends - 1 the last)
        window = jax.vmap(lambda f, e: jax.lax.dynamic_slice_in_dim(f, e, size - 1))(full, ends)
    return jax.nn.silu(out), window


def _l2_normalize(x: jax.Array) -> jax.Array:
    """x / |x| per head (last axis), in float32, as transformers normalises q and k."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)
