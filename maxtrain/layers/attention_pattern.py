"""Attention patterns: which keys each layer's queries see, stated per layer by model.layer_pattern.

A model's layers are `global` (causal over the whole document) or `local`, shaped by
model.local_attention: a sliding window of the last `window` positions (Gemma 3, GPT-OSS,
Mistral) or a chunk of `chunk` positions (Llama 4), with its own RoPE base where the family has
one (Gemma 3). Global layers may differ from the model's defaults too (model.global_attention):
Llama 4's have no RoPE (NoPE), no qk-norm, and a query temperature that grows with the position
(`QueryTemperature`). The kinds differ in masks, position encoding, whether the qk-norm runs and
the query's temperature only, never in parameters, so
layers of every kind share one stack (models/stacks.py) and one checkpoint layout; the decoder
hands each layer its kind's index (`KINDS`), a constant where a run of layers is all one kind
and a scanned value otherwise (the layer then picks its kind's attention with `lax.switch`:
only the taken branch runs).

A chunked layer is a sliding window in disguise: within a document, a query at position p sees
the keys from p - p % chunk on, which is causal attention over documents cut at every multiple
of `chunk` (`chunk_segments`), and never more than `chunk` keys back, which a kernel told
window = chunk uses to skip the key blocks outside the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from maxtrain.config import GlobalAttention, ModelArchitecture
from maxtrain.layers.rope import Rope

KINDS = ("global", "local")  # a layer's kind index is its position here


@dataclass(frozen=True)
class QueryTemperature:
    """Llama 4's attention temperature tuning (its NoPE layers): the query at position p times
    1 + scale * ln(1 + floor((p + 1) / floor)), which is 1 up to position floor - 2 and grows
    slowly past it, sharpening attention over long contexts that no position encoding cues."""

    floor: int
    scale: float

    def __call__(self, q: jax.Array, positions: jax.Array) -> jax.Array:
        """q [B, T, N, H] at positions [B, T] -> q scaled, same dtype."""
        steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / self.floor)
        factor = 1.0 + self.scale * jnp.log1p(steps)
        return (q.astype(jnp.float32) * factor[:, :, None, None]).astype(q.dtype)


@dataclass(frozen=True)
class AttentionVariant:
    """What one kind of layer does differently: which keys a query sees, its RoPE (None: no
    position encoding), whether the model's qk-norm runs, and the query's temperature."""

    window: int | None = None  # keys i - window + 1 .. i (chunked: the chunk, for the kernel)
    chunk: int | None = None  # documents cut at every multiple of `chunk` positions
    rope: Rope | None = None
    qk_norm: bool = True  # the model's qk-norm, where it has one, runs on this kind
    temperature: QueryTemperature | None = None

    def segments(self, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """The segment ids the kernel masks by: the documents, cut into chunks if chunked."""
        return (
            segment_ids
            if self.chunk is None
            else chunk_segments(segment_ids, positions, self.chunk)
        )


def variants(cfg: ModelArchitecture, head_dim: int) -> tuple[AttentionVariant, ...]:
    """Per kind of KINDS, its variant for a model (a local one only if the model has one)."""
    rotated = round(head_dim * cfg.partial_rotary_factor)  # the config checked it is whole
    rope = Rope(rotated, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleaved)
    glob = cfg.global_attention or GlobalAttention()
    temperature = None
    if glob.temperature_floor is not None:
        temperature = QueryTemperature(glob.temperature_floor, glob.temperature_scale)
    found = [
        AttentionVariant(
            rope=rope if glob.rope else None, qk_norm=glob.qk_norm, temperature=temperature
        )
    ]
    local = cfg.local_attention
    if local is not None:
        local_rope = rope
        if local.rope_theta is not None:
            local_rope = Rope(rotated, local.rope_theta, None, cfg.rope_interleaved)
        found.append(AttentionVariant(window=local.span, chunk=local.chunk, rope=local_rope))
    return tuple(found)


def kind_per_layer(cfg: ModelArchitecture) -> tuple[int, ...]:
    """Per model layer: the index in KINDS of its attention kind; 0 for a linear-attention
    layer, whose mixer has no kinds (layers/gated_deltanet.py)."""
    kinds = [cfg.layer_attention(i) for i in range(cfg.num_layers)]
    return tuple(0 if kind == "linear" else KINDS.index(kind) for kind in kinds)


def keys_per_query(cfg: ModelArchitecture, seq_len: int) -> tuple[float, ...]:
    """Per model layer: the keys a query attends to on average in a sequence of `seq_len`
    tokens, under its kind's causal mask, counted as model FLOPs count causal attention (the
    continuous half: seq_len / 2 for a global layer, training/metrics.py). A sliding window of
    W < T: W - W^2 / 2T (W keys once the window is full, its triangle over the first W
    queries); chunks of C: the triangles of the T // C full chunks and the last partial one,
    C^2 / 2 each, over T. A linear-attention layer attends to no keys: its recurrence's cost
    is its own (training/metrics.py)."""
    t = seq_len
    local = cfg.local_attention
    if local is None:
        local_keys = t / 2
    elif local.chunk is not None:
        full, rest = divmod(t, local.chunk)
        local_keys = (full * local.chunk**2 + rest**2) / (2 * t)
    else:
        w = min(local.window, t)
        local_keys = w - w * w / (2 * t)
    keys = {"global": t / 2, "local": local_keys, "linear": 0.0}
    return tuple(keys[cfg.layer_attention(i)] for i in range(cfg.num_layers))


def chunk_segments(segment_ids: jax.Array, positions: jax.Array, chunk: int) -> jax.Array:
    """[B, T] -> [B, T]: ids that change wherever the document does or a position is a multiple
    of `chunk` (positions restart in every packed document, so chunks follow the document)."""
    starts = (positions % chunk == 0) | jnp.pad(
        segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0))
    )
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)
