"""config.json <-> ModelConfig for the families in families.py.

Both config.json layouts in the wild are read:

- the older one most published checkpoints use: `rope_theta` and `rope_scaling` at top level,
  `torch_dtype`, Qwen3-MoE's `num_experts`;
- the one transformers 5 writes: `rope_parameters` (holding rope_theta and the scaling),
  `dtype`, `num_local_experts`, `head_dim: null`.

Export writes the older layout, which transformers 4 and 5 both read. A key that is absent
takes the value transformers' config class gives it (Family.defaults); an option we do not model
(sliding windows, biases, other RoPE types, quantization) is a ConversionError naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from maxtrain.config import ModelConfig
from maxtrain.hf.errors import ConversionError
from maxtrain.hf.families import FAMILIES, Family
from maxtrain.model.stacks import is_moe_per_layer

CONFIG_JSON = "config.json"
_NO_DEFAULT = object()
# RoPE scaling keys named alike in RopeScaling and config.json, per type (required ones first;
# original_max_position <-> original_max_position_embeddings differs); YaRN's others default
# as in transformers. A rope type we do not list is a ConversionError.
_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}
_REQUIRED_SCALING_KEYS = {"llama3": _SCALING_KEYS["llama3"], "yarn": ("factor",)}
# YaRN options of transformers we do not model, with the value we compute.
_YARN_FIXED = {"attention_factor": None}
# layer_types' names of our attention kinds (model.layer_pattern).
_LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}
# The aux-loss-free bias update rate an imported routing bias trains with: DeepSeek-V3's
# published gamma (its paper, section 2.1.2); the checkpoint does not record it.
IMPORTED_BIAS_UPDATE_RATE = 0.001


def read_config_json(hf_dir: Path) -> tuple[dict[str, Any], Family]:
    """config.json of a model directory and the family its model_type names."""
    path = hf_dir / CONFIG_JSON
    if not path.is_file():
        raise ConversionError(
            f"{hf_dir}: no {CONFIG_JSON}; expected a Hugging Face model directory "
            "(config.json plus model.safetensors or model.safetensors.index.json)"
        )
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: expected a JSON object at top level")
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConversionError(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return hf, FAMILIES[model_type]


def model_config(hf: dict[str, Any], family: Family, where: str) -> ModelConfig:
    """Our ModelConfig for a config.json of `family` (where: its path, for messages)."""
    _check_supported(hf, family, where)
    defaults = {**family.defaults, **family.moe_defaults}

    def value(key: str) -> Any:
        """The key's value, else transformers' default; the shape keys have none."""
        found = hf.get(key, defaults.get(key, _NO_DEFAULT))
        if found is _NO_DEFAULT:
            raise ConversionError(f"{where}: no {key!r}; a {family.model_type} config needs it")
        return found

    heads = value("num_attention_heads")
    num_layers = value("num_hidden_layers")
    theta, scaling = _rope(hf, family, where, value("max_position_embeddings"))
    mla = {key: value(key) for key in family.mla_keys} or None
    fields = dict(
        vocab_size=value("vocab_size"),
        emb_dim=value("hidden_size"),
        num_layers=num_layers,
        num_heads=heads,
        # Multi-head latent attention has as many key/value heads as query heads, its head
        # sizes in model.mla (transformers' head_dim is then the rotary part's).
        num_kv_heads=heads if mla else value("num_key_value_heads") or heads,
        head_dim=None if mla else value("head_dim"),
        attention_type="mla" if mla else "gqa",
        mla=mla,
        rope_interleaved=value("rope_interleave") if mla else False,
        mlp_dim=value("intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=family.qk_norm,
        tie_embeddings=value("tie_word_embeddings"),
        norm_eps=value("rms_norm_eps"),
        max_seq_len=value("max_position_embeddings"),
        init_std=value("initializer_range"),
    )
    if family.attention_bias:
        fields["attention_bias"] = family.attention_bias if value("attention_bias") else "none"
    fields["attention_sinks"] = family.attention_sinks
    if family.layer_types:
        fields.update(_layer_pattern(hf, family, num_layers, value("sliding_window"), where))
    hf_layers = None  # Qwen3-MoE: which layers transformers makes MoE
    if family.is_moe:
        count_key = next((k for k in family.expert_count_keys if k in hf), None)
        renormalize = value(family.renormalize_key) if family.renormalize_key else True
        fields["moe"] = dict(
            num_experts=value(count_key or family.expert_count_keys[0]),
            top_k=value("num_experts_per_tok"),
            expert_mlp_dim=value(family.expert_width_key),
            score=family.score,
            renormalize=renormalize,
            aux_loss_weight=value(family.aux_loss_key) if family.aux_loss_key else 0.0,
            **{ours: value(key) for key, ours in family.moe_keys.items()},
        )
        if family.router_bias:
            fields["moe"]["bias_update_rate"] = IMPORTED_BIAS_UPDATE_RATE
        if family.expert_layout == "gpt_oss":
            fields["moe"].update(
                router_bias=True,
                expert_bias=True,
                clamped_swiglu=dict(alpha=value("swiglu_alpha"), limit=value("swiglu_limit")),
            )
        if family.sparse_layer_keys:
            step = value("decoder_sparse_step")
            hf_layers = _hf_sparse_layers(value("mlp_only_layers"), step, num_layers, where)
            fields["moe"].update(_sparse_layer_keys(hf_layers, step))
    cfg = _validated(fields, where)
    if hf_layers is not None and is_moe_per_layer(cfg) != hf_layers:
        raise ConversionError(
            f"{where}: mlp_only_layers {value('mlp_only_layers')} with decoder_sparse_step "
            f"{value('decoder_sparse_step')} makes layers {_indices(hf_layers)} MoE, which "
            "model.moe.first_dense_layers and interval cannot express (only a leading run of "
            "layers may be dense besides the interval)"
        )
    return cfg


def hf_config(cfg: ModelConfig, family: Family, dtype: str) -> dict[str, Any]:
    """The config.json (older layout) of `cfg` as a `family` model with weights in `dtype`."""
    _check_exportable(cfg, family)
    scaling = cfg.rope_scaling
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _hf_rope_scaling(scaling, family),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        **family.required,
    }
    if cfg.mla is not None:
        out.update({key: getattr(cfg.mla, key) for key in family.mla_keys})
        out["head_dim"] = cfg.mla.qk_rope_head_dim  # what transformers sets it to
        out["rope_interleave"] = cfg.rope_interleaved
        out["num_nextn_predict_layers"] = 0  # no multi-token prediction module is written
    if family.attention_bias:
        out["attention_bias"] = cfg.attention_bias != "none"
    if family.layer_types:
        local = cfg.local_attention
        out["layer_types"] = [_hf_layer_type(cfg.layer_attention(i)) for i in range(cfg.num_layers)]
        # transformers builds the sliding mask whether a layer uses it or not: never null
        out["sliding_window"] = family.defaults["sliding_window"] if local is None else local.window
    m = cfg.moe
    if m is not None and m.clamped_swiglu is not None:
        out["swiglu_alpha"], out["swiglu_limit"] = m.clamped_swiglu.alpha, m.clamped_swiglu.limit
    if m is not None:
        out[family.expert_count_keys[0]] = m.num_experts
        out["num_experts_per_tok"] = m.top_k
        out[family.expert_width_key] = m.expert_mlp_dim
        if family.aux_loss_key:
            out[family.aux_loss_key] = m.aux_loss_weight
        out.update({key: getattr(m, ours) for key, ours in family.moe_keys.items()})
        if family.renormalize_key:
            out[family.renormalize_key] = m.renormalize
        if family.sparse_layer_keys:
            out["decoder_sparse_step"] = m.interval
            out["mlp_only_layers"] = list(range(m.first_dense_layers))
    return out


def _check_supported(hf: dict[str, Any], family: Family, where: str) -> None:
    if quantization := hf.get("quantization_config"):
        # MXFP4 (GPT-OSS on the hub): transformers dequantizes it; we would need an oracle for
        # its packed blocks and scales, which no small fixture of ours can give.
        hint = (
            "; dequantize it first: transformers' from_pretrained(..., quantization_config="
            "Mxfp4Config(dequantize=True)) then save_pretrained"
            if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"
            else ""
        )
        raise ConversionError(
            f"{where}: quantization_config is set; quantized checkpoints are not supported{hint}"
        )
    for key, want in family.required.items():
        if key in hf and hf[key] != want:
            raise ConversionError(
                f"{where}: {key}={json.dumps(hf[key])} is not supported (a {family.model_type} "
                f"model converts only with {key}={json.dumps(want)})"
            )


def _rope(
    hf: dict[str, Any], family: Family, where: str, max_position: int
) -> tuple[float, dict[str, Any] | None]:
    """(theta, the model.rope_scaling keys or None) from either layout. As in transformers,
    `rope_scaling` wins over `rope_parameters`, and a theta inside them over the top-level
    `rope_theta`."""
    params = (
        hf.get("rope_scaling")
        or hf.get("rope_parameters")
        or family.defaults.get("rope_parameters")
    ) or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ConversionError(f"{where}: per-layer-type RoPE parameters are not supported")
    theta = params.get("rope_theta", hf.get("rope_theta", family.defaults["rope_theta"]))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConversionError(
            f"{where}: partial_rotary_factor={partial} is not supported (RoPE on every dim only)"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "yarn" and not family.yarn:  # checked against transformers where set
        yarn = ", ".join(f.model_type for f in FAMILIES.values() if f.yarn)
        raise ConversionError(
            f"{where}: RoPE type 'yarn' is supported for {yarn} only, not {family.model_type}"
        )
    if kind not in _SCALING_KEYS:
        raise ConversionError(
            f"{where}: RoPE type {kind!r} is not supported; supported: default, "
            + ", ".join(_SCALING_KEYS)
        )
    missing = [k for k in _REQUIRED_SCALING_KEYS[kind] if params.get(k) is None]
    if missing:
        raise ConversionError(f"{where}: {kind} RoPE scaling without {missing[0]!r}")
    if kind == "yarn":
        for key, want in _YARN_FIXED.items():
            if params.get(key, want) != want:
                raise ConversionError(
                    f"{where}: yarn {key}={json.dumps(params[key])} is not supported "
                    f"(only {json.dumps(want)})"
                )
    scaling = {key: params[key] for key in _SCALING_KEYS[kind] if params.get(key) is not None}
    original = params.get("original_max_position_embeddings", max_position)
    return theta, dict(type=kind, **scaling, original_max_position=original)


def _hf_rope_scaling(scaling, family: Family) -> dict[str, Any] | None:
    """config.json's rope_scaling for model.rope_scaling. None where transformers reads null as
    plain RoPE; {"rope_type": "default"} where it reads null as its family's default scaling."""
    if scaling is None:
        return {"rope_type": "default"} if "rope_parameters" in family.defaults else None
    return {
        "rope_type": scaling.type,
        **{key: getattr(scaling, key) for key in _SCALING_KEYS[scaling.type]},
        "original_max_position_embeddings": scaling.original_max_position,
    }


