"""Qwen3 (Qwen3ForCausalLM): Llama's layers with qk-norm; head_dim is its own key (128 when
absent)."""

from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family
from maxtrain.hf.feed_forward import DenseMlp

FAMILY = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,
    },
    required={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    aspects=(GroupedQuery(), DenseMlp()),
    fixed={"qk_norm": "rms"},
    claims=lambda cfg: cfg.moe is None and cfg.qk_norm != "none",
    rank=4,
)
