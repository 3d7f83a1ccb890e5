"""The Hugging Face architectures we read and write, described as data.

These transformers families compute exactly our decoder (RMSNorm, RoPE, grouped-query or
multi-head latent attention, gated feed-forward or routed SwiGLU experts). They differ only
in a few config.json keys, model options and tensor names, which is all this module holds:

    llama      LlamaForCausalLM     Llama 2/3 (Llama-3 RoPE scaling), Kanana, tied or not
    mistral    MistralForCausalLM   Llama's layers, every one with a sliding window
                                    (sliding_window; null: none)
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
    llama4_text  Llama4ForCausalLM  chunked RoPE layers and global NoPE layers (no_rope_layers),
                                    temperature tuning on the NoPE layers, an unscaled qk-norm on
                                    the RoPE layers, interleaved RoPE pairs; top-k sigmoid routing
                                    whose weight scales the expert's input, one shared expert,
                                    MoE layers by moe_layers / interleave_moe_layer_step, experts
                                    stored stacked (gate_up_proj [E, D, 2F], down_proj [E, F, D])
    gemma3_text  Gemma3ForCausalLM  Gemma 3: norms before and after attention and the MLP
                                    ("sandwich"), RMSNorm scaling by 1 + w, qk-norm, embeddings
                                    times sqrt(hidden_size), GeGLU (gelu_pytorch_tanh),
                                    query_pre_attn_scalar; sliding-window layers (layer_types or
                                    sliding_window_pattern) with their own RoPE base, linear
                                    RoPE scaling on the global ones
    gpt_oss    GptOssForCausalLM    q/k/v/o biases, attention sinks, sliding-window layers
                                    (layer_types), YaRN (untruncated); every layer MoE: a router
                                    with a bias, experts with biases and a clamped SwiGLU, stored
                                    fused (expert_layout "gpt_oss")
    qwen3_next  Qwen3NextForCausalLM  Qwen3-Next: Gated DeltaNet layers (linear_attention in
                                    layer_types, else all but every full_attention_interval-th)
                                    beside gated attention (q_proj holds per head its query and
                                    an output gate), partial RoPE (0.25 when absent), qk-norm,
                                    every RMSNorm 1 + w; Qwen3-MoE's router and layer choice,
                                    a shared expert whose output a sigmoid gate scales

Router semantics match ours for both MoE families: transformers takes the softmax over all
experts, keeps the top k, and (Mixtral always, Qwen3-MoE iff norm_topk_prob) divides by their
sum; Mixtral's "softmax over the top-k logits" is the same number. DeepSeek-V3 takes sigmoid
scores, picks by score + e_score_correction_bias (our aux-loss-free bias), weighs by the
unbiased scores, optionally renormalised, times routed_scaling_factor: model.moe's sigmoid mode.
GLM-4.5's router is the same computation under the same keys. Llama 4 takes the top k of the
logits (the same experts as of their sigmoids), and each chosen expert computes
SwiGLU(sigmoid(logit) * x), unrenormalised: model.moe.weight_on input. GPT-OSS takes the
softmax over the top-k biased logits: softmax mode, renormalised.

Multi-token prediction layers (DeepSeek-V3's layer 61, GLM-4.5's 92 and GLM-4.5-Air's 46, past
num_hidden_layers) are skipped on import, as transformers 5.23 skips them (it has no module to
run them, so nothing checks a conversion), and export writes none (`nextn_key` = 0).
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
    # The config.json key counting the dense layers before the MoE ones (DeepSeek-V3's
    # first_k_dense_replace: model.layers [global-dense*k, global-moe*...]).
    first_dense_key: str | None = None
    router_bias: str | None = None  # the router's selection bias tensor, inside `gate.`
    shared_block: str | None = None  # the shared experts' SwiGLU, inside moe_block
    # Multi-head latent attention (model.mla, its keys named alike); empty: GQA.
    mla_keys: tuple[str, ...] = ()
    # A config.json key that switches qk-norm (its default in `defaults`); None: `qk_norm`.
    qk_norm_key: str | None = None
    # model.attention_projection_bias of config.json's `attention_bias: true`; None: no biases.
    attention_bias: str | None = None
    # The config.json key counting the multi-token prediction layers a checkpoint holds.
    nextn_key: str | None = None
    # Where the layout of a family differs from Llama's: the dense feed-forward's module and
    # width key, the router's name inside moe_block, and whether RoPE pairs interleave.
    dense_block: str = "mlp"
    dense_width_key: str = "intermediate_size"
    router_name: str = "gate"
    rope_interleaved: bool = False
    # true: every MoE layer's experts as two stacked tensors, experts.gate_up_proj [E, D, 2F]
    # (the gate's F columns, then the up projection's) and experts.down_proj [E, F, D], input
    # axis first; false: experts.<e>.<name>.weight per expert, as torch Linear weights.
    stacked_experts: bool = False
    # model.moe keys the family's checkpoints cannot vary, with the value they have there
    # (import sets them, export refuses a model with others), beyond MOE_FIXED's.
    moe_fixed: Mapping[str, Any] = field(default_factory=dict)
    # Llama 4: moe_layers lists the MoE layers, else every interleave_moe_layer_step-th is.
    moe_layer_list: bool = False
    # Llama 4's attention: the layers no_rope_layers marks (or every no_rope_layer_interval-th)
    # are global NoPE layers with attention temperature tuning, the others chunked RoPE layers
    # with the unscaled qk-norm (use_qk_norm).
    chunked_nope: bool = False

    @property
    def fixed_moe(self) -> dict[str, Any]:
        """model.moe key -> the only value this family's checkpoints express."""
        mapped = set(self.moe_keys.values()) | ({"renormalize"} if self.renormalize_key else set())
        if self.shared_width_key:
            mapped.add("shared_experts")
        fixed = {**MOE_FIXED, **self.moe_fixed}
        return {key: want for key, want in fixed.items() if key not in mapped}

    # The config.json key of a sliding window on every layer (null in it: no window), which is
    # model.layers [sliding-dense] with model.sliding_window; None: the family has none.
    window_key: str | None = None
    # Our model keys (ModelConfig) the family fixes; the others of FEATURE_DEFAULTS stay
    # at their defaults: import sets them, export refuses a model without them.
    features: Mapping[str, Any] = field(default_factory=dict)
    # Sliding-window layers named by config.json's layer_types (sliding_attention or
    # full_attention per layer) with sliding_window; without layer_types every
    # global_period-th layer is global (GPT-OSS: 2), or, global_period None, every
    # sliding_window_pattern-th (Gemma 3). local_rope_key: the config.json key of the local
    # layers' own RoPE base (Gemma 3's rope_local_base_freq, or rope_parameters'
    # sliding_attention), None: they use the model's RoPE (config_map.py).
    layer_types: bool = False
    global_period: int | None = None
    local_rope_key: str | None = None
    softmax_scale_key: str | None = None  # config.json's model.softmax_scale_dim
    attention_sinks: bool = False  # self_attn.sinks [N] in every layer (model.attention_sinks)
    # How a MoE layer's experts are stored: "per_expert" (experts.<e>.<expert_names>.weight,
    # the router `gate`) or "gpt_oss" (the router `router` with a bias; every expert's weights
    # and biases fused per layer: experts.gate_up_proj [E, D, 2F] with the gate's and up
    # projection's columns interleaved, experts.down_proj [E, F, D]; the clamped SwiGLU's
    # swiglu_alpha and swiglu_limit).
    expert_layout: str = "per_expert"
    # Qwen3-Next: the shared experts as one SwiGLU of this config.json key's width (ours:
    # model.moe.shared_experts x expert_mlp_dim), with a gate (shared_expert_gate.weight [1, D]
    # inside moe_block); None: shared experts as moe_keys map them, if any.
    shared_width_key: str | None = None
    # Gated DeltaNet layers (model.layers' `linear`, model.linear_attention) named by
    # layer_types' linear_attention (config_map.py).
    linear_layers: bool = False

    @property
    def is_moe(self) -> bool:
        return self.moe_block is not None


