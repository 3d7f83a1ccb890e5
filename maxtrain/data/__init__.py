"""Input pipelines: each yields this host's rows of the global batch as numpy arrays.

`to_global` assembles the hosts' rows into one global jax.Array per key, sharded over the
batch axes of the mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxtrain.config import Config, ConfigError
from maxtrain.parallel.mesh import build_mesh, logical_to_spec

BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


def batch_sharding(mesh: Mesh, rules: dict[str, list[str]]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules, mesh))


def host_rows(cfg: Config) -> range:
    """The rows of the global batch this process loads: those its devices hold under the run's
    batch sharding. Usually an equal share per process; every row when the batch is replicated
    across processes (pipeline stages on different hosts each need the whole batch)."""
    shape = (cfg.train.global_batch_size, cfg.train.seq_len)
    mesh = build_mesh(cfg.mesh)
    # With the shape, a batch the mesh does not divide is replicated rather than refused: the
    # data tools read batches too small for the devices (training checks the batch itself).
    sharding = NamedSharding(
        mesh, logical_to_spec(("batch", "length"), cfg.mesh.rules, mesh, shape)
    )
    held = sharding.addressable_devices_indices_map(shape)
    global_batch = shape[0]
    rows = sorted({r for index in held.values() for r in range(global_batch)[index[0]]})
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ConfigError(
            f"process {jax.process_index()}'s devices hold rows {rows} of the batch, not one "
            "contiguous range; put the process-spanning mesh axes first in mesh.rules.batch"
        )
    return range(rows[0], rows[-1] + 1)


def to_global(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
