"""Hugging Face's per-layer layouts <-> model.layers: the one place that reads and writes them.

Families say which layers are what in several ways, each a class here that a family's entry
names (family.py `layers`):

    attention  every layer global (AllGlobal); a window on every layer or none (Mistral's
               sliding_window: WindowOnEveryLayer); a `layer_types` list, else every n-th layer
               of one kind (Gemma 3, GPT-OSS, Qwen3-Next: LayerTypes); `no_rope_layers`, else
               every no_rope_layer_interval-th layer without RoPE (Llama 4: NoRopeLayers)
    experts    none (AllDense); every layer (AllMoe); all after the first k
               (first_k_dense_replace: FirstDense); every decoder_sparse_step-th less
               mlp_only_layers (SparseStep); moe_layers, else every interleave_moe_layer_step-th
               (MoeLayerList)

LayerLayout joins the two into model.layers (config/layer_list.py) and writes both back; each
refuses, on export, the layers its family cannot state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.config.layer_list import shortest_entries
from maxtrain.hf.aspect import Aspect, HfConfig


@dataclass(frozen=True)
class EveryNth:
    """Layer i is `nth` where (i + 1) % period == 0, else `other`; the period is a config.json
    key's value, or the number itself (GPT-OSS: 2)."""

    period: str | int
    nth: str
    other: str

    def kinds(self, period: int, num_layers: int) -> list[str]:
        return [self.nth if (i + 1) % period == 0 else self.other for i in range(num_layers)]

    def read(self, hf: HfConfig, num_layers: int) -> list[str]:
        period = hf[self.period] if isinstance(self.period, str) else self.period
        if not isinstance(period, int) or period < 1:
            raise hf.error(f"{self.period}={period!r} is not supported")
        return self.kinds(period, num_layers)

    def written(self, kinds: list[str]) -> dict[str, Any]:
        """The period key where it states `kinds` (for transformers versions that read no
        per-layer list), else nothing."""
        period = _period(kinds)
        if isinstance(self.period, str) and kinds == self.kinds(period, len(kinds)):
            return {self.period: period}
        return {}


