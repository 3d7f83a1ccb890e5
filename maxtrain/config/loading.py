"""How a run's config is assembled and checked: YAML files, parents, model presets, CLI
overrides, and one readable line for the first thing wrong.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from maxtrain.config.schema import Config
from maxtrain.errors import first_line

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


class ConfigError(Exception):
    """A user mistake in the config: the CLI prints it as one line and exits with status 2."""


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {first_line(e)}") from e
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


def _load_with_parents(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    data = _read_yaml(path)
    parent = data.get("base_config")
    if parent:
        parent_path = (path.parent / parent).resolve()
        data = deep_merge(_load_with_parents(parent_path, (*seen, path)), data)
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 0.0003); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. optim.lr=3e-4)")
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


def _model_file(name: str) -> Path:
    path = CONFIGS_DIR / "models" / f"{name}.yml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIGS_DIR / "models").glob("*.yml"))
        hint = difflib.get_close_matches(name, known, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"model_name {name!r} has no file configs/models/{name}.yml{suggestion}; "
            f"known models: {', '.join(known)}"
        )
    return path


def load(config_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Builds the validated Config for a config file plus CLI overrides."""
    parsed = [parse_override(o) for o in overrides]
    user = _load_with_parents(Path(config_path))
    for keys, value in parsed:
        _set_dotted(user, keys, value)

    merged = _read_yaml(CONFIGS_DIR / "base.yml")
    model_name = user.get("model_name", merged.get("model_name"))
    if not isinstance(model_name, str):
        raise ConfigError("model_name must be set to the name of a file in configs/models/")
    merged = deep_merge(merged, {"model": _read_yaml(_model_file(model_name))})
    merged = deep_merge(merged, user)
    return validate(merged)


def validate(tree: dict[str, Any]) -> Config:
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_describe(e.errors()[0], tree)) from None
    return cfg


def _describe(err: dict[str, Any], tree: dict[str, Any]) -> str:
    """One readable line for the first pydantic error, naming the dotted key."""
    loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        parent_schema = _schema_at(loc[:-1])
        valid = sorted(parent_schema.model_fields) if parent_schema else []
        hint = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        where = ".".join(loc[:-1]) or "the top level"
        msg = f"unknown config key {key!r}"
        if hint:
            prefix = ".".join(loc[:-1])
            msg += f"; did you mean {(prefix + '.' if prefix else '') + hint[0]!r}?"
        else:
            msg += f"; valid keys in {where}: {', '.join(valid)}"
        return msg
    if err["type"] == "missing":
        return f"config key {key!r} is required but not set"
    if err["type"] == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    got = err.get("input")
    return f"config key {key!r}: {err['msg'].lower()} (got {got!r})"


def _schema_at(path: list[str]) -> type[BaseModel] | None:
    schema: type[BaseModel] = Config
    for part in path:
        field = schema.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        candidates = getattr(ann, "__args__", (ann,))
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        schema = nested[0]
    return schema


def to_yaml(cfg: Config) -> str:
    """The resolved config, as written into the run directory."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
