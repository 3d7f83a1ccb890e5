"""The config a checkpoint was saved with, as a Config to load its model by: over base.yml's
defaults, with a caller's overrides. Every reader of a checkpoint's model (generation,
evaluation, merging, export) starts here."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import yaml

from maxtrain.checkpointing.integrity import CheckpointError
from maxtrain.checkpointing.restore import read_saved_config
from maxtrain.config import CONFIGS_DIR, Config, deep_merge, parse_override, validate

# How far up from a step directory its tokenizer files may sit: the step, its tier, the
# checkpoints directory, the run directory.
TOKENIZER_SEARCH_DEPTH = 4


def saved_config(step_dir: Path, overrides: Sequence[str] = (), dropless: bool = True) -> Config:
    """The config a step was saved with, over base.yml's defaults, with `overrides` applied.
    dropless: mixture-of-experts layers without a capacity limit, so inference drops no token
    (False: the run's own capacity, for a config to train with)."""
    saved = yaml.safe_load(read_saved_config(step_dir)) or {}
    if not isinstance(saved.get("model"), dict):
        raise CheckpointError(f"{step_dir}: its saved config names no model")
    base = yaml.safe_load((CONFIGS_DIR / "base.yml").read_text())
    tree = deep_merge(base, saved)
    for text in overrides:
        keys, value = parse_override(text)
        tree = deep_merge(
            tree, functools.reduce(lambda inner, key: {key: inner}, keys[::-1], value)
        )
    if dropless and tree["model"].get("moe"):
        tree = deep_merge(tree, {"model": {"moe": {"capacity_factor": None}}})
    return validate(tree)
