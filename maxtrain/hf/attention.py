"""Aspects of grouped-query attention that several families share: its heads, a qk-norm a
config.json key switches, projection biases. (Their tensors are layout.py's, by the model's
keys; multi-head latent attention is DeepSeek-V3's, families/deepseek_v3.py.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.aspect import Aspect, HfConfig


class GroupedQuery(Aspect):
    """Key/value heads (num_key_value_heads; null or absent in some families: as many as
    query heads) and the head size (head_dim; null: hidden_size / heads)."""

    owns = frozenset({"num_kv_heads", "head_dim"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        heads = hf["num_attention_heads"]
        kv_heads = hf["num_key_value_heads"] or heads
        fields = {"head_dim": hf["head_dim"]}
        return fields if kv_heads == heads else {**fields, "num_kv_heads": kv_heads}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {"num_key_value_heads": cfg.resolved_kv_heads, "head_dim": cfg.resolved_head_dim}


@dataclass(frozen=True)
class QkNormKey(Aspect):
    """A config.json key switching the scaled qk-norm (GLM-4.5's use_qk_norm)."""

    key: str
    owns: frozenset[str] = frozenset({"qk_norm"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        return {"qk_norm": "rms"} if hf[self.key] else {}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {self.key: cfg.qk_norm != "none"}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        return [f"model.qk_norm={cfg.qk_norm}"] if cfg.qk_norm == "rms_unscaled" else []


@dataclass(frozen=True)
class ProjectionBias(Aspect):
    """config.json's attention_bias: true gives the family's projections (`kind`) biases."""

    kind: str  # model.attention_projection_bias: qkv (GLM-4.5) or qkvo (GPT-OSS)
    owns: frozenset[str] = frozenset({"attention_projection_bias"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        return {"attention_projection_bias": self.kind} if hf["attention_bias"] else {}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": cfg.attention_projection_bias != "none"}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        if cfg.attention_projection_bias in ("none", self.kind):
            return []
        return [f"model.attention_projection_bias={cfg.attention_projection_bias}"]
