"""GLM-4.5 (Glm4MoeForCausalLM): DeepSeek-V3's router, shared expert and first dense layers
under grouped-query attention with partial RoPE (partial_rotary_factor, 0.5 when absent:
Glm4MoeConfig sets it), q/k/v biases (attention_bias; o_proj never has one) and an optional
qk-norm (use_qk_norm). Its multi-token prediction layers (GLM-4.5's 92, GLM-4.5-Air's 46) are
skipped, as DeepSeek-V3's."""

from maxtrain.hf.attention import GroupedQuery, ProjectionBias, QkNormKey
from maxtrain.hf.families.deepseek_v3 import NO_MTP_LAYERS, SIGMOID_ROUTED_EXPERTS
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family, RopeFormat
from maxtrain.hf.feed_forward import DenseMlp
from maxtrain.hf.layer_layout import AllGlobal, FirstDense, LayerLayout

FAMILY = Family(
    model_type="glm4_moe",
    architecture="Glm4MoeForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": None,
        "use_qk_norm": False,
        "attention_bias": False,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    required={"hidden_act": "silu"},
    layers=LayerLayout(AllGlobal(), FirstDense("first_k_dense_replace")),
    aspects=(
        GroupedQuery(),
        QkNormKey("use_qk_norm"),
        ProjectionBias("qkv"),
        DenseMlp(),
        SIGMOID_ROUTED_EXPERTS,
        NO_MTP_LAYERS,
    ),
    fixed={"moe.score": "sigmoid"},
    rope=RopeFormat(partial_default=0.5),
    # grouped-query attention with sigmoid routing, qk-normed or not
    claims=lambda cfg: cfg.moe is not None and cfg.moe.score == "sigmoid",
    rank=5,
)
