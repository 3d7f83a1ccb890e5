"""The Hugging Face architectures we read and write, described as data.

Five transformers families compute exactly our decoder (pre-norm RMSNorm, RoPE, grouped-query
or multi-head latent attention, SwiGLU feed-forward or routed SwiGLU experts). They differ
only in a few config.json keys and tensor names, which is all this module holds:

    llama      LlamaForCausalLM     Llama 2/3 (Llama-3 RoPE scaling), Kanana, tied or not
    qwen3      Qwen3ForCausalLM     qk-norm; head_dim is its own key (default 128)
    mixtral    MixtralForCausalLM   every layer MoE; top-k weights always renormalised
    qwen3_moe  Qwen3MoeForCausalLM  qk-norm; renormalisation optional (norm_topk_prob); dense
                                    layers chosen by mlp_only_layers and decoder_sparse_step
    deepseek_v3  DeepseekV3ForCausalLM  multi-head latent attention (with or without q_lora_rank),
                                    interleaved RoPE pairs, YaRN; sigmoid routing with a
                                    correction bias, shared experts, first_k_dense_replace
                                    dense layers, routed_scaling_factor, group-limited routing
    gpt_oss    GptOssForCausalLM    q/k/v/o biases, attention sinks, sliding-window layers
                                    (layer_types), YaRN (untruncated); every layer MoE: a router
                                    with a bias, experts with biases and a clamped SwiGLU, stored
                                    fused (expert_layout "gpt_oss")

Router semantics match ours for both MoE families: transformers takes the softmax over all
experts, keeps the top k, and (Mixtral always, Qwen3-MoE iff norm_topk_prob) divides by their
sum; Mixtral's "softmax over the top-k logits" is the same number. DeepSeek-V3 takes sigmoid
scores, picks by score + e_score_correction_bias (our aux-loss-free bias), weighs by the
unbiased scores, optionally renormalised, times routed_scaling_factor: model.moe's sigmoid mode.
GPT-OSS takes the softmax over the top-k biased logits: softmax mode, renormalised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from maxtrain.config import ModelConfig


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
    yarn: bool = False  # YaRN RoPE scaling, checked against transformers for this family
    # What config.json's `attention_bias: true` means (model.attention_bias); None: the key is
    # in `required` or absent.
    attention_bias: str | None = None
    attention_sinks: bool = False  # self_attn.sinks [N] in every layer (model.attention_sinks)
    # Sliding-window layers, named by config.json's `layer_types` (sliding_attention or
    # full_attention per layer) with `sliding_window`; the pattern transformers repeats when
    # layer_types is absent. Empty: the family has none.
    layer_types: tuple[str, ...] = ()
    # How a MoE layer's experts are stored: "per_expert" (experts.<e>.<expert_names>.weight,
    # the router `gate`) or "gpt_oss" (the router `router` with a bias; every expert's weights
    # and biases fused per layer: experts.gate_up_proj [E, D, 2F] with the gate's and up
    # projection's columns interleaved, experts.down_proj [E, F, D]; the clamped SwiGLU's
    # swiglu_alpha and swiglu_limit).
    expert_layout: str = "per_expert"

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
    yarn=True,
)

GPT_OSS = Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    qk_norm=False,
    defaults={
        **_BASE_DEFAULTS,
        "rope_theta": 150000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "attention_bias": True,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        # transformers' RoPE when config.json states none
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
    required={},
    moe_block="mlp",
    expert_count_keys=("num_local_experts",),
    expert_width_key="intermediate_size",
    moe_defaults={"num_local_experts": 128, "num_experts_per_tok": 4, "router_aux_loss_coef": 1e-3},
    yarn=True,
    attention_bias="qkvo",
    attention_sinks=True,
    layer_types=("sliding_attention", "full_attention"),
    expert_layout="gpt_oss",
)
FAMILIES = {f.model_type: f for f in (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, DEEPSEEK_V3, GPT_OSS)}


def family_for(cfg: ModelConfig) -> Family:
    """The family a model of ours exports as: the only one with its attention, qk-norm and
    MoE choice (multi-head latent attention: DeepSeek-V3, whose layers are MoE; attention
    sinks: GPT-OSS)."""
    if cfg.attention_type == "mla":
        return DEEPSEEK_V3
    if cfg.attention_sinks:
        return GPT_OSS
    if cfg.moe is None:
        return QWEN3 if cfg.qk_norm else LLAMA
    return QWEN3_MOE if cfg.qk_norm else MIXTRAL
