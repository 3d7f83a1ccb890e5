"""RoPE in config.json <-> model.rope (theta, scaling, fraction), for every family.

Both layouts are read: `rope_theta` and `rope_scaling` at top level (the older), or
`rope_parameters` holding both (transformers 5; keyed by layer type for some families, whose
full_attention entry is the global layers'). As in transformers, `rope_scaling` wins over
`rope_parameters`, and a theta inside them over the top-level `rope_theta`. Export writes the
older layout. A scaling type is read only for the families whose transformers class it was
checked against (family.py RopeFormat; llama3's: every family's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from maxtrain.config import ModelConfig, RopeScaling
from maxtrain.hf.aspect import HfConfig
from maxtrain.hf.family import RopeFormat

# RoPE scaling keys named alike in RopeScaling and config.json, per type (required ones first;
# original_max_position <-> original_max_position_embeddings differs); YaRN's others default
# as in transformers. A rope type we do not list is a ConversionError.
_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "linear": ("factor",),
}
_REQUIRED_SCALING_KEYS = {
    "llama3": _SCALING_KEYS["llama3"],
    "yarn": ("factor",),
    "linear": ("factor",),
}
EVERY_FAMILY_SCALES = ("llama3",)  # checked against transformers for every family
# The scaling types that scale relative to an original context (original_max_position).
_EXTENDS_A_CONTEXT = ("llama3", "yarn")
# YaRN options of transformers we do not model, with the value we compute.
_YARN_FIXED = {"attention_factor": None}
OWNS = frozenset({"rope.theta", "rope.scaling", "rope.fraction"})


def read_rope(hf: HfConfig, fmt: RopeFormat, checked_by: Mapping[str, list[str]]) -> dict[str, Any]:
    """model.rope's theta, scaling and fraction of a config.json (checked_by: scaling type ->
    the families whose transformers class it was checked against)."""
    params = _parameters(hf, fmt)
    rope: dict[str, Any] = {"theta": params.get("rope_theta", hf["rope_theta"])}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        rope["scaling"] = _scaling(hf, fmt, kind, params, checked_by)
    fraction = _partial_rotary_factor(hf, fmt)
    if fraction != 1.0:
        rope["fraction"] = fraction
    return rope


def _parameters(hf: HfConfig, fmt: RopeFormat) -> dict[str, Any]:
    params = (
        hf.raw.get("rope_scaling")
        or hf.raw.get("rope_parameters")
        or hf.defaults.get("rope_parameters")
        or {}
    )
    if fmt.by_layer_type and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # the global layers' (the sliding ones': gemma3.py)
    if any(isinstance(v, dict) for v in params.values()):
        raise hf.error("per-layer-type RoPE parameters are not supported")
    return params


def _scaling(
    hf: HfConfig,
    fmt: RopeFormat,
    kind: str,
    params: dict[str, Any],
    checked_by: Mapping[str, list[str]],
) -> dict[str, Any]:
    """model.rope.scaling of a config.json's scaling parameters of type `kind`."""
    if kind not in (*EVERY_FAMILY_SCALES, *fmt.scalings):
        if checked_by.get(kind):
            raise hf.error(
                f"RoPE type {kind!r} is supported for {', '.join(checked_by[kind])} only, not "
                f"{hf.model_type}"
            )
        raise hf.error(
            f"RoPE type {kind!r} is not supported; supported: default, " + ", ".join(_SCALING_KEYS)
        )
    missing = [k for k in _REQUIRED_SCALING_KEYS[kind] if params.get(k) is None]
    if missing:
        raise hf.error(f"{kind} RoPE scaling without {missing[0]!r}")
    if kind == "yarn":
        for key, want in _YARN_FIXED.items():
            if params.get(key, want) != want:
                raise hf.error(
                    f"yarn {key}={json.dumps(params[key])} is not supported "
                    f"(only {json.dumps(want)})"
                )
    scaling = {key: params[key] for key in _SCALING_KEYS[kind] if params.get(key) is not None}
    if kind in _EXTENDS_A_CONTEXT:
        scaling["original_max_position"] = params.get(
            "original_max_position_embeddings", hf["max_position_embeddings"]
        )
    return dict(type=kind, **scaling)


def _partial_rotary_factor(hf: HfConfig, fmt: RopeFormat) -> float:
    """The fraction of each head that RoPE rotates, found where the RoPE keys are (or at top
    level, as published GLM-4.5 configs have it); only a family with a default for it rotates
    part of a head."""
    params = hf.raw.get("rope_scaling") or hf.raw.get("rope_parameters") or {}
    default = 1.0 if fmt.partial_default is None else fmt.partial_default
    partial = params.get("partial_rotary_factor", hf.raw.get("partial_rotary_factor", default))
    if partial != 1.0 and fmt.partial_default is None:
        raise hf.error(
            f"partial_rotary_factor={partial} is not supported for {hf.model_type} (RoPE on "
            "every dim only)"
        )
    return partial


def rope_keys(cfg: ModelConfig, fmt: RopeFormat, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's RoPE keys of `cfg` (older layout; partial_rotary_factor at top level, as
    published GLM-4.5 has it)."""
    out = {"rope_theta": cfg.rope.theta, "rope_scaling": _hf_scaling(cfg.rope.scaling, defaults)}
    if fmt.partial_default is not None:
        out["partial_rotary_factor"] = cfg.rope.fraction
    return out


def _hf_scaling(scaling: RopeScaling | None, defaults: Mapping[str, Any]) -> dict[str, Any] | None:
    """config.json's rope_scaling for model.rope.scaling. None where transformers reads null as
    plain RoPE; {"rope_type": "default"} where it reads null as its family's default scaling."""
    if scaling is None:
        return {"rope_type": "default"} if "rope_parameters" in defaults else None
    return {
        "rope_type": scaling.type,
        **{key: getattr(scaling, key) for key in _SCALING_KEYS[scaling.type]},
        **(
            {"original_max_position_embeddings": scaling.original_max_position}
            if scaling.type in _EXTENDS_A_CONTEXT
            else {}
        ),
    }


def unexpressed_rope(cfg: ModelConfig, fmt: RopeFormat) -> list[str]:
    """What of model.rope's theta, scaling and fraction a family cannot write."""
    found = []
    scaling = cfg.rope.scaling
    if scaling is not None and scaling.type not in (*EVERY_FAMILY_SCALES, *fmt.scalings):
        found.append(f"model.rope.scaling.type={scaling.type}")
    if cfg.rope.fraction != 1 and fmt.partial_default is None:
        found.append(f"model.rope.fraction={cfg.rope.fraction}")
    return found
