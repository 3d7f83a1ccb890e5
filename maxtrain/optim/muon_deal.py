"""Muon's matrices dealt out over the devices that share them, each orthogonalised once.

A stacked parameter ([layers, in, out], [layers, experts, in, out], stage axes in front) whose
matrices are split over mesh axes (fsdp on `embed`, tensor on `mlp` or `heads`) is shared by
G devices, the product of those axes: each holds a 1/G piece of every one of its K matrices
(K: this device's part of the stacked axes; experts split over `expert` and layers over
`stage` stay where they are). Orthogonalising needs whole matrices. Gathering every matrix
whole on each of the G devices, as maxtrain did before, costs G times the compute (every device
runs every matrix's iterations) and a whole stacked parameter of scratch per device: 18 GiB for
llama3-8b on 256 devices.

Here, under shard_map, each device splits its K pieces into G equal chunks (K padded with zero
matrices to a multiple of G), and one all-to-all over the G devices hands chunk g to device g:
each receives K/G matrices, whole, assembled from the G pieces. It runs Newton-Schulz on those
alone and the reverse all-to-all returns every piece to its shard. Per device and step that is
one block of the parameter out and one back (bytes as the shard), K/G matrices of scratch, and
1/G of the iterations. The other way (all-gather the matrices, orthogonalise a share, then a
reduce-scatter of zero-filled updates) moves G times the bytes and holds the stacked parameter
whole: docs/optimizers.md quotes both from the compiled program.

Balance: the matrices of one parameter have one shape, so one cost (m * n * min(m, n)); each
device gets ceil(K/G) of them, the padding is the imbalance (`Deal.padding`; none when G
divides K). Parameters are dealt one by one: those of different shapes are not mixed, so a
device's total work is the sum over parameters of ceil(K/G) matrices each.

Devices that hold the same piece (an axis the parameter is replicated over, `data`) deal the
same way and compute the same matrices, as every optimizer's update is repeated on replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from maxtrain.parallel.mesh import spec_axes


@dataclass(frozen=True)
class Deal:
    """How one stacked parameter's matrices are dealt. `groups`: each matrix dimension's split
    over devices (1 where whole); `matrices`: K, this device's part of the stacked axes;
    `per_device`: the matrices each device orthogonalises, ceil(K / G)."""

    groups: tuple[int, ...]
    matrices: int
    per_device: int

    @property
    def degree(self) -> int:
        return math.prod(self.groups)

    @property
    def padding(self) -> int:
        """Zero matrices added so that every device gets the same number."""
        return self.per_device * self.degree - self.matrices


def plan(shape: tuple[int, ...], shard: tuple[int, ...], n_matrix: int) -> Deal:
    """The deal of a parameter of this global shape of which one device holds `shard`, its
    trailing n_matrix dims the matrix (muon.matrix_dims' in + out axes)."""
    stacked = len(shape) - n_matrix
    groups = tuple(d // s for d, s in zip(shape[stacked:], shard[stacked:], strict=True))
    matrices = math.prod(shard[:stacked])
    return Deal(groups, matrices, -(-matrices // math.prod(groups)))


def dealt(
    u: jax.Array,
    n_matrix: int,
    sharding: NamedSharding,
    orthogonalize: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """orthogonalize (on whole matrices, any leading axes a batch) applied to every matrix of u,
    each on one of the devices that share it (the module docstring). u is laid out as
    `sharding` says."""
    mesh, spec = sharding.mesh, sharding.spec
    deal = plan(u.shape, sharding.shard_shape(u.shape), n_matrix)
    if deal.degree == 1:  # whole matrices on every device: nothing to deal
        return orthogonalize(u)
    # The devices sharing a matrix, in the order its dims' pieces are laid out (_assemble).
    parts = (*spec, *(None,) * u.ndim)[u.ndim - n_matrix : u.ndim]
    axes = tuple(a for p in parts for a in spec_axes(p) if mesh.shape[a] > 1)

    def local(block: jax.Array) -> jax.Array:
        matrix = block.shape[-n_matrix:]  # this device's piece of each matrix
        x = block.reshape(deal.matrices, *matrix)
        x = jnp.pad(x, [(0, deal.padding)] + [(0, 0)] * n_matrix)
        # [G, K/G, *piece]: chunk g to device g; back, axis 0 is the sender.
        x = x.reshape(deal.degree, deal.per_device, *matrix)
        x = _assemble(jax.lax.all_to_all(x, axes, 0, 0, tiled=True), deal.groups)
        x = _split(orthogonalize(x), deal.groups)
        x = jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
        x = x.reshape(deal.per_device * deal.degree, *matrix)[: deal.matrices]
        return x.reshape(block.shape)

    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(u)


def _assemble(pieces: jax.Array, groups: tuple[int, ...]) -> jax.Array:
    """[G, k, *piece] with G in the order of the matrix dims' mesh axes (the first dim's
    axes major) -> [k, *whole]: each matrix dim's pieces put side by side."""
    r = len(groups)
    k, piece = pieces.shape[1], pieces.shape[2:]
    x = pieces.reshape(*groups, k, *piece)
    # [g_1..g_r, k, l_1..l_r] -> [k, g_1, l_1, ..., g_r, l_r]
    x = x.transpose(r, *[i for d in range(r) for i in (d, r + 1 + d)])
    return x.reshape(k, *[g * n for g, n in zip(groups, piece, strict=True)])


def _split(whole: jax.Array, groups: tuple[int, ...]) -> jax.Array:
    """The inverse of _assemble: [k, *whole] -> [G, k, *piece]."""
    r = len(groups)
    k = whole.shape[0]
    piece = [n // g for n, g in zip(whole.shape[1:], groups, strict=True)]
    x = whole.reshape(k, *[i for g, n in zip(groups, piece, strict=True) for i in (g, n)])
    # [k, g_1, l_1, ..., g_r, l_r] -> [g_1..g_r, k, l_1..l_r]
    x = x.transpose(*[1 + 2 * d for d in range(r)], 0, *[2 + 2 * d for d in range(r)])
    return x.reshape(math.prod(groups), k, *piece)
