"""Where each Hugging Face tensor lives in our parameter tree, and how the two layouts differ.

transformers stores every linear map as a torch nn.Linear weight: [out, in], with heads
flattened into the feature axis (q_proj: [N*H, D], o_proj: [D, N*H]). Our kernels are einsum
operands with the input axes first and heads kept apart (layers/): q [D, N, H], o [N, H, D],
gate [D, F], down [F, D], router [D, E], lm_head [D, V]. So one rule converts every linear
weight: ours = W.T reshaped to our axes, W = ours flattened to [in, out] and transposed. No
q/k permutation is needed: our RoPE pairs dim i with i + H/2 ("rotate half"), as transformers
does. Embedding and norm scales have the same layout on both sides.

Biases have our output axes flattened (q_proj.bias: [N*H]). GPT-OSS stores each layer's
experts fused, in our [E, in, out] layout already, but with the gate's and up projection's
columns interleaved in one tensor (gate_up_proj [E, D, 2F]: gate at even columns, up at odd):
two Slots name that tensor, each its `part` of the columns.

Our per-layer parameters are stacked: model layer i is row stack_positions(...)[i] of its
kind's stack (model/stacks.py), and a MoE layer's experts add one more axis. A Slot names one
Hugging Face tensor (or its part) and that position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from maxtrain.config import ModelConfig
from maxtrain.hf.families import Family
from maxtrain.model.stacks import STACKS, is_moe_per_layer, stack_positions

# (our path inside a layer, Hugging Face name inside `model.layers.<i>.`, input axes of a
# linear weight or None)
_NORMS = (
    (("attn_norm", "scale"), "input_layernorm.weight", None),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", None),
)
_ATTENTION = (
    (("attn", "q", "kernel"), "self_attn.q_proj.weight", 1),
    (("attn", "k", "kernel"), "self_attn.k_proj.weight", 1),
    (("attn", "v", "kernel"), "self_attn.v_proj.weight", 1),
    (("attn", "o", "kernel"), "self_attn.o_proj.weight", 2),
)
# Multi-head latent attention (model/layers/mla.py): the query's two layouts, then the rest.
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
_QK_NORM = (
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", None),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", None),
)
_DENSE_MLP = (
    (("mlp", "gate", "kernel"), "mlp.gate_proj.weight", 1),
    (("mlp", "up", "kernel"), "mlp.up_proj.weight", 1),
    (("mlp", "down", "kernel"), "mlp.down_proj.weight", 1),
)
_EXPERTS = ("gate", "up", "down")  # ours, in the order of Family.expert_names
# GPT-OSS's fused experts inside the MoE block (Family.expert_layout "gpt_oss"): (our path
# inside `moe`, Hugging Face name, part of the interleaved columns or None).
_GPT_OSS_MOE = (
    (("router", "kernel"), "router.weight", 1, None),
    (("router", "logit_bias"), "router.bias", None, None),
    (("gate", "kernel"), "experts.gate_up_proj", None, (0, 2)),
    (("up", "kernel"), "experts.gate_up_proj", None, (1, 2)),
    (("gate", "bias"), "experts.gate_up_proj_bias", None, (0, 2)),
    (("up", "bias"), "experts.gate_up_proj_bias", None, (1, 2)),
    (("down", "kernel"), "experts.down_proj", None, None),
    (("down", "bias"), "experts.down_proj_bias", None, None),
)
_ATTENTION_BIAS = {
    name: (("attn", name, "bias"), f"self_attn.{name}_proj.bias", 0) for name in "qkvo"
}
_SINKS = (("attn", "sinks"), "self_attn.sinks", None)
_SHARED = tuple((("moe", "shared", ours, "kernel"), f"{ours}_proj.weight", 1) for ours in _EXPERTS)


@dataclass(frozen=True)
class Slot:
    """One Hugging Face tensor: its name, our parameter path, and the position in that
    (stacked) parameter: () for embedding/final norm/head, (layer,) or (layer, expert)."""

    hf_name: str
    path: tuple[str, ...]
    index: tuple[int, ...]
    # A linear weight: leading input axes of our kernel; 0: a bias, our axes flattened; None:
    # same layout.
    in_axes: int | None
    # (p, n): our block is columns p, p + n, p + 2n, ... of the tensor's last axis, the other
    # parts are other Slots' (join_parts); None: the whole tensor.
    part: tuple[int, int] | None = None

    def hf_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face shape of a tensor whose block of our parameter has block_shape."""
        if self.in_axes is None:
            shape = tuple(block_shape)
        elif self.in_axes == 0:
            shape = (math.prod(block_shape),)
        else:
            shape = (math.prod(block_shape[self.in_axes :]), math.prod(block_shape[: self.in_axes]))
        return shape if self.part is None else (*shape[:-1], shape[-1] * self.part[1])

    def to_ours(self, tensor: np.ndarray, block_shape: tuple[int, ...]) -> np.ndarray:
        if self.part is not None:
            first, step = self.part
            tensor = tensor[..., first::step]
        if self.in_axes is None:
            return tensor
        return tensor.reshape(block_shape) if self.in_axes == 0 else tensor.T.reshape(block_shape)

    def to_hf(self, block: np.ndarray) -> np.ndarray:
        """Our block in the Hugging Face layout (of its part only: join_parts joins them)."""
        if self.in_axes is None:
            return block
        if self.in_axes == 0:
            return block.reshape(-1)
        return block.reshape(math.prod(block.shape[: self.in_axes]), -1).T


