"""GPT-OSS (GptOssForCausalLM): q/k/v/o biases, attention sinks, sliding-window layers
(layer_types, else every second layer), YaRN (untruncated; YaRN too when config.json states no
RoPE); every layer a mixture of experts. Its router has a bias and takes the softmax over the
top-k biased logits (softmax mode, renormalised); its experts have biases and a clamped SwiGLU
(swiglu_alpha, swiglu_limit), stored fused per layer: experts.gate_up_proj [E, D, 2F] with the
gate's and up projection's columns interleaved, experts.down_proj [E, F, D], input axis first.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.aspect import HfConfig
from maxtrain.hf.attention import GroupedQuery, ProjectionBias
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family, RopeFormat
from maxtrain.hf.feed_forward import DenseMlp, Experts
from maxtrain.hf.layer_layout import AllMoe, EveryNth, LayerLayout, LayerTypes
from maxtrain.hf.layout import LayerSite, Part, Slot

_GATE, _UP = Part(0, (1, 1)), Part(1, (1, 1))  # the interleaved columns of gate_up_proj
# (our path inside `moe`, Hugging Face name inside `mlp.`, input axes, Part or None)
_TENSORS = (
    (("router", "kernel"), "router.weight", 1, None),
    (("router", "logit_bias"), "router.bias", None, None),
    (("gate", "kernel"), "experts.gate_up_proj", None, _GATE),
    (("up", "kernel"), "experts.gate_up_proj", None, _UP),
    (("gate", "bias"), "experts.gate_up_proj_bias", None, _GATE),
    (("up", "bias"), "experts.gate_up_proj_bias", None, _UP),
    (("down", "kernel"), "experts.down_proj", None, None),
    (("down", "bias"), "experts.down_proj_bias", None, None),
)


class FusedExperts(Experts):
    """GPT-OSS's experts: the clamped SwiGLU's keys, and the router and experts fused with
    their biases."""

    @property
    def owns(self) -> frozenset[str]:  # type: ignore[override]
        return super().owns | {"moe.clamped_swiglu"}

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        fields = super().read(hf, layers)
        clamp = {"alpha": hf["swiglu_alpha"], "limit": hf["swiglu_limit"]}
        return {"moe": {**fields["moe"], "clamped_swiglu": clamp}}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        assert cfg.moe is not None and cfg.moe.clamped_swiglu is not None  # unexpressed
        clamp = cfg.moe.clamped_swiglu
        return {
            "swiglu_alpha": clamp.alpha,
            "swiglu_limit": clamp.limit,
            **super().write(cfg, defaults),
        }

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        if cfg.moe is not None and cfg.moe.clamped_swiglu is None:
            return ["model.moe.clamped_swiglu=null"]
        return super().unexpressed(cfg)

    def tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        if not site.is_moe:
            return []
        return [
            site.slot(f"{self.block}.{name}", ("moe", *path), in_axes, part)
            for path, name, in_axes, part in _TENSORS
        ]


FAMILY = Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
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
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "router_aux_loss_coef": 1e-3,
    },
    required={},
    layers=LayerLayout(
        LayerTypes(
            names={"full_attention": "global", "sliding_attention": "sliding"},
            every=EveryNth(2, "global", "sliding"),
        ),
        AllMoe(),
    ),
    aspects=(
        GroupedQuery(),
        ProjectionBias("qkvo"),
        DenseMlp(),
        FusedExperts(count_keys=("num_local_experts",), width_key="intermediate_size"),
    ),
    fixed={
        "attention_sinks": True,  # self_attn.sinks [N] in every layer
        "moe.router_logit_bias": True,
        "moe.expert_projection_bias": True,
    },
    rope=RopeFormat(scalings=("yarn",), by_layer_type=True),
    claims=lambda cfg: cfg.attention_sinks,
    rank=8,
)
