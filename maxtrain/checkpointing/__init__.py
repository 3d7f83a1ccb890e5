"""Checkpoints: two asynchronous Orbax tiers, exact resume, corruption and mistake detection.

Why two tiers: a preemptible run wants frequent checkpoints on fast storage it may lose (the
local tier: local disk or RAM disk, e.g. every 50 steps, keep 2) and rare ones on storage that
survives the machine (the persistent tier: any path Orbax/etils writes, e.g. a bucket, every
500 steps, keep N, plus milestones every keep_every_steps). Resume takes the newest complete
checkpoint of either tier, so the tiers need no coordination beyond one restore policy.

    ckpt = open_checkpointer(cfg.checkpoint, cfg.run_dir, to_yaml(cfg), state)
    restored = ckpt.restore_latest(abstract_like(state), data_iterator)  # (state, step) or None
    ckpt.maybe_save(step, state, data_iterator)       # async: returns after the host copy
    ckpt.save_now(step, state, data_iterator, tier="local", wait=True)  # SIGTERM: durable
    ckpt.close()
    params = load_parameters(path, abstract_params)   # checkpoint.load_parameters_path
    config_yaml = read_saved_config(step_dir)         # which model a step holds

That interface and its lifecycle (which tiers are due, skipping a busy persistent tier, waiting,
closing, prewarming) are TieredCheckpointer's (lifecycle.py). Two strategies implement the
Orbax side, picked by open_checkpointer:

- Checkpointer (checkpointer.py): one Orbax CheckpointManager per tier. One process with any
  number of devices, and multi-process runs with a single data-parallel replica (every process
  writes its shards to both tiers; a lost host loses its part of the local tier).
- EmergencyCheckpointer (emergency.py): Orbax's emergency multi-tier manager, for
  multi-process runs with >= 2 data-parallel replicas (mesh axis `data`): the local tier is
  kept per replica and a lost host's part is restored from a peer replica. Its persistent
  layout differs (the state item is `default`, the rest is in a sidecar); both
  implementations, load_parameters and read_saved_config read both layouts (restore.py).

On disk, per tier directory (Checkpointer):

    <tier_dir>/<step>/                       one checkpoint
        state/                               TrainState {step, params, opt_state}: Orbax
                                             StandardSave (OCDBT + zarr, zstd-compressed)
        data/                                data iterator position (grain: one JSON per process)
        config/metadata                      {"yaml": the resolved config}
        meta/metadata                        {step, tier, seed, params_fingerprint, time, extras}
        maxtrain_manifest.json               {"files": {relative path: bytes}} (integrity.py)
        _CHECKPOINT_METADATA, commit_success.txt   Orbax's, written at commit
    <tier_dir>/<step>.orbax-checkpoint-tmp/  a save in flight, or one a crash interrupted
                                             (ignored; Orbax deletes it when the tier reopens)
    <tier_dir>/<step>.corrupt-<time>/        a step found corrupt at resume, moved aside

EmergencyCheckpointer: <local_dir>/process_<i>/<step>/{state,process_metadata}/ on the
processes of replicas 1.., <persistent_dir>/<step>/default/ (replica 0) and
<persistent_dir>/sidecar/<step>/ (sidecar.py).

Restoring onto another mesh or device count reshards on read (Orbax reads into the abstract
state's shardings).
"""

from typing import Any

import jax
from etils import epath

from maxtrain.checkpointing.checkpointer import Checkpointer, load_parameters
from maxtrain.checkpointing.common import abstract_like, stderr_log
from maxtrain.checkpointing.emergency import EmergencyCheckpointer, unsupported_reason
from maxtrain.checkpointing.integrity import CheckpointError
from maxtrain.checkpointing.lifecycle import TieredCheckpointer
from maxtrain.checkpointing.restore import read_saved_config
from maxtrain.config import CheckpointConfig

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "EmergencyCheckpointer",
    "TieredCheckpointer",
    "abstract_like",
    "load_parameters",
    "open_checkpointer",
    "read_saved_config",
]


def open_checkpointer(
    cfg: CheckpointConfig, run_dir: str | epath.PathLike, config_yaml: str, state: Any
) -> TieredCheckpointer:
    """The emergency checkpointer where Orbax's emergency manager applies to this run (state:
    the train state, concrete or abstract, laid out on the run's mesh), else the Checkpointer.
    A multi-process run that falls back says why on stderr."""
    reason = unsupported_reason(state)
    if reason is None:
        mesh = jax.tree.leaves(state)[0].sharding.mesh
        return EmergencyCheckpointer(cfg, run_dir, config_yaml, mesh=mesh)
    if jax.process_count() > 1:
        stderr_log(
            f"Orbax's emergency multi-tier manager does not apply ({reason}); using one manager "
            "per tier, so a lost host loses its part of the local tier"
        )
    return Checkpointer(cfg, run_dir, config_yaml)
