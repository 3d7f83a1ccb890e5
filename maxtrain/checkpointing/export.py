"""Parameters-only checkpoints written outside a train run: what tools/upcycle.py and
tools/depth_upscale.py produce, for `checkpoint.load_parameters_path` (or load_parameters)
to read.

The Checkpointer itself writes them, as step 0 of a one-tier checkpoint directory, so the format
is the train loop's (Orbax state item, config, meta, integrity manifest, Orbax's commit
markers); the state item holds {"params": ...} alone, written in one OCDBT transaction, so
its bytes on disk are a function of the parameters (checkpointer.py _one_transaction_registry;
PTQ exists to shrink them, and tools/quantize.py reports them). One process.
"""

from __future__ import annotations

import os
from typing import Any

from etils import epath

from maxtrain.checkpointing.checkpointer import Checkpointer
from maxtrain.checkpointing.integrity import CheckpointError
from maxtrain.common.files import atomic_directory
from maxtrain.config import CheckpointConfig, CheckpointTier


def save_parameters(
    output: str | os.PathLike,
    params: Any,
    *,
    config_yaml: str = "",
    meta: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> epath.Path:
    """Writes params as a complete checkpoint in the new directory `output`; returns its step
    directory (<output>/0: a new run starts from it at step 0).

    config_yaml: the resolved config of the model the params belong to. meta: extra entries of
    the meta item (e.g. where the params came from). files: {name: text} written beside the
    step directory (the model file, model.yml). Refuses an existing `output`. Atomic on
    local disks: it is written as the sibling `<output>.partial-<pid>` and renamed once
    committed; on a failure the partial directory is removed, so `output` is either complete or
    absent.
    """
    output = epath.Path(output)
    if output.exists():
        raise CheckpointError(f"{output} already exists; name a new output directory")
    with atomic_directory(output) as partial:
        tier = CheckpointTier(dir=os.fspath(partial), every_steps=1, keep=1)
        with Checkpointer(
            CheckpointConfig(persistent=tier),
            run_dir=partial,
            config_yaml=config_yaml,
            one_transaction=True,
        ) as ckpt:
            ckpt.save_now(0, {"params": params}, tier="persistent", wait=True, meta=meta)
        for name, text in (files or {}).items():
            (partial / name).write_text(text)
    return output / "0"
