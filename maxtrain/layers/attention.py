"""Grouped-query self-attention with optional qk-norm, biases, sinks and RoPE; the kernel lives
in kernels/, the layer kinds (global, sliding, chunked, nope: which keys a query sees, with or
without RoPE, qk-norm and query temperature) in attention_pattern.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ModelConfig
from maxtrain.kernels.attention import attention_kernel
from maxtrain.kernels.xla_attention import cached_attention, head_max_logit
from maxtrain.layers.attention_pattern import AttentionVariant, variants
from maxtrain.layers.base import Projection
from maxtrain.layers.kv_cache import LayerCache, WindowCache
from maxtrain.layers.norms import RMSNorm
from maxtrain.layers.spec import ModelSpec
from maxtrain.parallel.context import context_attention, context_degree
from maxtrain.parallel.mesh import constrain


@dataclass(frozen=True)
class AttentionCounts:
    """What one layer of an attention kind costs per token, declared by the kind itself so that
    the FLOP count (training/metrics.py) and the memory estimate (analysis/memory.py) need not know
    it."""

    matmul_params: int  # projection weights a token multiplies against
    qk_width: int  # heads x query/key head size: the score matmul's contraction per query
    v_width: int  # heads x value head size: the value matmul's output per query
    saved: int  # elements per token remat "minimal" keeps: projection and kernel outputs
    # A linear-attention layer's (layers/gated_deltanet.py): the forward FLOPs per token
    # of its recurrence, which do not grow with the sequence, and the float32 bytes per token
    # its backward keeps besides `saved` (the states entering each chunk).
    recurrence_flops: int = 0
    state_bytes: float = 0.0


class Attention(nnx.Module):
    @staticmethod
    def counts(cfg: ModelConfig) -> AttentionCounts:
        D, N, K, H = cfg.emb_dim, cfg.num_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim
        gate = N * H if cfg.attention_output_gate else 0  # the output gate's projection
        return AttentionCounts(
            matmul_params=2 * D * N * H + 2 * D * K * H + D * gate,  # q and o; k and v; gate
            qk_width=N * H,
            v_width=N * H,
            saved=2 * N * H + 2 * K * H + D + gate,  # q, k, v, the kernel's output, o, gate
        )

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        cfg, compute = spec.model, spec.compute
        D, N, K, H = cfg.emb_dim, cfg.num_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim
        kw = spec.projection(rngs)
        qkv_bias = cfg.attention_projection_bias != "none"
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q = Projection("btd,dnh->btnh", (D, N, H), q_axes, bias=qkv_bias, **kw)
        self.k = Projection("btd,dkh->btkh", (D, K, H), kv_axes, bias=qkv_bias, **kw)
        self.v = Projection("btd,dkh->btkh", (D, K, H), kv_axes, bias=qkv_bias, **kw)
        o_bias = cfg.attention_projection_bias == "qkvo"
        self.o = Projection(
            "btnh,nhd->btd", (N, H, D), ("heads", "head_dim", "embed"), bias=o_bias, **kw
        )
        # Qwen3-Next's output gate: the kernel's output times sigmoid(x W_gate), per head and dim.
        self.output_gate = (
            Projection("btd,dnh->btnh", (D, N, H), q_axes, **kw)
            if cfg.attention_output_gate
            else None
        )
        # GPT-OSS's attention sinks: one logit per query head in every softmax's denominator
        # (the kernels take it as `sinks`), starting at zero.
        self.sinks = (
            nnx.Param(
                jnp.zeros((N,), spec.param_dtype), out_sharding=("heads",), eager_sharding=False
            )
            if cfg.attention_sinks
            else None
        )
        if cfg.qk_norm != "none":
            norm_kw = dict(eps=cfg.norm_eps, param_dtype=spec.param_dtype, rngs=rngs)
            norm_kw.update(scaled=cfg.qk_norm == "rms", plus_one=cfg.norm_scale_plus_one)
            self.q_norm = RMSNorm(H, **norm_kw)
            self.k_norm = RMSNorm(H, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        # The kernels divide the logits by sqrt(H); queries scaled by this divide them by
        # sqrt(model.softmax_scale_dim) instead, in every kernel and the decode path alike.
        self.q_scale = math.sqrt(H / (cfg.softmax_scale_dim or H))
        # The layer kinds this model has (attention_pattern.model_kinds), each with its kernel,
        # picked once, and the exchange that runs it on a sequence split over mesh.context.
        self.variants = variants(cfg, H)
        # With compute.attention_max_logit the kernels also give each head's largest logit.
        self.max_logit = compute.attention_max_logit
        self.kernels = tuple(
            attention_kernel(compute.attention, var.window, self.max_logit) for var in self.variants
        )
        self.attend_split = context_attention(compute.context_exchange, compute.context_layout)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, kind: int | jax.Array = 0
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> [B, T, D]; `kind`: the layer's index in attention_pattern.model_kinds,
        a constant, or a traced scalar where a scan runs layers of several kinds. With
        compute.attention_max_logit: (that, each query head's largest logit [N])."""
        q, k, v = self._project(x)

        def attend(variant: AttentionVariant, kernel) -> jax.Array:
            rotated_q, rotated_k = self._as_scored(variant, q, k, positions)
            segments = variant.segments(segment_ids, positions)
            if context_degree() > 1:
                return self.attend_split(
                    rotated_q, rotated_k, v, segments, self._sinks(), window=variant.window
                )
            return kernel(rotated_q, rotated_k, v, segments, self._sinks())  # [B, T, N, H]

        out = self._switch(kind, attend, zip(self.variants, self.kernels, strict=True))
        if self.max_logit:  # each head's over the batch, padding left out by the batch's ids
            out, row_max = out
            return self._output(x, out), head_max_logit(row_max, segment_ids)
        return self._output(x, out)

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: LayerCache | WindowCache, kind: int = 0
    ) -> tuple[jax.Array, LayerCache | WindowCache]:
        """Generation's path (maxtrain/inference/): the new tokens' keys and values are written into
        the layer's cache at their positions ([B, T], consecutive per row; -1: a prefill's padding),
        and the queries attend over what the cache gives them: all of a global layer's, a sliding or
        chunked layer's ring and the new keys (layers/kv_cache.py). `kind` is a constant: the cache
        is of its kind. Same projections, norms and RoPE as the training path."""
        q, k, v = self._project(x)
        variant = self.variants[kind]
        q, k = self._as_scored(variant, q, k, positions)
        cache, (keys, values, key_positions) = cache.update(k, v, positions)
        out = cached_attention(
            q, keys, values, positions, self._sinks(), window=variant.window, chunk=variant.chunk,
            k_positions=key_positions,
        )  # fmt: skip
        return self._output(x, out), cache

    @staticmethod
    def _switch(kind, branch, per_kind):
        """branch(*args of the layer's kind): directly for a constant kind, else by lax.switch
        over every kind the model has (only the taken one runs)."""
        per_kind = list(per_kind)
        if isinstance(kind, int):
            return branch(*per_kind[kind])
        return jax.lax.switch(kind, [lambda args=args: branch(*args) for args in per_kind])

    def _output(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """The attention output [B, T, N, H] of input x projected back to [B, T, D], gated
        first where the model has an output gate."""
        if self.output_gate is not None:
            gate = constrain(self.output_gate(x), ("batch", "length", "heads", "head_dim"))
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return self.o(out)

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...]

    def _project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """Queries, keys and values of x [B, T, D]."""
        q = constrain(self.q(x), ("batch", "length", "heads", "head_dim"))  # [B, T, N, H]
        k = constrain(self.k(x), ("batch", "length", "kv_heads", "head_dim"))  # [B, T, K, H]
        v = constrain(self.v(x), ("batch", "length", "kv_heads", "head_dim"))  # [B, T, K, H]
        return q, k, v

    def _as_scored(self, variant: AttentionVariant, q, k, positions) -> tuple[jax.Array, ...]:
        """Queries and keys as the layer's kind scores them: qk-normed, rotated, the query
        tempered, each where the kind does. (RoPE turns pairs of dims and leaves each head's
        RMS as it was, so norming first, as Qwen3 does, gives Llama 4's numbers too, which
        norms the rotated heads.)"""
        if self.q_norm is not None and variant.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if variant.rope is not None:
            q, k = variant.rope(q, positions), variant.rope(k, positions)
        if variant.temperature is not None:
            q = variant.temperature(q, positions)
        if self.q_scale != 1.0:
            q = q * self.q_scale  # a weak-typed float: q keeps its dtype
        return q, k
