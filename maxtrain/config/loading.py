"""How a run's config is assembled and checked: YAML files, parents, model presets, CLI
overrides, and one readable line for the first thing wrong.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from maxtrain.common.errors import first_line
from maxtrain.config import migration
from maxtrain.config.errors import ConfigError
from maxtrain.config.model import ModelConfig
from maxtrain.config.schema import Config

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


# libyaml's safe loader where PyYAML has it: the same documents, ~10x faster than the pure-Python
# one (base.yml is loaded for every config; the tests load thousands).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """'found unexpected end of stream at line 3, column 1' (the first line of PyYAML's own
    message is the context, e.g. 'while parsing a flow sequence', which says neither)."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if not problem:
        return first_line(error)
    return f"{problem}" + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark else "")


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():  # a run directory, say: its config is the file in it
        inside = (
            f"; the config in it is {path / 'config.yml'}"
            if (path / "config.yml").is_file()
            else ""
        )
        raise ConfigError(f"config file {path} is a directory, not a YAML file{inside}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e.object[e.start : e.start + 1]
        raise ConfigError(
            f"config file {path} is not UTF-8 text: byte {e.start} is {bad!r}"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e})") from None
    try:
        data = yaml.load(text, Loader=_YAML_LOADER) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    return data


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Returns base updated by override; nested mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """deep_merge of two migrated sources: an override that sets model.layers replaces the
    older layout keys before it too (migration.py)."""
    return deep_merge(migration.without_layout(base, override), override)


def _read_source(path: Path) -> dict[str, Any]:
    """A config or model file, its keys of an older maxtrain migrated (a note on stderr)."""
    tree, notes = migration.migrate_source(_read_yaml(path))
    migration.note(str(path), notes)
    return tree


def _load_with_parents(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    data = _data_paths_beside(_read_source(path), path.parent)
    parent = data.get("base_config")
    if parent:
        parent_path = (path.parent / parent).resolve()
        data = _merged(_load_with_parents(parent_path, (*seen, path)), data)
    return data


def _data_paths_beside(tree: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A config file's relative data paths made absolute, beside the file, as base_config is:
    the files a run reads (data.sources[].path, data.tokenizer, a data.chat_template file) are
    found from any working directory. A command-line override stays relative to the working
    directory; a path with a scheme (embedded:prose, gs://...) stays as written."""
    data = tree.get("data")
    if not isinstance(data, dict):
        return tree
    data = dict(data)
    if isinstance(data.get("sources"), list):
        data["sources"] = [
            {**s, "path": _beside(s["path"], folder)} if isinstance(s, dict) and "path" in s else s
            for s in data["sources"]
        ]
    if "tokenizer" in data:
        data["tokenizer"] = _beside(data["tokenizer"], folder)
    template = data.get("chat_template")
    if isinstance(template, str) and ("/" in template or template.endswith((".jinja", ".json"))):
        data["chat_template"] = _beside(template, folder)  # not a built-in template's name
    return {**tree, "data": data}


def _beside(value: Any, folder: Path) -> Any:
    """A relative path as seen from `folder`; anything else (absolute, ~, a scheme, not a
    string) unchanged."""
    if not isinstance(value, str) or not value or ":" in value or value.startswith(("/", "~")):
        return value
    return os.path.normpath(folder / value)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 0.0003); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} is not of the form key=value (e.g. optim.lr=3e-4) "
            "nor an overlay file (.yml)"
        )
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    node = tree
    for k in keys[:-1]:
        child = node.get(k)
        if not isinstance(child, dict):
            child = {}
            node[k] = child
        node = child
    node[keys[-1]] = value


def overridden(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`tree` with command-line overrides set, each key=value replacing what is there, their
    keys of an older maxtrain migrated (one note on stderr for all of them)."""
    notes: list[str] = []
    for keys, value in [parse_override(o) for o in overrides]:
        nested: dict[str, Any] = {}
        _set_dotted(nested, keys, value)
        moved, said = migration.migrate_source(nested)
        notes += said
        tree = migration.without_layout(tree, moved)
        if said:
            tree = deep_merge(tree, moved)
        else:
            _set_dotted(tree, keys, value)
    migration.note("the command line", notes)
    return tree


def _model_file(name: str) -> Path:
    """configs/models/<name>.yml, or the model file `name` is a path to (it ends in .yml or
    .yaml, or has a /): the model.yml that convert_hf import, upcycle and depth_upscale write
    beside their checkpoint, used where it lies."""
    if name.endswith((".yml", ".yaml")) or "/" in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"model_name {name!r}: no such model file")
        return path
    path = CONFIGS_DIR / "models" / f"{name}.yml"
    if not path.is_file():
        known = preset_names()
        hint = difflib.get_close_matches(name, known, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"model_name {name!r} has no file configs/models/{name}.yml{suggestion}; "
            f"known models: {', '.join(known)}"
        )
    return path


def preset_names() -> list[str]:
    """The model presets, by the name model_name takes: the files of configs/models/."""
    return sorted(p.stem for p in (CONFIGS_DIR / "models").glob("*.yml"))


def preset(name: str) -> ModelConfig:
    """The model a preset (or a model file's path) describes, at the schema's defaults."""
    path = _model_file(name)
    return validate_model(migration.migrate({"model": _read_yaml(path)}, str(path))["model"])


def is_overlay(text: str) -> bool:
    """Whether a command-line argument after the config is an overlay file (a YAML path, such
    as the layout `tools/plan.py` writes), not a key=value override."""
    return "=" not in text and text.endswith((".yml", ".yaml"))


def load(config_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Builds the validated Config for a config file plus what follows it on the command line,
    each source's keys of an older maxtrain migrated as it is read (migration.py).

    Merge order, later wins: configs/base.yml, the model's file, the config file (its
    base_config parents first), then `overrides` left to right: each overlay file (a YAML
    path, its own parents first) merged as a config file is, each key=value set."""
    for text in overrides:
        if not is_overlay(text):
            parse_override(text)  # a malformed override is refused before any file is read
    user, settings = _load_with_parents(Path(config_path)), []
    for text in [*overrides, None]:  # None: the end, where the last key=values are set
        if text is None or is_overlay(text):
            user = overridden(user, settings) if settings else user
            settings = []
            user = _merged(user, _load_with_parents(Path(text))) if text else user
        else:
            settings.append(text)
    merged = _read_yaml(CONFIGS_DIR / "base.yml")
    model_name = user.get("model_name", merged.get("model_name"))
    if not isinstance(model_name, str):
        raise ConfigError(
            "model_name must be set to the name of a file in configs/models/ or a model file's path"
        )
    path = _model_file(model_name)
    model_file, notes = migration.migrate_source({"model": _read_yaml(path)})
    migration.note(str(path), notes)
    merged = _merged(_merged(merged, model_file), user)
    return validate(migration.resolve(merged))


def validate_saved(tree: dict[str, Any], source: str) -> Config:
    """A whole config as it was saved (with a checkpoint: `source`), its keys of an older
    maxtrain migrated (a note on stderr)."""
    return validate(migration.migrate(tree, source))


def validate(tree: dict[str, Any]) -> Config:
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_describe(_first(e.errors()), tree)) from None
    return cfg


def _first(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: a misspelt key first (its "did you mean" explains the others: a
    `pth:` in a data source is also why its `path` is missing), else pydantic's first."""
    return next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])


