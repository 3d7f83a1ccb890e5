"""What makes a run the run it is: its model, its data and its objective. A run directory
holding checkpoints is extended or resumed only with the same; a config that changes one of
them names another run, and is refused in one line before anything is read or written.

A finished run used to answer any config with "complete, nothing to do": a different model
or a data path that does not exist was silently not trained. A resumed one failed at restore,
if at all. The config each step was saved with (checkpointing/restore.py read_saved_config)
is what the new one is compared with.

Everything else may change between starts: train.steps (to extend a run), the schedule, the
batch, logging and eval cadence, the mesh, all of `compute:` (dtypes, remat, kernels, the
exchanges between devices), checkpoint cadence. A config saved by an older maxtrain is
migrated to today's keys before it is compared (config/migration.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

import yaml
from etils import epath

from maxtrain import config as config_lib
from maxtrain import posttrain
from maxtrain.checkpointing import read_saved_config
from maxtrain.checkpointing.integrity import newest_complete
from maxtrain.common.errors import UserError
from maxtrain.config import Config

# Keys (with every key under them) whose change makes another run: the model's architecture
# and where its parameters start from, the data, the objective. data's reader settings
# (workers, buffers, the cache) read the same rows, so they may change.
IDENTITY = (
    "model_name",
    "model",
    "data",
    *posttrain.CONFIG_KEYS,
    "checkpoint.load_parameters_path",
    "init",
)
_READER_SETTINGS = ("data.num_workers", "data.worker_buffer_size", "data.cache_dir")
SHOWN = 3  # differences named in the refusal; the rest are counted


class ChangedRun(UserError):
    """The config changes the model, data or objective of a run that has checkpoints."""


def check_same_run(cfg: Config, tier_dirs: Iterable[epath.Path]) -> None:
    """Refuses (ChangedRun) a config whose model, data or objective differs from the config
    the run's newest complete checkpoint (in any tier) was saved with. Nothing saved, or a
    saved config this schema no longer reads: nothing to compare."""
    found = [step for d in tier_dirs if (step := newest_complete(d)) is not None]
    newest = max(found, key=lambda step_and_dir: step_and_dir[0], default=None)
    if newest is None:
        return
    step, step_dir = newest
    try:
        saved = config_lib.validate_saved(
            yaml.safe_load(read_saved_config(step_dir)) or {}, str(step_dir)
        )
    except UserError:
        return
    changed = differences(saved, cfg)
    if changed:
        named = ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changed[:SHOWN])
        more = f" (and {len(changed) - SHOWN} more)" if len(changed) > SHOWN else ""
        raise ChangedRun(
            f"run {cfg.run_dir} was trained to step {step} with another model, data or "
            f"objective: {named}{more}; give this config another run.name (or delete "
            f"{cfg.run_dir} to start it over)"
        )


def differences(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for each identity key that differs, in schema order."""
    before, after = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    keys = list(dict.fromkeys([*before, *after]))
    return [
        (key, before.get(key), after.get(key))
        for key in keys
        if _identity(key)
        and _as_compared(key, before.get(key)) != _as_compared(key, after.get(key))
    ]


# Data paths: a config file's relative ones are resolved beside it (config/loading.py), which
# configs saved before that rule hold as written, relative to the directory the run was started
# from. Both sides are compared as absolute paths from here, so that such a run still resumes.
_PATH_KEY = re.compile(r"data\.(sources\[\d+\]\.path|tokenizer|chat_template)")


def _as_compared(key: str, value: Any) -> Any:
    if isinstance(value, str) and _PATH_KEY.fullmatch(key) and os.sep in value:
        if ":" not in value and not value.startswith("~"):
            return os.path.abspath(value)
    return value


def _identity(key: str) -> bool:
    """Whether a dotted key belongs to the run's identity (IDENTITY, less the reader settings)."""
    if key.startswith(_READER_SETTINGS):
        return False
    return any(key == p or key.startswith((f"{p}.", f"{p}[")) for p in IDENTITY)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'data.sources[0].path': ..., ...}: every leaf of a config dump under its dotted key."""
    if isinstance(tree, dict):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in tree.items()]
    elif isinstance(tree, list) and any(isinstance(v, dict) for v in tree):
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(tree)]
    else:
        return {prefix: tree}
    return {key: leaf for k, v in items for key, leaf in _flat(v, k).items()}
