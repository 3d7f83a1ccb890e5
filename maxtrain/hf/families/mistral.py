"""Mistral (MistralForCausalLM): Llama's layers, every one with a sliding window
(sliding_window; null: none). transformers' query sees itself and the sliding_window - 1 keys
before it (masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window), as our
window does."""

from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family
from maxtrain.hf.feed_forward import DenseMlp
from maxtrain.hf.layer_layout import LayerLayout, WindowOnEveryLayer

FAMILY = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": None,
        "sliding_window": 4096,
    },
    required={"hidden_act": "silu"},
    layers=LayerLayout(WindowOnEveryLayer()),
    aspects=(GroupedQuery(), DenseMlp()),
    # a dense model with local layers (any but sliding ones on every layer: refused)
    claims=lambda cfg: (
        cfg.moe is None and bool({t.attention for t in cfg.layer_types} & {"sliding", "chunked"})
    ),
    rank=2,
)
