"""Orbax's emergency multi-tier manager as a TieredCheckpointer (multi-process runs).

Why: on a multi-host run the local tier is each host's own disk or RAM disk, and a lost host
takes its part of every local checkpoint with it; two plain managers (checkpointer.py) would
then fall back to the older persistent tier. Orbax's emergency CheckpointManager
(orbax.checkpoint.experimental.emergency.checkpoint_manager) keeps the local tier per
data-parallel REPLICA instead: each replica holds the whole state, the processes of replicas
1..R-1 write their shards to their local directories, replica 0 writes the persistent tier,
and a restore reads the step on one replica that holds it completely (local tier, else the
persistent one) and broadcasts it to the others over the interconnect. With R >= 3 replicas a
lost host still leaves R - 2 complete local copies; with R = 2, losing a host of replica 1 falls
back to the persistent tier. Every process writes one tier, so a step due in both tiers costs
each process one device-to-host copy.

The replica axis is mesh axis 0, `data`. Orbax slices the mesh along `replica_axis_index` and
needs every slice to hold a complete copy of the state. Of our axes only `data` is pure
replication: fsdp, tensor and expert (and stage, context) shard the parameters, the optimizer
state or the activations, and mesh.rules map no parameter axis to `data` by default. It is
also MESH_AXES[0], Orbax's default index. Across slices (parallel/mesh.py) DCN is the outer part of
each axis, so with the usual multi-slice layout (mesh.dcn.data = num_slices, ICI data 1) the
replicas are exactly the TPU slices and a lost slice is restored from a healthy one; with ICI
data > 1 there are several replicas per slice, equally correct, with more local copies.

It applies (`unsupported_reason` is None) with more than one process, mesh.data >= 2, no
state leaf sharded over `data`, and no process holding devices of two replicas (Orbax gives
each process one replica). Otherwise `open_checkpointer` keeps the two plain managers.

The lifecycle (which tiers are due, the busy-persistent skip, waiting, closing, prewarming) is
lifecycle.py's, shared with the Checkpointer. Kept from the Checkpointer, around Orbax:
- Data positions, meta and config: Orbax saves only the state; sidecar.py keeps the rest per
  process, atomically, in the persistent directory (shared, it survives any host).
- Integrity: persistent steps get our manifest before Orbax commits (its post-finalization
  callback, as in checkpointer.py). Orbax's local manager takes no callback, so a local step
  gets its manifest once its commit is known: at the process's next local save (Orbax first
  waits for the previous one) or the next wait. A local step a crash left without one is
  checked for Orbax's commit marker and metadata only.
- Restore: every process vets what it holds (its local steps; process 0 the persistent ones),
  including the shape check; the reports are exchanged, and all processes pick the same step:
  the newest that one replica holds completely in its local tier, or the persistent tier
  holds, with every process's data position. Newer steps are moved aside, since Orbax refuses
  to save a step number that exists. A persistent step in our own layout (a run that had one
  replica) is read the plain way (restore.py).
- A slow persistent tier: a due persistent save whose previous one is still being written is
  skipped with a warning (all processes agree first), never waited for.

The local tier of process i is <checkpoint.local.dir>/process_<i>: on hosts with their own
disks that is one directory each; on a shared filesystem (the tests) it keeps them apart.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from orbax.checkpoint._src.multihost import multislice
from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm
from orbax.checkpoint.experimental.emergency.path import sync_global_data

from maxtrain.checkpointing import checksums, integrity, sidecar
from maxtrain.checkpointing.common import (
    abstract_like,
    host_copy,
    listed_steps,
    meta_record,
    probe_writable,
    stderr_log,
)
from maxtrain.checkpointing.data_state import adapter_for
from maxtrain.checkpointing.integrity import EMERGENCY_STATE_ITEM as EMERGENCY_ITEM
from maxtrain.checkpointing.integrity import CheckpointError, Corrupt
from maxtrain.checkpointing.lifecycle import Restored, TieredCheckpointer
from maxtrain.checkpointing.restore import check_state, read_step
from maxtrain.common.errors import cause, first_line
from maxtrain.config import CheckpointConfig

REPLICA_AXIS = 0  # mesh axis `data`; see the module docstring
PRIMARY_REPLICA = 0  # Orbax: replica 0 writes the persistent tier, the others the local one


def unsupported_reason(state: Any) -> str | None:
    """None if the emergency manager applies to this (abstract or concrete) state's layout,
    else why not."""
    if jax.process_count() == 1:
        return "a single process"
    leaves = jax.tree_util.tree_leaves_with_path(state)
    meshes = {getattr(x.sharding, "mesh", None) for _, x in leaves}
    if len(meshes) != 1 or not all(isinstance(x.sharding, NamedSharding) for _, x in leaves):
        return "the state is not laid out on one device mesh"
    mesh = meshes.pop()
    axis, replicas = mesh.axis_names[REPLICA_AXIS], mesh.devices.shape[REPLICA_AXIS]
    if replicas < 2:
        return f"mesh axis {axis!r} has {replicas} replica; it needs 2 or more"
    for path, x in leaves:
        for entry in x.sharding.spec:
            if axis in (entry if isinstance(entry, tuple) else (entry,)):
                return (
                    f"{jax.tree_util.keystr(path)} is sharded over mesh axis {axis!r}, so a "
                    "replica does not hold the whole state"
                )
    if multislice.process_spans_multiple_replicas(mesh, replica_axis_index=REPLICA_AXIS):
        return f"a process holds devices of two {axis!r} replicas"
    return None


class EmergencyCheckpointer(TieredCheckpointer):
    """Orbax's emergency manager behind TieredCheckpointer; see the module docstring.

    Every method is called by every process at the same point (they are collective).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | epath.PathLike,
        config_yaml: str = "",
        *,
        mesh: Mesh,
        prewarm: bool = True,
        log: Callable[[str], None] = stderr_log,
    ):
        super().__init__(cfg, run_dir, config_yaml, prewarm=prewarm, log=log)
        self.mesh = mesh
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.local_dir = self.dirs["local"] / f"process_{self.process}"
        self.persistent_dir = self.dirs["persistent"]
        replica = dict(replica_id=PRIMARY_REPLICA, replica_axis_index=REPLICA_AXIS)
        self.in_primary_replica = multislice.in_replica(self.process, mesh, **replica)
        self.persistent_primary = self.process == multislice.primary_process_in_replica(
            mesh, **replica
        )
        self._manager: ecm.CheckpointManager | None = None
        self._want: set[str] = set()  # the tiers the save in progress writes (should_save_fn)
        self._persistent_pending: int | None = None  # persistent primary: step being written
        self._persistent_checksums: Any = None  # checksums.start of that step's state
        self._local_unlisted: int | None = None  # newest local step saved here, no manifest yet
        self._recent: list[int] = []  # newest steps saved or restored (their sidecars stay)

    # ---- restore ------------------------------------------------------------------------------

    def _step_directories(self) -> list[epath.Path]:
        """Its local directory; process 0 also the shared persistent one."""
        return [self.local_dir] + ([self.persistent_dir] if self.process == 0 else [])

    def _restore_newest(self, abstract_state: Any, data_iterator: Any) -> Restored | None:
        """The newest step complete across the tiers and processes (every process returns the
        same): each process vets what it holds, the reports are exchanged, and all choose
        alike."""
        adapter = adapter_for(data_iterator)
        reports = sync_global_data(self._vet(abstract_state))
        errors = [r["error"] for r in reports if r["error"]]
        if errors:
            raise CheckpointError(errors[0])
        replica_of = functools.partial(
            multislice.process_replica_id, global_mesh=self.mesh, replica_axis_index=REPLICA_AXIS
        )
        step, tier, replica = choose(reports, replica_of, need_data=adapter is not None)
        unusable = [u for r in reports for u in r["steps"] if step is None or u[1] > step]
        if step is None:
            if unusable:
                raise self._no_complete_checkpoint([(s, d, why) for _, s, d, why in unusable])
            return None
        self._set_aside(unusable, step, reports[self.process])
        path = self.persistent_dir / str(step)
        if tier == "persistent" and step in reports[0]["plain"]:  # every process reads
            try:
                state, info = read_step(
                    path, step, abstract_state, data_iterator, self.log, self.config_yaml
                )
            except Corrupt as e:
                raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
        else:
            state = self._open(abstract_state).restore(step).state
            if tier == "persistent":  # a local step's manifest lists no checksums
                sums = integrity.listed_checksums(path)
                if (bad := checksums.first_mismatch(state, sums)) is not None:
                    raise CheckpointError(
                        f"cannot read checkpoint {path}: {bad!r} reads back with another "
                        "content checksum than it was saved with; move it aside to resume from "
                        "the step before"
                    )
            data_restored = adapter is not None and sidecar.restore_data(
                self.persistent_dir, step, adapter, data_iterator, self.process, self.processes
            )
            meta = sidecar.read_meta(self.persistent_dir, step)
            info = {"step": step, "data_restored": data_restored, "meta": meta}
        where = f"the local tier of replica {replica}" if tier == "local" else "the persistent tier"
        self.log(f"restored step {step} from {where}")
        self._recent = [step]
        return Restored(state, step, tier, info)

    def _vet(self, abstract_state: Any) -> dict[str, Any]:
        """What this process holds: usable steps per tier, its data positions, and problems.

        "steps" lists every step directory it found as [tier, step, dir, why-unusable], the
        reason filled in for corrupt ones; "error" is a shape mismatch (a user mistake).
        """
        data = sidecar.data_file(self.process, self.processes)
        report = {
            "process": self.process,
            "local": [],
            "persistent": [],
            "plain": [],  # persistent steps in checkpointer.py's layout (one replica wrote them)
            "data": sorted(sidecar.steps_with(self.persistent_dir, data)),
            "steps": [],
            "error": None,
        }
        tiers = [("local", self.local_dir)]
        if self.process == 0:  # shared storage: one process reads it for all
            tiers.append(("persistent", self.persistent_dir))
        for tier, directory in tiers:
            shapes_checked = False
            for step, path in listed_steps(directory):
                why = "not held by every process of a replica, or a data position is missing"
                try:
                    integrity.verify(path, require_manifest=tier == "persistent")
                    if not shapes_checked:  # the newest complete step: same model?
                        saved = integrity.read_state_shapes(path)
                        check_state(path, saved, abstract_state, self.config_yaml)
                        shapes_checked = True
                    report[tier].append(step)
                    if tier == "persistent" and integrity.state_dir(path).name != EMERGENCY_ITEM:
                        report["plain"].append(step)
                except Corrupt as e:
                    why = f"incomplete or corrupt: {e}"
                except CheckpointError as e:
                    report["error"] = str(e)
                    return report
                report["steps"].append([tier, step, str(directory), why])
        return report

    def _set_aside(self, unusable: list, step: int, mine: dict) -> None:
        """Moves this process's step directories newer than `step` aside (Orbax would refuse
        to save those step numbers again), and its unreadable copy of `step` itself (Orbax
        would try to read it); process 0 says why."""
        for _, bad_step, directory, why in unusable:
            self.log(f"checkpoint step {bad_step} in {directory} is {why}; using step {step}")
        dirs = [("local", self.local_dir)]
        if self.process == 0:
            dirs.append(("persistent", self.persistent_dir))
        aside = [
            (directory, s)
            for name, directory in dirs
            for s, _ in listed_steps(directory)
            if s > step or (s == step and s not in mine[name])
        ]
        suffix = time.strftime("%Y%m%d-%H%M%S")
        for directory, s in aside:
            try:
                integrity.quarantine(directory / str(s), suffix)
            except OSError as e:
                self.log(
                    f"could not move {directory / str(s)} aside ({first_line(e, 300, typed=True)})"
                )

    # ---- save ---------------------------------------------------------------------------------

    def _tiers_to_save(self, due: list[str]) -> list[str]:
        """Every due tier: each process writes only its replica's tier (replica 0 the
        persistent one, the others the local one), so each still makes one host copy."""
        return due

    def _persistent_busy(self) -> str | None:
        """Whether the persistent primary is still writing the previous persistent save, as
        every process learns it (only that process knows; one tiny all-gather). Never waited
        for: all processes would wait together."""
        mine = np.array([int(self._persistent_pending is not None)], np.int32)
        if not np.max(multihost_utils.process_allgather(mine)):
            return None
        return f"the previous one is still being written to {self.persistent_dir}"

    def _start_save(
        self, step: int, state: Any, data_iterator: Any, meta, tiers: list[str]
    ) -> None:
        manager = self._open(abstract_like(state))
        files = {}
        adapter = adapter_for(data_iterator)
        if adapter is not None:
            files[sidecar.data_file(self.process, self.processes)] = adapter.to_json(data_iterator)
        if self.process == 0:
            record = meta_record(step, state, "+".join(tiers), self._seed, meta)
            files[sidecar.META] = json.dumps(record)
            files[sidecar.CONFIG] = self.config_yaml
        try:
            sidecar.write(self.persistent_dir, step, files)
        except OSError as e:
            raise CheckpointError(
                f"cannot write the sidecar of step {step} to {self.persistent_dir}: "
                f"{first_line(e, 300, typed=True)}"
            ) from e
        if "persistent" in tiers:  # every process runs the checksum program (a collective)
            self._persistent_checksums = checksums.start(state)
            if self.persistent_primary:
                self._persistent_pending = step
        self._want = set(tiers)
        try:
            manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
        except Exception as e:
            raise CheckpointError(
                f"saving step {step} to the {' and '.join(tiers)} tier failed: {cause(e)}"
            ) from e
        finally:
            self._want = set()
        if "local" in tiers and not self.in_primary_replica:  # this process wrote it
            self._manifest_local()  # the previous one: Orbax waited for its commit
            self._local_unlisted = step
        if step not in self._recent:
            self._recent = (self._recent + [step])[-(self.cfg.local.keep + 1) :]
        if self.process == 0:
            self._prune_sidecars(step)

    def _prune_sidecars(self, step: int) -> None:
        """Drops the sidecars of steps no tier can still hold (retention removed them)."""
        keep = {s for s, _ in listed_steps(self.persistent_dir)} | set(self._recent)
        every = self.cfg.local.keep_every_steps
        sidecar.prune(
            self.persistent_dir, step, lambda s: s in keep or bool(every and s % every == 0)
        )

    def _open(self, abstract_state: Any) -> ecm.CheckpointManager:
        """The emergency manager, created on first use (restore of a local step, or a save)."""
        if self._manager is None:
            ocp.multihost.initialize_distributed_to_device_ids()  # Orbax requires it
            probe_writable(self.local_dir)
            probe_writable(self.persistent_dir)
            local_keep = ocp.checkpoint_managers.LatestN(self.cfg.local.keep)
            if self.cfg.local.keep_every_steps:
                local_keep = ocp.checkpoint_managers.AnyPreservationPolicy(
                    [
                        local_keep,
                        ocp.checkpoint_managers.EveryNSteps(self.cfg.local.keep_every_steps),
                    ]
                )
            options = ecm.CheckpointManagerOptions(
                local=ecm.LocalCheckpointOptions(
                    should_save_fn=lambda step, last: "local" in self._want,
                    preservation_policy=local_keep,
                ),
                persistent=ecm.PersistentCheckpointOptions(
                    should_save_fn=lambda step, last: "persistent" in self._want,
                    max_to_keep=self.cfg.persistent.keep,
                    keep_period=self.cfg.persistent.keep_every_steps,
                ),
                replica_axis_index=REPLICA_AXIS,
                cleanup_tmp_directories=True,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest),
            )
            try:
                self._manager = ecm.CheckpointManager(
                    self.local_dir,
                    self.persistent_dir,
                    global_mesh=self.mesh,
                    abstract_state=abstract_state,
                    options=options,
                )
            except Exception as e:
                raise CheckpointError(
                    f"cannot open the checkpoint directories {self.local_dir} and "
                    f"{self.persistent_dir}: {first_line(e, 300, typed=True)}"
                ) from e
        return self._manager

    def _write_manifest(self) -> None:
        """Runs in Orbax's thread on the persistent primary, after the writes, before commit."""
        step = self._persistent_pending
        if step is not None:  # None: a save Orbax chose itself (its preemption policy)
            sums = checksums.finish(self._persistent_checksums)
            integrity.write_manifest(integrity.in_flight_dir(self.persistent_dir, step), step, sums)
        self._persistent_pending = None

    # ---- waiting and errors -------------------------------------------------------------------

    def _raise_finished_errors(self) -> None:
        if self._manager is not None:
            try:
                self._manager.check_for_errors()
            except Exception as e:
                raise CheckpointError(f"a checkpoint save failed: {cause(e)}") from e

    def wait_until_finished(self) -> None:
        """Blocks until this process's saves in flight are committed."""
        if self._manager is not None:
            try:
                self._manager.wait_until_finished()
            except Exception as e:
                raise CheckpointError(
                    f"saving step {self.last_saved_step} to {self.local_dir} or "
                    f"{self.persistent_dir} failed: {cause(e)}"
                ) from e
            self._manifest_local()

    def _wait_for(self, tier: str) -> None:
        """One manager holds both tiers: waiting for one is waiting for all."""
        self.wait_until_finished()

    def _manifest_local(self) -> None:
        """Writes the manifest of this process's newest local step, now committed."""
        step, self._local_unlisted = self._local_unlisted, None
        path = self.local_dir / str(step)
        if step is not None and (path / integrity.COMMIT_FILE).exists():
            integrity.write_manifest(path, step)

    def _release(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    # ---- first-save costs ---------------------------------------------------------------------

    def _open_managers(self, state: Any) -> None:
        self._open(abstract_like(state))

    def _host_copy(self, state: Any) -> None:
        """Each process writes one tier, so one host copy in flight at a time, sliced as its
        tier's handler slices (replica 0: one replica's shards; the others: every local
        shard)."""
        replica_id = 0 if self.in_primary_replica else None
        host_copy(state, copies=1, replica_id=replica_id, use_replica_parallel=False)


def choose(
    reports: list[dict], replica_of: Callable[[int], int], need_data: bool
) -> tuple[int | None, str | None, int | None]:
    """(step, tier, replica) to restore, from every process's report (EmergencyCheckpointer._vet;
    reports[0] is process 0's, the only one that reads the persistent tier). Every process
    computes it from the same reports, so all agree.

    A local step counts when every process of one replica holds it; a persistent one when
    process 0 found it complete. need_data: a step also needs every process's data position
    in the sidecar, except persistent steps in checkpointer.py's layout, which hold their own.
    The newest wins; on a tie the local tier (no read from shared storage).
    """
    held: dict[int, set[int]] = {}  # replica -> local steps all its processes hold
    for r in reports:
        replica, steps = replica_of(r["process"]), set(r["local"])
        held[replica] = held[replica] & steps if replica in held else steps
    plain = set(reports[0]["plain"])
    usable = (set(reports[0]["persistent"]) - plain).union(*held.values())
    if need_data:
        usable = usable.intersection(*(r["data"] for r in reports))
    usable |= plain
    if not usable:
        return None, None, None
    step = max(usable)
    replica = next((k for k, steps in sorted(held.items()) if step in steps), None)
    return step, ("persistent" if replica is None else "local"), replica
