"""What Orbax's emergency manager cannot hold, kept beside it: per-process data positions, the
meta and the config of each step.

The emergency manager saves only the train state. Each process writes its data iterator's
position, and process 0 the meta and the resolved config, as small files under the PERSISTENT
directory, which is shared storage and survives the loss of any host:

    <persistent dir>/sidecar/<step>/process_<i>-of-<n>.json   one per process (data_state.py)
    <persistent dir>/sidecar/<step>/meta.json                 {step, tier, seed, ...}
    <persistent dir>/sidecar/<step>/config.yml                the resolved config

Each file is written to a temporary name and renamed over the old one, so a file that exists is
whole. They are written before the step's state save starts, and a step counts as restorable
only once every process's position is there, so the order of the two never matters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from etils import epath

from maxtrain.checkpointing.data_state import DataStateAdapter
from maxtrain.common.files import write_atomic

SIDECAR = "sidecar"
META = "meta.json"
CONFIG = "config.yml"


def step_dir(persistent_dir: epath.Path, step: int) -> epath.Path:
    return persistent_dir / SIDECAR / str(step)


def data_file(process_index: int, process_count: int) -> str:
    return f"process_{process_index}-of-{process_count}.json"  # grain's own naming


def write(persistent_dir: epath.Path, step: int, files: dict[str, str]) -> None:
    """Writes each {name: text} atomically into the step's sidecar directory."""
    directory = step_dir(persistent_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_atomic(directory / name, text)  # a step saved again (final, SIGTERM) overwrites


def steps_with(persistent_dir: epath.Path, name: str) -> set[int]:
    """Steps whose sidecar holds a file of this name."""
    root = persistent_dir / SIDECAR
    if not root.is_dir():
        return set()
    return {int(d.name) for d in root.iterdir() if d.name.isdigit() and (d / name).exists()}


def read_meta(persistent_dir: epath.Path, step: int) -> dict[str, Any] | None:
    path = step_dir(persistent_dir, step) / META
    return json.loads(path.read_text()) if path.exists() else None


def restore_data(
    persistent_dir: epath.Path,
    step: int,
    adapter: DataStateAdapter,
    iterator: Any,
    process_index: int,
    process_count: int,
) -> bool:
    """Sets the iterator to its saved position; False if this process has none for step."""
    path = step_dir(persistent_dir, step) / data_file(process_index, process_count)
    if not path.exists():
        return False
    adapter.from_json(iterator, path.read_text())
    return True


def prune(persistent_dir: epath.Path, below: int, keep: Callable[[int], bool]) -> None:
    """Deletes the sidecars of steps older than `below` for which keep(step) is false."""
    root = persistent_dir / SIDECAR
    if not root.is_dir():
        return
    for d in root.iterdir():
        if d.name.isdigit() and int(d.name) < below and not keep(int(d.name)):
            d.rmtree(missing_ok=True)
