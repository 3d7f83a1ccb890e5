"""Checkpoints: two asynchronous Orbax tiers, exact resume, corruption and mistake detection.

Why two tiers: a preemptible run wants frequent checkpoints on fast storage it may lose (the
local tier: local disk or RAM disk, e.g. every 50 steps, keep 2) and rare ones on storage that
survives the machine (the persistent tier: any path Orbax/etils writes, e.g. a bucket, every
500 steps, keep N, plus milestones every keep_every_steps). Resume takes the newest complete
checkpoint of either tier, so the tiers need no coordination beyond one restore policy.

    ckpt = Checkpointer(cfg.checkpoint, run_dir=cfg.run_dir, config_yaml=to_yaml(cfg))
    restored = ckpt.restore_latest(abstract_state, data_iterator)  # (state, step) or None
    ckpt.maybe_save(step, state, data_iterator)       # async: returns after the host copy
    ckpt.save_now(step, state, data_iterator, tier="local", wait=True)  # SIGTERM: durable
    ckpt.close()
    params = load_parameters(path, abstract_params)   # checkpoint.load_parameters_path

On disk, per tier directory:

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

Supported: one process with any number of devices (CPU, one GPU, one TPU host); restoring onto
another mesh or device count (Orbax reshards to the abstract state's shardings).

Multi-process (jax.process_count() > 1): the two managers work (Orbax coordinates the hosts and
each process writes its shards; grain iterator state is per process), but the local tier is
then only as durable as every host's local disk, and a lost host loses its shards of it. The
right tool there is Orbax's emergency manager,
`orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager`: it keeps the
local tier per data-parallel replica and restores a lost host's shards from a peer replica (it
needs >= 2 data-parallel replicas along mesh axis 0, `multihost.
initialize_distributed_to_device_ids()` after `jax.distributed.initialize`, and absl flags
marked parsed). It is NOT wired in here yet; multi-process runs are untested with this module.
"""

from maxtrain.checkpointing.checkpointer import Checkpointer, load_parameters
from maxtrain.checkpointing.integrity import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "load_parameters"]
