"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3.5 (qwen3_5_text.py)
with Qwen3-Next's experts (qwen3_next.py: a shared expert shared_expert_intermediate_size wide,
scaled by a sigmoid gate) in every layer, the top-k weights always renormalised (no
norm_topk_prob, decoder_sparse_step or mlp_only_layers)."""

from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.families.qwen3_5_text import separate_projection_tensors
from maxtrain.hf.families.qwen3_next import (
    EXPERT_WIDTH,
    HYBRID_DEFAULTS,
    HYBRID_FIXED,
    LAYER_TYPES,
    SHARED_WIDTH,
    GatedDeltaNet,
    SharedExpertWidth,
    is_hybrid,
)
from maxtrain.hf.family import Family, RopeFormat
from maxtrain.hf.feed_forward import Experts
from maxtrain.hf.layer_layout import AllMoe, LayerLayout

FAMILY = Family(
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    defaults={
        **HYBRID_DEFAULTS,
        "num_key_value_heads": 2,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        EXPERT_WIDTH: 512,
        SHARED_WIDTH: 512,
        "router_aux_loss_coef": 1e-3,
    },
    required={"hidden_act": "silu", "attention_bias": False},
    layers=LayerLayout(LAYER_TYPES, AllMoe()),
    aspects=(
        GroupedQuery(),
        GatedDeltaNet(separate_projection_tensors),  # before the experts: transformers' order
        Experts(count_keys=("num_experts",), width_key=EXPERT_WIDTH, shared_block="shared_expert"),
        SharedExpertWidth(),
    ),
    fixed=HYBRID_FIXED,
    rope=RopeFormat(partial_default=0.25),
    # Qwen3-Next (rank 10) states the rest: dense layers beside MoE, weights not renormalised.
    claims=lambda cfg: (
        is_hybrid(cfg)
        and cfg.moe is not None
        and cfg.moe.renormalize
        and all(t.ffn == "moe" for t in cfg.layer_types)
    ),
    rank=12,
)
