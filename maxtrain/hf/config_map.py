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

from maxtrain.config import LayerType, ModelConfig
from maxtrain.config.layer_list import shortest_entries
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
# transformers' layer_types -> our model.layers' attention kinds.
_LAYER_KINDS = {"full_attention": "global", "sliding_attention": "sliding"}
# Qwen3-Next's layer_types -> our model.layers' attention kinds.
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


def init_std(hf: dict[str, Any], family: Family) -> float:
    """config.json's initializer_range: the init.std of a run of the imported model."""
    return hf.get("initializer_range", family.defaults["initializer_range"])


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
    kv_heads = None if mla else value("num_key_value_heads") or heads
    qk_norm = value(family.qk_norm_key) if family.qk_norm_key else family.qk_norm
    fields = dict(
        vocab_size=value("vocab_size"),
        emb_dim=value("hidden_size"),
        num_layers=num_layers,
        num_heads=heads,
        # Multi-head latent attention has its head sizes in model.mla (transformers' head_dim
        # is then the rotary part's); as many key/value heads as query heads is the default.
        num_kv_heads=None if kv_heads == heads else kv_heads,
        head_dim=None if mla else value("head_dim"),
        mla=mla,
        rope=dict(
            theta=theta,
            scaling=scaling,
            interleaved=value("rope_interleave") if mla else family.rope_interleaved,
            fraction=_partial_rotary_factor(hf, family, where),
        ),
        qk_norm="rms" if qk_norm else "none",
        attention_projection_bias=biases,
        tie_embeddings=value("tie_word_embeddings"),
        norm_eps=value("rms_norm_eps"),
        max_seq_len=value("max_position_embeddings"),
        attention_sinks=family.attention_sinks,
    )
    attention, sizes = _attention_kinds(hf, family, where, value, num_layers)
    if local_theta := sizes.pop("local_theta", None):
        fields["rope"]["local_theta"] = local_theta
    fields.update(sizes, **family.features)
    if family.softmax_scale_key:
        fields["softmax_scale_dim"] = value(family.softmax_scale_key)
    moe_layers = [False] * num_layers
    if family.is_moe:
        fields["moe"] = _moe(hf, family, value, where)
        moe_layers = _moe_layers(family, value, num_layers, where)
    kinds = [
        LayerType(a, "moe" if m else "dense") for a, m in zip(attention, moe_layers, strict=True)
    ]
    fields["layers"] = shortest_entries(kinds, family.is_moe)
    if not all(moe_layers):  # the dense layers' width
        fields["mlp_dim"] = value(family.dense_width_key)
    return _validated(fields, where)


def _moe(hf: dict[str, Any], family: Family, value, where: str) -> dict[str, Any]:
    """model.moe of a config.json of an MoE family."""
    count_key = next((k for k in family.expert_count_keys if k in hf), None)
    moe = dict(
        num_experts=value(count_key or family.expert_count_keys[0]),
        top_k=value("num_experts_per_tok"),
        expert_mlp_dim=value(family.expert_width_key),
        score=family.score,
        aux_loss_weight=value(family.aux_loss_key) if family.aux_loss_key else 0.0,
        **{ours: value(key) for key, ours in family.moe_keys.items()},
        **family.fixed_moe,
    )
    if family.renormalize_key:
        moe["renormalize"] = value(family.renormalize_key)
    if family.shared_width_key:
        moe["shared_experts"] = _shared_experts(family, value, where)
    if family.router_bias:
        moe["balance_bias_update_rate"] = IMPORTED_BIAS_UPDATE_RATE
    if family.expert_layout == "gpt_oss":
        moe.update(
            router_logit_bias=True,
            expert_projection_bias=True,
            clamped_swiglu=dict(alpha=value("swiglu_alpha"), limit=value("swiglu_limit")),
        )
    return moe


def _moe_layers(family: Family, value, num_layers: int, where: str) -> list[bool]:
    """Per layer, whether transformers builds it a mixture of experts: by the family's lists
    and steps (Qwen3-MoE, Llama 4), after its first dense layers (DeepSeek-V3, GLM-4.5), else
    every layer."""
    if family.sparse_layer_keys or family.moe_layer_list:
        return list(_hf_moe_layers(family, value, num_layers, where))
    first = value(family.first_dense_key) if family.first_dense_key else 0
    if not isinstance(first, int) or first < 0:
        raise ConversionError(f"{where}: {family.first_dense_key}={first!r} is not supported")
    return [i >= first for i in range(num_layers)]


