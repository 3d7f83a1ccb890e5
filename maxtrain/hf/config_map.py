"""config.json <-> ModelConfig for the families in families.py.

Both config.json layouts in the wild are read:

- the older one most published checkpoints use: `rope_theta` and `rope_scaling` at top level,
  `torch_dtype`, Qwen3-MoE's `num_experts`;
- the one transformers 5 writes: `rope_parameters` (holding rope_theta and the scaling),
  `dtype`, `num_local_experts`, `head_dim: null`.

Export writes the older layout, which transformers 4 and 5 both read. A key that is absent
takes the value transformers' config class gives it (Family.defaults); an option we do not model
(a sliding window outside Mistral, biases, other RoPE types, quantization) is a ConversionError
naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from maxtrain.config import GlobalAttention, ModelConfig
from maxtrain.hf.errors import ConversionError
from maxtrain.hf.families import FAMILIES, FEATURE_DEFAULTS, Family
from maxtrain.models.stacks import is_moe_per_layer

CONFIG_JSON = "config.json"
_NO_DEFAULT = object()
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
# Scaling types checked against transformers for some families only: type -> those families.
_SCALING_FAMILIES = {"yarn": ("deepseek_v3", "gpt_oss"), "linear": ("gemma3_text",)}
# The scaling types that scale relative to an original context (original_max_position).
_EXTENDS_A_CONTEXT = ("llama3", "yarn")
# transformers' layer_types -> our model.layer_pattern kinds.
_LAYER_KINDS = {"full_attention": "global", "sliding_attention": "local"}
# Qwen3-Next's layer_types -> our model.layer_pattern kinds.
_LINEAR_LAYER_KINDS = {"linear_attention": "linear", "full_attention": "global"}
# Qwen3-Next's config.json keys of its Gated DeltaNet -> model.linear_attention's.
_LINEAR_KEYS = {
    "linear_num_key_heads": "num_key_heads",
    "linear_num_value_heads": "num_value_heads",
    "linear_key_head_dim": "key_head_dim",
    "linear_value_head_dim": "value_head_dim",
    "linear_conv_kernel_dim": "conv_kernel",
}
# YaRN options of transformers we do not model, with the value we compute.
_YARN_FIXED = {"attention_factor": None}
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
    biases = family.attention_bias if family.attention_bias and value("attention_bias") else "none"
    pattern = _layer_pattern(hf, family, where, value, num_layers) if family.layer_types else {}
    if family.linear_layers:
        pattern = _linear_pattern(hf, where, value, num_layers)
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
        rope_interleaved=value("rope_interleave") if mla else family.rope_interleaved,
        partial_rotary_factor=_partial_rotary_factor(hf, family, where),
        mlp_dim=value(family.dense_width_key),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=value(family.qk_norm_key) if family.qk_norm_key else family.qk_norm,
        attention_bias=biases,
        tie_embeddings=value("tie_word_embeddings"),
        norm_eps=value("rms_norm_eps"),
        max_seq_len=value("max_position_embeddings"),
        init_std=value("initializer_range"),
    )
    if family.chunked_nope:
        fields.update(_chunked_nope(value, num_layers, where))
    window = value(family.window_key) if family.window_key else None
    if window is not None:
        fields.update(layer_pattern=["local"], local_attention=dict(window=window))
    fields.update(**pattern, **family.features)
    if family.softmax_scale_key:
        fields["softmax_scale_dim"] = value(family.softmax_scale_key)
    fields["attention_sinks"] = family.attention_sinks
    hf_layers = None  # Qwen3-MoE, Llama 4: which layers transformers makes MoE
    if family.is_moe:
        count_key = next((k for k in family.expert_count_keys if k in hf), None)
        fields["moe"] = dict(
            num_experts=value(count_key or family.expert_count_keys[0]),
            top_k=value("num_experts_per_tok"),
            expert_mlp_dim=value(family.expert_width_key),
            score=family.score,
            aux_loss_weight=value(family.aux_loss_key) if family.aux_loss_key else 0.0,
            **{ours: value(key) for key, ours in family.moe_keys.items()},
            **family.fixed_moe,
        )
        if family.renormalize_key:
            fields["moe"]["renormalize"] = value(family.renormalize_key)
        if family.shared_width_key:
            fields["moe"]["shared_experts"] = _shared_experts(family, value, where)
        if family.router_bias:
            fields["moe"]["bias_update_rate"] = IMPORTED_BIAS_UPDATE_RATE
        if family.expert_layout == "gpt_oss":
            fields["moe"].update(
                router_bias=True,
                expert_bias=True,
                clamped_swiglu=dict(alpha=value("swiglu_alpha"), limit=value("swiglu_limit")),
            )
        if family.sparse_layer_keys or family.moe_layer_list:
            hf_layers, step, chosen_by = _hf_moe_layers(family, value, num_layers, where)
            fields["moe"].update(_sparse_layer_keys(hf_layers, step))
    cfg = _validated(fields, where)
    if hf_layers is not None and is_moe_per_layer(cfg) != hf_layers:
        raise ConversionError(
            f"{where}: {chosen_by} makes layers {_indices(hf_layers)} MoE, which "
            "model.moe.first_dense_layers and interval cannot express (only a leading run of "
            "layers may be dense besides the interval)"
        )
    return cfg


def _linear_pattern(hf: dict[str, Any], where: str, value, num_layers: int) -> dict[str, Any]:
    """Qwen3-Next's layer kinds as model.layer_pattern (linear_attention: `linear`,
    full_attention: `global`) with model.linear_attention: layer_types, else, as transformers
    derives it, every full_attention_interval-th layer full."""
    types = value("layer_types")
    if types is None:
        interval = value("full_attention_interval")
        if not isinstance(interval, int) or interval < 1:
            raise ConversionError(f"{where}: full_attention_interval={interval!r} is not supported")
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    unknown = sorted(set(types) - set(_LINEAR_LAYER_KINDS))
    if unknown:
        raise ConversionError(
            f"{where}: layer_types holds {unknown[0]!r}; supported: "
            + ", ".join(_LINEAR_LAYER_KINDS)
        )
    if len(types) != num_layers:
        raise ConversionError(
            f"{where}: layer_types names {len(types)} layers, num_hidden_layers is {num_layers}"
        )
    kinds = [_LINEAR_LAYER_KINDS[t] for t in types]
    if "linear" not in kinds:
        return {}
    linear = {ours: value(key) for key, ours in _LINEAR_KEYS.items()}
    return dict(layer_pattern=_period(kinds), linear_attention=linear)


def _shared_experts(family: Family, value, where: str) -> int:
    """model.moe.shared_experts of a shared expert as wide as `shared_width_key` says: how
    many routed experts' widths it spans."""
    width, expert = value(family.shared_width_key), value(family.expert_width_key)
    if width <= 0 or width % expert:
        raise ConversionError(
            f"{where}: {family.shared_width_key}={width} is not supported (only a positive "
            f"multiple of {family.expert_width_key}={expert})"
        )
    return width // expert


