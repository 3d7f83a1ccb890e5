"""Qwen3.5 (Qwen3_5ForCausalLM, model_type qwen3_5_text): Qwen3-Next's hybrid (qwen3_next.py:
Gated DeltaNet layers beside gated attention, partial RoPE 0.25 when absent, qk-norm, every
RMSNorm 1 + w) with a dense SwiGLU in every layer, and the Gated DeltaNet's input projections
stored apart rather than fused by query/key head:

    in_proj_qkv.weight [2 Nk dk + Nv dv, D]  is  [q (Nk dk) | k (Nk dk) | v (Nv dv)], head-major
    in_proj_z.weight   [Nv dv, D]            in_proj_b.weight, in_proj_a.weight  [Nv, D]

(the order of conv1d's channels). Its RoPE is multimodal (rope_parameters' mrope_section,
mrope_interleaved), which for text, every position id the same on all three axes, is plain
RoPE: those keys are read past. The multimodal checkpoints (model_type qwen3_5, text_config
nested, tensors under model.language_model.) are not read.
"""

from maxtrain.config import LinearAttention
from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.families.qwen3_next import (
    HYBRID_DEFAULTS,
    HYBRID_FIXED,
    LAYER_TYPES,
    LINEAR_ATTN,
    GatedDeltaNet,
    is_hybrid,
    linear_state_tensors,
)
from maxtrain.hf.family import Family, RopeFormat
from maxtrain.hf.feed_forward import DenseMlp
from maxtrain.hf.layer_layout import AllDense, LayerLayout
from maxtrain.hf.layout import Part


def separate_projection_tensors(linear: LinearAttention) -> tuple:
    """A Qwen3.5 Gated DeltaNet layer's tensors inside `linear_attn.`, as qwen3_next.py's
    linear_attention_tensors gives Qwen3-Next's."""
    nk, nv, la = linear.num_key_heads, linear.num_value_heads, LINEAR_ATTN
    qkv = (nk * linear.key_head_dim, nk * linear.key_head_dim, nv * linear.value_head_dim)
    return (
        *(
            ((la, ours, "kernel"), f"{la}.in_proj_qkv.weight", 1, Part(i, qkv), None)
            for i, ours in enumerate("qkv")
        ),
        *(((la, ours, "kernel"), f"{la}.in_proj_{ours}.weight", 1, None, None) for ours in "zba"),
        *linear_state_tensors(linear),
    )


FAMILY = Family(
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    defaults={**HYBRID_DEFAULTS, "num_key_value_heads": 4, "intermediate_size": 12288},
    required={"hidden_act": "silu", "attention_bias": False},
    layers=LayerLayout(LAYER_TYPES, AllDense()),
    aspects=(
        GroupedQuery(),
        GatedDeltaNet(separate_projection_tensors),  # before the MLP: transformers' order
        DenseMlp(),
    ),
    fixed=HYBRID_FIXED,
    rope=RopeFormat(partial_default=0.25),
    claims=lambda cfg: is_hybrid(cfg) and cfg.moe is None,
    rank=11,
)