def _attention_kinds(
    hf: dict[str, Any], family: Family, where: str, value, num_layers: int
) -> tuple[list[str], dict[str, Any]]:
    """Per layer, its attention kind (model.layers), and the model keys that size those kinds
    (sliding_window, attention_chunk, linear_attention, ...; local_theta: model.rope's)."""
    if family.layer_types:
        return _layer_pattern(hf, family, where, value, num_layers)
    if family.linear_layers:
        return _linear_pattern(hf, where, value, num_layers)
    if family.chunked_nope:
        return _chunked_nope(value, num_layers, where)
    window = value(family.window_key) if family.window_key else None
    if window is not None:
        return ["sliding"] * num_layers, dict(sliding_window=window)
    return ["global"] * num_layers, {}


def _linear_pattern(
    hf: dict[str, Any], where: str, value, num_layers: int
) -> tuple[list[str], dict[str, Any]]:
    """Qwen3-Next's layer kinds (linear_attention: `linear`, full_attention: `global`) with
    model.linear_attention: layer_types, else, as transformers derives it, every
    full_attention_interval-th layer full."""
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
        return kinds, {}
    return kinds, dict(linear_attention={ours: value(key) for key, ours in _LINEAR_KEYS.items()})


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


def _chunked_nope(value, num_layers: int, where: str) -> tuple[list[str], dict[str, Any]]:
    """Llama 4's attention as our keys: its RoPE layers (no_rope_layers 1; without the list,
    all but every no_rope_layer_interval-th) chunked layers, the others nope layers with
    attention temperature tuning; the unscaled qk-norm (use_qk_norm), which nope layers skip."""
    rope_layers = value("no_rope_layers")  # transformers reads an empty list as absent too
    if not rope_layers:
        interval = value("no_rope_layer_interval")
        rope_layers = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(rope_layers) < num_layers:
        raise ConversionError(
            f"{where}: no_rope_layers has {len(rope_layers)} entries for {num_layers} layers"
        )
    kinds = ["chunked" if rope_layers[i] else "nope" for i in range(num_layers)]
    implied = ["chunked_attention" if k == "chunked" else "full_attention" for k in kinds]
    layer_types = value("layer_types")
    if layer_types is not None and list(layer_types) != implied:
        raise ConversionError(
            f"{where}: layer_types {layer_types} is not supported (only chunked attention on "
            f"the RoPE layers and full attention on the others: {implied})"
        )
    chunk = value("attention_chunk_size")
    if "chunked" in kinds and chunk is None:
        raise ConversionError(f"{where}: attention_chunk_size is null; chunked layers need it")
    tuning = value("attn_temperature_tuning")  # a number in published configs (Scout's 4)
    sizes: dict[str, Any] = dict(qk_norm="rms_unscaled" if value("use_qk_norm") else "none")
    if "chunked" in kinds:
        sizes["attention_chunk"] = chunk
    if tuning and "nope" in kinds:
        sizes["attention_temperature"] = dict(floor=value("floor_scale"), scale=value("attn_scale"))
    return kinds, sizes


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


def hf_config(cfg: ModelConfig, family: Family, dtype: str, init_std: float) -> dict[str, Any]:
    """The config.json (older layout) of `cfg` as a `family` model with weights in `dtype`,
    initialised with `init_std` (initializer_range)."""
    _check_exportable(cfg, family)
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        family.dense_width_key: _dense_width(cfg, family),
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.resolved_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope.theta,
        "rope_scaling": _hf_rope_scaling(cfg.rope.scaling, family),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": init_std,
        "torch_dtype": dtype,
        **family.required,
    }
    if family.window_key:
        out[family.window_key] = cfg.sliding_window
    if family.layer_types:
        out.update(_layer_types_keys(cfg, family))
    if family.softmax_scale_key:
        out[family.softmax_scale_key] = cfg.softmax_scale_dim or cfg.resolved_head_dim
    if cfg.mla is not None:
        out.update({key: getattr(cfg.mla, key) for key in family.mla_keys})
        out["head_dim"] = cfg.mla.qk_rope_head_dim  # what transformers sets it to
        out["rope_interleave"] = cfg.rope.interleaved
    if family.nextn_key:
        out[family.nextn_key] = 0  # no multi-token prediction module is written
    if family.qk_norm_key:
        out[family.qk_norm_key] = cfg.qk_norm != "none"
    if family.attention_bias:
        out["attention_bias"] = cfg.attention_projection_bias != "none"
    if "partial_rotary_factor" in family.defaults:  # top level, as published GLM-4.5 has it
        out["partial_rotary_factor"] = cfg.rope.fraction
    if cfg.moe is not None:
        out.update(_moe_keys(cfg, family))
    if family.chunked_nope:
        out.update(_chunked_nope_keys(cfg, family))
    if family.linear_layers:
        out.update(_linear_keys(cfg, family))
    return out


