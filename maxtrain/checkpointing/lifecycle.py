"""The checkpoint lifecycle both strategies share, and the hooks through which they differ.

A run drives a TieredCheckpointer the same way whichever strategy open_checkpointer picked:

    restore_latest -> prewarm -> maybe_save, maybe_save, ... -> save_now (SIGTERM, final) -> close

This base class owns what that sequence means: which tiers are due at a step, that a due
persistent save is skipped (with a warning) while the previous one is still being written,
that an earlier background failure surfaces at the next call, what a restore records, what
closing waits for, and what prewarming measures. Its subclasses own the Orbax side:

- Checkpointer (checkpointer.py): one Orbax CheckpointManager per tier, in one process or in
  a multi-process run with a single data-parallel replica;
- EmergencyCheckpointer (emergency.py): Orbax's emergency manager, which keeps the local tier
  per data-parallel replica in a multi-process run.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import yaml
from etils import epath

from maxtrain.checkpointing import integrity
from maxtrain.checkpointing.common import (
    TIERS,
    listed_steps,
    quiet_orbax_tracebacks,
    stderr_log,
    tier_dirs,
)
from maxtrain.checkpointing.integrity import CheckpointError
from maxtrain.common import absl_flags
from maxtrain.common.errors import first_line
from maxtrain.config import CheckpointConfig


@dataclass(frozen=True)
class Restored:
    """What a strategy found to resume from: the state, its step and tier, and restore_info's
    other entries (step, data_restored, meta, ...)."""

    state: Any
    step: int
    tier: str
    info: dict[str, Any]


class TieredCheckpointer(abc.ABC):
    """Saves the train state, data position, config and meta to two tiers (checkpoint.local,
    checkpoint.persistent); restores the newest complete step of either.

    prewarm: let the first maybe_save call pay the first save's one-time costs (see prewarm);
    False: the first save pays them (benchmarks measure that).
    log: where warnings go (default: stderr of process 0, prefixed "maxtrain: checkpoint:").
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | epath.PathLike,
        config_yaml: str = "",
        *,
        prewarm: bool = True,
        log: Callable[[str], None] = stderr_log,
    ):
        absl_flags.mark_parsed()  # Orbax reads them
        quiet_orbax_tracebacks()  # a failed save is reported once, in one line
        self.cfg, self.config_yaml, self.log = cfg, config_yaml, log
        self.dirs = tier_dirs(cfg, run_dir)  # {tier: checkpoint.<tier>.dir or the run's}
        self.last_saved_step: int | None = None  # newest step saved or restored, any tier
        self.restore_info: dict[str, Any] | None = None  # what restore_latest found
        self.prewarm_times: dict[str, float] = {}  # what prewarm spent, by part
        self._seed = (yaml.safe_load(config_yaml) or {}).get("run", {}).get("seed")
        self._tier_step: dict[str, int | None] = dict.fromkeys(TIERS)  # newest per tier
        self._prewarmed = not prewarm
        self._closed = False

    # ---- restore ------------------------------------------------------------------------------

    def restore_latest(self, abstract_state: Any, data_iterator: Any = None):
        """(state, step) from the newest complete checkpoint of either tier, or None if none.

        abstract_state: the TrainState as jax.ShapeDtypeStruct with .sharding (abstract_like:
        the target layout; a checkpoint from another mesh or device count is resharded on
        read). The data iterator is set to the saved position where the step holds one.
        Corrupt or incomplete steps are reported, moved aside and skipped; if nothing else is
        left, CheckpointError. A checkpoint of a different model raises CheckpointError before
        anything on disk changes. restore_info then says what was read (step, tier,
        data_restored, meta).
        """
        if not self.cfg.enabled:
            return None
        found = self._restore_newest(abstract_state, data_iterator)
        if found is None:
            return None
        self._tier_step[found.tier] = self.last_saved_step = found.step
        self.restore_info = {**found.info, "tier": found.tier}
        return found.state, found.step

    @staticmethod
    def _no_complete_checkpoint(unusable: list[tuple[int, Any, str]]) -> CheckpointError:
        """The error for a run whose every checkpoint is unusable: (step, directory, why) each.
        Starting from scratch silently would overwrite the run's history."""
        listing = "; ".join(f"step {step} in {where}: {why}" for step, where, why in unusable)
        return CheckpointError(
            f"no complete checkpoint to resume from: {listing}. Move these aside (or start a new "
            "run.name) to start from scratch"
        )

    # ---- save ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether maybe_save(step) would save to some tier (the loop checks the state first)."""
        return self.cfg.enabled and step > 0 and any(self._interval_hit(t, step) for t in TIERS)

    def _interval_hit(self, tier: str, step: int) -> bool:
        return step % getattr(self.cfg, tier).every_steps == 0

    def maybe_save(
        self, step: int, state: Any, data_iterator: Any = None, meta: dict[str, Any] | None = None
    ) -> list[str]:
        """Starts an async save of step to the tiers due at it; returns their names ([]: none).

        Call after the step's update, with the iterator positioned at the next batch. Returns
        after the device-to-host copy. A failure of an earlier background save is raised here
        (CheckpointError). A due persistent save whose previous one is still being written is
        skipped with a warning, never waited for: slow storage must not stall training. Which
        of the due tiers get written is the strategy's (_tiers_to_save).
        """
        if not self.cfg.enabled or step <= 0:
            return []
        if not self._prewarmed:  # the first call (usually step 1, not a save step) pays it
            self.prewarm(state)
        self._raise_finished_errors()
        due = [t for t in TIERS if self._interval_hit(t, step) and self._tier_step[t] != step]
        if "persistent" in due and (busy := self._persistent_busy()):
            self.log(f"skipping the persistent checkpoint of step {step}: {busy} (slow storage?)")
            due.remove("persistent")
        tiers = self._tiers_to_save(due)
        if tiers:
            self._save(step, state, data_iterator, meta, tiers)
        return tiers

    def save_now(
        self,
        step: int,
        state: Any,
        data_iterator: Any = None,
        tier: str = "local",
        wait: bool = True,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Saves step to one tier now, whatever the interval (the SIGTERM path, the final step).

        wait=True returns only once the checkpoint is committed (durable).
        """
        if tier not in TIERS:
            raise ValueError(f"unknown checkpoint tier {tier!r}; tiers: {', '.join(TIERS)}")
        if self._tier_step[tier] != step:
            self._save(step, state, data_iterator, meta, [tier])
        if wait:
            self._wait_for(tier)

    def _save(self, step: int, state: Any, data_iterator: Any, meta, tiers: list[str]) -> None:
        self._start_save(step, state, data_iterator, meta, tiers)
        for tier in tiers:
            self._tier_step[tier] = step
        self.last_saved_step = step

    # ---- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for saves in flight (they are not abandoned), then releases Orbax's threads.
        A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_until_finished()
        finally:
            self._release()

    def set_aside_from(self, step: int, label: str) -> tuple[list[epath.Path], int | None]:
        """Closes (saves in flight commit first), then moves every checkpoint of step >= `step`
        in this process's tier directories aside as `<step>.<label>-<time>`; returns their new
        paths and the newest step left (None: none).

        For checkpoints a restart must not resume from, although they are complete: the state
        saved just before a non-finite loss gave that loss (training/loop.py), and resume takes the
        newest step. Moved, never deleted.
        """
        self.close()
        suffix, moved = time.strftime("%Y%m%d-%H%M%S"), []
        for directory in self._step_directories():
            for s, path in listed_steps(directory):
                if s < step:
                    continue
                try:  # processes sharing a tier directory race for it: one of them moves it
                    moved.append(integrity.quarantine(path, suffix, label))
                except OSError as e:
                    self.log(f"could not move {path} aside ({first_line(e, 300, typed=True)})")
        left = [s for d in self._step_directories() for s, _ in listed_steps(d)]
        return moved, max(left, default=None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- first-save costs ---------------------------------------------------------------------

    def prewarm(self, state: Any) -> float:
        """Pays the first save's one-time costs now, outside the train loop; returns seconds.

        Opens the tiers (directories, write probes, Orbax managers and their thread pools) and
        copies the state to the host as saves do, as many copies at once as saves can be in
        flight (_host_copy): that compiles Orbax's slicing of replicated arrays and, on GPU,
        grows the pinned host memory pool to what those saves hold, so no save has to (the cost
        moves here: ~6 s per copy at 1B params on an H100; on CPU the copies are views).
        maybe_save calls it on its first call if nobody did. prewarm_times: the two parts.
        """
        t0 = time.perf_counter()
        self._prewarmed = True
        if self.cfg.enabled:
            self._open_managers(state)
            t1 = time.perf_counter()
            self._host_copy(state)
            self.prewarm_times = {"open_s": t1 - t0, "host_copy_s": time.perf_counter() - t1}
        return time.perf_counter() - t0

    # ---- what the strategies differ in --------------------------------------------------------

    @abc.abstractmethod
    def _step_directories(self) -> list[epath.Path]:
        """The directories of step directories this process writes (set_aside_from)."""

    @abc.abstractmethod
    def _restore_newest(self, abstract_state: Any, data_iterator: Any) -> Restored | None:
        """Finds, vets and reads the newest complete step (None: there is none), moving aside
        the unusable steps newer than it. The strategies store steps differently: one
        directory per tier, or per replica and process with the rest in a sidecar."""

    @abc.abstractmethod
    def _tiers_to_save(self, due: list[str]) -> list[str]:
        """Which of the due tiers a step is written to. A save's cost to the loop is its
        device-to-host copies, and the strategies spend them differently."""

    @abc.abstractmethod
    def _start_save(
        self, step: int, state: Any, data_iterator: Any, meta, tiers: list[str]
    ) -> None:
        """Starts the async save of step to these tiers; returns after the host copy. Raises
        CheckpointError (naming the directory) if it cannot start."""

    @abc.abstractmethod
    def _persistent_busy(self) -> str | None:
        """None if a persistent save can start now, else what is still being written (for the
        warning). Who knows, and how long to wait, is the strategy's."""

    @abc.abstractmethod
    def _raise_finished_errors(self) -> None:
        """Raises CheckpointError for a background save that has already failed, without
        waiting for any still in flight."""

    @abc.abstractmethod
    def wait_until_finished(self) -> None:
        """Blocks until this process's saves in flight are committed; CheckpointError if one
        failed."""

    @abc.abstractmethod
    def _wait_for(self, tier: str) -> None:
        """Blocks until the tier's save in flight is committed (save_now's wait)."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Closes the Orbax managers (their threads and their references to the last save's
        data); after wait_until_finished, also when it raised."""

    @abc.abstractmethod
    def _open_managers(self, state: Any) -> None:
        """Creates the Orbax managers a save needs, after write probes of their directories."""

    @abc.abstractmethod
    def _host_copy(self, state: Any) -> None:
        """Copies the state to the host as this strategy's saves do (common.host_copy), as many
        times at once as it can have saves in flight."""
