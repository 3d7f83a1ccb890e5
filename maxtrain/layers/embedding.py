"""Token embedding lookup whose gradient is computed where the table's shard lives.

The lookup reads a table gathered whole, like every FSDP weight (rows looked up in a sharded
table make XLA reshard the activations instead: a full rematerialisation when the batch is
split over several mesh axes). Left to autodiff, the gradient of that gather is a scatter-add
into a whole [V, D] table on every device, summed over the data-parallel devices by an
all-reduce of the whole table: for Llama 3's 128256 x 2048 float32 table, 1 GiB written and
1 GiB reduced per device and step, though each device keeps only 1/fsdp of it.

The backward here moves the tokens' cotangents instead: [B, T, D] re-split from the batch to
the table's `embed` axis (an all-to-all of one device's activations), then each device adds
every token's cotangent into its own [V, D / fsdp] shard. Nothing table-sized is communicated,
and the sum runs in float32 whatever the compute dtype (thousands of tokens may hit one row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.mesh import constrain


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """table [V, D] (the parameter as stored), tokens [B, T] int -> [B, T, D] in dtype."""
    whole = constrain(table.astype(dtype), (None, None))
    return constrain(jnp.take(whole, tokens, axis=0), ("batch", "length", "act_embed"))


def _lookup_forward(table, tokens, dtype):
    return lookup(table, tokens, dtype), (table, tokens)


def _lookup_backward(dtype, residuals, cotangent):
    table, tokens = residuals
    # Every token's row, each device holding the table's columns it keeps ([B, T, D / fsdp]).
    cotangent = constrain(cotangent, (None, None, "embed"))
    tokens = constrain(tokens, (None, None))
    grad = constrain(jnp.zeros(table.shape, jnp.float32), ("vocab", "embed"))
    grad = grad.at[tokens].add(cotangent.astype(jnp.float32))
    return constrain(grad, ("vocab", "embed")).astype(table.dtype), None


lookup.defvjp(_lookup_forward, _lookup_backward)