def _chunked_nope(value, num_layers: int, where: str) -> dict[str, Any]:
    """Llama 4's attention as our keys: its RoPE layers (no_rope_layers 1; without the list,
    all but every no_rope_layer_interval-th) chunked local layers with the unscaled qk-norm
    (use_qk_norm), the others global NoPE layers with attention temperature tuning."""
    rope_layers = value("no_rope_layers")  # transformers reads an empty list as absent too
    if not rope_layers:
        interval = value("no_rope_layer_interval")
        rope_layers = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(rope_layers) < num_layers:
        raise ConversionError(
            f"{where}: no_rope_layers has {len(rope_layers)} entries for {num_layers} layers"
        )
    kinds = ["local" if rope_layers[i] else "global" for i in range(num_layers)]
    implied = ["chunked_attention" if k == "local" else "full_attention" for k in kinds]
    layer_types = value("layer_types")
    if layer_types is not None and list(layer_types) != implied:
        raise ConversionError(
            f"{where}: layer_types {layer_types} is not supported (only chunked attention on "
            f"the RoPE layers and full attention on the others: {implied})"
        )
    chunk = value("attention_chunk_size")
    if "local" in kinds and chunk is None:
        raise ConversionError(f"{where}: attention_chunk_size is null; chunked layers need it")
    tuning = value("attn_temperature_tuning")  # a number in published configs (Scout's 4)
    return dict(
        layer_pattern=None if "local" not in kinds else _period(kinds),
        local_attention={"chunk": chunk} if "local" in kinds else None,
        global_attention=dict(
            rope=False,
            qk_norm=False,
            temperature_floor=value("floor_scale") if tuning else None,
            temperature_scale=value("attn_scale"),
        ),
        qk_norm=bool(value("use_qk_norm")),
        qk_norm_scale=False,
    )