def validate_model(tree: dict[str, Any]) -> ModelConfig:
    """A `model:` section alone, checked as validate checks a whole config (its keys named
    model.KEY)."""
    try:
        return ModelConfig.model_validate(tree)
    except ValidationError as e:
        first = _first(e.errors())
        raise ConfigError(_describe({**first, "loc": ("model", *first["loc"])}, tree)) from None


# What a value must be, per pydantic error type ({...} from the error's context): the domain a
# key declares in schema.py, as the message states it.
_DOMAINS = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "finite_number": "must be a finite number",
    "literal_error": "must be one of {expected}",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "string_too_short": "must be at least {min_length} character(s) long",
    "too_short": "must hold at least {min_length} item(s)",
    "list_type": "must be a list",
    "dict_type": "must be a mapping of keys to values",
    "model_type": "must be a mapping of keys to values",
    "model_attributes_type": "must be a mapping of keys to values",
}


def _dotted(loc: tuple[Any, ...]) -> str:
    """('data', 'sources', 0, 'weight') -> 'data.sources[0].weight'. A mapping's refused key
    (pydantic's '[key]' after it) is named as the key itself."""
    key = ""
    for part in loc:
        if part == "[key]":
            continue
        key += f"[{part}]" if isinstance(part, int) else f".{part}" if key else str(part)
    return key


def _describe(err: dict[str, Any], tree: dict[str, Any]) -> str:
    """One readable line for the first pydantic error: the dotted key, and for a value outside
    the key's declared domain that domain and the value given."""
    loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
    key = _dotted(err["loc"])
    if err["type"] == "extra_forbidden":
        parent_schema = _schema_at(loc[:-1])
        valid = sorted(parent_schema.model_fields) if parent_schema else []
        hint = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        where = ".".join(loc[:-1]) or "the top level"
        msg = f"unknown config key {key!r}"
        if now := migration.replacement(key):
            msg += f"; it is now {now}"
        elif hint:
            prefix = _dotted(err["loc"][:-1])  # with list indices: data.sources[0]
            msg += f"; did you mean {(prefix + '.' if prefix else '') + hint[0]!r}?"
        else:
            msg += f"; valid keys in {where}: {', '.join(valid)}"
        return msg
    if err["type"] == "missing":
        return f"config key {key!r} is required but not set"
    got = f"(got {first_line(repr(err.get('input')), 200)})"
    if err["type"] == "value_error":
        msg = str(err["msg"]).removeprefix("Value error, ")
        # A field's own validator says what the value must be; a section's names its keys.
        return f"config key {key!r} {msg} {got}" if msg.startswith("must ") else msg
    domain = _DOMAINS.get(err["type"])
    if domain is not None:
        ctx = {k: _number(v) for k, v in err.get("ctx", {}).items()}
        if ctx.get("min_length") == 1:
            domain = "must not be empty"
        return f"config key {key!r} {domain.format(**ctx)} {got}"
    return f"config key {key!r}: {err['msg'][:1].lower()}{err['msg'][1:]} {got}"


def _number(value: Any) -> Any:
    """A bound as written in the schema: 0, not 0.0 (pydantic turns a float's bounds to floats)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _schema_at(path: list[str]) -> type[BaseModel] | None:
    """The section at a dotted path of keys; a mapping of sections (compute.grouped_matmul_tiles)
    takes any one key to its value's section."""
    schema: type[BaseModel] = Config
    parts = iter(path)
    for part in parts:
        field = schema.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        if typing.get_origin(ann) is dict:
            ann = typing.get_args(ann)[1]
            if next(parts, None) is None:
                return None
        candidates = getattr(ann, "__args__", (ann,))
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        schema = nested[0]
    return schema


def to_yaml(cfg: Config) -> str:
    """The resolved config, as written into the run directory."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
