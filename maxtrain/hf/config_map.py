"""config.json <-> ModelConfig, for every family of maxtrain/hf/families/.

Both config.json layouts in the wild are read:

- the older one most published checkpoints use: `rope_theta` and `rope_scaling` at top level,
  `torch_dtype`, Qwen3-MoE's `num_experts`;
- the one transformers 5 writes: `rope_parameters` (holding rope_theta and the scaling),
  `dtype`, `num_local_experts`, `head_dim: null`.

Export writes the older layout, which transformers 4 and 5 both read. Here are the keys every
family shares (sizes, norms, RoPE: rope.py); the family's layer layout and aspects read and
write the rest (family.py). A key that is absent takes the value transformers' config class
gives it (Family.defaults); an option we do not model (biases, other RoPE types, quantization)
is a ConversionError naming the key, and so is, on export, a model key the family does not
state that is not at its fixed value or the schema's default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from maxtrain.config import ModelConfig
from maxtrain.hf.aspect import shown
from maxtrain.hf.errors import ConversionError
from maxtrain.hf.families import FAMILIES
from maxtrain.hf.family import Family
from maxtrain.hf.rope import OWNS as ROPE_KEYS
from maxtrain.hf.rope import read_rope, rope_keys, unexpressed_rope

CONFIG_JSON = "config.json"
# The model keys every family maps here, beside RoPE's.
_SHARED_KEYS = frozenset(
    {"vocab_size", "emb_dim", "num_layers", "num_heads", "tie_embeddings", "norm_eps",
     "max_seq_len"}
) | ROPE_KEYS  # fmt: skip
# Model keys no checkpoint records, which export leaves out: how a run trains the model
# (its losses, capacity, chunking), and its multi-token prediction modules, which transformers
# does not run.
_NOT_IN_A_CHECKPOINT = frozenset(
    {"mtp", "moe.aux_loss_weight", "moe.router_z_loss_weight", "moe.expert_capacity_factor",
     "linear_attention.chunk"}
)  # fmt: skip


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


def model_config(raw: dict[str, Any], family: Family, where: str) -> ModelConfig:
    """Our ModelConfig for a config.json of `family` (where: its path, for messages)."""
    _check_supported(raw, family, where)
    hf = family.config_json(raw, where)
    checked_by = {
        kind: [f.model_type for f in FAMILIES.values() if kind in f.rope.scalings]
        for kind in {kind for f in FAMILIES.values() for kind in f.rope.scalings}
    }
    rope = read_rope(hf, family.rope, checked_by)
    layers = family.layers.types(hf)
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        emb_dim=hf["hidden_size"],
        num_layers=len(layers),
        num_heads=hf["num_attention_heads"],
        rope=rope,
        tie_embeddings=hf["tie_word_embeddings"],
        norm_eps=hf["rms_norm_eps"],
        max_seq_len=hf["max_position_embeddings"],
    )
    for aspect in family.mappings:
        _merge(fields, aspect.read(hf, layers))
    for key, value in family.fixed.items():  # a section's keys only where it is set
        *sections, name = key.split(".")
        if not sections or sections[0] in fields:
            _merge(fields, _nested(sections, {name: value}))
    return _validated(fields, where)


def hf_config(cfg: ModelConfig, family: Family, dtype: str, init_std: float) -> dict[str, Any]:
    """The config.json (older layout) of `cfg` as a `family` model with weights in `dtype`,
    initialised with `init_std` (initializer_range)."""
    _check_exportable(cfg, family)
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        **rope_keys(cfg, family.rope, family.defaults),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": init_std,
        "torch_dtype": dtype,
        **family.required,
    }
    for aspect in family.mappings:
        out.update(aspect.write(cfg, family.defaults))
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


def _check_exportable(cfg: ModelConfig, family: Family) -> None:
    """Raises ConversionError naming all that `family` cannot express of `cfg`."""
    unsupported = unexpressed_rope(cfg, family.rope)
    for aspect in family.mappings:
        unsupported += aspect.unexpressed(cfg)
    unsupported += _off_default(cfg, family)
    if unsupported:
        attention = "multi-head latent attention" if cfg.mla else "grouped-query attention"
        names = ", ".join(dict.fromkeys(unsupported))
        raise ConversionError(
            f"cannot export as {family.architecture} (the family for {attention}, "
            f"qk_norm={cfg.qk_norm}, {'MoE' if cfg.moe else 'dense'}): {names} "
            f"{'is' if len(unsupported) == 1 else 'are'} not supported"
        )


def _off_default(cfg: ModelConfig, family: Family) -> list[str]:
    """The model keys that no aspect of `family` states and that are not at the family's
    fixed value or the schema's default, as "model.KEY=VALUE"."""
    mapped = _SHARED_KEYS | frozenset().union(*(a.owns for a in family.mappings))
    inside = mapped | set(family.fixed)  # keys whose sections are looked into

    def visit(section: BaseModel, prefix: str) -> list[str]:
        found = []
        for name, info in type(section).model_fields.items():
            key, value = prefix + name, getattr(section, name)
            if key in mapped or key in _NOT_IN_A_CHECKPOINT:
                continue
            if isinstance(value, BaseModel) and any(k.startswith(key + ".") for k in inside):
                found += visit(value, key + ".")
            elif value != family.fixed.get(key, info.default):
                found.append(f"model.{key}={shown(value)}")
        return found

    return visit(cfg, "")


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    """Adds `more`'s keys to `into`, merging the dicts both hold (a section several aspects
    read)."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _nested(sections: list[str], leaf: dict[str, Any]) -> dict[str, Any]:
    for section in reversed(sections):
        leaf = {section: leaf}
    return leaf


def _validated(fields: dict[str, Any], where: str) -> ModelConfig:
    try:
        return ModelConfig.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ConversionError(f"{where}: {key + ': ' if key else ''}{msg}") from None