def _period(kinds: list[str]) -> list[str]:
    """The shortest list whose repetition gives `kinds` (model.layer_pattern)."""
    n = next(
        p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds))
    )
    return kinds[:n]


def hf_config(cfg: ModelConfig, family: Family, dtype: str) -> dict[str, Any]:
    """The config.json (older layout) of `cfg` as a `family` model with weights in `dtype`."""
    _check_exportable(cfg, family)
    scaling = cfg.rope_scaling
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        family.dense_width_key: cfg.mlp_dim,
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
    if family.window_key:
        out[family.window_key] = cfg.local_attention.window if cfg.local_attention else None
    if family.layer_types:
        out.update(_layer_types_keys(cfg, family))
    if family.softmax_scale_key:
        out[family.softmax_scale_key] = cfg.softmax_scale_dim or cfg.resolved_head_dim
    if cfg.mla is not None:
        out.update({key: getattr(cfg.mla, key) for key in family.mla_keys})
        out["head_dim"] = cfg.mla.qk_rope_head_dim  # what transformers sets it to
        out["rope_interleave"] = cfg.rope_interleaved
    if family.nextn_key:
        out[family.nextn_key] = 0  # no multi-token prediction module is written
    if family.qk_norm_key:
        out[family.qk_norm_key] = cfg.qk_norm
    if family.attention_bias:
        out["attention_bias"] = cfg.attention_bias != "none"
    if "partial_rotary_factor" in family.defaults:  # top level, as published GLM-4.5 has it
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
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
        if family.shared_width_key:
            out[family.shared_width_key] = m.shared_experts * m.expert_mlp_dim
        if family.sparse_layer_keys:
            out["decoder_sparse_step"] = m.interval
            out["mlp_only_layers"] = list(range(m.first_dense_layers))
        if family.moe_layer_list:
            out["interleave_moe_layer_step"] = m.interval
            out["moe_layers"] = _indices(is_moe_per_layer(cfg))
    if family.chunked_nope:
        out.update(_chunked_nope_keys(cfg, family))
    if family.linear_layers:
        out.update(_linear_keys(cfg, family))
    return out


