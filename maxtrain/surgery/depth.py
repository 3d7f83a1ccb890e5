"""Depth upscaling: a deeper model whose layers are copies of a trained model's layers.

A layer map lists, for each layer of the new model, the source layer it copies. SOLAR (Kim et
al., 2023) copies an N-layer model twice, drops the last m layers of the first copy and the
first m of the second, and joins them: layers 0..N-m-1 followed by m..N-1, 2(N - m) layers.
Any map works here, e.g. one that repeats a single block of middle layers to reach an odd
depth. Copies are exact: the new model starts where the source left off, except that the
repeated layers now run twice, so training continues from a perturbed but informed function.

Mixture-of-experts models upscale too: each new layer takes the kind (token mixer, dense or
MoE) of the source layer it copies, and the new model's config must give the same kinds (see
copied_kinds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from maxtrain.config import ConfigError, ModelConfig
from maxtrain.models.stacks import (
    STACKS,
    LayerKind,
    layer_kinds,
    outside_layers,
    stack_members,
    stack_positions,
    take_layers,
)


def solar_layer_map(num_layers: int, trim: int) -> list[int]:
    """SOLAR's map for N = num_layers, m = trim: layers 0..N-m-1 followed by m..N-1."""
    if not 0 <= trim < num_layers:
        raise ConfigError(f"the SOLAR trim m must be in 0..{num_layers - 1} (got {trim})")
    return list(range(num_layers - trim)) + list(range(trim, num_layers))


def copied_kinds(cfg: ModelConfig, layer_map: Sequence[int]) -> tuple[LayerKind, ...]:
    """Per new layer: its kind (models/stacks.py), that of the source layer it copies."""
    check_layer_map(cfg, layer_map)
    kinds = layer_kinds(cfg)
    return tuple(kinds[source] for source in layer_map)


def check_layer_map(cfg: ModelConfig, layer_map: Sequence[int]) -> None:
    """Raises ConfigError unless every entry names a layer of the source model."""
    if not layer_map:
        raise ConfigError("init.layer_map is empty; list the source layer of every new layer")
    bad = [i for i in layer_map if not 0 <= i < cfg.num_layers]
    if bad:
        raise ConfigError(
            f"init.layer_map names layer {bad[0]}, but the source model has {cfg.num_layers} "
            f"layers (0..{cfg.num_layers - 1})"
        )


def depth_upscale(
    params: dict[str, Any], cfg: ModelConfig, layer_map: Sequence[int]
) -> dict[str, Any]:
    """The parameters of a model whose layer i is a copy of layer layer_map[i] of `cfg`'s.

    Embedding, final norm and LM head are copied; the new model has len(layer_map) layers.
    """
    kinds = copied_kinds(cfg, layer_map)
    position = stack_positions(layer_kinds(cfg))
    out = outside_layers(params)
    for kind, members in stack_members(kinds).items():
        sources = [position[layer_map[i]] for i in members]
        out[STACKS[kind]] = take_layers(params[STACKS[kind]], sources)
    return out
