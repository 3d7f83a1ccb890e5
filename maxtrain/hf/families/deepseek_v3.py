"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (with or without
q_lora_rank), interleaved RoPE pairs (rope_interleave), YaRN; its first first_k_dense_replace
layers dense, the others MoE with shared experts. The router takes sigmoid scores, picks by
score + e_score_correction_bias (our aux-loss-free bias), weighs by the unbiased scores,
optionally renormalised (norm_topk_prob), times routed_scaling_factor, within the best
topk_group of n_group groups: model.moe's sigmoid mode.

Its multi-token prediction layer (layer 61, past num_hidden_layers) is skipped on import, as
transformers 5.23 skips it (it has no module to run it, so nothing checks a conversion), and
export writes none (num_nextn_predict_layers 0).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.aspect import Aspect, HfConfig, Writes
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family, RopeFormat
from maxtrain.hf.feed_forward import DenseMlp, Experts
from maxtrain.hf.layer_layout import AllGlobal, FirstDense, LayerLayout

# config.json's keys of the sigmoid router (GLM-4.5's too) -> model.moe's.
SIGMOID_ROUTER_KEYS = {
    "routed_scaling_factor": "routed_scale",
    "n_shared_experts": "shared_experts",
    "n_group": "n_group",
    "topk_group": "topk_group",
}
NO_MTP_LAYERS = Writes({"num_nextn_predict_layers": 0})
# The routed and shared experts as DeepSeek-V3 and GLM-4.5 write them.
SIGMOID_ROUTED_EXPERTS = Experts(
    count_keys=("n_routed_experts", "num_local_experts"),
    width_key="moe_intermediate_size",
    renormalize_key="norm_topk_prob",
    aux_key=None,
    keys=SIGMOID_ROUTER_KEYS,
    router_bias="e_score_correction_bias",
    shared_block="shared_experts",
)


@dataclass(frozen=True)
class LatentAttention(Aspect):
    """model.mla, its keys named alike in config.json, and the RoPE pairing rope_interleave
    says (transformers' head_dim is the rotary part's); `rotates` false: a family whose MLA
    rotates nothing (Kimi Linear's NoPE), which has no rope_interleave."""

    rotates: bool = True
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    owns = frozenset({"mla", "rope.interleaved"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        rope = {"rope": {"interleaved": hf["rope_interleave"]}} if self.rotates else {}
        return {"mla": {key: hf[key] for key in self.keys}, **rope}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        assert cfg.mla is not None  # unexpressed refuses grouped-query attention first
        rope = {"rope_interleave": cfg.rope.interleaved} if self.rotates else {}
        return {
            **{key: getattr(cfg.mla, key) for key in self.keys},
            "num_key_value_heads": cfg.resolved_kv_heads,
            "head_dim": cfg.mla.qk_rope_head_dim,  # what transformers sets it to
            **rope,
        }

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        if cfg.mla is None:
            return ["model.mla=null (its attention is multi-head latent)"]
        if cfg.mla.indexer is not None:  # deepseek_v32.py's
            return ["model.mla.indexer=set (DeepSeek sparse attention: deepseek_v32)"]
        if cfg.mla.rope != self.rotates:
            return [
                f"model.mla.rope={str(cfg.mla.rope).lower()}" + ("" if cfg.mla.rope else " (NoPE)")
            ]
        return []


FAMILY = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_interleave": True,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
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
    required={"hidden_act": "silu", "attention_bias": False},
    layers=LayerLayout(AllGlobal(), FirstDense("first_k_dense_replace")),
    aspects=(
        LatentAttention(),
        DenseMlp(),
        SIGMOID_ROUTED_EXPERTS,
        NO_MTP_LAYERS,
    ),
    fixed={"moe.score": "sigmoid"},
    rope=RopeFormat(scalings=("yarn",)),
    claims=lambda cfg: cfg.mla is not None,
    rank=9,
)
