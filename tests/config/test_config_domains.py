"""The schema walk: every config key's declared domain is enforced, and says so in one line.

The walk visits every key of `Config` (nested sections, optional sections, list items, mapping
values), reads its declaration (type, bounds, choices, finiteness, length), builds values
outside it from that declaration alone, loads each through the real loader and expects one
line naming the key. A new key is covered by declaring its domain; a key whose values are
checked by a validator instead is listed in VALIDATED, one that takes anything of its type in
FREE, and the test fails for a key that is in none of these.
"""

import math
import types
import typing
from typing import Annotated, Any, Literal, Union

import annotated_types as at
import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from maxtrain import config as config_lib
from maxtrain.config import Config, ConfigError

BASE = config_lib.CONFIGS_DIR / "base.yml"
TINY = ["model_name=tiny", "data.kind=synthetic"]

# Where a key lives inside an optional section, a list or a mapping: a valid value to put the
# bad one into ("[*]" is any list item, ".*" any mapping key).
CONTAINERS = {
    "model.moe": {"num_experts": 4, "top_k": 2, "expert_mlp_dim": 32},
    "model.rope.scaling": {},
    "model.attention_temperature": {"floor": 4},
    "model.linear_attention": {"num_key_heads": 1, "num_value_heads": 2},
    "model.mla": {"kv_lora_rank": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4},
    "data.sources[*]": {"name": "a", "path": "embedded:prose"},
    "quantization.rules[*]": {"module_path": "lm_head"},
    "mesh.rules.*": "embed",  # the mapping key to use
    "compute.grouped_matmul_tiles.*": "gate_up",
}

# Keys whose values a validator (or the loader) checks, with its own message: a bad value, and
# what the line must say.
VALIDATED = {
    "model_name": ("no-such-model", "model_name 'no-such-model' has no file"),
    "data.megatron.split": ("1,2,3,4", "data.megatron.split '1,2,3,4' is not a Megatron"),
    "distributed.coordinator_address": ("nohost", "distributed.coordinator_address must be"),
    "quantization.rules[*].module_path": ("(", "module_path '(' is not a valid regex"),
    "quantization.rules[*].weight_calibration": ("max", "weight_calibration 'max' is not one"),
    "quantization.rules[*].act_calibration": ("max", "act_calibration 'max' is not one"),
}

# Keys that take any value of their type (paths and names resolved where they are used).
FREE = {
    "base_config",
    "data.cache_dir",
    "checkpoint.local.dir",
    "checkpoint.persistent.dir",
    "checkpoint.load_parameters_path",
    "init.source_model",
    "run.output_dir",
    "run.compilation_cache_dir",
    "run.device",  # a device kind as jax names it; the benchmark refuses one it does not know
}

MIN_KEYS = 120  # the walk covers at least this many keys: it cannot silently shrink


def _optional(annotation: Any) -> Any:
    """X | None -> X."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _split(annotation: Any, metadata: list) -> tuple[Any, list]:
    """Annotated[X, Field(...)] -> (X, the constraints of the Field and of `metadata`)."""
    annotation = _optional(annotation)
    metadata = list(metadata)
    while typing.get_origin(annotation) is Annotated:
        annotation, *extra = typing.get_args(annotation)
        for m in extra:
            metadata += m.metadata if isinstance(m, FieldInfo) else [m]
    return _optional(annotation), metadata


def walk(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, Any, list]]:
    """(key, annotation, constraints) of every leaf key; sections are recursed into."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation, metadata = _split(field.annotation, field.metadata)
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += walk(annotation, key + ".")
        elif origin is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            out += walk(args[0], key + "[*].")
        elif origin is dict and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            out += walk(args[1], key + ".*.")
        elif origin is dict:
            out.append((key + ".*", args[1], []))
        else:
            out.append((key, annotation, metadata))
    return out