def _layer_pattern(
    hf: dict[str, Any], family: Family, num_layers: int, window: int | None, where: str
) -> dict[str, Any]:
    """model.layer_pattern and local_attention from `layer_types` (else the family's pattern
    repeated, as transformers makes it) and `sliding_window`: the shortest pattern whose
    repetition gives every layer's kind; no sliding window (null) makes every layer global."""
    types = hf.get("layer_types") or [
        family.layer_types[i % len(family.layer_types)] for i in range(num_layers)
    ]
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise ConversionError(
            f"{where}: layer_types {unknown[0]!r} is not supported; supported: "
            + ", ".join(_LAYER_TYPES)
        )
    if len(types) != num_layers:
        raise ConversionError(
            f"{where}: layer_types names {len(types)} layers, num_hidden_layers is {num_layers}"
        )
    kinds = [_LAYER_TYPES[t] for t in types]
    if window is None or "local" not in kinds:
        return {}
    repeats = lambda p: all(kinds[i] == kinds[i % p] for i in range(num_layers))  # noqa: E731
    period = next(p for p in range(1, num_layers + 1) if repeats(p))
    return {"layer_pattern": kinds[:period], "local_attention": {"window": window}}


def _hf_layer_type(kind: str) -> str:
    return next(hf for hf, ours in _LAYER_TYPES.items() if ours == kind)


