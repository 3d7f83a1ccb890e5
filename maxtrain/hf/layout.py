"""Where each Hugging Face tensor lives in our parameter tree, and how the two layouts differ.

transformers stores every linear map as a torch nn.Linear weight: [out, in], with heads
flattened into the feature axis (q_proj: [N*H, D], o_proj: [D, N*H]). Our kernels are einsum
operands with the input axes first and heads kept apart (layers/): q [D, N, H], o [N, H, D],
gate [D, F], down [F, D], router [D, E], lm_head [D, V]. So one rule converts every linear
weight: ours = W.T reshaped to our axes, W = ours flattened to [in, out] and transposed. No
q/k permutation is needed: our RoPE pairs dim i with i + H/2 ("rotate half"), as transformers
does. Embedding and norm scales have the same layout on both sides; a bias is the flattened
output of its projection (q_proj.bias: [N*H], ours [N, H]).

Our per-layer parameters are stacked: model layer i is row stack_positions(...)[i] of its
kind's stack (models/stacks.py), and a MoE layer's experts add one more axis. A Slot names one
Hugging Face tensor (or its part) and that position. A family may store all of a layer's
experts as one tensor, in our layout, with two projections side by side (Llama 4's
gate_up_proj [E, D, 2F]) or interleaved (GPT-OSS's): each of ours is then a Slot of one Part
of the tensor's last axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import numpy as np

from maxtrain.config import ModelConfig
from maxtrain.models.stacks import STACKS, layer_kinds, stack_positions


class Part(NamedTuple):
    """Part `index` of a tensor's last axis, which repeats groups of runs of `widths` columns
    each: ours is run `index` of every group. One group of equal runs is a contiguous block
    (Llama 4's gate_up_proj: the gate's F columns, then the up projection's: widths (F, F)),
    runs of one column interleave (GPT-OSS's: the gate's at even columns: widths (1, 1)), and
    a group per head splits heads' blocks (Qwen3-Next's q_proj: per head its query, then its
    output gate: widths (H, H))."""

    index: int
    widths: tuple[int, ...]

    def of(self, tensor: np.ndarray) -> np.ndarray:
        groups = tensor.reshape(*tensor.shape[:-1], -1, sum(self.widths))
        start = sum(self.widths[: self.index])
        run = groups[..., start : start + self.widths[self.index]]
        return run.reshape(*tensor.shape[:-1], -1)

    def whole_width(self, width: int) -> int:
        """The last axis' size of the tensor whose part has `width` columns."""
        return width // self.widths[self.index] * sum(self.widths)


