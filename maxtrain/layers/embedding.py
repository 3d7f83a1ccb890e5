"""Token embedding lookup whose gradient is computed where the table's shard lives.

The lookup reads a table gathered whole, like every FSDP weight (rows looked up in a sharded
table make XLA reshard the activations instead: a full rematerialisation when the batch is
split over several mesh axes). Left to autodiff, the gradient of that gather is a scatter-add
into a whole [V, D] table on every device, summed over the data-parallel devices by an
all-reduce of the whole table: for Llama 3's 128256 x 2048 float32 table, 1 GiB written and
1 GiB reduced per device and step, though each device keeps only 1/fsdp of it.

The backward here moves the tokens' cotangents instead: [B, T, D] re-split from the batch's
FSDP axes to the table's `embed` axes (an all-to-all of one device's activations), then each
device adds its tokens' cotangents into its own [V, D / fsdp] shard. Nothing table-sized
crosses FSDP's devices (over pure data-parallel axes, where the table is replicated, its
gradient is summed like any replicated parameter's), and the sum runs in float32 whatever the
compute dtype (thousands of tokens may hit one row).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from maxtrain.parallel.mesh import active_rules, constrain, sharding_rules


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """table [V, D] (the parameter as stored), tokens [B, T] int -> [B, T, D] in dtype."""
    whole = constrain(table.astype(dtype), (None, None))
    return constrain(jnp.take(whole, tokens, axis=0), ("batch", "length", "act_embed"))


def _lookup_forward(table, tokens, dtype):
    return lookup(table, tokens, dtype), (table, tokens)


def _lookup_backward(dtype, residuals, cotangent):
    table, tokens = residuals
    with _split_like_the_table():
        # Each device: the tokens of its data-parallel share, with the table's columns it keeps.
        cotangent = constrain(cotangent, ("batch", "length", "embed"))
        tokens = constrain(tokens, ("batch", "length"))
    grad = constrain(jnp.zeros(table.shape, jnp.float32), ("vocab", "embed"))
    grad = grad.at[tokens].add(cotangent.astype(jnp.float32))
    return constrain(grad, ("vocab", "embed")).astype(table.dtype), None


def _split_like_the_table():
    """The active sharding rules with the table's `embed` axes taken off the batch and length:
    the cotangent moves from those axes to the columns, and stays split over the rest (data,
    context), over which the table is replicated and its gradient is summed as any replicated
    parameter's is."""
    active = active_rules()
    if active is None:
        return contextlib.nullcontext()
    mesh, rules = active
    columns = set(rules.get("embed", []))
    rest = lambda name: [a for a in rules.get(name, []) if a not in columns]  # noqa: E731
    return sharding_rules(mesh, {**rules, "batch": rest("batch"), "length": rest("length")})


lookup.defvjp(_lookup_forward, _lookup_backward)
