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
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from maxtrain.config import LinearAttention, ModelConfig, MoeConfig
from maxtrain.hf.families import Family
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
_EXPERTS = ("gate", "up", "down")  # ours, in the order of Family.expert_names
# A dense layer's SwiGLU, inside Family.dense_block.
_DENSE_MLP = tuple((("mlp", ours, "kernel"), f"{ours}_proj.weight", 1) for ours in _EXPERTS)
# GPT-OSS's fused experts inside the MoE block (Family.expert_layout "gpt_oss"): (our path
# inside `moe`, Hugging Face name, input axes, Part of the interleaved columns or None).
_GATE, _UP = Part(0, (1, 1)), Part(1, (1, 1))
_GPT_OSS_MOE = (
    (("router", "kernel"), "router.weight", 1, None),
    (("router", "logit_bias"), "router.bias", None, None),
    (("gate", "kernel"), "experts.gate_up_proj", None, _GATE),
    (("up", "kernel"), "experts.gate_up_proj", None, _UP),
    (("gate", "bias"), "experts.gate_up_proj_bias", None, _GATE),
    (("up", "bias"), "experts.gate_up_proj_bias", None, _UP),
    (("down", "kernel"), "experts.down_proj", None, None),
    (("down", "bias"), "experts.down_proj_bias", None, None),
)
_SINKS = ((("attn", "sinks"), "self_attn.sinks", None),)
_SHARED = tuple((("moe", "shared", ours, "kernel"), f"{ours}_proj.weight", 1) for ours in _EXPERTS)


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
    # An axis of size 1 the Hugging Face tensor has and ours not (Conv1d's input channel per
    # group, conv1d.weight [C, 1, K]); None: none.
    unit_axis: int | None = None

    def hf_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face shape of a tensor whose block of our parameter has block_shape."""
        shape = list(self._in_major_shape(block_shape))
        if self.part is not None:
            shape[-1] = self.part.whole_width(shape[-1])
        if self.in_axes:
            shape.reverse()
        if self.unit_axis is not None:
            shape.insert(self.unit_axis, 1)
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


def _mixer(cfg: ModelConfig, mixer: str, prefix: str, stack: str, j: int) -> list[Slot]:
    """A layer's norms and token mixer: attention, or Gated DeltaNet (`linear_attn.`)."""
    plain = _NORMS if mixer == "linear" else _attention(cfg)
    table = tuple((path, name, ax, None, None) for path, name, ax in plain)
    if mixer == "linear":
        assert cfg.linear_attention is not None  # a linear layer implies it
        table += linear_attention_tensors(cfg.linear_attention)
    out = [
        Slot(prefix + name, (stack, *path), (j,), ax, part, unit_axis)
        for path, name, ax, part, unit_axis in table
    ]
    if cfg.attention_output_gate and mixer == "attention":
        # q_proj [N 2H, D]: per head its query's H rows, then its output gate's
        q = next(slot for slot in out if slot.path[-2:] == ("q", "kernel"))
        widths = (cfg.resolved_head_dim,) * 2
        gate = Slot(q.hf_name, (stack, "attn", "output_gate", "kernel"), (j,), 1, Part(1, widths))
        out[out.index(q)] = Slot(q.hf_name, q.path, (j,), 1, Part(0, widths))
        out.append(gate)
    return out


