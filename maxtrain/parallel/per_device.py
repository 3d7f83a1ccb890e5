"""Attention kernels XLA cannot partition, run per device on a mesh.

A Pallas kernel is a custom call that XLA's partitioner cannot split: on a mesh, such a kernel
runs inside `shard_map`, each device on its own rows and heads, over the mesh axes the batch
and heads are split on (mesh.rules). The plain-XLA reference is plain jnp and is partitioned
like any other op; a sequence split over `context` goes through parallel/context.py instead.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.parallel.mesh import active_rules, logical_to_spec, spec_axes

type AttentionFn = Callable[..., jax.Array]  # (q, k, v, segment_ids, sinks=None) -> output


def per_device(kernel: AttentionFn) -> AttentionFn:
    """The kernel run per device inside `shard_map` when traced for a mesh (mesh.sharding_rules
    active), else called as it is.

    Every mesh axis is manual: the batch is split as `batch` says, query heads as `heads`, key
    and value heads as `kv_heads`; the sequence is whole on each device, and so is head_dim.
    An axis that splits none of them (e.g. `tensor` over a model whose heads it does not
    divide) leaves each of its devices computing the same attention.

    Where the query heads are split and the key/value heads are not split alike (fewer K/V
    heads than the tensor degree: 8 of them over 16 devices), each device takes the K/V heads
    its own query heads use (`_own_kv_heads`).

    The gradient flows through shard_map's transpose: a K/V head several devices read gets the
    sum of their contributions (shard_map sums the cotangent of an input over the axes its spec
    does not split).
    """

    def fn(q, k, v, segment_ids, sinks=None):
        active = active_rules()
        if active is None:
            return kernel(q, k, v, segment_ids, sinks)
        mesh, rules = active
        q_spec = logical_to_spec(("batch", None, "heads", None), rules, mesh, q.shape)
        kv_spec = logical_to_spec(("batch", None, "kv_heads", None), rules, mesh, k.shape)
        head_axes = spec_axes(q_spec[2])
        split_alike = spec_axes(kv_spec[2]) == head_axes
        if not split_alike:  # K/V heads whole on every device; each takes its own below
            kv_spec = P(kv_spec[0], None, None, None)
        groups = q.shape[2] // k.shape[2]  # G: query heads per K/V head

        def local(q, k, v, segment_ids, sinks):
            if not split_alike:
                k, v = _own_kv_heads(k, v, q.shape[2], groups, head_axes)
            return kernel(q, k, v, segment_ids, sinks)

        rows, heads = P(q_spec[0], None), None if sinks is None else P(q_spec[2])
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, rows, heads),
            out_specs=P(*q_spec[:3], None),
            # Pallas calls carry no varying-axes types; the transpose's sums above are what
            # check_vma=False does (jax's shard_map transpose).
            check_vma=False,
        )(q, k, v, segment_ids, sinks)

    return fn


def _own_kv_heads(k, v, n_local: int, groups: int, head_axes) -> tuple[jax.Array, jax.Array]:
    """Of whole K/V heads, those this device's `n_local` query heads read: query head n reads
    K/V head n // G. If its query heads are whole groups (a multiple of G), those are their
    groups' K/V heads; otherwise one K/V head per query head (the kernel then runs as
    multi-head attention, exact either way)."""
    first = jax.lax.axis_index(head_axes) * n_local  # global index of my first head
    if n_local % groups == 0:
        heads = first // groups + jnp.arange(n_local // groups)
    else:
        heads = (first + jnp.arange(n_local)) // groups
    return jnp.take(k, heads, axis=2), jnp.take(v, heads, axis=2)