# (our path inside a layer, Hugging Face name inside `model.layers.<i>.`, input axes of a
# linear weight or None)
_NORMS = (
    (("attn_norm", "scale"), "input_layernorm.weight", None),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", None),
)
# model.block_norms sandwich (Gemma 3): post_attention_layernorm is there the attention
# output's norm, and the feed-forward's input norm is pre_feedforward_layernorm.
_SANDWICH_NORMS = (
    (("attn_norm", "scale"), "input_layernorm.weight", None),
    (("attn_post_norm", "scale"), "post_attention_layernorm.weight", None),
    (("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", None),
    (("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight", None),
)
_ATTENTION = (
    (("attn", "q", "kernel"), "self_attn.q_proj.weight", 1),
    (("attn", "k", "kernel"), "self_attn.k_proj.weight", 1),
    (("attn", "v", "kernel"), "self_attn.v_proj.weight", 1),
    (("attn", "o", "kernel"), "self_attn.o_proj.weight", 2),
)
# Multi-head latent attention (layers/mla.py): the query's two layouts, then the rest.
_MLA_Q = ((("attn", "q", "kernel"), "self_attn.q_proj.weight", 1),)
_MLA_Q_LORA = (
    (("attn", "q_a", "kernel"), "self_attn.q_a_proj.weight", 1),
    (("attn", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", None),
    (("attn", "q_b", "kernel"), "self_attn.q_b_proj.weight", 1),
)
_MLA = (
    (("attn", "kv_a", "kernel"), "self_attn.kv_a_proj_with_mqa.weight", 1),
    (("attn", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", None),
    (("attn", "kv_b", "kernel"), "self_attn.kv_b_proj.weight", 1),
    (("attn", "o", "kernel"), "self_attn.o_proj.weight", 2),
)
# Attention biases (model.attention_projection_bias): input axes 0, as a bias has none.
_QKV_BIAS = (
    (("attn", "q", "bias"), "self_attn.q_proj.bias", 0),
    (("attn", "k", "bias"), "self_attn.k_proj.bias", 0),
    (("attn", "v", "bias"), "self_attn.v_proj.bias", 0),
)
_O_BIAS = ((("attn", "o", "bias"), "self_attn.o_proj.bias", 0),)
_QK_NORM = (
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", None),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", None),
)
_SINKS = ((("attn", "sinks"), "self_attn.sinks", None),)


@dataclass(frozen=True)
class Slot:
    """One Hugging Face tensor: its name, our parameter path, and the position in that
    (stacked) parameter: () for embedding/final norm/head, (layer,) or (layer, expert)."""

    hf_name: str
    path: tuple[str, ...]
    index: tuple[int, ...]
    # A linear weight: leading input axes of our kernel (0: a bias, flattened); None: same layout
    in_axes: int | None
    part: Part | None = None  # our block is this part of the tensor's last axis; None: all of it
    # Axes of size 1 the Hugging Face tensor has and ours not (Conv1d's input channel per
    # group, conv1d.weight [C, 1, K]: 1; Kimi Linear's A_log [1, 1, H, 1]: (0, 1, 3)); None:
    # none.
    unit_axis: int | tuple[int, ...] | None = None

    def hf_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face shape of a tensor whose block of our parameter has block_shape."""
        shape = list(self._in_major_shape(block_shape))
        if self.part is not None:
            shape[-1] = self.part.whole_width(shape[-1])
        if self.in_axes:
            shape.reverse()
        for axis in sorted(np.atleast_1d(self.unit_axis if self.unit_axis is not None else [])):
            shape.insert(axis, 1)
        return tuple(shape)

    def _in_major_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.in_axes is None:
            return tuple(block_shape)
        if self.in_axes == 0:
            return (math.prod(block_shape),)
        return (math.prod(block_shape[: self.in_axes]), math.prod(block_shape[self.in_axes :]))

    def to_ours(self, tensor: np.ndarray, block_shape: tuple[int, ...]) -> np.ndarray:
        if self.unit_axis is not None:
            tensor = np.squeeze(tensor, self.unit_axis)
        if self.in_axes:
            tensor = tensor.T
        if self.part is not None:
            tensor = self.part.of(tensor)
        return tensor.reshape(block_shape)

    def in_major(self, block: np.ndarray) -> np.ndarray:
        """Our block with its input axes flattened first and its output axes last: the layout
        whose last axis Parts split (hf_tensor finishes the Hugging Face layout)."""
        return block.reshape(self._in_major_shape(block.shape))


def hf_tensor(parts: list[Slot], blocks: list[np.ndarray]) -> np.ndarray:
    """The Hugging Face tensor of the Slots that share it (several: its Parts along the last
    axis, in order) and their blocks of our parameters."""
    first = parts[0]
    runs = [slot.in_major(block) for slot, block in zip(parts, blocks, strict=True)]
    if first.part is None:
        tensor = runs[0]
    else:
        grouped = [
            run.reshape(*run.shape[:-1], -1, slot.part.widths[slot.part.index])
            for slot, run in zip(parts, runs, strict=True)
        ]
        tensor = np.concatenate(grouped, axis=-1).reshape(*runs[0].shape[:-1], -1)
    if first.in_axes:
        tensor = tensor.T
    return tensor if first.unit_axis is None else np.expand_dims(tensor, first.unit_axis)


def _attention(cfg: ModelConfig) -> tuple:
    """A layer's attention and norm tensors: (our path, Hugging Face name, input axes)."""
    norms = _SANDWICH_NORMS if cfg.block_norms == "sandwich" else _NORMS
    if cfg.mla is None:
        by_kind = {"none": (), "qkv": _QKV_BIAS, "qkvo": _QKV_BIAS + _O_BIAS}
        biases = by_kind[cfg.attention_projection_bias]
        sinks = _SINKS if cfg.attention_sinks else ()
        qk_norm = _QK_NORM if cfg.qk_norm == "rms" else ()
        return norms + _ATTENTION + biases + sinks + qk_norm
    return norms + (_MLA_Q if cfg.mla.q_lora_rank is None else _MLA_Q_LORA) + _MLA


class LayerSite(NamedTuple):
    """Where one decoder layer's tensors go: its Hugging Face name prefix (`model.layers.<i>.`),
    its kind's stack in our tree and its row there, its token mixer and feed-forward kind."""

    prefix: str
    stack: str
    row: int
    mixer: str
    is_moe: bool

    def slot(
        self,
        name: str,
        path: tuple[str, ...],
        in_axes: int | None,
        part: Part | None = None,
        expert: int | None = None,
    ) -> Slot:
        """The Slot of the layer's tensor `name` (after the prefix) at `path` in its block
        (and at `expert` along the experts' axis)."""
        index = (self.row,) if expert is None else (self.row, expert)
        return Slot(self.prefix + name, (self.stack, *path), index, in_axes, part)


def _mixer(cfg: ModelConfig, site: LayerSite) -> list[Slot]:
    """A layer's norms and, for an attention layer, its attention tensors (the tensors of
    another token mixer are its family's: Qwen3-Next's Gated DeltaNet)."""
    table = _attention(cfg) if site.mixer == "attention" else _NORMS
    out = [site.slot(name, path, ax) for path, name, ax in table]
    if cfg.attention_output_gate and site.mixer == "attention":
        # q_proj [N 2H, D]: per head its query's H rows, then its output gate's
        q = next(slot for slot in out if slot.path[-2:] == ("q", "kernel"))
        widths = (cfg.resolved_head_dim,) * 2
        gate = replace(q, path=(site.stack, "attn", "output_gate", "kernel"), part=Part(1, widths))
        out[out.index(q)] = replace(q, part=Part(0, widths))
        out.append(gate)
    return out


class TensorSource(Protocol):
    def tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]: ...


class HasAspects(Protocol):
    """A family (family.py): its aspects name the tensors of a layer this module does not."""

    @property
    def aspects(self) -> Sequence[TensorSource]: ...


def slots(cfg: ModelConfig, family: HasAspects) -> list[Slot]:
    """Every tensor of `cfg` as a `family` checkpoint, in model order (embedding, layers,
    final norm, head): the attention and norms here, the rest from the family's aspects."""
    out = [Slot("model.embed_tokens.weight", ("embedding",), (), None)]
    kinds = layer_kinds(cfg)
    for i, (kind, row) in enumerate(zip(kinds, stack_positions(kinds), strict=True)):
        site = LayerSite(f"model.layers.{i}.", STACKS[kind], row, kind.mixer, kind.is_moe)
        out += _mixer(cfg, site)
        for aspect in family.aspects:
            out += aspect.tensors(cfg, site)
    out.append(Slot("model.norm.weight", ("final_norm", "scale"), (), None))
    if not cfg.tie_embeddings:
        out.append(Slot("lm_head.weight", ("lm_head", "kernel"), (), 1))
    return out