def linear_attention_tensors(linear: LinearAttention) -> tuple:
    """A Gated DeltaNet layer's tensors inside `linear_attn.` (transformers' fused layout:
    maxtrain/hf/gated_deltanet.py): (our path, Hugging Face name, input axes, Part, unit
    axis)."""
    nk, nv, dk, dv = (
        linear.num_key_heads,
        linear.num_value_heads,
        linear.key_head_dim,
        linear.value_head_dim,
    )
    group = nv // nk
    qkvz, ba = (dk, dk, group * dv, group * dv), (group, group)
    conv = (nk * dk, nk * dk, nv * dv)
    la = "linear_attn"
    return (
        *(
            ((la, ours, "kernel"), f"{la}.in_proj_qkvz.weight", 1, Part(i, qkvz), None)
            for i, ours in enumerate("qkvz")
        ),
        *(
            ((la, ours, "kernel"), f"{la}.in_proj_ba.weight", 1, Part(i, ba), None)
            for i, ours in enumerate("ba")
        ),
        *(
            ((la, f"{ours}_conv"), f"{la}.conv1d.weight", 1, Part(i, conv), 1)
            for i, ours in enumerate("qkv")
        ),
        ((la, "o", "kernel"), f"{la}.out_proj.weight", 2, None, None),
        ((la, "a_log"), f"{la}.A_log", None, None, None),
        ((la, "dt_bias"), f"{la}.dt_bias", None, None, None),
        ((la, "norm", "scale"), f"{la}.norm.weight", None, None, None),
    )


def _experts(family: Family, block: str, stack: str, j: int, moe: MoeConfig) -> list[Slot]:
    """One MoE layer's routed experts: stacked (two tensors for all) or one tensor each."""
    if family.stacked_experts:
        path, fused, widths = (
            (stack, "moe"),
            f"{block}experts.gate_up_proj",
            (moe.expert_mlp_dim,) * 2,
        )
        return [
            Slot(fused, (*path, "gate", "kernel"), (j,), None, Part(0, widths)),
            Slot(fused, (*path, "up", "kernel"), (j,), None, Part(1, widths)),
            Slot(f"{block}experts.down_proj", (*path, "down", "kernel"), (j,), None),
        ]
    return [
        Slot(f"{block}experts.{e}.{name}.weight", (stack, "moe", ours, "kernel"), (j, e), 1)
        for e in range(moe.num_experts)
        for ours, name in zip(_EXPERTS, family.expert_names, strict=True)
    ]


def slots(cfg: ModelConfig, family: Family) -> list[Slot]:
    """Every tensor of `cfg` as a `family` checkpoint, in model order (embedding, layers,
    final norm, head)."""
    out = [Slot("model.embed_tokens.weight", ("embedding",), (), None)]
    kinds = layer_kinds(cfg)
    for i, (kind, j) in enumerate(zip(kinds, stack_positions(kinds), strict=True)):
        is_moe, stack, prefix = kind.is_moe, STACKS[kind], f"model.layers.{i}."
        out += _mixer(cfg, kind.mixer, prefix, stack, j)
        if not is_moe:
            dense = f"{prefix}{family.dense_block}."
            out += [Slot(dense + name, (stack, *path), (j,), ax) for path, name, ax in _DENSE_MLP]
        if is_moe and family.expert_layout == "gpt_oss":
            block = f"{prefix}{family.moe_block}."
            out += [
                Slot(block + name, (stack, "moe", *path), (j,), ax, part)
                for path, name, ax, part in _GPT_OSS_MOE
            ]
        elif is_moe:
            block = f"{prefix}{family.moe_block}."
            router, router_path = f"{block}{family.router_name}.", (stack, "moe", "router")
            out.append(Slot(router + "weight", (*router_path, "kernel"), (j,), 1))
            if family.router_bias:
                out.append(Slot(router + family.router_bias, (*router_path, "bias"), (j,), None))
            assert cfg.moe is not None  # a MoE layer implies it
            if family.shared_block and cfg.moe.shared_experts:
                shared = f"{block}{family.shared_block}."
                out += [Slot(shared + name, (stack, *p), (j,), ax) for p, name, ax in _SHARED]
            if cfg.moe.shared_expert_gate:
                gate = (stack, "moe", "shared_gate", "kernel")
                out.append(Slot(f"{block}{family.shared_block}_gate.weight", gate, (j,), 1))
            out += _experts(family, block, stack, j, cfg.moe)
    out.append(Slot("model.norm.weight", ("final_norm", "scale"), (), None))
    if not cfg.tie_embeddings:
        out.append(Slot("lm_head.weight", ("lm_head", "kernel"), (), 1))
    return out
