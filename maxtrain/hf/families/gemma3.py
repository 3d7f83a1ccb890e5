"""Gemma 3's language model (Gemma3ForCausalLM): norms before and after attention and the MLP
("sandwich"), RMSNorm scaling by 1 + w, qk-norm, embeddings times sqrt(hidden_size), GeGLU
(gelu_pytorch_tanh), the softmax scale of query_pre_attn_scalar; sliding-window layers
(layer_types, else every sliding_window_pattern-th layer global) with their own RoPE base,
unscaled, and linear RoPE scaling on the global ones. The vision+text `gemma3` checkpoints are
not read (their text_config is a gemma3_text model)."""

from collections.abc import Mapping, Sequence
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.aspect import Aspect, HfConfig
from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family, RopeFormat
from maxtrain.hf.feed_forward import DenseMlp
from maxtrain.hf.layer_layout import EveryNth, LayerLayout, LayerTypes

_LOCAL_THETA = "rope_local_base_freq"
_SOFTMAX_SCALE = "query_pre_attn_scalar"


class LocalRope(Aspect):
    """The sliding layers' RoPE base (model.rope.local_theta): rope_parameters'
    sliding_attention (transformers 5), else rope_local_base_freq; unscaled, as transformers
    computes it."""

    owns = frozenset({"rope.local_theta"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        if all(t.attention != "sliding" for t in layers):
            return {}
        local = (hf.raw.get("rope_parameters") or {}).get("sliding_attention")
        if not isinstance(local, dict):
            return {"rope": {"local_theta": hf[_LOCAL_THETA]}}
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise hf.error(f"sliding_attention RoPE type {kind!r} is not supported (only default)")
        return {"rope": {"local_theta": local.get("rope_theta", hf[_LOCAL_THETA])}}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {_LOCAL_THETA: cfg.rope.local_theta or cfg.rope.theta}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        local = {t.attention for t in cfg.layer_types} & {"sliding", "chunked"}
        if local and cfg.rope.local_theta is None and cfg.rope.scaling is not None:
            return [
                "model.rope.local_theta=null with model.rope.scaling (sliding layers' RoPE is "
                "unscaled)"
            ]
        return []


class SoftmaxScale(Aspect):
    """query_pre_attn_scalar: the attention logits divided by its square root
    (model.softmax_scale_dim)."""

    owns = frozenset({"softmax_scale_dim"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        return {"softmax_scale_dim": hf[_SOFTMAX_SCALE]}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {_SOFTMAX_SCALE: cfg.softmax_scale_dim or cfg.resolved_head_dim}


FAMILY = Family(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rope_theta": 1000000.0,
        _LOCAL_THETA: 10000.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 4,
        "head_dim": 256,
        _SOFTMAX_SCALE: 256,
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
    layers=LayerLayout(
        LayerTypes(
            names={"full_attention": "global", "sliding_attention": "sliding"},
            every=EveryNth("sliding_window_pattern", "global", "sliding"),
        )
    ),
    aspects=(GroupedQuery(), LocalRope(), SoftmaxScale(), DenseMlp()),
    fixed={
        "qk_norm": "rms",
        "block_norms": "sandwich",
        "norm_scale_plus_one": True,
        "scale_embeddings": True,
        "mlp_activation": "gelu_tanh",
    },
    rope=RopeFormat(scalings=("linear",), by_layer_type=True),
    claims=lambda cfg: cfg.block_norms == "sandwich",
    rank=6,
)
