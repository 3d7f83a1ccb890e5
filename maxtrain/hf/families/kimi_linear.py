"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention layers (maxtrain/hf/kimi_delta.py:
Gated DeltaNet with a decay per key channel, model.linear_attention.channel_decay) beside
multi-head latent attention that sees no position (NoPE: model.mla.rope false; DeepSeek-V3's
tensors, no RoPE key at all), and DeepSeek-V3's sigmoid router with a shared expert after
first_k_dense_replace dense layers, all under `block_sparse_moe.` (experts' w1, w3, w2: gate,
up, down).

Which layers are Kimi Delta Attention: layer_types' linear_attention (transformers writes it),
else linear_attn_config's full_attn_layers (numbered from 1, as published configs have them),
else transformers' default, full attention at every 4th layer from layer 4 (0-based). The
linear layers' sizes are linear_attn_config's num_heads, head_dim and short_conv_kernel_size
(or the linear_num_heads, linear_head_dim and linear_conv_kernel_dim transformers also
writes); one set of heads serves queries, keys and values. config.json names some keys its
own way (transformers' attribute_map: model_max_length, num_experts_per_token, ...): read
under either name, written under the shared one.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from maxtrain.config import LayerType, LinearAttention, ModelConfig
from maxtrain.hf.aspect import HfConfig, Writes
from maxtrain.hf.families.deepseek_v3 import LatentAttention
from maxtrain.hf.families.qwen3_next import GatedDeltaNet
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family
from maxtrain.hf.feed_forward import DenseMlp, Experts
from maxtrain.hf.kimi_delta import kimi_delta_attention_tensors
from maxtrain.hf.layer_layout import EveryNth, FirstDense, LayerLayout, LayerTypes

_BLOCK = "block_sparse_moe"
_LINEAR = "linear_attn_config"
# linear_attn_config's keys -> the top-level ones transformers also writes.
_LINEAR_KEYS = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}


class KimiLayerTypes(LayerTypes):
    """layer_types, else linear_attn_config's full_attn_layers (from 1), else every 4th from
    layer 4 full attention."""

    def kinds(self, hf: HfConfig, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return super().kinds(hf, num_layers)
        full = (hf.get(_LINEAR) or {}).get("full_attn_layers")
        if full is None:
            return ["global" if i and i % 4 == 0 else "linear" for i in range(num_layers)]
        return ["global" if i + 1 in full else "linear" for i in range(num_layers)]


@dataclass(frozen=True)
class KimiDelta(GatedDeltaNet):
    """model.linear_attention (Kimi Delta Attention) from linear_attn_config, and its layers'
    tensors (Gated DeltaNet's slots, in kimi_delta.py's layout)."""

    layout: Callable[[LinearAttention], tuple] = kimi_delta_attention_tensors

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        if all(t.attention != "linear" for t in layers):
            return {}
        nested = hf.get(_LINEAR) or {}
        heads, dim, conv = (nested.get(key, hf[top]) for key, top in _LINEAR_KEYS.items())
        return {
            "linear_attention": dict(
                num_key_heads=heads,
                num_value_heads=heads,
                key_head_dim=dim,
                value_head_dim=dim,
                conv_kernel=conv,
                channel_decay=True,
            )  # fmt: skip
        }

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        la = cfg.linear_attention
        values = (
            (la.num_value_heads, la.value_head_dim, la.conv_kernel)
            if la
            else tuple(defaults[top] for top in _LINEAR_KEYS.values())
        )
        return {
            _LINEAR: dict(zip(_LINEAR_KEYS, values, strict=True)),
            **dict(zip(_LINEAR_KEYS.values(), values, strict=True)),
        }

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        la = cfg.linear_attention
        if la is None:
            return []
        found = [] if la.channel_decay else ["model.linear_attention.channel_decay=false"]
        if (la.num_key_heads, la.key_head_dim) != (la.num_value_heads, la.value_head_dim):
            found.append("model.linear_attention's key heads unlike its value heads")
        return found


FAMILY = Family(
    model_type="kimi_linear",
    architecture="KimiLinearForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "layer_types": None,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1024,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "intermediate_size": 9216,
        "linear_num_heads": 32,
        "linear_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
    required={"hidden_act": "silu", "attention_bias": False},
    layers=LayerLayout(
        KimiLayerTypes(
            names={"linear_attention": "linear", "full_attention": "global"},
            every=EveryNth(1, "global", "global"),  # unread: kinds() says the default
        ),
        FirstDense("first_k_dense_replace"),
    ),
    aspects=(
        LatentAttention(rotates=False),
        KimiDelta(),
        DenseMlp(block=_BLOCK),
        Experts(
            count_keys=("num_experts",),
            width_key="moe_intermediate_size",
            block=_BLOCK,
            names=("w1", "w3", "w2"),
            renormalize_key="moe_renormalize",
            aux_key=None,
            keys={
                "routed_scaling_factor": "routed_scale",
                "num_shared_experts": "shared_experts",
                "num_expert_group": "n_group",
                "topk_group": "topk_group",
            },
            router_bias="e_score_correction_bias",
            shared_block="shared_experts",
        ),
        # KimiLinearConfig's absent special ids are Kimi's tokenizer's (163584, ...): an export
        # states its own tokenizer's (write_hf_model's extra_config), else none.
        Writes({"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    ),
    fixed={"moe.score": "sigmoid", "mla.rope": False},
    claims=lambda cfg: cfg.mla is not None and not cfg.mla.rope,
    rank=13,
    aliases={
        "max_position_embeddings": "model_max_length",
        "num_experts_per_tok": "num_experts_per_token",
    },
)
