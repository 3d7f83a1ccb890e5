"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 (deepseek_v3.py) with DeepSeek sparse
attention, a lightning indexer in every attention layer choosing each query's index_topk keys
(model.mla.indexer, layers/indexer.py). transformers' class has no rope_interleave key: the
attention always pairs its rotary dims interleaved, the indexer by halves; its query is always
low-rank (q_lora_rank).

The indexer's tensors, inside `self_attn.indexer.`: wq_b.weight [I Hi, q_lora_rank] (our q
kernel [q_lora_rank, I, Hi]), wk.weight [Hi, D], k_norm (a LayerNorm: weight and bias [Hi]) and
weights_proj.weight [I, D], linear weights transposed like every other (layout.py).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.aspect import HfConfig
from maxtrain.hf.families.deepseek_v3 import FAMILY as DEEPSEEK_V3
from maxtrain.hf.families.deepseek_v3 import (
    NO_MTP_LAYERS,
    SIGMOID_ROUTED_EXPERTS,
    LatentAttention,
)
from maxtrain.hf.family import Family
from maxtrain.hf.feed_forward import DenseMlp
from maxtrain.hf.layout import LayerSite, Slot

# config.json's keys of the indexer -> model.mla.indexer's.
INDEXER_KEYS = {"index_n_heads": "heads", "index_head_dim": "head_dim", "index_topk": "top_k"}
_INDEXER_TENSORS = (
    (("q", "kernel"), "wq_b.weight", 1),
    (("k", "kernel"), "wk.weight", 1),
    (("k_norm", "scale"), "k_norm.weight", None),
    (("k_norm", "bias"), "k_norm.bias", None),
    (("weights", "kernel"), "weights_proj.weight", 1),
)


@dataclass(frozen=True)
class IndexedLatentAttention(LatentAttention):
    """DeepSeek-V3's latent attention with the indexer's keys and tensors; the attention's
    RoPE pairing is not a key (`attention_interleaved`), the indexer's is the family's
    (`indexer_interleaved`)."""

    attention_interleaved: bool = True
    indexer_interleaved: bool = False

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        indexer = {ours: hf[key] for key, ours in INDEXER_KEYS.items()}
        indexer["rope_interleaved"] = self.indexer_interleaved
        return {
            "mla": {**{key: hf[key] for key in self.keys}, "indexer": indexer},
            "rope": {"interleaved": self.attention_interleaved},
        }

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        assert cfg.mla is not None and cfg.mla.indexer is not None  # unexpressed refuses
        written = super().write(cfg, defaults)
        del written["rope_interleave"]
        indexer = {key: getattr(cfg.mla.indexer, ours) for key, ours in INDEXER_KEYS.items()}
        return {**written, **indexer}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        if cfg.mla is None or cfg.mla.indexer is None:
            return ["model.mla.indexer=null (its attention is DeepSeek sparse attention)"]
        found = [] if cfg.mla.rope else ["model.mla.rope=false (NoPE)"]
        if cfg.rope.interleaved != self.attention_interleaved:
            found.append(f"model.rope.interleaved={str(cfg.rope.interleaved).lower()}")
        if cfg.mla.indexer.rope_interleaved != self.indexer_interleaved:
            rope = str(cfg.mla.indexer.rope_interleaved).lower()
            found.append(f"model.mla.indexer.rope_interleaved={rope}")
        return found

    def tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        if site.mixer != "attention":
            return []
        return [
            site.slot(f"self_attn.indexer.{name}", ("attn", "indexer", *path), in_axes)
            for path, name, in_axes in _INDEXER_TENSORS
        ]


_DEFAULTS = {
    **DEEPSEEK_V3.defaults,
    "max_position_embeddings": 163840,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}
del _DEFAULTS["rope_interleave"]

FAMILY = Family(
    model_type="deepseek_v32",
    architecture="DeepseekV32ForCausalLM",
    defaults=_DEFAULTS,
    required=DEEPSEEK_V3.required,
    layers=DEEPSEEK_V3.layers,
    aspects=(IndexedLatentAttention(), DenseMlp(), SIGMOID_ROUTED_EXPERTS, NO_MTP_LAYERS),
    fixed=DEEPSEEK_V3.fixed,
    rope=DEEPSEEK_V3.rope,
    claims=lambda cfg: cfg.mla is not None and cfg.mla.indexer is not None,
    rank=20,  # past the other families' ranks, which never claim a model with an indexer
)
