"""The parts a Hugging Face family is made of (family.py): a config.json as transformers reads
it, and the aspect: one thing a family maps between config.json and the model section.

An aspect reads its config.json keys into model keys, writes them back, names what of a model
it cannot write, and lists its tensors in a decoder layer. It `owns` the model keys it maps
(dotted: `moe.top_k`; a section's name owns all of its keys): export refuses a model whose
other keys are not at the family's fixed value or the schema's default (config_map.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.errors import ConversionError
from maxtrain.hf.layout import LayerSite, Slot

_NO_DEFAULT = object()


class HfConfig:
    """A config.json as its family's transformers config class reads it: a key that is absent
    takes the class's default; a shape key without one is an error naming it."""

    def __init__(self, raw: Mapping[str, Any], defaults: Mapping[str, Any], model_type: str,
                 where: str, aliases: Mapping[str, str] | None = None) -> None:  # fmt: skip
        self.raw, self.defaults, self.model_type, self.where = raw, defaults, model_type, where
        self.aliases = aliases or {}  # transformers' attribute_map: a key -> the one it stores

    def _stored(self, key: str) -> str:
        """The key config.json holds `key` under: its alias where the family has one there."""
        alias = self.aliases.get(key)
        return alias if alias is not None and alias in self.raw else key

    def __getitem__(self, key: str) -> Any:
        found = self.raw.get(self._stored(key), self.defaults.get(key, _NO_DEFAULT))
        if found is _NO_DEFAULT:
            raise self.error(f"no {key!r}; a {self.model_type} config needs it")
        return found

    def __contains__(self, key: str) -> bool:
        return self._stored(key) in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(self._stored(key), self.defaults.get(key, default))

    def count(self, key: str, minimum: int = 1) -> int:
        """An integer key of at least `minimum` (num_hidden_layers)."""
        value = self[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(
                f"{key}={json.dumps(value)} is not supported (an integer >= {minimum})"
            )
        return value

    def error(self, message: str) -> ConversionError:
        return ConversionError(f"{self.where}: {message}")


class Aspect:
    """One part of a family's mapping. `owns`: the model keys it reads and writes (a section's
    name owns all of its keys); the export of a model refuses what `unexpressed` names."""

    owns: frozenset[str] = frozenset()

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        """Model keys (nested dicts) of the config.json whose layers are `layers`."""
        return {}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """config.json keys of `cfg` (what `read` reads back); defaults: the family's."""
        return {}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        """What of the keys it owns the family cannot write, as "model.KEY=VALUE ..."."""
        return []

    def tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        """Its tensors in one decoder layer."""
        return []


@dataclass(frozen=True)
class Writes(Aspect):
    """config.json keys export writes as they are, whatever the model (DeepSeek-V3's
    num_nextn_predict_layers 0: no multi-token prediction layer is written)."""

    keys: Mapping[str, Any]

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self.keys)


def shown(value: Any) -> str:
    """A model value as a message names it: JSON's true, false and null; a set section as
    "set"."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return "set" if isinstance(value, BaseModel) else str(value)
