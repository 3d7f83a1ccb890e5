"""Qwen3-MoE (Qwen3MoeForCausalLM): qk-norm; Mixtral's router, the top-k weights
renormalised iff norm_topk_prob; the MoE layers every decoder_sparse_step-th but those
mlp_only_layers lists."""

from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family
from maxtrain.hf.feed_forward import DenseMlp, Experts
from maxtrain.hf.layer_layout import AllGlobal, LayerLayout, SparseStep

FAMILY = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "head_dim": None,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 1e-3,
    },
    required={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    layers=LayerLayout(AllGlobal(), SparseStep()),
    aspects=(
        GroupedQuery(),
        DenseMlp(),
        # transformers <= 4 reads and writes num_experts; 5 writes num_local_experts.
        Experts(
            count_keys=("num_experts", "num_local_experts"),
            width_key="moe_intermediate_size",
            renormalize_key="norm_topk_prob",
        ),
    ),
    fixed={"qk_norm": "rms"},
    claims=lambda cfg: cfg.moe is not None and cfg.qk_norm != "none",
    rank=3,
)
