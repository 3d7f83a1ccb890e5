"""Llama 4's text model (Llama4ForCausalLM): chunked RoPE layers with an unscaled qk-norm
(use_qk_norm) and global NoPE layers with attention temperature tuning (which layers:
layer_layout.py NoRopeLayers), interleaved RoPE pairs. Its router takes the top k of the
logits (the same experts as of their sigmoids) and each chosen expert computes
SwiGLU(sigmoid(logit) * x), unrenormalised (model.moe.weight_on input), beside one shared
expert; the MoE layers by moe_layers / interleave_moe_layer_step; the experts stored stacked,
input axis first: experts.gate_up_proj [E, D, 2F] (the gate's F columns, then the up
projection's) and experts.down_proj [E, F, D]."""

from collections.abc import Mapping, Sequence
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.aspect import Aspect, HfConfig
from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family
from maxtrain.hf.feed_forward import DenseMlp, Experts
from maxtrain.hf.layer_layout import LayerLayout, MoeLayerList, NoRopeLayers
from maxtrain.hf.layout import LayerSite, Part, Slot


class ChunkedAttention(Aspect):
    """The chunked layers' chunk, the NoPE layers' temperature tuning and the RoPE layers'
    unscaled qk-norm (which NoPE layers skip)."""

    owns = frozenset({"qk_norm", "attention_chunk", "attention_temperature"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        kinds = {t.attention for t in layers}
        chunk = hf["attention_chunk_size"]
        if "chunked" in kinds and chunk is None:
            raise hf.error("attention_chunk_size is null; chunked layers need it")
        fields: dict[str, Any] = {"qk_norm": "rms_unscaled"} if hf["use_qk_norm"] else {}
        if "chunked" in kinds:
            fields["attention_chunk"] = chunk
        # attn_temperature_tuning is a number in published configs (Scout's 4)
        if hf["attn_temperature_tuning"] and "nope" in kinds:
            fields["attention_temperature"] = {
                "floor": hf["floor_scale"],
                "scale": hf["attn_scale"],
            }
        return fields

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        temperature = cfg.attention_temperature
        return {
            # transformers builds the chunked mask whatever the layers: one chunk is the context
            "attention_chunk_size": cfg.attention_chunk or cfg.max_seq_len,
            "use_qk_norm": cfg.qk_norm != "none",
            "attn_temperature_tuning": temperature is not None,
            "floor_scale": temperature.floor if temperature else defaults["floor_scale"],
            "attn_scale": temperature.scale if temperature else defaults["attn_scale"],
        }

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        return ["model.qk_norm=rms (its qk-norm has no scale)"] if cfg.qk_norm == "rms" else []


class StackedExperts(Experts):
    """Llama 4's experts: two stacked tensors for all of a layer's experts."""

    def expert_tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        assert cfg.moe is not None
        fused, widths = f"{self.block}.experts.gate_up_proj", (cfg.moe.expert_mlp_dim,) * 2
        return [
            site.slot(fused, ("moe", "gate", "kernel"), None, Part(0, widths)),
            site.slot(fused, ("moe", "up", "kernel"), None, Part(1, widths)),
            site.slot(f"{self.block}.experts.down_proj", ("moe", "down", "kernel"), None),
        ]


FAMILY = Family(
    model_type="llama4_text",
    architecture="Llama4ForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
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
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "intermediate_size": 8192,
        "router_aux_loss_coef": 1e-3,
        "interleave_moe_layer_step": 1,
        "moe_layers": None,
    },
    required={"hidden_act": "silu", "attention_bias": False},
    layers=LayerLayout(NoRopeLayers(), MoeLayerList()),
    aspects=(
        GroupedQuery(),
        ChunkedAttention(),
        DenseMlp(block="feed_forward", width_key="intermediate_size_mlp"),
        StackedExperts(
            count_keys=("num_local_experts",),
            width_key="intermediate_size",
            block="feed_forward",
            router="router",
            shared_block="shared_expert",
        ),
    ),
    fixed={
        "rope.interleaved": True,
        "moe.score": "sigmoid",
        "moe.renormalize": False,
        "moe.shared_experts": 1,
        "moe.weight_on": "input",
    },
    claims=lambda cfg: cfg.moe is not None and cfg.moe.weight_on == "input",
    rank=7,
)
