"""jax.lax.ragged_all_to_all's documented semantics, built from dense collectives for CPU.

XLA:CPU does not implement the op ("HLO opcode ragged-all-to-all is not supported"), so the
ragged expert-parallel exchange (maxtrain/parallel/expert_exchanges.py) is tested on CPU with
this in its place: the offsets and sizes it computes are then checked against what the op is
documented to do. Each slice travels padded to the operand's whole length, P times the traffic:
an oracle for tests, never a dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def emulated_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name,
) -> jax.Array:
    """Slice i of `operand` (input_offsets[i], send_sizes[i] rows) goes to peer i // S, where it
    is written at output_offsets[i]; a receiver writes recv_sizes[j] rows of the slice j it gets
    from peer j // S, at the offset that peer chose. S = len(input_offsets) / peers."""
    peers = jax.lax.psum(1, axis_name)
    slices = input_offsets.shape[0]
    per_peer = slices // peers
    rows = jnp.arange(operand.shape[0])
    take = input_offsets[:, None] + rows[None, :]  # [K, N] rows of each slice, padded
    valid = rows[None, :] < send_sizes[:, None]
    sent = jnp.where(
        valid.reshape(*valid.shape, *(1,) * (operand.ndim - 1)),
        operand[jnp.clip(take, 0, operand.shape[0] - 1)],
        0,
    )  # [K, N, ...]
    blocks = sent.reshape(peers, per_peer, *sent.shape[1:])
    received = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True).reshape(sent.shape)
    their_offsets = jax.lax.all_to_all(
        output_offsets.reshape(peers, per_peer), axis_name, 0, 0, tiled=True
    ).reshape(slices)
    target = their_offsets[:, None] + rows[None, :]
    target = jnp.where(rows[None, :] < recv_sizes[:, None], target, output.shape[0])  # unused
    flat = received.reshape(slices * operand.shape[0], *operand.shape[1:])
    return output.at[target.reshape(-1)].set(flat, mode="drop")
