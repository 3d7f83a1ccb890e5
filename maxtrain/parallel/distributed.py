"""Joining a multi-process run: `jax.distributed`, initialised before anything touches devices.

A multi-host run is one process per TPU host or GPU node (several per machine in the tests).
Each must join the others before jax creates its backend: a process that has not sees only its
own devices and would train alone. `train.run` therefore calls `initialize(cfg.distributed)`
first, before the mesh, the data or the checkpoints.

- Any of `distributed.coordinator_address`, `num_processes`, `process_id` set: they are passed
  to `jax.distributed.initialize`, which fills the others from the cluster environment.
- All null: if jax recognises a cluster (Cloud TPU, SLURM, Open MPI, Kubernetes) it is
  initialised from it, as `jax.distributed.initialize()` would be; otherwise the run is one
  process and nothing is done. Asking jax first, instead of calling initialize() and treating
  its failure as "single process", keeps a broken cluster environment an error: on a cluster,
  silently training alone on every host would be the worst outcome.
- `num_processes: 1` needs no coordinator and is a single-process run.

Settings jax rejects (e.g. no coordinator address and no cluster to take one from) surface as
one ConfigError line. A process that cannot reach the others within initialization_timeout_s
(a wrong address, a process that never started) is ended by jax itself: its C++ client aborts
with DEADLINE_EXCEEDED, which Python cannot catch. The timeout bounds that wait; it never hangs.
"""

from __future__ import annotations

import jax

from maxtrain.common.errors import first_line
from maxtrain.config import ConfigError, DistributedConfig


def detected_cluster() -> str | None:
    """The cluster environment jax would initialise from when given no arguments, or None.

    jax has no public query for this; its ClusterEnv registry is what initialize() consults.
    """
    from jax._src.clusters import ClusterEnv

    for env in ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.__name__
    return None


def initialize(cfg: DistributedConfig) -> None:
    """Joins the run described by cfg (see the module docstring); a no-op for one process."""
    if jax.distributed.is_initialized():  # a launcher or test harness already joined
        return
    given = {
        "coordinator_address": cfg.coordinator_address,
        "num_processes": cfg.num_processes,
        "process_id": cfg.process_id,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if cfg.num_processes == 1 or (not given and detected_cluster() is None):
        return
    try:
        jax.distributed.initialize(
            **given,
            initialization_timeout=cfg.initialization_timeout_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        )
    except ValueError as e:
        settings = ", ".join(f"{k}={v}" for k, v in given.items()) or "auto-detected"
        raise ConfigError(
            f"could not join the distributed run ({settings}, initialization_timeout_s="
            f"{cfg.initialization_timeout_s}): {first_line(e, 300)}"
        ) from None
