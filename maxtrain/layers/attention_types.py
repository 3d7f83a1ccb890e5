"""model.attention_type -> the attention module every decoder block of the model uses.

Each kind also declares what it costs (`counts(cfg)`: parameters a token multiplies against,
the attention matmuls' widths, the activations remat keeps), which training/metrics.py and
analysis/memory.py read through `attention_type` instead of re-deriving it.
"""

from __future__ import annotations

from maxtrain.config import ModelArchitecture
from maxtrain.layers.attention import Attention, AttentionCounts
from maxtrain.layers.gated_deltanet import GatedDeltaNet
from maxtrain.layers.mla import MLA

ATTENTION_TYPES: dict[str, type[Attention] | type[MLA]] = {"gqa": Attention, "mla": MLA}


def attention_type(cfg: ModelArchitecture) -> type[Attention] | type[MLA]:
    return ATTENTION_TYPES[cfg.attention_type]


def mixer_counts(cfg: ModelArchitecture, mixer: str) -> AttentionCounts:
    """What one layer's token mixer costs per token: its attention kind's, or a linear layer's
    (model.layer_pattern `linear`: Gated DeltaNet)."""
    return GatedDeltaNet.counts(cfg) if mixer == "linear" else attention_type(cfg).counts(cfg)
