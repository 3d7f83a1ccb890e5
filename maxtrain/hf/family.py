"""What a Hugging Face family is: the record each module of maxtrain/hf/families/ fills in.

A family is a transformers architecture that computes our decoder. Its entry says which
config.json keys change the model (with the values transformers' config class gives absent
ones), the options we do not model, how it states RoPE, which of its layers are what
(layer_layout.py), and its aspects (aspect.py): the attention, the feed-forward and experts,
whatever else it maps, each with its tensors. The shared code (config_map.py, layout.py) runs
them all and branches on no family: every model key that no aspect owns must be at the
family's `fixed` value, else at the schema's default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from maxtrain.config import ModelConfig
from maxtrain.hf.aspect import Aspect, HfConfig
from maxtrain.hf.layer_layout import LayerLayout

# Values transformers' PretrainedConfig gives every family's absent keys.
TRANSFORMERS_DEFAULTS = {
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


@dataclass(frozen=True)
class RopeFormat:
    """How a family states RoPE beyond theta: the scaling types checked against its
    transformers class (llama3's is every family's), the partial_rotary_factor an absent key
    means (None: every dim rotates, another is refused), and whether transformers 5 keys
    rope_parameters by layer type (full_attention: the global layers')."""

    scalings: tuple[str, ...] = ("llama3",)
    partial_default: float | None = None
    by_layer_type: bool = False


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    # config.json keys that change the model's function, with the value transformers' config
    # class assumes when the key is absent (class defaults differ between families).
    defaults: Mapping[str, Any]
    # Options of the family we do not model: a key present with another value is refused.
    # Export writes them as they are here.
    required: Mapping[str, Any]
    aspects: tuple[Aspect, ...]
    # Export picks, of the families that claim a model, the one of highest rank.
    claims: Callable[[ModelConfig], bool]
    rank: int
    # Which layers are sliding, chunked, linear, ... and which MoE (layer_layout.py).
    layers: LayerLayout = LayerLayout()
    # Model keys (dotted) the family's checkpoints cannot vary, with the value they have
    # there: import sets them, export refuses a model with others.
    fixed: Mapping[str, Any] = field(default_factory=dict)
    rope: RopeFormat = RopeFormat()
    # transformers' attribute_map: a key the shared code reads -> the one config.json stores
    # it under (Kimi Linear's model_max_length for max_position_embeddings). Export writes the
    # first, which transformers maps.
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def mappings(self) -> tuple[Aspect, ...]:
        """Everything that maps config.json keys: the layer layout, then the aspects."""
        return (self.layers, *self.aspects)

    def config_json(self, raw: Mapping[str, Any], where: str) -> HfConfig:
        """A config.json of this family (where: its path, for messages)."""
        return HfConfig(raw, self.defaults, self.model_type, where, self.aliases)