def _linear_keys(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """Qwen3-Next's config.json keys of cfg's layer kinds (_linear_pattern's inverse); the
    DeltaNet's sizes at transformers' defaults where no layer is linear."""
    hf_names = {kind: name for name, kind in _LINEAR_LAYER_KINDS.items()}
    linear = cfg.linear_attention
    return {
        "layer_types": [hf_names[cfg.layer_attention(i)] for i in range(cfg.num_layers)],
        **{
            key: getattr(linear, ours) if linear else family.defaults[key]
            for key, ours in _LINEAR_KEYS.items()
        },
    }


def _chunked_nope_keys(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """Llama 4's config.json keys of a model's layer kinds (_chunked_nope's inverse)."""
    glob = cfg.global_attention or GlobalAttention()
    local = cfg.local_attention
    return {
        "no_rope_layers": [int(cfg.layer_attention(i) == "local") for i in range(cfg.num_layers)],
        # transformers builds the chunked mask whatever the layers: one chunk is the context
        "attention_chunk_size": local.chunk if local is not None else cfg.max_seq_len,
        "use_qk_norm": cfg.qk_norm,
        "attn_temperature_tuning": glob.temperature_floor is not None,
        "floor_scale": glob.temperature_floor or family.defaults["floor_scale"],
        "attn_scale": glob.temperature_scale,
    }


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
        or {}
    )
    if family.layer_types and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # the global layers' (_local_rope_theta: the others')
    if any(isinstance(v, dict) for v in params.values()):
        raise ConversionError(f"{where}: per-layer-type RoPE parameters are not supported")
    theta = params.get("rope_theta", hf.get("rope_theta", family.defaults["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    checked_for = _SCALING_FAMILIES.get(kind, (family.model_type,))
    if family.model_type not in checked_for:
        raise ConversionError(
            f"{where}: RoPE type {kind!r} is supported for {', '.join(checked_for)} only, not "
            f"{family.model_type}"
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
    if kind in _EXTENDS_A_CONTEXT:
        scaling["original_max_position"] = params.get(
            "original_max_position_embeddings", max_position
        )
    return theta, dict(type=kind, **scaling)


def _layer_pattern(
    hf: dict[str, Any], family: Family, where: str, value, num_layers: int
) -> dict[str, Any]:
    """model.layer_pattern and local_attention of a config.json with sliding-window layers:
    layer_types, else every global_period-th layer global (sliding_window_pattern-th for
    Gemma 3, as transformers derives it), written as the shortest pattern that repeats into
    them; none for all-global layers."""
    types = hf.get("layer_types")
    if types is None:
        period = family.global_period or value("sliding_window_pattern")
        if not isinstance(period, int) or period < 1:
            raise ConversionError(f"{where}: sliding_window_pattern={period!r} is not supported")
        kinds = _every_nth_global(period, num_layers)
    else:
        unknown = sorted(set(types) - set(_LAYER_KINDS))
        if unknown:
            raise ConversionError(
                f"{where}: layer_types holds {unknown[0]!r}; supported: {', '.join(_LAYER_KINDS)}"
            )
        if len(types) != num_layers:
            raise ConversionError(
                f"{where}: layer_types names {len(types)} layers, num_hidden_layers is {num_layers}"
            )
        kinds = [_LAYER_KINDS[t] for t in types]
    if "local" not in kinds:
        return {}
    period = next(p for p in range(1, num_layers + 1) if kinds == _repeated(kinds[:p], num_layers))
    window = value("sliding_window")
    if window is None:
        raise ConversionError(f"{where}: layer_types has sliding layers but sliding_window is null")
    local = dict(window=window)
    if family.local_rope_key:  # else the model's RoPE, scaled as the global layers'
        local["rope_theta"] = _local_rope_theta(hf, family, where, value)
    return dict(layer_pattern=kinds[:period], local_attention=local)


def _every_nth_global(period: int, num_layers: int) -> list[str]:
    """Layer i global iff (i + 1) % period == 0 (Gemma's sliding_window_pattern)."""
    return ["global" if (i + 1) % period == 0 else "local" for i in range(num_layers)]


def _repeated(pattern: list[str], num_layers: int) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(num_layers)]


def _local_rope_theta(hf: dict[str, Any], family: Family, where: str, value) -> float:
    """The sliding layers' RoPE base: rope_parameters' sliding_attention (transformers 5),
    else rope_local_base_freq; unscaled, as transformers computes it."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if not isinstance(local, dict):
        return value(family.local_rope_key)
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise ConversionError(
            f"{where}: sliding_attention RoPE type {kind!r} is not supported (only default)"
        )
    return local.get("rope_theta", value(family.local_rope_key))


def _layer_types_keys(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """The config.json keys of cfg's attention pattern as Gemma 3 and GPT-OSS state it (what
    _layer_pattern reads back), with Gemma's sliding_window_pattern too where that period
    expresses it, for transformers versions that read no layer_types."""
    kinds = [cfg.layer_attention(i) for i in range(cfg.num_layers)]
    local = cfg.local_attention
    hf_names = {kind: name for name, kind in _LAYER_KINDS.items()}
    out = {
        "layer_types": [hf_names[kind] for kind in kinds],
        # transformers builds the sliding mask whether a layer uses it or not: never null
        "sliding_window": local.window if local else family.defaults["sliding_window"],
    }
    if family.local_rope_key:
        theta = local.rope_theta if local and local.rope_theta else cfg.rope_theta
        out[family.local_rope_key] = theta
    period = len(cfg.layer_pattern or ["global"])
    if not family.global_period and kinds == _every_nth_global(period, cfg.num_layers):
        out["sliding_window_pattern"] = period
    return out


def _partial_rotary_factor(hf: dict[str, Any], family: Family, where: str) -> float:
    """The fraction of each head that RoPE rotates, found where _rope finds the RoPE keys (or
    at top level, as published GLM-4.5 configs have it); only a family whose defaults name it
    (GLM-4.5) rotates part of a head."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    default = family.defaults.get("partial_rotary_factor", 1.0)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default))
    if partial != 1.0 and "partial_rotary_factor" not in family.defaults:
        raise ConversionError(
            f"{where}: partial_rotary_factor={partial} is not supported for "
            f"{family.model_type} (RoPE on every dim only)"
        )
    return partial


def _hf_rope_scaling(scaling, family: Family) -> dict[str, Any] | None:
    """config.json's rope_scaling for model.rope_scaling. None where transformers reads null as
    plain RoPE; {"rope_type": "default"} where it reads null as its family's default scaling."""
    if scaling is None:
        return {"rope_type": "default"} if "rope_parameters" in family.defaults else None
    return {
        "rope_type": scaling.type,
        **{key: getattr(scaling, key) for key in _SCALING_KEYS[scaling.type]},
        **(
            {"original_max_position_embeddings": scaling.original_max_position}
            if scaling.type in _EXTENDS_A_CONTEXT
            else {}
        ),
    }


def _hf_sparse_layers(
    mlp_only_layers: list[int], step: int, num_layers: int, where: str
) -> tuple[bool, ...]:
    """Per layer: True where transformers' Qwen3-MoE builds a sparse block (Llama 4's without
    moe_layers: none dense by list)."""
    if step < 1:
        raise ConversionError(f"{where}: decoder_sparse_step={step} is not supported (< 1)")
    dense = set(mlp_only_layers)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _hf_moe_layers(
    family: Family, value, num_layers: int, where: str
) -> tuple[tuple[bool, ...], int, str]:
    """Per layer, True where transformers builds a sparse block; the step between them; the
    keys that say so (for messages)."""
    if family.sparse_layer_keys:  # Qwen3-MoE
        step, dense = value("decoder_sparse_step"), value("mlp_only_layers")
        chosen_by = f"mlp_only_layers {dense} with decoder_sparse_step {step}"
        return _hf_sparse_layers(dense, step, num_layers, where), step, chosen_by
    step, listed = value("interleave_moe_layer_step"), value("moe_layers")  # Llama 4
    if listed is None:
        layers = _hf_sparse_layers([], step, num_layers, where)
        return layers, step, f"interleave_moe_layer_step {step}"
    return tuple(i in listed for i in range(num_layers)), step, f"moe_layers {listed}"


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
        kinds = is_moe_per_layer(cfg)
        if family.sparse_layer_keys or family.moe_layer_list:
            pass  # any first_dense_layers and interval
        elif "first_dense_layers" in family.moe_keys.values():
            if not all(kinds[m.first_dense_layers :]):
                unsupported.append(f"model.moe.interval={m.interval}")
        elif not all(kinds):
            unsupported.append("dense layers between MoE layers")
        if family.shared_width_key and not m.shared_experts:
            unsupported.append("model.moe.shared_experts=0 (its MoE layers have a shared expert)")
        for key, want in family.fixed_moe.items():
            if getattr(m, key) != want:
                unsupported.append(f"model.moe.{key}={_shown(getattr(m, key))}")
    elif family.is_moe:
        unsupported.append("a dense model (its MoE layers are required)")
    if cfg.mla is not None and not family.mla_keys:
        unsupported.append("model.attention_type=mla")
    if cfg.rope_interleaved != family.rope_interleaved and not family.mla_keys:
        unsupported.append(f"model.rope_interleaved={_shown(cfg.rope_interleaved)}")
    unsupported += _unexportable_pattern(cfg, family)
    if cfg.attention_bias not in ("none", family.attention_bias):
        unsupported.append(f"model.attention_bias={cfg.attention_bias}")
    if cfg.partial_rotary_factor != 1 and "partial_rotary_factor" not in family.defaults:
        unsupported.append(f"model.partial_rotary_factor={cfg.partial_rotary_factor}")
    unsupported += _unexpressed_attention(cfg, family)
    scaling = cfg.rope_scaling
    if scaling is not None and family.model_type not in _SCALING_FAMILIES.get(
        scaling.type, (family.model_type,)
    ):
        unsupported.append(f"model.rope_scaling.type={scaling.type}")
    for key, default in {**FEATURE_DEFAULTS, **family.features}.items():
        want = family.features.get(key, default)
        if getattr(cfg, key) != want:
            unsupported.append(f"model.{key}={getattr(cfg, key)} (the family's is {want})")
    if cfg.softmax_scale_dim is not None and not family.softmax_scale_key:
        unsupported.append(f"model.softmax_scale_dim={cfg.softmax_scale_dim}")
    unsupported += _unexportable_layer_types(cfg, family)
    unsupported += _unexportable_sinks_and_biases(cfg, family)
    if unsupported:
        raise ConversionError(
            f"cannot export as {name} (the family for attention_type={cfg.attention_type}, "
            f"qk_norm={cfg.qk_norm}, {'MoE' if m else 'dense'}): {unsupported[0]} is not "
            "supported"
        )


def _unexpressed_attention(cfg: ModelConfig, family: Family) -> list[str]:
    """What of model.global_attention, model.local_attention and the qk-norm's scale `family`
    cannot express (Llama 4's NoPE layers and chunks: only its own)."""
    glob, local = cfg.global_attention or GlobalAttention(), cfg.local_attention
    found = []
    if not family.chunked_nope:
        if glob != GlobalAttention():
            found.append(f"model.global_attention={glob.model_dump()}")
        if cfg.qk_norm and not cfg.qk_norm_scale:
            found.append("model.qk_norm_scale=false")
        return found
    if cfg.qk_norm and cfg.qk_norm_scale:
        found.append("model.qk_norm_scale=true (its qk-norm has no scale)")
    if local is not None and (local.window is not None or local.rope_theta is not None):
        found.append(f"model.local_attention={local.model_dump()} (only a chunk, the model's RoPE)")
    has_global = any(cfg.layer_attention(i) == "global" for i in range(cfg.num_layers))
    if has_global and (glob.rope or glob.qk_norm):
        found.append(f"model.global_attention={glob.model_dump()} (its global layers are NoPE)")
    return found


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _unexportable_pattern(cfg: ModelConfig, family: Family) -> list[str]:
    """What of the layers' attention kinds `family` cannot write: a family with a window key
    has one sliding window on every layer, the others have no local layers."""
    local = cfg.local_attention
    if local is None or family.chunked_nope or family.layer_types:
        return []  # Llama 4's chunks: _unexpressed_attention; Gemma 3's layer_types: its own
    if not family.window_key:
        return ["model.layer_pattern with local layers"]
    if {cfg.layer_attention(i) for i in range(cfg.num_layers)} != {"local"}:
        return [f"model.layer_pattern={cfg.layer_pattern} (global layers beside local ones)"]
    if local.chunk is not None:
        return [f"model.local_attention.chunk={local.chunk}"]
    if local.rope_theta is not None:
        return [f"model.local_attention.rope_theta={local.rope_theta}"]
    return []


def _unexportable_layer_types(cfg: ModelConfig, family: Family) -> list[str]:
    """What of the local layers a family with layer_types cannot write: chunks, and a local
    RoPE base unlike its own (Gemma 3: one of their own, unscaled; GPT-OSS: the model's)."""
    local = cfg.local_attention  # other families' local layers: _unexportable_pattern
    if local is None or not family.layer_types:
        return []
    if local.chunk is not None:
        return [f"model.local_attention.chunk={local.chunk} (windows only)"]
    if not family.local_rope_key and local.rope_theta is not None:
        return [f"model.local_attention.rope_theta={local.rope_theta} (the model's RoPE only)"]
    if family.local_rope_key and local.rope_theta is None and cfg.rope_scaling is not None:
        return [
            "model.local_attention.rope_theta=null with model.rope_scaling (local layers' RoPE "
            "is unscaled)"
        ]
    return []


def _unexportable_sinks_and_biases(cfg: ModelConfig, family: Family) -> list[str]:
    """The attention sinks, router and expert biases and clamped SwiGLU `family` cannot
    express (GPT-OSS has all of them, every other family none), as the key and value a message
    names."""
    out = []
    if cfg.attention_sinks != family.attention_sinks:
        out.append(f"model.attention_sinks={_shown(cfg.attention_sinks)}")
    m = cfg.moe
    if m is not None:
        fused = family.expert_layout == "gpt_oss"
        for key in ("router_bias", "expert_bias"):
            if getattr(m, key) != fused:
                out.append(f"model.moe.{key}={_shown(getattr(m, key))}")
        if (m.clamped_swiglu is not None) != fused:
            out.append(f"model.moe.clamped_swiglu={'set' if m.clamped_swiglu else 'null'}")
    return out


def _indices(flags: tuple[bool, ...]) -> list[int]:
    return [i for i, f in enumerate(flags) if f]
