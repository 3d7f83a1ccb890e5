"""The Checkpointer: two tiers of asynchronous Orbax checkpoints and one restore policy.

Each tier is one Orbax CheckpointManager with async saves: `save()` returns once the arrays are
on the host, and a background thread writes them, writes our manifest, then commits. Nothing is
written to a tier before it is first needed (the first save, or `prewarm`), so a run that fails
its shape check on resume has touched nothing on disk.

A step due in both tiers is saved to the persistent tier only: one device-to-host copy instead
of two (two blocked the loop ~0.6 s at 1B parameters on an H100, one ~0.3 s), and nothing is
lost, since restore takes the newest complete step of either tier. If the persistent tier is
still busy with its previous save, that step goes to the local tier instead.

What a save, a restore, closing and prewarming mean is lifecycle.py's (TieredCheckpointer);
this module is how they are done with one plain Orbax manager per tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from maxtrain.checkpointing import checksums, integrity
from maxtrain.checkpointing.common import (
    absolute,
    host_copy,
    listed_steps,
    meta_record,
    probe_writable,
    remove_partial_save,
    stderr_log,
)
from maxtrain.checkpointing.data_state import adapter_for
from maxtrain.checkpointing.integrity import CONFIG_ITEM, STATE_ITEM, CheckpointError, Corrupt
from maxtrain.checkpointing.lifecycle import Restored, TieredCheckpointer
from maxtrain.checkpointing.restore import read_step
from maxtrain.common import absl_flags
from maxtrain.common.errors import cause, first_line
from maxtrain.config import CheckpointConfig, CheckpointTier


@dataclass
class _Tier:
    name: str  # "local" | "persistent"
    directory: epath.Path
    cfg: CheckpointTier
    manager: ocp.CheckpointManager | None = None
    pending_step: int | None = None  # the step whose save is (or was last) in flight
    pending_checksums: Any = None  # checksums.start of that step's state, for its manifest


class Checkpointer(TieredCheckpointer):
    """One Orbax CheckpointManager per tier; see the module docstring and TieredCheckpointer.

    persistent_busy_wait_s: how long a due persistent save may wait for the previous one still
    in flight before it is skipped with a warning (0: skip at once). The local tier always waits
    for its previous save (Orbax does), since its saves are the resume point.
    one_transaction: write the state in one OCDBT transaction, so its bytes on disk depend on
    its values alone (see _one_transaction_registry); for parameters-only outputs (export.py).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | epath.PathLike,
        config_yaml: str = "",
        *,
        persistent_busy_wait_s: float = 0.0,
        prewarm: bool = True,
        log: Callable[[str], None] = stderr_log,
        one_transaction: bool = False,
    ):
        super().__init__(cfg, run_dir, config_yaml, prewarm=prewarm, log=log)
        self.persistent_busy_wait_s = persistent_busy_wait_s
        self.one_transaction = one_transaction
        self.tiers = {
            name: _Tier(name, directory, getattr(cfg, name))
            for name, directory in self.dirs.items()
        }

    # ---- restore ------------------------------------------------------------------------------

    def _step_directories(self) -> list[epath.Path]:
        return [tier.directory for tier in self.tiers.values()]

    def _restore_newest(self, abstract_state: Any, data_iterator: Any) -> Restored | None:
        """The newest step of either tier that reads back completely; on a tie the local tier
        (the faster read). Steps found corrupt on the way are reported and moved aside."""
        candidates = sorted(
            (
                (step, i, tier, path)
                for i, tier in enumerate(self.tiers.values())
                for step, path in listed_steps(tier.directory)
            ),
            key=lambda c: (-c[0], c[1]),  # newest first, then the local tier
        )
        bad: list[tuple[int, epath.Path, str]] = []
        for step, _, tier, path in candidates:
            try:
                state, info = read_step(
                    path, step, abstract_state, data_iterator, self.log, self.config_yaml
                )
            except Corrupt as e:
                bad.append((step, path, str(e)))
                continue
            for bad_step, bad_path, reason in bad:
                self.log(
                    f"checkpoint step {bad_step} in {bad_path.parent} is incomplete or corrupt "
                    f"({reason}); falling back to step {step}"
                )
                self._move_aside(bad_path)
            return Restored(state, step, tier.name, {**info, "dir": str(path)})
        if bad:
            raise self._no_complete_checkpoint([(s, p.parent, r) for s, p, r in bad])
        return None

    def _move_aside(self, path: epath.Path) -> None:
        """A corrupt step newer than the resume point would block saving that step again."""
        try:
            moved = integrity.quarantine(path, time.strftime("%Y%m%d-%H%M%S"))
            self.log(f"moved it aside to {moved}")
        except OSError as e:
            self.log(
                f"could not move {path} aside ({first_line(e, 300, typed=True)}); saving that "
                "step will fail"
            )

    # ---- save ---------------------------------------------------------------------------------

    def _tiers_to_save(self, due: list[str]) -> list[str]:
        """The persistent tier alone when both are due: one host copy (see the module
        docstring)."""
        return due[-1:]

    def _persistent_busy(self) -> str | None:
        """Whether the previous persistent save is still in flight after waiting up to
        persistent_busy_wait_s for it."""
        tier = self.tiers["persistent"]
        if tier.manager is None or not tier.manager.is_saving_in_progress():
            return None
        deadline = time.monotonic() + self.persistent_busy_wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if not tier.manager.is_saving_in_progress():
                return None
        return f"the save of step {tier.pending_step} to {tier.directory} is still being written"

    def _start_save(
        self, step: int, state: Any, data_iterator: Any, meta, tiers: list[str]
    ) -> None:
        for name in tiers:
            self._save_to(self.tiers[name], step, state, data_iterator, meta)

    def _save_to(self, tier: _Tier, step: int, state: Any, data_iterator: Any, meta) -> None:
        manager = self._open(tier)
        save = ocp.args.PyTreeSave if self.one_transaction else ocp.args.StandardSave
        items: dict[str, ocp.args.CheckpointArgs] = {
            STATE_ITEM: save(state),
            CONFIG_ITEM: ocp.args.JsonSave({"yaml": self.config_yaml}),
            "meta": ocp.args.JsonSave(meta_record(step, state, tier.name, self._seed, meta)),
        }
        adapter = adapter_for(data_iterator)
        if adapter is not None:
            items["data"] = adapter.save_args(data_iterator)
        self._wait(tier)  # surface the previous save's error, naming its step
        tier.pending_step = step
        tier.pending_checksums = checksums.start(state)  # fetched by _write_manifest
        try:
            manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._save_failed(tier, e) from e

    def _open(self, tier: _Tier) -> ocp.CheckpointManager:
        """The tier's manager, created on first use after a write probe of its directory."""
        if tier.manager is None:
            probe_writable(tier.directory)
            options = ocp.CheckpointManagerOptions(
                max_to_keep=tier.cfg.keep,
                keep_period=tier.cfg.keep_every_steps,
                enable_async_checkpointing=True,
                cleanup_tmp_directories=True,  # saves a crash interrupted (never restored)
                async_options=ocp.AsyncOptions(
                    post_finalization_callback=lambda: self._write_manifest(tier)
                ),
            )
            registry = _one_transaction_registry() if self.one_transaction else None
            try:
                tier.manager = ocp.CheckpointManager(
                    tier.directory, options=options, handler_registry=registry
                )
            except Exception as e:
                raise CheckpointError(
                    f"cannot open checkpoint directory {tier.directory}: "
                    f"{first_line(e, 300, typed=True)}"
                ) from e
        return tier.manager

    def _write_manifest(self, tier: _Tier) -> None:
        """Runs in Orbax's background thread after the items are written, before the commit."""
        if jax.process_index() == 0:
            step, sums = tier.pending_step, checksums.finish(tier.pending_checksums)
            integrity.write_manifest(integrity.in_flight_dir(tier.directory, step), step, sums)

    # ---- waiting and errors -------------------------------------------------------------------

    def _wait(self, tier: _Tier) -> None:
        if tier.manager is None:
            return
        try:
            tier.manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(tier, e) from e

    def _save_failed(self, tier: _Tier, error: Exception) -> CheckpointError:
        """One line for a failed save: the step, the tier directory and the cause (a full disk
        says "No space left on device", not Orbax's first line), with what it left removed."""
        step = tier.pending_step
        removed = remove_partial_save(tier.directory, step) if step is not None else None
        committed = [s for t in self.tiers.values() for s, _ in integrity.step_dirs(t.directory)]
        return CheckpointError(
            f"saving step {step} to {tier.directory} failed: {cause(error)}"
            + (f"; removed the partial {removed.name}" if removed else "")
            + (f"; a restart resumes from step {max(committed)}" if committed else "")
        )

    def _wait_for(self, tier: str) -> None:
        self._wait(self.tiers[tier])

    def _raise_finished_errors(self) -> None:
        for tier in self.tiers.values():  # cheap: joins only saves that have already ended
            if tier.manager is not None and not tier.manager.is_saving_in_progress():
                self._wait(tier)

    def wait_until_finished(self) -> None:
        """Blocks until every save in flight is committed; raises CheckpointError on a failure
        (the first, after waiting for both tiers)."""
        errors = []
        for tier in self.tiers.values():
            try:
                self._wait(tier)
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _release(self) -> None:
        for tier in self.tiers.values():
            if tier.manager is not None:
                tier.manager.close()
                tier.manager = None  # drops Orbax's references to the last save's data

    # ---- first-save costs ---------------------------------------------------------------------

    def _open_managers(self, state: Any) -> None:
        for tier in self.tiers.values():
            self._open(tier)

    def _host_copy(self, state: Any) -> None:
        """Two copies at once: a slow persistent save and the next local one can both be in
        flight, so the pinned pool must hold two."""
        host_copy(state, copies=len(self.tiers))


