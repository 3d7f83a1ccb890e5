"""Attention patterns: which keys each layer's queries see, stated per layer by model.layer_pattern.

A model's layers are `global` (causal over the whole document) or `local`, shaped by
model.local_attention: a sliding window of the last `window` positions (Gemma 3, GPT-OSS,
Mistral) or a chunk of `chunk` positions (Llama 4), with its own RoPE base where the family has
one (Gemma 3). The kinds differ in masks and position encoding only, never in parameters, so
layers of every kind share one stack (model/stacks.py) and one checkpoint layout; the decoder
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

from maxtrain.config import ModelArchitecture
from maxtrain.model.layers.rope import Rope

KINDS = ("global", "local")  # a layer's kind index is its position here


@dataclass(frozen=True)
class AttentionVariant:
    """What one kind of layer does differently: which keys a query sees, and its RoPE."""

    window: int | None = None  # keys i - window + 1 .. i (chunked: the chunk, for the kernel)
    chunk: int | None = None  # documents cut at every multiple of `chunk` positions
    rope: Rope | None = None

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
    found = [AttentionVariant(rope=rope)]
    local = cfg.local_attention
    if local is not None:
        local_rope = rope
        if local.rope_theta is not None:
            local_rope = Rope(rotated, local.rope_theta, None, cfg.rope_interleaved)
        found.append(AttentionVariant(window=local.span, chunk=local.chunk, rope=local_rope))
    return tuple(found)


def kind_per_layer(cfg: ModelArchitecture) -> tuple[int, ...]:
    """Per model layer: the index in KINDS of its attention kind."""
    return tuple(KINDS.index(cfg.layer_attention(i)) for i in range(cfg.num_layers))


def chunk_segments(segment_ids: jax.Array, positions: jax.Array, chunk: int) -> jax.Array:
    """[B, T] -> [B, T]: ids that change wherever the document does or a position is a multiple
    of `chunk` (positions restart in every packed document, so chunks follow the document)."""
    starts = (positions % chunk == 0) | jnp.pad(
        segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0))
    )
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)