def _hf_sparse_layers(
    mlp_only_layers: list[int], step: int, num_layers: int, where: str
) -> tuple[bool, ...]:
    """Per layer: True where transformers' Qwen3-MoE builds a sparse block."""
    if step < 1:
        raise ConversionError(f"{where}: decoder_sparse_step={step} is not supported (< 1)")
    dense = set(mlp_only_layers)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _sparse_layer_keys(hf_layers: tuple[bool, ...], step: int) -> dict[str, int]:
    """The only candidate (first_dense_layers, interval): the first MoE layer, the step.
    model_config checks that the candidate reproduces every layer."""
    first = hf_layers.index(True) if any(hf_layers) else len(hf_layers)
    return {"first_dense_layers": first, "interval": step}


def _validated(fields: dict[str, Any], where: str) -> ModelConfig:
    try:
        return ModelConfig.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ConversionError(f"{where}: {key + ': ' if key else ''}{msg}") from None


def _check_exportable(cfg: ModelConfig, family: Family) -> None:
    """Raises ConversionError for what `family` cannot express."""
    name = family.architecture
    m = cfg.moe
    unsupported = []
    if m is not None:
        if m.score != family.score:
            unsupported.append(f"model.moe.score={m.score}")
        if (m.bias_update_rate > 0) != bool(family.router_bias):
            unsupported.append(f"model.moe.bias_update_rate={m.bias_update_rate} (a routing bias)")
        if family.renormalize_key is None and not m.renormalize:
            unsupported.append("model.moe.renormalize=false")
        kinds = is_moe_per_layer(cfg)
        if family.sparse_layer_keys:
            pass  # any first_dense_layers and interval
        elif "first_dense_layers" in family.moe_keys.values():
            if not all(kinds[m.first_dense_layers :]):
                unsupported.append(f"model.moe.interval={m.interval}")
        elif not all(kinds):
            unsupported.append("dense layers between MoE layers")
        fixed = {"shared_experts": 0, "routed_scale": 1.0, "n_group": 1, "topk_group": 1}
        for key, want in fixed.items():
            if key not in family.moe_keys.values() and getattr(m, key) != want:
                unsupported.append(f"model.moe.{key}={getattr(m, key)}")
    elif family.is_moe:
        unsupported.append("a dense model (its MoE layers are required)")
    if cfg.rope_interleaved and not family.mla_keys:
        unsupported.append("model.rope_interleaved=true")
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.type == "yarn" and not family.yarn:
        unsupported.append("model.rope_scaling.type=yarn")
    unsupported += _unexportable_options(cfg, family)
    if unsupported:
        raise ConversionError(
            f"cannot export as {name} (the family for attention_type={cfg.attention_type}, "
            f"qk_norm={cfg.qk_norm}, {'MoE' if m else 'dense'}): {unsupported[0]} is not "
            "supported"
        )