def join_parts(parts: list[np.ndarray]) -> np.ndarray:
    """The tensor whose last axis interleaves `parts` (Slot.part (p, n): parts[p] = columns
    p, p + n, ...); one part is the tensor itself."""
    if len(parts) == 1:
        return parts[0]
    return np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)


def _attention(cfg: ModelConfig) -> tuple:
    """A layer's attention and norm tensors: (our path, Hugging Face name, input axes)."""
    if cfg.mla is None:
        biased = "" if cfg.attention_bias == "none" else cfg.attention_bias  # "qkv", "qkvo"
        extra = tuple(_ATTENTION_BIAS[name] for name in biased)
        extra += (_SINKS,) if cfg.attention_sinks else ()
        return _NORMS + _ATTENTION + extra + (_QK_NORM if cfg.qk_norm else ())
    return _NORMS + (_MLA_Q if cfg.mla.q_lora_rank is None else _MLA_Q_LORA) + _MLA


def slots(cfg: ModelConfig, family: Family) -> list[Slot]:
    """Every tensor of `cfg` as a `family` checkpoint, in model order (embedding, layers,
    final norm, head)."""
    out = [Slot("model.embed_tokens.weight", ("embedding",), (), None)]
    kinds = is_moe_per_layer(cfg)
    for i, (is_moe, j) in enumerate(zip(kinds, stack_positions(kinds), strict=True)):
        stack, prefix = STACKS[is_moe], f"model.layers.{i}."
        per_layer = _attention(cfg)
        if not is_moe:
            per_layer += _DENSE_MLP
        out += [Slot(prefix + name, (stack, *path), (j,), ax) for path, name, ax in per_layer]
        if is_moe and family.expert_layout == "gpt_oss":
            block = f"{prefix}{family.moe_block}."
            out += [
                Slot(block + name, (stack, "moe", *path), (j,), ax, part)
                for path, name, ax, part in _GPT_OSS_MOE
            ]
        elif is_moe:
            block = f"{prefix}{family.moe_block}."
            out.append(Slot(block + "gate.weight", (stack, "moe", "router", "kernel"), (j,), 1))
            if family.router_bias:
                bias = (stack, "moe", "router", "bias")
                out.append(Slot(f"{block}gate.{family.router_bias}", bias, (j,), None))
            assert cfg.moe is not None  # a MoE layer implies it
            if family.shared_block and cfg.moe.shared_experts:
                shared = f"{block}{family.shared_block}."
                out += [Slot(shared + name, (stack, *p), (j,), ax) for p, name, ax in _SHARED]
            for e in range(cfg.moe.num_experts):
                out += [
                    Slot(
                        f"{block}experts.{e}.{name}.weight",
                        (stack, "moe", ours, "kernel"),
                        (j, e),
                        1,
                    )
                    for ours, name in zip(_EXPERTS, family.expert_names, strict=True)
                ]
    out.append(Slot("model.norm.weight", ("final_norm", "scale"), (), None))
    if not cfg.tie_embeddings:
        out.append(Slot("lm_head.weight", ("lm_head", "kernel"), (), 1))
    return out
