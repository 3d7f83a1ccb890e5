"""The Hugging Face architectures we read and write, described as data.

These transformers families compute exactly our decoder (RMSNorm, RoPE, grouped-query or
multi-head latent attention, gated feed-forward or routed SwiGLU experts). They differ only
in a few config.json keys, model options and tensor names, which is all this module holds:

    llama      LlamaForCausalLM     Llama 2/3 (Llama-3 RoPE scaling), Kanana, tied or not
    qwen3      Qwen3ForCausalLM     qk-norm; head_dim is its own key (default 128)
    mixtral    MixtralForCausalLM   every layer MoE; top-k weights always renormalised
    qwen3_moe  Qwen3MoeForCausalLM  qk-norm; renormalisation optional (norm_topk_prob); dense
                                    layers chosen by mlp_only_layers and decoder_sparse_step
    deepseek_v3  DeepseekV3ForCausalLM  multi-head latent attention (with or without q_lora_rank),
                                    interleaved RoPE pairs, YaRN; sigmoid routing with a
                                    correction bias, shared experts, first_k_dense_replace
                                    dense layers, routed_scaling_factor, group-limited routing
    glm4_moe   Glm4MoeForCausalLM   GLM-4.5: DeepSeek-V3's router and experts under grouped-query
                                    attention with partial RoPE (partial_rotary_factor, 0.5
                                    when absent), q/k/v biases (attention_bias), optional qk-norm
                                    (use_qk_norm)
    gemma3_text  Gemma3ForCausalLM  Gemma 3: norms before and after attention and the MLP
                                    ("sandwich"), RMSNorm scaling by 1 + w, qk-norm, embeddings
                                    times sqrt(hidden_size), GeGLU (gelu_pytorch_tanh),
                                    query_pre_attn_scalar; sliding-window layers (layer_types or
                                    sliding_window_pattern) with their own RoPE base, linear
                                    RoPE scaling on the global ones

Router semantics match ours for both MoE families: transformers takes the softmax over all
experts, keeps the top k, and (Mixtral always, Qwen3-MoE iff norm_topk_prob) divides by their
sum; Mixtral's "softmax over the top-k logits" is the same number. DeepSeek-V3 takes sigmoid
scores, picks by score + e_score_correction_bias (our aux-loss-free bias), weighs by the
unbiased scores, optionally renormalised, times routed_scaling_factor: model.moe's sigmoid mode.
GLM-4.5's router is the same computation under the same keys.

Multi-token prediction layers (DeepSeek-V3's layer 61, GLM-4.5's 92 and GLM-4.5-Air's 46, past
num_hidden_layers) are skipped on import, as transformers 5.23 skips them (it has no module to
run them, so nothing checks a conversion), and export writes none (`nextn_key` = 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from maxtrain.config import ModelArchitecture, ModelConfig


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    qk_norm: bool
    # config.json keys that change the model's function, with the value transformers' config
    # class assumes when the key is absent (class defaults differ between families).
    defaults: Mapping[str, Any]
    # Options of the family we do not model: a key present with another value is unsupported.
    # Export writes them as they are here.
    required: Mapping[str, Any]
    # Mixture of experts only.
    moe_block: str | None = None  # per-layer module holding the router (`gate`) and experts
    expert_names: tuple[str, str, str] = ("", "", "")  # an expert's gate, up, down projections
    # Keys naming the expert count, the first present wins; export writes the first.
    expert_count_keys: tuple[str, ...] = ()
    expert_width_key: str = ""  # each expert's hidden size
    renormalize_key: str | None = None  # None: top-k weights are always renormalised
    # mlp_only_layers / decoder_sparse_step pick the MoE layers (else every layer is MoE).
    sparse_layer_keys: bool = False
    moe_defaults: Mapping[str, Any] = field(default_factory=dict)
    score: str = "softmax"  # the router's score function (model.moe.score)
    aux_loss_key: str | None = "router_aux_loss_coef"  # -> model.moe.aux_loss_weight
    # config.json keys mapped one to one onto keys of model.moe.
    moe_keys: Mapping[str, str] = field(default_factory=dict)
    router_bias: str | None = None  # the router's selection bias tensor, inside `gate.`
    shared_block: str | None = None  # the shared experts' SwiGLU, inside moe_block
    # Multi-head latent attention (model.mla, its keys named alike); empty: GQA.
    mla_keys: tuple[str, ...] = ()
    # A config.json key that switches qk-norm (its default in `defaults`); None: `qk_norm`.
    qk_norm_key: str | None = None
    # model.attention_bias of config.json's `attention_bias: true`; None: no biases.
    attention_bias: str | None = None
    # The config.json key counting the multi-token prediction layers a checkpoint holds.
    nextn_key: str | None = None
    # Our model keys (ModelArchitecture) the family fixes; the others of FEATURE_DEFAULTS stay
    # at their defaults: import sets them, export refuses a model without them.
    features: Mapping[str, Any] = field(default_factory=dict)
    # Sliding-window layers as Gemma 3 states them: layer_types (else every
    # sliding_window_pattern-th layer global), sliding_window, the local layers' RoPE base in
    # rope_local_base_freq or rope_parameters' sliding_attention (config_map.py).
    layer_types: bool = False
    softmax_scale_key: str | None = None  # config.json's model.softmax_scale_dim

    @property
    def is_moe(self) -> bool:
        return self.moe_block is not None


_BASE_DEFAULTS = {"rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02}

LLAMA = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    qk_norm=False,
    defaults={
        **_BASE_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "num_key_value_heads": None,  # None: as many as query heads
        "head_dim": None,  # None: hidden_size // num_attention_heads
    },
    required={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
)

QWEN3 = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    qk_norm=True,
    defaults={
        **_BASE_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,
    },
    required={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
)

MIXTRAL = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    qk_norm=False,
    defaults={
        **_BASE_DEFAULTS,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": None,
    },
    required={"hidden_act": "silu", "sliding_window": None},
    moe_block="block_sparse_moe",
    expert_names=("w1", "w3", "w2"),
    expert_count_keys=("num_local_experts",),
    expert_width_key="intermediate_size",
    moe_defaults={"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 1e-3},
)

QWEN3_MOE = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    qk_norm=True,
    defaults={
        **_BASE_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "head_dim": None,
    },
    required={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    moe_block="mlp",
    expert_names=("gate_proj", "up_proj", "down_proj"),
    # transformers <= 4 reads and writes num_experts; 5 writes num_local_experts.
    expert_count_keys=("num_experts", "num_local_experts"),
    expert_width_key="moe_intermediate_size",
    renormalize_key="norm_topk_prob",
    sparse_layer_keys=True,
    moe_defaults={
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 1e-3,
    },
)

DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    qk_norm=False,
    defaults={
        **_BASE_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "num_key_value_heads": None,
        "head_dim": None,
        "rope_interleave": True,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    required={"hidden_act": "silu", "attention_bias": False},
    moe_block="mlp",
    expert_names=("gate_proj", "up_proj", "down_proj"),
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    expert_width_key="moe_intermediate_size",
    renormalize_key="norm_topk_prob",
    moe_defaults={
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
    },
    score="sigmoid",
    aux_loss_key=None,
    moe_keys={
        "routed_scaling_factor": "routed_scale",
        "n_shared_experts": "shared_experts",
        "first_k_dense_replace": "first_dense_layers",
        "n_group": "n_group",
        "topk_group": "topk_group",
    },
    router_bias="e_score_correction_bias",
    shared_block="shared_experts",
    mla_keys=("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    nextn_key="num_nextn_predict_layers",
)

GLM4_MOE = Family(
    model_type="glm4_moe",
    architecture="Glm4MoeForCausalLM",
    qk_norm=False,
    defaults={
        **_BASE_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": None,
        "partial_rotary_factor": 0.5,  # Glm4MoeConfig sets it when absent
        "use_qk_norm": False,
        "attention_bias": False,
    },
    required={"hidden_act": "silu"},
    moe_block="mlp",
    expert_names=("gate_proj", "up_proj", "down_proj"),
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    expert_width_key="moe_intermediate_size",
    renormalize_key="norm_topk_prob",
    moe_defaults={
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
    score="sigmoid",
    aux_loss_key=None,
    moe_keys=DEEPSEEK_V3.moe_keys,
    router_bias="e_score_correction_bias",
    shared_block="shared_experts",
    qk_norm_key="use_qk_norm",
    attention_bias="qkv",  # o_proj never has one
    nextn_key="num_nextn_predict_layers",
)

GEMMA3 = Family(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    qk_norm=True,
    defaults={
        **_BASE_DEFAULTS,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
    required={
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
    features={
        "qk_norm": True,
        "block_norms": "sandwich",
        "norm_scale_plus_one": True,
        "scale_embeddings": True,
        "mlp_activation": "gelu_tanh",
    },
    layer_types=True,
    softmax_scale_key="query_pre_attn_scalar",
)
FAMILIES = {
    f.model_type: f for f in (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, DEEPSEEK_V3, GLM4_MOE, GEMMA3)
}
# The model keys a Family's `features` may fix, at the value every other family has.
FEATURE_DEFAULTS = {
    key: ModelArchitecture.model_fields[key].default
    for key in ("block_norms", "norm_scale_plus_one", "scale_embeddings", "mlp_activation")
}


def family_for(cfg: ModelConfig) -> Family:
    """The family a model of ours exports as: the only one with its attention, qk-norm and
    MoE choice (multi-head latent attention: DeepSeek-V3, whose layers are MoE; sandwich norms:
    Gemma 3; grouped-query attention with sigmoid routing: GLM-4.5, qk-normed or not)."""
    if cfg.attention_type == "mla":
        return DEEPSEEK_V3
    if cfg.block_norms == "sandwich":
        return GEMMA3
    if cfg.moe is not None and cfg.moe.score == "sigmoid":
        return GLM4_MOE
    if cfg.moe is None:
        return QWEN3 if cfg.qk_norm else LLAMA
    return QWEN3_MOE if cfg.qk_norm else MIXTRAL
