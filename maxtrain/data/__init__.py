"""Input pipelines: each yields this host's rows of the global batch as numpy arrays.

`to_global` assembles the hosts' rows into one global jax.Array per key, sharded over the
batch axes of the mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxtrain.mesh import logical_to_spec

BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


def batch_sharding(mesh: Mesh, rules: dict[str, list[str]]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules, mesh))


def host_rows(global_batch: int) -> range:
    """The rows of the global batch this process loads."""
    per_host = global_batch // jax.process_count()
    start = jax.process_index() * per_host
    return range(start, start + per_host)


def to_global(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
