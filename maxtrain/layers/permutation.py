"""Rows moved into another order and back by gathers only, forward and backward.

An MoE layer moves its rows twice a pass: each token's k copies into expert order (and into an
exchange's buffers), and the experts' outputs back to their tokens. Written as indexing, both
are gathers, but autodiff transposes a gather into a scatter-add of the rows: a pass of
read-modify-writes over [rows, D], slow on GPUs (two of them were a seventh of the MoE step's
kernel time on H100: recipes/h100/README.md). A permutation is invertible, so the backward of
moving rows by it is moving the gradients back by its inverse: another gather, plus a sum over
the k copies of a token. `Permutation` carries both directions, `take` is the gather whose
backward is the gather by the inverse (jax.custom_vjp).

Partial permutations are allowed, as buffers need them: an output row no source fills comes
out zero, a source no output row holds gets zero gradient. "None" is any index at or past the
end of what it points into (never a negative one: jax wraps those).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Permutation(NamedTuple):
    """A one-to-one map between source slots and output rows, both ways (integers).

    index [m]    the source slot of each output row (>= the number of slots: none)
    inverse [s]  the output row of each source slot (>= m: none)

    A source slot is a copy of a source row: with `copies` c, slot j is copy j % c of row
    j // c (an MoE token's k assignments are its k slots)."""

    index: jax.Array
    inverse: jax.Array

    @classmethod
    def to(cls, destinations: jax.Array, rows: int) -> Permutation:
        """The permutation sending slot j to output row destinations[j] of `rows` (>= rows:
        nowhere); destinations must not repeat below `rows`. Its index is an integer scatter
        of [slots] positions: no rows move."""
        slots = destinations.shape[0]
        index = jnp.full((rows,), slots, jnp.int32)
        index = index.at[destinations].set(jnp.arange(slots, dtype=jnp.int32), mode="drop")
        return cls(index, destinations.astype(jnp.int32))

    def inverted(self) -> Permutation:
        """The permutation taking the output rows back to their slots."""
        return Permutation(self.inverse, self.index)

    def take(self, x: jax.Array, copies: int = 1) -> jax.Array:
        """x [n, ...] -> [m, ...]: output row i is x[index[i] // copies] (zero where none);
        its backward sums, for each source row, the gradients of its copies' output rows,
        gathered by `inverse`."""
        return _take_rows(x, self.index, self.inverse, copies)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array, copies: int) -> jax.Array:
    return _gather(x, index // copies)


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """x's rows at index, zero for an index at or past x's end."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_forward(x, index, inverse, copies):
    return _take_rows(x, index, inverse, copies), (index, inverse)


def _take_rows_backward(copies, saved, grad):
    index, inverse = saved
    per_slot = _gather(grad, inverse)  # [n * copies, ...]
    per_row = per_slot.reshape(-1, copies, *per_slot.shape[1:]).sum(axis=1)
    return per_row, None, None


_take_rows.defvjp(_take_rows_forward, _take_rows_backward)