# model.moe keys fixed in a family unless a config.json key maps them (moe_keys, renormalize_key):
# the top-k weights renormalised, no shared expert, no routed scale, no groups, weights on the
# experts' outputs.
MOE_FIXED = {
    "renormalize": True,
    "shared_experts": 0,
    "routed_scale": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "weight_on": "output",
    "shared_expert_gate": False,
}

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

# transformers' Mistral: a query sees itself and the sliding_window - 1 keys before it
# (masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window), as our window does.
MISTRAL = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    qk_norm=False,
    defaults={
        **_BASE_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": None,
        "sliding_window": 4096,
    },
    required={"hidden_act": "silu"},
    window_key="sliding_window",
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
        "n_group": "n_group",
        "topk_group": "topk_group",
    },
    first_dense_key="first_k_dense_replace",
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
    first_dense_key=DEEPSEEK_V3.first_dense_key,
    router_bias="e_score_correction_bias",
    shared_block="shared_experts",
    qk_norm_key="use_qk_norm",
    attention_bias="qkv",  # o_proj never has one
    nextn_key="num_nextn_predict_layers",
)
LLAMA4 = Family(
    model_type="llama4_text",
    architecture="Llama4ForCausalLM",
    qk_norm=False,  # use_qk_norm says (chunked_nope)
    defaults={
        **_BASE_DEFAULTS,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size_mlp": 16384,
        "use_qk_norm": True,
        "no_rope_layers": None,
        "no_rope_layer_interval": 4,
        "layer_types": None,
        "attention_chunk_size": 8192,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    },
    required={"hidden_act": "silu", "attention_bias": False},
    moe_block="feed_forward",
    expert_count_keys=("num_local_experts",),
    expert_width_key="intermediate_size",
    moe_defaults={
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "intermediate_size": 8192,
        "router_aux_loss_coef": 1e-3,
        "interleave_moe_layer_step": 1,
        "moe_layers": None,
    },
    score="sigmoid",
    shared_block="shared_expert",
    dense_block="feed_forward",
    dense_width_key="intermediate_size_mlp",
    router_name="router",
    rope_interleaved=True,
    stacked_experts=True,
    moe_fixed={"renormalize": False, "shared_experts": 1, "weight_on": "input"},
    moe_layer_list=True,
    chunked_nope=True,
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
        "qk_norm": "rms",
        "block_norms": "sandwich",
        "norm_scale_plus_one": True,
        "scale_embeddings": True,
        "mlp_activation": "gelu_tanh",
    },
    layer_types=True,
    local_rope_key="rope_local_base_freq",
    softmax_scale_key="query_pre_attn_scalar",
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
    attention_bias="qkvo",
    attention_sinks=True,
    layer_types=True,
    global_period=2,
    expert_layout="gpt_oss",
)
# transformers' Qwen3NextConfig: its MoE is Qwen3-MoE's under other defaults, every layer
# has a shared expert with a gate, and the attention layers' q_proj holds the output gate.
QWEN3_NEXT = Family(
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    qk_norm=True,
    defaults={
        **_BASE_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 5632,
        "partial_rotary_factor": 0.25,  # Qwen3NextConfig sets it when absent
        "layer_types": None,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
    required={"hidden_act": "silu", "attention_bias": False},
    moe_block="mlp",
    expert_names=("gate_proj", "up_proj", "down_proj"),
    expert_count_keys=("num_experts",),
    expert_width_key="moe_intermediate_size",
    renormalize_key="norm_topk_prob",
    sparse_layer_keys=True,
    moe_defaults={
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 1e-3,
    },
    shared_block="shared_expert",
    moe_fixed={"shared_expert_gate": True},
    features={"qk_norm": "rms", "norm_scale_plus_one": True, "attention_output_gate": True},
    shared_width_key="shared_expert_intermediate_size",
    linear_layers=True,
)
FAMILIES = {
    f.model_type: f
    for f in (
        LLAMA,
        MISTRAL,
        QWEN3,
        MIXTRAL,
        QWEN3_MOE,
        DEEPSEEK_V3,
        GLM4_MOE,
        LLAMA4,
        GEMMA3,
        GPT_OSS,
        QWEN3_NEXT,
    )
}
# The model keys a Family's `features` may fix, at the value every other family has.
FEATURE_DEFAULTS = {
    key: ModelConfig.model_fields[key].default
    for key in (
        "block_norms",
        "norm_scale_plus_one",
        "scale_embeddings",
        "mlp_activation",
        "attention_output_gate",
    )
}


def family_for(cfg: ModelConfig) -> Family:
    """The family a model of ours exports as: the only one with its attention, qk-norm and
    MoE choice (linear layers or gated attention: Qwen3-Next; multi-head latent attention:
    DeepSeek-V3, whose layers are MoE; attention
    sinks: GPT-OSS; experts weighing their inputs: Llama 4; sandwich norms: Gemma 3; other
    grouped-query attention with sigmoid routing: GLM-4.5, qk-normed or not), a dense model
    with local layers as Mistral
    (config_map refuses what it cannot express)."""
    if cfg.linear_attention is not None or cfg.attention_output_gate:
        return QWEN3_NEXT
    if cfg.mla is not None:
        return DEEPSEEK_V3
    if cfg.attention_sinks:
        return GPT_OSS
    if cfg.moe is not None and cfg.moe.weight_on == "input":
        return LLAMA4
    if cfg.block_norms == "sandwich":
        return GEMMA3
    if cfg.moe is not None and cfg.moe.score == "sigmoid":
        return GLM4_MOE
    qk_norm = cfg.qk_norm != "none"
    if cfg.moe is None:
        if qk_norm:
            return QWEN3
        local = {t.attention for t in cfg.layer_types} & {"sliding", "chunked"}
        return MISTRAL if local else LLAMA
    return QWEN3_MOE if qk_norm else MIXTRAL
