"""Helpers both checkpointers use: tier directories and their listing, warnings, write probes,
the abstract state a restore reads into, the host-copy prewarm, and the meta record saved with
every checkpoint. (The lifecycle they share is lifecycle.py.)"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from maxtrain.checkpointing import integrity
from maxtrain.checkpointing.integrity import CheckpointError
from maxtrain.common.errors import first_line
from maxtrain.config import CheckpointConfig

TIERS = ("local", "persistent")


def stderr_log(line: str) -> None:
    if jax.process_index() == 0:
        print(f"maxtrain: checkpoint: {line}", file=sys.stderr, flush=True)


class _OrbaxTracebacks(logging.Filter):
    """Drops the tracebacks Orbax logs for a failed background save.

    Orbax logs a failed save with its traceback (logging.exception) from every thread that
    sees it, about 340 lines for one full disk, and then raises the same error to whoever waits
    for the save; maxtrain reports that one in a line naming the directory and the cause. Its
    other records (warnings, errors without a traceback) pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from_orbax = f"{os.sep}orbax{os.sep}" in record.pathname
        return not (from_orbax and record.exc_info and record.levelno >= logging.ERROR)


def quiet_orbax_tracebacks() -> None:
    """Installs _OrbaxTracebacks on absl's logger (Orbax logs through it), once."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxTracebacks) for f in logger.filters):
        logger.addFilter(_OrbaxTracebacks())


def remove_partial_save(tier_dir: epath.Path, step: int) -> epath.Path | None:
    """Removes what a failed save of `step` left in tier_dir (Orbax's temporary directory, never
    a committed step) and returns its path; None if there was none. Orbax would remove it only
    when the tier is next opened, and a full disk is better off without it now."""
    try:
        partial = integrity.in_flight_dir(tier_dir, step)
        if integrity.TMP_SUFFIX not in partial.name or not partial.exists():
            return None
        partial.rmtree()
    except OSError:  # the save's own error is the one to report
        return None
    return partial


def absolute(path: str | epath.PathLike) -> epath.Path:
    """Orbax's array writer (tensorstore) rejects relative paths, and only in its background
    thread: `run.output_dir: runs` made every save fail. Local paths are made absolute here;
    URLs (gs://...) already are."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def tier_dirs(cfg: CheckpointConfig, run_dir: str | epath.PathLike) -> dict[str, epath.Path]:
    """{tier name: directory}: checkpoint.<tier>.dir, else <run_dir>/checkpoints/<tier>."""
    root = absolute(run_dir) / "checkpoints"
    dirs = {}
    for name in TIERS:
        configured = getattr(cfg, name).dir
        dirs[name] = absolute(configured) if configured else root / name
    if dirs["local"] == dirs["persistent"]:
        raise CheckpointError(
            f"checkpoint.local.dir and checkpoint.persistent.dir are the same directory "
            f"({dirs['local']}); give each tier its own"
        )
    return dirs


def listed_steps(directory: epath.Path) -> list[tuple[int, epath.Path]]:
    """integrity.step_dirs, with a directory that cannot be listed as a CheckpointError."""
    try:
        return integrity.step_dirs(directory)
    except OSError as e:  # e.g. the path runs through a regular file
        raise CheckpointError(
            f"cannot list checkpoints in {directory}: {first_line(e, 300, typed=True)}"
        ) from None


def probe_writable(directory: epath.Path) -> None:
    """Creates the directory and writes one small file, so an unwritable path fails here with a
    clear message instead of inside Orbax's background thread."""
    probe = directory / f".maxtrain-write-probe-{jax.process_index()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:
        raise CheckpointError(
            f"cannot write checkpoints to {directory}: {first_line(e, 300, typed=True)}"
        ) from e


def abstract_like(tree: Any) -> Any:
    """The tree's arrays as jax.ShapeDtypeStruct with their shardings: the target layout that
    restore_latest and load_parameters read a checkpoint into (resharding it on read)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def meta_record(step: int, state: Any, tier: str, seed: Any, extra: Any) -> dict[str, Any]:
    """What a checkpoint says about itself (restore checks `step` against its directory)."""
    return {
        "step": step,
        "tier": tier,
        "seed": seed,
        "params_fingerprint": integrity.fingerprint(getattr(state, "params", state)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),  # e.g. the loop's RNG state
    }


def host_copy(
    state: Any, copies: int, replica_id: int | None = 0, use_replica_parallel: bool = True
) -> None:
    """Copies every array to the host `copies` times at once, the way Orbax's save does, then
    drops the copies.

    On GPU Orbax copies into pinned host memory (its PyTree handler's default there), which the
    runtime allocates on first use and then keeps in a pool: growing that pool is what made the
    first save of each tier block ~7 s at 1B params on an H100. `copies` is how many saves can
    hold a host copy at the same time. On CPU the copies are views (free). Orbax's own transfer
    function (a private API, hence the fallback) also compiles the small slicing programs it
    uses for replicated arrays (~0.5 s on a 2-core CPU for 16 of them); replica_id and
    use_replica_parallel select the same slicing as the handler that will save.
    """
    arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    pinned = jax.default_backend() == "gpu"  # BasePyTreeCheckpointHandler's default
    try:
        from orbax.checkpoint._src.serialization import replica_slices

        held = [
            replica_slices.transfer_arrays_to_host(
                arrays,
                replica_id=replica_id,
                use_replica_parallel=use_replica_parallel,
                enable_pinned_host_transfer=pinned,
            )
            for _ in range(copies)
        ]
        del held
        return
    except (ImportError, AttributeError, TypeError):
        pass
    shards = [s.data for x in arrays for s in x.addressable_shards]
    for d in shards:
        d.copy_to_host_async()
    for d in shards:
        np.asarray(d)
