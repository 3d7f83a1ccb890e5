"""The attention module every softmax-attention block of a model uses: multi-head latent
attention where the model has model.mla, else grouped-query attention.

Each also declares what it costs (`counts(cfg)`: parameters a token multiplies against, the
attention matmuls' widths, the activations remat keeps), which training/metrics.py and
analysis/memory.py read through `attention_type` instead of re-deriving it.
"""

from __future__ import annotations

from maxtrain.config import ModelConfig
from maxtrain.layers.attention import Attention, AttentionCounts
from maxtrain.layers.gated_deltanet import GatedDeltaNet
from maxtrain.layers.mla import MLA


def attention_type(cfg: ModelConfig) -> type[Attention] | type[MLA]:
    return MLA if cfg.mla is not None else Attention


def mixer_counts(cfg: ModelConfig, mixer: str) -> AttentionCounts:
    """What one layer's token mixer costs per token: its attention kind's, or a linear layer's
    (model.layers' `linear`: Gated DeltaNet)."""
    return GatedDeltaNet.counts(cfg) if mixer == "linear" else attention_type(cfg).counts(cfg)