def bad_values(annotation: Any, metadata: list) -> list[Any]:
    """Values outside a declared domain, each from one part of the declaration."""
    annotation, metadata = _split(annotation, metadata)
    origin = typing.get_origin(annotation)
    if origin is list:
        return ["not-a-list", *([v] for v in bad_values(typing.get_args(annotation)[0], []))]
    if origin is Literal:
        return ["not-a-choice", 3.5]
    if annotation is bool:
        return ["maybe"]
    if annotation is str:
        return [["a", "list"]] + [""] * any(isinstance(m, at.MinLen) for m in metadata)
    assert annotation in (int, float), f"no bad values for {annotation}"
    out: list[Any] = ["x"] + [0.5] * (annotation is int)
    for m in metadata:
        if isinstance(m, at.Gt):
            out.append(m.gt)
        elif isinstance(m, at.Ge):
            out.append(m.ge - 1)
        elif isinstance(m, at.Lt):
            out.append(m.lt)
        elif isinstance(m, at.Le):
            out.append(m.le + 1)
        elif getattr(m, "allow_inf_nan", True) is False:
            out += [math.inf, math.nan]
    return out


def declares_domain(annotation: Any, metadata: list) -> bool:
    """Beyond its type: bounds, choices, finiteness or length (bool: true or false)."""
    annotation, metadata = _split(annotation, metadata)
    if typing.get_origin(annotation) is list:
        return declares_domain(typing.get_args(annotation)[0], [])
    return typing.get_origin(annotation) is Literal or annotation is bool or bool(metadata)


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("...\n").strip()


def overrides_for(key: str, value: Any) -> tuple[list[str], str]:
    """The overrides that give `key` this value, and the key as the error names it."""
    for container, valid in CONTAINERS.items():  # a section under a mapping key: name one
        if container.endswith(".*") and key.startswith(container + "."):
            key = container.removesuffix("*") + valid + key.removeprefix(container)
    for container, valid in CONTAINERS.items():
        if container.endswith("[*]") and key.startswith(container + "."):
            section, field = container.removesuffix("[*]"), key.removeprefix(container + ".")
            item = {**valid, field: value}
            return [f"{section}=[{_yaml(item)}]"], f"{section}[0].{field}"
        if container.endswith(".*") and key == container:
            named = container.removesuffix("*") + valid
            return [f"{named}={_yaml(value)}"], named
        if key.startswith(container + "."):
            return [f"{container}={_yaml(valid)}", f"{key}={_yaml(value)}"], key
    return [f"{key}={_yaml(value)}"], key


LEAVES = walk()
CASES = [
    pytest.param(key, value, id=f"{key}={value!r}")
    for key, annotation, metadata in LEAVES
    if key not in VALIDATED
    for value in bad_values(annotation, metadata)
]


def test_every_key_declares_a_domain_or_is_listed():
    keys = {key for key, _, _ in LEAVES}
    assert len(keys) >= MIN_KEYS, f"the walk found only {len(keys)} keys"
    assert VALIDATED.keys() <= keys and FREE <= keys, (VALIDATED.keys() | FREE) - keys
    undeclared = {k for k, ann, meta in LEAVES if not declares_domain(ann, meta)}
    assert undeclared - FREE - VALIDATED.keys() == set(), "declare a domain, or list it here"
    assert FREE & {k for k, ann, meta in LEAVES if declares_domain(ann, meta)} == set()


@pytest.mark.parametrize(("key", "value"), CASES)
def test_a_value_outside_the_declared_domain_is_one_line_naming_the_key(key, value):
    overrides, named = overrides_for(key, value)
    with pytest.raises(ConfigError) as err:
        config_lib.load(BASE, [*TINY, *overrides])
    message = str(err.value)
    assert f"config key '{named}" in message and "\n" not in message, message


@pytest.mark.parametrize(("key", "bad"), VALIDATED.items(), ids=list(VALIDATED))
def test_validated_keys_name_the_key(key, bad):
    value, expected = bad
    overrides, _ = overrides_for(key, value)
    with pytest.raises(ConfigError) as err:
        config_lib.load(BASE, [*TINY, *overrides])
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_every_default_is_inside_its_domain():
    """The walk's other half: the reference's defaults load, and as written (a default outside
    its domain would raise; one the schema had to coerce would come back changed). Each
    preset's model keys: test_presets."""
    loaded = config_lib.load(BASE, TINY).model_dump(mode="json")
    written = yaml.safe_load((config_lib.CONFIGS_DIR / "reference.yml").read_text())
    compared = 0
    for section in ("optim", "train", "checkpoint", "init", "pipeline", "profile", "run"):
        for key, value in written[section].items():
            if not isinstance(value, dict):
                assert loaded[section][key] == value, f"{section}.{key}"
                compared += 1
    assert compared >= 30  # the walk cannot silently shrink
