"""Attention kinds: which keys each layer's queries see and how positions reach them, stated
per layer by model.layers (config/layer_list.py).

A softmax attention layer is `global` (causal over its whole document, RoPE), `sliding` (the
last model.sliding_window positions: Gemma 3, GPT-OSS, Mistral), `chunked` (its chunk of
model.attention_chunk positions: Llama 4) or `nope` (global with no position encoding and no
qk-norm, its query's temperature growing with the position where the model sets
model.attention_temperature: Llama 4's `QueryTemperature`). Sliding and chunked layers take
model.rope.local_theta where the family has a RoPE base of their own (Gemma 3). The kinds
differ in masks, position encoding, whether the qk-norm runs and the query's temperature only,
never in parameters, so layers of every kind share one stack (models/stacks.py) and one
checkpoint layout; the decoder hands each layer the index of its kind among the model's own
(`model_kinds`), a constant where a run of layers is all one kind and a scanned value otherwise
(the layer then picks its kind's attention with `lax.switch`: only the taken branch runs).

A chunked layer is a sliding window in disguise: within a document, a query at position p sees
the keys from p - p % chunk on, which is causal attention over documents cut at every multiple
of `chunk` (`chunk_segments`), and never more than `chunk` keys back, which a kernel told
window = chunk uses to skip the key blocks outside the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from maxtrain.config import ModelConfig
from maxtrain.layers.rope import Rope

# The softmax attention kinds, in the order a model's own are indexed (`model_kinds`).
KINDS = ("global", "sliding", "chunked", "nope")


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


def model_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The softmax attention kinds of a model's layers, in KINDS order (("global",) for a model
    without any): a layer's kind index is its kind's position here."""
    present = {t.attention for t in cfg.layer_types}
    return tuple(kind for kind in KINDS if kind in present) or ("global",)


def variants(cfg: ModelConfig, head_dim: int) -> tuple[AttentionVariant, ...]:
    """Per kind of model_kinds, its variant."""
    rotated = round(head_dim * cfg.rope.fraction)  # the config checked it is whole
    rope = Rope(rotated, cfg.rope.theta, cfg.rope.scaling, cfg.rope.interleaved)
    local_rope = rope
    if cfg.rope.local_theta is not None:
        local_rope = Rope(rotated, cfg.rope.local_theta, None, cfg.rope.interleaved)
    tuning = cfg.attention_temperature
    temperature = None if tuning is None else QueryTemperature(tuning.floor, tuning.scale)
    found = {
        "global": AttentionVariant(rope=rope),
        "sliding": AttentionVariant(window=cfg.sliding_window, rope=local_rope),
        "chunked": AttentionVariant(
            window=cfg.attention_chunk, chunk=cfg.attention_chunk, rope=local_rope
        ),
        "nope": AttentionVariant(qk_norm=False, temperature=temperature),
    }
    return tuple(found[kind] for kind in model_kinds(cfg))


def kind_per_layer(cfg: ModelConfig) -> tuple[int, ...]:
    """Per model layer: the index in model_kinds of its attention kind; 0 for a
    linear-attention layer, whose mixer has no kinds (layers/gated_deltanet.py)."""
    kinds = model_kinds(cfg)
    return tuple(
        0 if t.attention == "linear" else kinds.index(t.attention) for t in cfg.layer_types
    )


def span(cfg: ModelConfig, kind: str) -> int | None:
    """The most positions a query of this kind reaches back, itself included (None: its whole
    document): a sliding layer's window, a chunked layer's chunk."""
    return {"sliding": cfg.sliding_window, "chunked": cfg.attention_chunk}.get(kind)


def keys_per_query(cfg: ModelConfig, seq_len: int) -> tuple[float, ...]:
    """Per model layer: the keys a query attends to on average in a sequence of `seq_len`
    tokens, under its kind's causal mask, counted as model FLOPs count causal attention (the
    continuous half: seq_len / 2 for a global layer, training/metrics.py). A sliding window of
    W < T: W - W^2 / 2T (W keys once the window is full, its triangle over the first W
    queries); chunks of C: the triangles of the T // C full chunks and the last partial one,
    C^2 / 2 each, over T. A linear-attention layer attends to no keys: its recurrence's cost
    is its own (training/metrics.py). DeepSeek sparse attention's global layers (model.mla's
    indexer, sparse stage) attend to top_k keys once past them: a window's count."""
    t = seq_len
    keys = {"global": t / 2, "nope": t / 2, "linear": 0.0}
    indexer = cfg.mla.indexer if cfg.mla is not None else None
    if indexer is not None and indexer.stage == "sparse":
        k = min(indexer.top_k, t)
        keys["global"] = k - k * k / (2 * t)
    if cfg.attention_chunk is not None:
        full, rest = divmod(t, cfg.attention_chunk)
        keys["chunked"] = (full * cfg.attention_chunk**2 + rest**2) / (2 * t)
    if cfg.sliding_window is not None:
        w = min(cfg.sliding_window, t)
        keys["sliding"] = w - w * w / (2 * t)
    return tuple(keys[t.attention] for t in cfg.layer_types)


def chunk_segments(segment_ids: jax.Array, positions: jax.Array, chunk: int) -> jax.Array:
    """[B, T] -> [B, T]: ids that change wherever the document does or a position is a multiple
    of `chunk` (positions restart in every packed document, so chunks follow the document)."""
    starts = (positions % chunk == 0) | jnp.pad(
        segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0))
    )
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)