class AttentionLayout:
    """Each layer's attention kind (model.layers), with the keys that size those kinds: as
    such, every layer global."""

    expressible: frozenset[str] = frozenset({"global"})
    owns: frozenset[str] = frozenset()

    def kinds(self, hf: HfConfig, num_layers: int) -> list[str]:
        return ["global"] * num_layers

    def sizes(self, hf: HfConfig, kinds: list[str]) -> dict[str, Any]:
        return {}

    def keys(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        kinds = {t.attention for t in cfg.layer_types}
        return [f"model.layers' {kind} layers" for kind in sorted(kinds - self.expressible)]


class AllGlobal(AttentionLayout):
    """Every layer global attention."""


@dataclass(frozen=True)
class WindowOnEveryLayer(AttentionLayout):
    """Mistral: one sliding window on every layer (the key null: none)."""

    key: str = "sliding_window"
    expressible: frozenset[str] = frozenset({"global", "sliding"})
    owns: frozenset[str] = frozenset({"sliding_window"})

    def kinds(self, hf: HfConfig, num_layers: int) -> list[str]:
        return ["global" if hf[self.key] is None else "sliding"] * num_layers

    def sizes(self, hf: HfConfig, kinds: list[str]) -> dict[str, Any]:
        return {} if hf[self.key] is None else {"sliding_window": hf[self.key]}

    def keys(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {self.key: cfg.sliding_window}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        found = super().unexpressed(cfg)
        if {t.attention for t in cfg.layer_types} >= {"global", "sliding"}:
            found.append(f"model.layers={cfg.layers} (global layers beside sliding ones)")
        return found


@dataclass(frozen=True)
class LayerTypes(AttentionLayout):
    """transformers' `layer_types`, one name per layer (`names`: ours for each), else
    `every`; sliding layers take the window of `sliding_window` (written never null:
    transformers builds the sliding mask whether a layer uses it or not)."""

    names: Mapping[str, str] = field(default_factory=dict)
    every: EveryNth = EveryNth(1, "global", "global")

    @property
    def expressible(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset(self.names.values())

    @property
    def owns(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({"sliding_window"} if "sliding" in self.expressible else ())

    def kinds(self, hf: HfConfig, num_layers: int) -> list[str]:
        types = hf.get("layer_types")
        if types is None:
            return self.every.read(hf, num_layers)
        unknown = sorted(set(types) - set(self.names))
        if unknown:
            raise hf.error(f"layer_types holds {unknown[0]!r}; supported: {', '.join(self.names)}")
        if len(types) != num_layers:
            raise hf.error(
                f"layer_types names {len(types)} layers, num_hidden_layers is {num_layers}"
            )
        return [self.names[t] for t in types]

    def sizes(self, hf: HfConfig, kinds: list[str]) -> dict[str, Any]:
        if "sliding" not in kinds:
            return {}
        if hf["sliding_window"] is None:
            raise hf.error("layer_types has sliding layers but sliding_window is null")
        return {"sliding_window": hf["sliding_window"]}

    def keys(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        kinds = [t.attention for t in cfg.layer_types]
        hf_names = {kind: name for name, kind in self.names.items()}
        out: dict[str, Any] = {"layer_types": [hf_names[kind] for kind in kinds]}
        if "sliding" in self.expressible:
            out["sliding_window"] = cfg.sliding_window or defaults["sliding_window"]
        return {**out, **self.every.written(kinds)}


@dataclass(frozen=True)
class NoRopeLayers(AttentionLayout):
    """Llama 4: `no_rope_layers` (1: a RoPE layer, with chunked attention; 0: a global layer
    without RoPE; empty, as transformers reads it: absent), else every
    no_rope_layer_interval-th layer without RoPE. A `layer_types` list must say the same."""

    expressible: frozenset[str] = frozenset({"chunked", "nope"})
    every: EveryNth = EveryNth("no_rope_layer_interval", "nope", "chunked")

    def kinds(self, hf: HfConfig, num_layers: int) -> list[str]:
        rope_layers = hf["no_rope_layers"]
        if not rope_layers:
            kinds = self.every.read(hf, num_layers)
        elif len(rope_layers) < num_layers:
            raise hf.error(f"no_rope_layers has {len(rope_layers)} entries for {num_layers} layers")
        else:
            kinds = ["chunked" if rope_layers[i] else "nope" for i in range(num_layers)]
        implied = ["chunked_attention" if k == "chunked" else "full_attention" for k in kinds]
        layer_types = hf["layer_types"]
        if layer_types is not None and list(layer_types) != implied:
            raise hf.error(
                f"layer_types {layer_types} is not supported (only chunked attention on the "
                f"RoPE layers and full attention on the others: {implied})"
            )
        return kinds

    def keys(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        return {"no_rope_layers": [int(t.attention == "chunked") for t in cfg.layer_types]}


class ExpertLayers:
    """Which layers' feed-forward is a mixture of experts: as such, every layer."""

    has_experts = True

    def read(self, hf: HfConfig, num_layers: int) -> list[bool]:
        return [True] * num_layers

    def keys(self, moe_layers: list[bool]) -> dict[str, Any]:
        return {}

    def unexpressed(self, cfg: ModelConfig, moe_layers: list[bool]) -> list[str]:
        if all(moe_layers):
            return []
        return [f"model.layers={cfg.layers} (dense layers beside MoE layers)"]


class AllMoe(ExpertLayers):
    """Every layer a mixture of experts (Mixtral, GPT-OSS)."""


class AllDense(ExpertLayers):
    has_experts = False

    def read(self, hf: HfConfig, num_layers: int) -> list[bool]:
        return [False] * num_layers

    def unexpressed(self, cfg: ModelConfig, moe_layers: list[bool]) -> list[str]:
        return []


@dataclass(frozen=True)
class FirstDense(ExpertLayers):
    """DeepSeek-V3's first_k_dense_replace: the first k layers dense, the others MoE."""

    key: str = "first_k_dense_replace"

    def read(self, hf: HfConfig, num_layers: int) -> list[bool]:
        first = hf[self.key]
        if not isinstance(first, int) or first < 0:
            raise hf.error(f"{self.key}={first!r} is not supported")
        return [i >= first for i in range(num_layers)]

    def keys(self, moe_layers: list[bool]) -> dict[str, Any]:
        return {self.key: moe_layers.index(True)}

    def unexpressed(self, cfg: ModelConfig, moe_layers: list[bool]) -> list[str]:
        if all(moe_layers[moe_layers.index(True) :]):
            return []
        return [f"model.layers={cfg.layers} (dense layers between MoE layers)"]


class SparseStep(ExpertLayers):
    """Qwen3-MoE's: every decoder_sparse_step-th layer, less those mlp_only_layers lists;
    written as the largest step that fits, the rest listed."""

    def read(self, hf: HfConfig, num_layers: int) -> list[bool]:
        return _every_step(hf, "decoder_sparse_step", hf["mlp_only_layers"], num_layers)

    def keys(self, moe_layers: list[bool]) -> dict[str, Any]:
        step = _moe_step(moe_layers)
        dense = [i for i, moe in enumerate(moe_layers) if not moe and (i + 1) % step == 0]
        return {"decoder_sparse_step": step, "mlp_only_layers": dense}

    def unexpressed(self, cfg: ModelConfig, moe_layers: list[bool]) -> list[str]:
        return []


class MoeLayerList(SparseStep):
    """Llama 4's: moe_layers lists them, else every interleave_moe_layer_step-th."""

    def read(self, hf: HfConfig, num_layers: int) -> list[bool]:
        listed = hf["moe_layers"]
        if listed is None:
            return _every_step(hf, "interleave_moe_layer_step", [], num_layers)
        return [i in listed for i in range(num_layers)]

    def keys(self, moe_layers: list[bool]) -> dict[str, Any]:
        return {
            "interleave_moe_layer_step": _moe_step(moe_layers),
            "moe_layers": [i for i, moe in enumerate(moe_layers) if moe],
        }


@dataclass(frozen=True)
class LayerLayout(Aspect):
    """model.layers from a family's attention and expert layouts, and back."""

    attention: AttentionLayout = AllGlobal()
    experts: ExpertLayers = AllDense()

    @property
    def owns(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({"layers"}) | self.attention.owns

    def types(self, hf: HfConfig) -> tuple[LayerType, ...]:
        num_layers = hf.count("num_hidden_layers")
        attention = self.attention.kinds(hf, num_layers)
        moe = self.experts.read(hf, num_layers)
        return tuple(
            LayerType(a, "moe" if m else "dense") for a, m in zip(attention, moe, strict=True)
        )

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        kinds = [t.attention for t in layers]
        entries = shortest_entries(layers, self.experts.has_experts)
        return {"layers": entries, **self.attention.sizes(hf, kinds)}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        moe_layers = [t.ffn == "moe" for t in cfg.layer_types]
        experts = self.experts.keys(moe_layers) if cfg.moe is not None else {}
        return {**self.attention.keys(cfg, defaults), **experts}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        moe_layers = [t.ffn == "moe" for t in cfg.layer_types]
        experts = self.experts.unexpressed(cfg, moe_layers) if cfg.moe is not None else []
        return [*self.attention.unexpressed(cfg), *experts]


def _every_step(hf: HfConfig, key: str, dense: list[int], num_layers: int) -> list[bool]:
    """Per layer: True at every `key`-th layer not listed in `dense`."""
    step = hf[key]
    if step < 1:
        raise hf.error(f"{key}={step} is not supported (< 1)")
    return [i not in set(dense) and (i + 1) % step == 0 for i in range(num_layers)]


def _period(kinds: list[Any]) -> int:
    """The length of the shortest list whose repetition gives `kinds`."""
    return next(
        p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds))
    )


def _moe_step(moe_layers: list[bool]) -> int:
    """The largest step s with every MoE layer i at (i + 1) % s == 0: Qwen3-MoE's
    decoder_sparse_step and Llama 4's interleave_moe_layer_step, the rest of the dense layers
    listed."""
    return next(
        s
        for s in range(len(moe_layers), 0, -1)
        if all((i + 1) % s == 0 for i, moe in enumerate(moe_layers) if moe)
    )
