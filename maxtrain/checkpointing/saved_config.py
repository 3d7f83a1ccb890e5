"""The config a checkpoint was saved with, as a Config to load its model by: over base.yml's
defaults, with a caller's overrides. Every reader of a checkpoint's model (generation,
evaluation, merging, export) starts here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from maxtrain.checkpointing.integrity import CheckpointError
from maxtrain.checkpointing.restore import read_saved_config
from maxtrain.config import (
    CONFIGS_DIR,
    Config,
    TrainConfig,
    deep_merge,
    migration,
    overridden,
    validate,
)

# How far up from a step directory its tokenizer files may sit: the step, its tier, the
# checkpoints directory, the run directory.
TOKENIZER_SEARCH_DEPTH = 4


def saved_config(step_dir: Path, overrides: Sequence[str] = (), dropless: bool = True) -> Config:
    """The config a step was saved with, over base.yml's defaults, with `overrides` applied.
    dropless: mixture-of-experts layers without a capacity limit, so inference drops no token
    (False: the run's own capacity, for a config to train with). Keys of an older maxtrain
    are migrated, with a note on stderr (config/migration.py)."""
    saved = yaml.safe_load(read_saved_config(step_dir)) or {}
    if not isinstance(saved.get("model"), dict):
        raise CheckpointError(f"{step_dir}: its saved config names no model")
    saved, notes = migration.migrate_source(saved)
    migration.note(str(step_dir), notes)
    base = yaml.safe_load((CONFIGS_DIR / "base.yml").read_text())
    tree = deep_merge(deep_merge(base, saved), _seq_len_within_model(saved))
    tree = migration.resolve(overridden(tree, overrides))
    if dropless and tree["model"].get("moe"):
        tree = deep_merge(tree, {"model": {"moe": {"expert_capacity_factor": None}}})
    return validate(tree)


def _seq_len_within_model(saved: dict) -> dict:
    """train.seq_len cut to the saved model's positions where the checkpoint does not set it
    (an import holds only its model): the schema's 128 is a training default, no reason to
    refuse a model of 64 positions, and a held-out loss of such a model (evaluate --loss)
    scores its own context. {} where nothing needs cutting."""
    positions = saved["model"].get("max_seq_len")
    default = TrainConfig.model_fields["seq_len"].default
    if positions is None or positions >= default or "seq_len" in (saved.get("train") or {}):
        return {}
    return {"train": {"seq_len": positions}}