def _dense_width(cfg: ModelConfig, family: Family) -> int:
    """config.json's dense feed-forward width: model.mlp_dim, else (no layer is dense, the key
    unread) transformers' default, or the experts' width."""
    if cfg.mlp_dim is not None:
        return cfg.mlp_dim
    assert cfg.moe is not None  # a model without dense layers has experts
    return family.defaults.get(family.dense_width_key, cfg.moe.expert_mlp_dim)


def _moe_keys(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """config.json's mixture-of-experts keys of `cfg` (_moe's and _moe_layers' inverse)."""
    m = cfg.moe
    assert m is not None
    out: dict[str, Any] = {}
    if m.clamped_swiglu is not None:
        out["swiglu_alpha"], out["swiglu_limit"] = m.clamped_swiglu.alpha, m.clamped_swiglu.limit
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
    moe_layers = list(is_moe_per_layer(cfg))
    step = _moe_step(moe_layers)
    if family.first_dense_key:
        out[family.first_dense_key] = moe_layers.index(True)
    if family.sparse_layer_keys:
        out["decoder_sparse_step"] = step
        out["mlp_only_layers"] = [
            i for i, moe in enumerate(moe_layers) if not moe and (i + 1) % step == 0
        ]
    if family.moe_layer_list:
        out["interleave_moe_layer_step"] = step
        out["moe_layers"] = _indices(moe_layers)
    return out


def _linear_keys(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """Qwen3-Next's config.json keys of cfg's layer kinds (_linear_pattern's inverse); the
    DeltaNet's sizes at transformers' defaults where no layer is linear."""
    hf_names = {kind: name for name, kind in _LINEAR_LAYER_KINDS.items()}
    linear = cfg.linear_attention
    return {
        "layer_types": [hf_names[t.attention] for t in cfg.layer_types],
        **{
            key: getattr(linear, ours) if linear else family.defaults[key]
            for key, ours in _LINEAR_KEYS.items()
        },
    }


def _chunked_nope_keys(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """Llama 4's config.json keys of a model's layer kinds (_chunked_nope's inverse)."""
    temperature = cfg.attention_temperature
    return {
        "no_rope_layers": [int(t.attention == "chunked") for t in cfg.layer_types],
        # transformers builds the chunked mask whatever the layers: one chunk is the context
        "attention_chunk_size": cfg.attention_chunk or cfg.max_seq_len,
        "use_qk_norm": cfg.qk_norm != "none",
        "attn_temperature_tuning": temperature is not None,
        "floor_scale": temperature.floor if temperature else family.defaults["floor_scale"],
        "attn_scale": temperature.scale if temperature else family.defaults["attn_scale"],
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
    """(theta, the model.rope.scaling keys or None) from either layout. As in transformers,
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
) -> tuple[list[str], dict[str, Any]]:
    """The layer kinds of a config.json with sliding-window layers (sliding or global) and the
    window, with the sliding layers' RoPE base where the family has one (local_theta):
    layer_types, else every global_period-th layer global (sliding_window_pattern-th for
    Gemma 3, as transformers derives it)."""
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
    if "sliding" not in kinds:
        return kinds, {}
    window = value("sliding_window")
    if window is None:
        raise ConversionError(f"{where}: layer_types has sliding layers but sliding_window is null")
    sizes: dict[str, Any] = dict(sliding_window=window)
    if family.local_rope_key:  # else the model's RoPE, scaled as the global layers'
        sizes["local_theta"] = _local_rope_theta(hf, family, where, value)
    return kinds, sizes


def _every_nth_global(period: int, num_layers: int) -> list[str]:
    """Layer i global iff (i + 1) % period == 0 (Gemma's sliding_window_pattern)."""
    return ["global" if (i + 1) % period == 0 else "sliding" for i in range(num_layers)]


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
    kinds = [t.attention for t in cfg.layer_types]
    hf_names = {kind: name for name, kind in _LAYER_KINDS.items()}
    out = {
        "layer_types": [hf_names[kind] for kind in kinds],
        # transformers builds the sliding mask whether a layer uses it or not: never null
        "sliding_window": cfg.sliding_window or family.defaults["sliding_window"],
    }
    if family.local_rope_key:
        out[family.local_rope_key] = cfg.rope.local_theta or cfg.rope.theta
    period = _period(kinds)
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
    """config.json's rope_scaling for model.rope.scaling. None where transformers reads null as
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


def _hf_moe_layers(family: Family, value, num_layers: int, where: str) -> tuple[bool, ...]:
    """Per layer, True where transformers builds a sparse block: Qwen3-MoE's by
    mlp_only_layers and decoder_sparse_step, Llama 4's by moe_layers, else
    interleave_moe_layer_step."""
    if family.sparse_layer_keys:  # Qwen3-MoE
        step, dense = value("decoder_sparse_step"), value("mlp_only_layers")
        return _hf_sparse_layers(dense, step, num_layers, where)
    step, listed = value("interleave_moe_layer_step"), value("moe_layers")  # Llama 4
    if listed is None:
        return _hf_sparse_layers([], step, num_layers, where)
    return tuple(i in listed for i in range(num_layers))


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
    unsupported = _unexportable_experts(cfg, family)
    if cfg.mla is not None and not family.mla_keys:
        unsupported.append("model.mla")
    if cfg.rope.interleaved != family.rope_interleaved and not family.mla_keys:
        unsupported.append(f"model.rope.interleaved={_shown(cfg.rope.interleaved)}")
    unsupported += _unexportable_pattern(cfg, family)
    if cfg.attention_projection_bias not in ("none", family.attention_bias):
        unsupported.append(f"model.attention_projection_bias={cfg.attention_projection_bias}")
    if cfg.rope.fraction != 1 and "partial_rotary_factor" not in family.defaults:
        unsupported.append(f"model.rope.fraction={cfg.rope.fraction}")
    unsupported += _unexpressed_attention(cfg, family)
    scaling = cfg.rope.scaling
    if scaling is not None and family.model_type not in _SCALING_FAMILIES.get(
        scaling.type, (family.model_type,)
    ):
        unsupported.append(f"model.rope.scaling.type={scaling.type}")
    for key, default in {**FEATURE_DEFAULTS, **family.features}.items():
        want = family.features.get(key, default)
        if getattr(cfg, key) != want:
            unsupported.append(f"model.{key}={getattr(cfg, key)} (the family's is {want})")
    if cfg.softmax_scale_dim is not None and not family.softmax_scale_key:
        unsupported.append(f"model.softmax_scale_dim={cfg.softmax_scale_dim}")
    unsupported += _unexportable_layer_types(cfg, family)
    unsupported += _unexportable_sinks_and_biases(cfg, family)
    if unsupported:
        attention = "multi-head latent attention" if cfg.mla else "grouped-query attention"
        raise ConversionError(
            f"cannot export as {family.architecture} (the family for {attention}, "
            f"qk_norm={cfg.qk_norm}, {'MoE' if cfg.moe else 'dense'}): {unsupported[0]} is not "
            "supported"
        )


def _unexportable_experts(cfg: ModelConfig, family: Family) -> list[str]:
    """What of the model's experts, and of which layers have them, `family` cannot write."""
    m = cfg.moe
    if m is None:
        return ["a dense model (its MoE layers are required)"] if family.is_moe else []
    unsupported = []
    if m.score != family.score:
        unsupported.append(f"model.moe.score={m.score}")
    if (m.balance_bias_update_rate > 0) != bool(family.router_bias):
        unsupported.append(
            f"model.moe.balance_bias_update_rate={m.balance_bias_update_rate} (a routing bias)"
        )
    moe_layers = is_moe_per_layer(cfg)
    if family.sparse_layer_keys or family.moe_layer_list:
        pass  # any layers: listed
    elif family.first_dense_key:
        if not all(moe_layers[moe_layers.index(True) :]):
            unsupported.append(f"model.layers={cfg.layers} (dense layers between MoE layers)")
    elif not all(moe_layers):
        unsupported.append(f"model.layers={cfg.layers} (dense layers beside MoE layers)")
    if family.shared_width_key and not m.shared_experts:
        unsupported.append("model.moe.shared_experts=0 (its MoE layers have a shared expert)")
    for key, want in family.fixed_moe.items():
        if getattr(m, key) != want:
            unsupported.append(f"model.moe.{key}={_shown(getattr(m, key))}")
    return unsupported


def _unexpressed_attention(cfg: ModelConfig, family: Family) -> list[str]:
    """What of the nope and chunked layers and the qk-norm's scale `family` cannot express
    (Llama 4's NoPE layers and chunks: only its own)."""
    kinds = {t.attention for t in cfg.layer_types}
    if not family.chunked_nope:
        found = ["model.layers' nope layers"] if "nope" in kinds else []
        if cfg.qk_norm == "rms_unscaled":
            found.append("model.qk_norm=rms_unscaled")
        return found
    found = []
    if cfg.qk_norm == "rms":
        found.append("model.qk_norm=rms (its qk-norm has no scale)")
    if other := sorted(kinds - {"chunked", "nope"}):
        found.append(f"model.layers' {other[0]} layers (its layers are chunked or nope)")
    if cfg.rope.local_theta is not None:
        found.append(f"model.rope.local_theta={cfg.rope.local_theta} (only the model's RoPE)")
    return found


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _unexportable_pattern(cfg: ModelConfig, family: Family) -> list[str]:
    """What of the layers' attention kinds `family` cannot write: a family with a window key
    has one sliding window on every layer, the others no sliding or chunked layers (Llama 4's
    chunks: _unexpressed_attention; Gemma 3's and GPT-OSS's layer_types: their own)."""
    kinds = {t.attention for t in cfg.layer_types} - {"global", "nope", "linear"}
    if not kinds or family.chunked_nope or family.layer_types:
        return []
    if not family.window_key:
        return [f"model.layers' {sorted(kinds)[0]} layers"]
    if "chunked" in kinds:
        return [f"model.attention_chunk={cfg.attention_chunk}"]
    if {t.attention for t in cfg.layer_types} != {"sliding"}:
        return [f"model.layers={cfg.layers} (global layers beside sliding ones)"]
    if cfg.rope.local_theta is not None:
        return [f"model.rope.local_theta={cfg.rope.local_theta}"]
    return []


def _unexportable_layer_types(cfg: ModelConfig, family: Family) -> list[str]:
    """What of the local layers a family with layer_types cannot write: chunks, and a local
    RoPE base unlike its own (Gemma 3: one of their own, unscaled; GPT-OSS: the model's)."""
    kinds = {t.attention for t in cfg.layer_types}
    if not family.layer_types or not kinds & {"sliding", "chunked"}:
        return []  # other families' local layers: _unexportable_pattern
    if "chunked" in kinds:
        return [f"model.attention_chunk={cfg.attention_chunk} (windows only)"]
    if not family.local_rope_key and cfg.rope.local_theta is not None:
        return [f"model.rope.local_theta={cfg.rope.local_theta} (the model's RoPE only)"]
    if family.local_rope_key and cfg.rope.local_theta is None and cfg.rope.scaling is not None:
        return [
            "model.rope.local_theta=null with model.rope.scaling (sliding layers' RoPE is unscaled)"
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
        for key in ("router_logit_bias", "expert_projection_bias"):
            if getattr(m, key) != fused:
                out.append(f"model.moe.{key}={_shown(getattr(m, key))}")
        if (m.clamped_swiglu is not None) != fused:
            out.append(f"model.moe.clamped_swiglu={'set' if m.clamped_swiglu else 'null'}")
    return out


def _indices(flags) -> list[int]:
    return [i for i, f in enumerate(flags) if f]
