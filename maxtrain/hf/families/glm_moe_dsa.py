"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's architecture (deepseek_v32.py) with GLM's
sizes, its indexer's rotary dims paired interleaved like the attention's.

transformers' class also lets a layer reuse the previous layer's top-k instead of running an
indexer of its own (indexer_types "shared", or index_topk_freq above 1): such a checkpoint is
refused, naming the key; the published GLM-5 runs an indexer in every layer.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maxtrain.config import LayerType
from maxtrain.hf.aspect import HfConfig
from maxtrain.hf.families.deepseek_v32 import FAMILY as DEEPSEEK_V32
from maxtrain.hf.families.deepseek_v32 import IndexedLatentAttention
from maxtrain.hf.family import Family


@dataclass(frozen=True)
class EveryLayerIndexed(IndexedLatentAttention):
    """IndexedLatentAttention, refusing layers that share another's selection."""

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        shared = [i for i, kind in enumerate(hf.get("indexer_types") or ()) if kind != "full"]
        if shared or hf.get("index_topk_freq", 1) > 1 or "index_topk_pattern" in hf:
            raise hf.error(
                f"layers {shared or '(index_topk_freq/index_topk_pattern)'} reuse the previous "
                "layer's top-k (indexer_types 'shared'): not supported; every layer must run "
                "its own indexer ('full')"
            )
        return super().read(hf, layers)


FAMILY = Family(
    model_type="glm_moe_dsa",
    architecture="GlmMoeDsaForCausalLM",
    defaults={
        **DEEPSEEK_V32.defaults,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 202752,
        "q_lora_rank": 2048,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "n_group": 1,
        "topk_group": 1,
        "index_n_heads": 32,
    },
    required=DEEPSEEK_V32.required,
    layers=DEEPSEEK_V32.layers,
    aspects=(EveryLayerIndexed(indexer_interleaved=True), *DEEPSEEK_V32.aspects[1:]),
    fixed=DEEPSEEK_V32.fixed,
    rope=DEEPSEEK_V32.rope,
    claims=lambda cfg: (
        cfg.mla is not None and cfg.mla.indexer is not None and cfg.mla.indexer.rope_interleaved
    ),
    rank=21,  # past deepseek_v32's: GLM-5 pairs the indexer's rotary dims interleaved
)