def _unexportable_options(cfg: ModelConfig, family: Family) -> list[str]:
    """The attention biases, sinks, sliding windows, router and expert biases and clamped
    SwiGLU `family` cannot express, each as the key and value a message names."""
    out = []
    if cfg.attention_bias not in ("none", family.attention_bias):
        out.append(f"model.attention_bias={cfg.attention_bias}")
    if cfg.attention_sinks != family.attention_sinks:
        out.append(f"model.attention_sinks={str(cfg.attention_sinks).lower()}")
    local = cfg.local_attention
    if local is not None and not family.layer_types:
        out.append("model.layer_pattern with local layers")
    if local is not None and local.chunk is not None:
        out.append(f"model.local_attention.chunk={local.chunk}")
    if local is not None and local.rope_theta is not None:
        out.append(f"model.local_attention.rope_theta={local.rope_theta}")
    m = cfg.moe
    if m is not None:
        fused = family.expert_layout == "gpt_oss"  # has all of them, and plain SwiGLU none
        for key in ("router_bias", "expert_bias"):
            if getattr(m, key) != fused:
                out.append(f"model.moe.{key}={str(getattr(m, key)).lower()}")
        if (m.clamped_swiglu is not None) != fused:
            out.append(f"model.moe.clamped_swiglu={'set' if m.clamped_swiglu else 'null'}")
    return out


def _indices(flags: tuple[bool, ...]) -> list[int]:
    return [i for i, f in enumerate(flags) if f]
