"""Llama (LlamaForCausalLM): Llama 2 and 3 (Llama-3 RoPE scaling), Kanana; tied or not. The
plain decoder: grouped-query attention and a SwiGLU in every layer."""

from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family
from maxtrain.hf.feed_forward import DenseMlp

FAMILY = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "num_key_value_heads": None,  # None: as many as query heads
        "head_dim": None,  # None: hidden_size // num_attention_heads
    },
    required={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    aspects=(GroupedQuery(), DenseMlp()),
    claims=lambda cfg: cfg.moe is None,
    rank=0,
)
