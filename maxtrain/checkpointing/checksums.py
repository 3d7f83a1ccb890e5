"""A content checksum per array of the train state: written with each save, checked on restore.

The manifest (integrity.py) catches files that are missing or of the wrong length; it cannot
see a flipped bit. A flipped bit in an optimizer moment restores silently and surfaces steps
later as a non-finite loss, with the corrupt step still taken for the newest good one. So each
save also records, per leaf, a 32-bit checksum of the leaf's bytes, and a restore recomputes it
from what it read and treats a difference like any other corrupt step.

The checksum is computed where the array lives, by one jitted program over the state: the sum
over elements of (the element's bits) * (2 * flat index + 1), modulo 2**32. A single flipped
bit b of element i changes it by 2**b * (2i + 1), never 0 modulo 2**32 (an odd factor times a
power of two below 2**32), so every single-bit error is caught; swapped elements change it too.
Being a reduction of a global array, it is the same number whatever the mesh, the sharding or
the process count, so a step saved on one layout is checked on another.

Cost: the save dispatches the program and goes on (jax runs it asynchronously); the Orbax
background thread that writes the manifest fetches the numbers (one uint32 per leaf). So a
step pays one read of the state in device memory, not a host round trip.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtrain.checkpointing.integrity import leaf_path


def _bits_as_uint32(x: jax.Array) -> jax.Array:
    """The array's raw bits as uint32 elements (narrower types widened, wider ones split)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jax.dtypes.itemsize_bits(x.dtype) < 8:  # int4 and the like: widened, value for value
        wide = jnp.int8 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32
        x = x.astype(wide)
    itemsize = np.dtype(x.dtype).itemsize
    if itemsize >= 4:
        return lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing axis of 2
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * itemsize}")).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """sum(bits * (2 * flat index + 1)) mod 2**32. The flat index is built from one iota per
    axis rather than by flattening: a flattened sharded array would be gathered, where this
    stays a per-shard reduction plus one all-reduce of a scalar."""
    bits = _bits_as_uint32(x)
    index = jnp.zeros((), jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _checksums(leaves: list[jax.Array]) -> list[jax.Array]:
    """One program for the whole state, leaf after leaf: each leaf waits (an optimization
    barrier) for the previous leaf's sum, so XLA:CPU, which keeps a leaf-sized temporary,
    holds one at a time rather than all at once (2x the state's memory, measured)."""
    sums, previous = [], jnp.zeros((), jnp.uint32)
    for leaf in leaves:
        leaf, _ = lax.optimization_barrier((leaf, previous))
        previous = _leaf_checksum(leaf)
        sums.append(previous)
    return sums


def paths(tree: Any) -> list[str]:
    """Leaf paths as the manifest names them ('params/layers/attn/q/kernel')."""
    return [leaf_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def start(state: Any) -> tuple[list[str], list[jax.Array]]:
    """Dispatches the checksum program on the state; returns at once (finish fetches)."""
    return paths(state), _checksums(jax.tree.leaves(state))


def finish(pending: tuple[list[str], list[jax.Array]]) -> dict[str, int]:
    """{leaf path: checksum} once the program has run (blocks until then)."""
    names, values = pending
    return {name: int(v) for name, v in zip(names, jax.device_get(values), strict=True)}


def of(state: Any) -> dict[str, int]:
    """{leaf path: checksum} of a state, computed now."""
    return finish(start(state))


def first_mismatch(state: Any, expected: dict[str, int]) -> str | None:
    """The path of the first leaf whose checksum differs from `expected` (None: all agree).
    Leaves absent from `expected` are not checked: it may list only some (older checkpoints
    list none)."""
    for name, value in of(state).items():
        if name in expected and expected[name] != value:
            return name
    return None
