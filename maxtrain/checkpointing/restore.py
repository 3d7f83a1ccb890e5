"""Reading one step directory back: the state, its meta, this process's data position, and the
config saved with it.

Two layouts are read, so a run can move between the two checkpointers (a multi-process run
resumed on one process, or one that gained data-parallel replicas):

- ours (checkpointer.py): items `state`, `meta`, `config`, `data` (grain: a JSON per process);
- the persistent tier of Orbax's emergency manager (emergency.py): the state as item `default`,
  the rest in the sidecar (sidecar.py) under the same tier directory.

Every process calls it (Orbax reads each process's shards); it does not move or delete files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
import yaml
from etils import epath

from maxtrain.checkpointing import checksums, integrity, sidecar
from maxtrain.checkpointing.data_state import adapter_for
from maxtrain.checkpointing.integrity import (
    CONFIG_ITEM,
    EMERGENCY_STATE_ITEM,
    STATE_ITEM,
    CheckpointError,
    Corrupt,
)
from maxtrain.common.errors import first_line


def read_step(
    path: epath.Path,
    step: int,
    abstract_state: Any,
    data_iterator: Any,
    log: Callable[[str], None],
    config_yaml: str = "",
) -> tuple[Any, dict[str, Any]]:
    """(state, info) of a complete step; Corrupt if it is not one, CheckpointError if it holds
    another model or optimizer (a user mistake, not a reason to fall back). config_yaml: this
    run's config, to name the optimizer settings that differ."""
    integrity.verify(path)
    check_state(path, integrity.read_state_shapes(path), abstract_state, config_yaml)
    emergency = integrity.state_dir(path).name == EMERGENCY_STATE_ITEM
    item = EMERGENCY_STATE_ITEM if emergency else STATE_ITEM
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            items = {item: ocp.args.StandardRestore(abstract_state)}
            if not emergency:
                items["meta"] = ocp.args.JsonRestore()
            restored = ckptr.restore(path, args=ocp.args.Composite(**items))
            meta = sidecar.read_meta(path.parent, step) if emergency else restored["meta"]
            if meta is not None and meta.get("step") != step:  # a renamed or mixed-up dir
                raise Corrupt(f"its meta says step {meta.get('step')}")
            if emergency:
                data_restored = _sidecar_data(path, step, data_iterator, log)
            else:
                data_restored = _item_data(ckptr, path, data_iterator, log)
    except (Corrupt, CheckpointError):
        raise
    except Exception as e:  # tensorstore/JSON read failures: unreadable bytes on disk
        raise Corrupt(f"restore failed: {first_line(e, 300, typed=True)}") from None
    bad = checksums.first_mismatch(restored[item], integrity.listed_checksums(path))
    if bad is not None:
        raise Corrupt(f"{bad!r} reads back with another content checksum than it was saved with")
    return restored[item], {"step": step, "data_restored": data_restored, "meta": meta}


def check_state(
    path: epath.Path, saved: dict[str, tuple[int, ...]], abstract_state: Any, config_yaml: str
) -> None:
    """CheckpointError unless the saved leaves (integrity.read_state_shapes) are the run's:
    first the parameters (another model: the leaf and both shapes), then the optimizer state.

    The optimizer state's structure follows the optimizer config: optim.clip_norm 0 drops the
    clipping stage from optax's chain, so every opt_state path changes while the parameters
    still match. That is said as such, with the optim keys that differ between the config saved
    with the checkpoint and this run's, and how to keep the parameters with a fresh optimizer.
    """
    (saved_rest, saved_opt), (expected_rest, expected_opt) = map(
        _split_optimizer, (saved, integrity.flat_shapes(abstract_state))
    )
    integrity.check_shapes(saved_rest, expected_rest, str(path))
    if saved_opt == expected_opt:
        return
    changed = _changed_optim_keys(path, config_yaml)
    if not changed:  # the same settings: say which leaf differs
        missing = [p for p in expected_opt if saved_opt.get(p) != expected_opt[p]]
        first = missing[0] if missing else next(iter(saved_opt.keys() - expected_opt.keys()))
        changed = f"first difference: {first!r}"
    raise CheckpointError(
        f"checkpoint {path} holds the state of another optimizer ({changed}); its parameters "
        f"match this model. Set those keys back to resume, or keep only its parameters with a "
        f"fresh optimizer: a new run.name with checkpoint.load_parameters_path={path}"
    )


def _split_optimizer(shapes: dict[str, tuple[int, ...]]) -> tuple[dict, dict]:
    """(every leaf but the optimizer state's, the optimizer state's leaves)."""
    opt = {p: s for p, s in shapes.items() if p.startswith("opt_state/")}
    return {p: s for p, s in shapes.items() if p not in opt}, opt


def _changed_optim_keys(step_dir: epath.Path, config_yaml: str) -> str:
    """'optim.clip_norm 1.0 there, 0.0 here, ...' from the saved config and this run's; '' if
    either is missing or they agree."""
    try:
        saved = (yaml.safe_load(read_saved_config(step_dir)) or {}).get("optim", {})
    except CheckpointError:
        return ""
    mine = (yaml.safe_load(config_yaml) or {}).get("optim", {})
    keys = sorted(k for k in saved.keys() | mine.keys() if saved.get(k) != mine.get(k))
    return ", ".join(f"optim.{k} {saved.get(k)} there, {mine.get(k)} here" for k in keys)


def _item_data(ckptr, path: epath.Path, data_iterator: Any, log) -> bool:
    adapter = adapter_for(data_iterator)
    if adapter is None:
        return False
    if not (path / "data").exists():
        log(f"{path} holds no data-iterator state; the data stream starts afresh")
        return False
    args = ocp.args.Composite(data=adapter.restore_args(data_iterator))
    restored = ckptr.restore(path, args=args)
    adapter.apply(data_iterator, restored["data"])
    return True


def _sidecar_data(path: epath.Path, step: int, data_iterator: Any, log) -> bool:
    adapter = adapter_for(data_iterator)
    if adapter is None:
        return False
    index, count = jax.process_index(), jax.process_count()
    if sidecar.restore_data(path.parent, step, adapter, data_iterator, index, count):
        return True
    log(
        f"{path} holds no data-iterator state for process {index} of {count}; the data stream "
        "starts afresh"
    )
    return False


def read_saved_config(step_dir: epath.PathLike) -> str:
    """The resolved config (YAML) saved with a step: the `config` item of ours, else the sidecar's
    config.yml (the emergency layout). It says which model the step holds, for the tools that
    read a checkpoint without a run's config (export to Hugging Face).

    CheckpointError, one line naming the file, if the step holds no config or it is unreadable.
    """
    step_dir = epath.Path(step_dir)
    item = step_dir / CONFIG_ITEM / "metadata"  # what Orbax's JsonSave wrote
    step = int(step_dir.name) if step_dir.name.isdigit() else -1
    side = sidecar.step_dir(step_dir.parent, step) / sidecar.CONFIG
    try:
        if item.is_file():
            return json.loads(item.read_text())["yaml"]
        if side.is_file():
            return side.read_text()
    except (OSError, ValueError, KeyError, TypeError) as e:
        path = item if item.is_file() else side
        raise CheckpointError(
            f"{path}: the config saved with the checkpoint is unreadable "
            f"({first_line(e, 300, typed=True)})"
        ) from None
    raise CheckpointError(f"{step_dir}: holds no saved config ({item})")