def _one_transaction_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Orbax's state handler without a limit on the bytes a save writes at once.

    With a limit (StandardCheckpointHandler's default: 96 GB) Orbax commits every array to the
    OCDBT database on its own, and OCDBT batches whatever is pending into one version at a time.
    Each version writes a new root B-tree node holding every key so far, with the small values
    (array metadata, scales, norms under 1 KiB) inlined, and old versions are never compacted
    away. So the bytes on disk depend on how the writes happened to be batched, which depends
    on timing and cores: 7 to 15 versions and 296 to 346 KB for the tiny MoE's 221 KB of int8
    parameters (tests/quantization/test_quantization.py). Without a limit Orbax writes all
    arrays in one atomic transaction: one version, the same bytes every time. Peak memory was
    the same either way (a 400 MB state on CPU)."""
    handler = ocp.PyTreeCheckpointHandler(
        handler_impl=ocp.BasePyTreeCheckpointHandler(save_concurrent_bytes=None)
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, ocp.args.PyTreeSave, handler)
    return registry


# ---- parameters only --------------------------------------------------------------------------


def load_parameters(path: str | epath.PathLike, abstract_params: Any) -> Any:
    """The params of a checkpoint (no optimizer state, no step): to start a new run from them.

    path: a step directory, or a tier directory / run checkpoints directory (the newest complete
    step in it). abstract_params: the model's params as ShapeDtypeStruct with .sharding.
    Raises CheckpointError if nothing complete is found or a shape differs.
    """
    absl_flags.mark_parsed()  # Orbax reads them
    step_dir = resolve_step_dir(absolute(path))
    try:
        saved = integrity.read_state_shapes(step_dir)
    except Corrupt as e:
        raise CheckpointError(f"checkpoint {step_dir} is unreadable ({e})") from None
    saved = {p: s for p, s in saved.items() if p.startswith("params/")}
    expected = integrity.flat_shapes({"params": abstract_params})
    integrity.check_shapes(saved, expected, str(step_dir))
    target = {"params": abstract_params}
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            integrity.state_dir(step_dir),
            args=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            ),
        )
    except Exception as e:
        raise CheckpointError(
            f"cannot read parameters from {step_dir}: {first_line(e, 300, typed=True)}"
        ) from e
    return restored["params"]


def resolve_step_dir(path: epath.Path) -> epath.Path:
    """A step dir as given, else the newest complete step under path (or its tier dirs)."""
    if integrity.state_dir(path).is_dir():
        try:
            integrity.verify(path, require_manifest=False)  # also accepts plain Orbax output
        except Corrupt as e:
            raise CheckpointError(f"checkpoint {path} is incomplete or corrupt ({e})") from None
        return path
    roots = [path] + [path / sub for sub in ("local", "persistent")]
    roots += [path / "checkpoints" / sub for sub in ("local", "persistent")]
    found = sorted((sp for r in roots for sp in integrity.step_dirs(r)), key=lambda sp: -sp[0])
    for _, step_dir in found:
        try:
            integrity.verify(step_dir, require_manifest=False)
            return step_dir
        except Corrupt as e:
            stderr_log(f"skipping {step_dir}: incomplete or corrupt ({e})")
    raise CheckpointError(f"no complete checkpoint found at {path}")
