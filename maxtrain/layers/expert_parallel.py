"""Expert parallelism: each device's routed rows travel to the devices holding their experts.

The experts are split over P devices (mesh axes `mesh.rules.exp`), EL = E / P on each, and the
tokens are split over the same devices. Each device routes its n tokens to k experts: R = n * k
rows, sorted by expert, of which each row must reach the device owning its expert, run through
that expert, and come back. Static shapes are the difficulty: how many rows a device sends to
each peer, and receives from all of them, is known only at run time. A buffer for the worst
case (every row bound for one device) is P times the rows the routing fills, and so is the
traffic of an all-to-all of it: what maxtrain did before, 8x the routed volume at P = 8.

Three exchanges, each with buffers of at most `moe.ep_capacity_factor` (f) times the routed rows.
Rows that do not fit are dropped (their expert contributes nothing; the residual stream carries
the token on), counted and reported as `moe/dropped`; f >= P never drops (worst-case buffers).

  all_to_all  every device sends each peer a block of Q = ceil(f * R / P) rows. Moves f x R
              rows each way, on any backend (the CPU default). Drops a row when its device sends
              one peer more than Q: a pair's imbalance, the strictest of the three.
  ragged      `jax.lax.ragged_all_to_all` sends each peer exactly its rows, and they arrive
              grouped by expert, so the receiver runs its grouped matmul without re-sorting.
              Sends R rows, receives into a buffer of ceil(f * R); drops only what overflows a
              device's whole share (device imbalance). GPU and TPU only: XLA:CPU does not
              implement the op (the GPU/TPU default; see below).
  all_gather  every device gathers all P * n tokens, runs its experts on the rows routed to
              them (at most ceil(f * R)) and the outputs return by reduce-scatter. Moves P / k
              times the routed rows, so it pays when k >= P (Kanana-MoE: k = 8, P = 8), and
              keeps the same rows as `ragged` when it must drop.

Which is fastest depends on the interconnect and the routing. The defaults are those whose cost
is bounded whatever k and P: `ragged` on GPU/TPU (the routed rows exactly), `all_to_all` on CPU
(f times them). The ragged exchange has not yet run on a GPU or TPU here: its index arithmetic
is tested on CPU against an emulation of the op's documented semantics (tests/test_moe_dispatch),
and the op's transpose (the backward pass) is jax's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from maxtrain.config import MoeConfig
from maxtrain.kernels.grouped_matmul import GroupedMatmul
from maxtrain.layers.moe_dispatch import (
    Dispatch,
    ExpertBlocks,
    ExpertWeights,
    Parallelism,
    combine,
    dropless_local,
    rank_in_group,
    sort_by_expert,
    swiglu_grouped,
)

type RaggedAllToAll = Callable[..., jax.Array]  # the signature of jax.lax.ragged_all_to_all


def routed_capacity(rows: int, factor: float, most: int) -> int:
    """Rows a buffer holds for `rows` routed rows at capacity factor `factor`; never more than
    `most`, the rows that could arrive at all (the worst case)."""
    return max(1, min(math.ceil(factor * rows), most))


@dataclass(frozen=True)
class AllToAll:
    """Fixed blocks of Q rows per peer, exchanged by all-to-all (see the module docstring)."""

    capacity_factor: float

    def __call__(
        self,
        x: jax.Array,
        expert_ids: jax.Array,
        weights: jax.Array,
        w: ExpertWeights,
        *,
        num_experts: int,
        par: Parallelism,
        gmm: GroupedMatmul,
    ) -> tuple[jax.Array, jax.Array]:
        """x [n, D], expert_ids/weights [n, k] -> (y [n, D], dropped assignments)."""
        if par.degree == 1:
            return dropless_local(x, expert_ids, weights, w, num_experts=num_experts, gmm=gmm)
        n, k = expert_ids.shape
        P, EL = par.degree, num_experts // par.degree
        Q = routed_capacity(n * k, self.capacity_factor / P, n * k)  # rows per peer
        order, sorted_ids, _ = sort_by_expert(expert_ids.reshape(-1), num_experts)
        dest = sorted_ids // EL  # [R] the device holding each row's expert
        slot = rank_in_group(dest, P)  # [R] the row's place in its peer's block
        rows = x[order // k]  # [R, D]; assignment a belongs to token a // k
        # Rows ranked Q or later for their peer fall outside the block: dropped.
        send = jnp.zeros((P, Q, x.shape[-1]), x.dtype).at[dest, slot].set(rows, mode="drop")
        send_ids = jnp.full((P, Q), EL).at[dest, slot].set(sorted_ids % EL, mode="drop")
        received = jax.lax.all_to_all(send, par.expert_axes, 0, 0, tiled=True)
        received_ids = jax.lax.all_to_all(send_ids, par.expert_axes, 0, 0, tiled=True)
        # Empty slots carry id EL: sorted last, outside every group, computed as zeros.
        local_order = jnp.argsort(received_ids.reshape(-1), stable=True)
        group_sizes = jnp.bincount(received_ids.reshape(-1), length=EL + 1)[:EL]
        out = swiglu_grouped(received.reshape(P * Q, -1)[local_order], group_sizes, w, gmm)
        out = out[jnp.argsort(local_order)].reshape(P, Q, -1)
        back = jax.lax.all_to_all(out, par.expert_axes, 0, 0, tiled=True)
        y_sorted = back.at[dest, slot].get(mode="fill", fill_value=0)  # dropped rows: 0
        return combine(y_sorted, order, weights), jnp.sum(slot >= Q)


@dataclass(frozen=True)
class RaggedLayout:
    """Where every routed row goes, for one device, as sender and as expert holder.

    C[s, d, e] counts the rows device s sends to local expert e of device d. On the holder the
    rows are laid out by expert, then by sender: expert e's rows from every sender are
    contiguous, so they are the grouped matmul's groups as they arrive. A row whose place would
    pass the holder's capacity is not sent: dropped. Slices are indexed (peer, expert), as
    ragged_all_to_all wants them (slice i goes to, or comes from, peer i // EL).
    """

    send_offsets: jax.Array  # [P * EL] (d, e): where my slice for it starts in my sorted rows
    send_sizes: jax.Array  # [P * EL] (d, e): its rows that fit at d
    land_offsets: jax.Array  # [P * EL] (d, e): where that slice lands in d's buffer
    held_offsets: jax.Array  # [P * EL] (s, e): where s's slice for my expert e landed here
    held_sizes: jax.Array  # [P * EL] (s, e): how many rows of it
    home_offsets: jax.Array  # [P * EL] (s, e): where that slice came from in s's sorted rows
    group_sizes: jax.Array  # [EL] rows each of my experts holds
    dropped: jax.Array  # my rows that did not fit


def ragged_layout(counts: jax.Array, me: jax.Array, capacity: int) -> RaggedLayout:
    """The layout from every device's counts C [P, P, EL] (all-gathered), for device `me`."""
    P, _, EL = counts.shape
    per_expert = counts.sum(axis=0)  # [P_d, EL] rows each device's experts hold in all
    expert_start = jnp.cumsum(per_expert, axis=1) - per_expert  # [P_d, EL] expert-major...
    sender_start = jnp.cumsum(counts, axis=0) - counts  # [P_s, P_d, EL] ...then by sender
    lands = expert_start[None] + sender_start  # [P_s, P_d, EL] place in the holder's buffer
    kept = jnp.clip(capacity - lands, 0, counts)  # rows that fit below the capacity
    lands = jnp.minimum(lands, capacity)  # a slice with nothing kept starts at the end
    flat = counts.reshape(P, P * EL)
    starts = (jnp.cumsum(flat, axis=1) - flat).reshape(P, P, EL)  # [P_s, P_d, EL] sender side
    return RaggedLayout(
        send_offsets=starts[me].reshape(-1),
        send_sizes=kept[me].reshape(-1),
        land_offsets=lands[me].reshape(-1),
        held_offsets=lands[:, me].reshape(-1),
        held_sizes=kept[:, me].reshape(-1),
        home_offsets=starts[:, me].reshape(-1),
        group_sizes=kept[:, me].sum(axis=0),
        dropped=jnp.sum(counts[me]) - jnp.sum(kept[me]),
    )


@dataclass(frozen=True)
class Ragged:
    """Exactly the routed rows, by ragged all-to-all (see the module docstring).

    `exchange` is `jax.lax.ragged_all_to_all`; tests pass an emulation of its documented
    semantics built from dense collectives, which runs on CPU.
    """

    capacity_factor: float
    exchange: RaggedAllToAll = jax.lax.ragged_all_to_all

    def __call__(
        self,
        x: jax.Array,
        expert_ids: jax.Array,
        weights: jax.Array,
        w: ExpertWeights,
        *,
        num_experts: int,
        par: Parallelism,
        gmm: GroupedMatmul,
    ) -> tuple[jax.Array, jax.Array]:
        """x [n, D], expert_ids/weights [n, k] -> (y [n, D], dropped assignments)."""
        if par.degree == 1:
            return dropless_local(x, expert_ids, weights, w, num_experts=num_experts, gmm=gmm)
        n, k = expert_ids.shape
        P, EL = par.degree, num_experts // par.degree
        capacity = routed_capacity(n * k, self.capacity_factor, P * n * k)
        order, sorted_ids, _ = sort_by_expert(expert_ids.reshape(-1), num_experts)
        rows = x[order // k]  # [R, D] sorted by global expert id, i.e. by (device, expert)
        mine = jnp.bincount(sorted_ids, length=num_experts).reshape(P, EL)
        counts = jax.lax.all_gather(mine, par.expert_axes)  # [P, P, EL] integers: tiny
        at = ragged_layout(counts, jax.lax.axis_index(par.expert_axes), capacity)
        held = self.exchange(
            rows,
            jnp.zeros((capacity, x.shape[-1]), x.dtype),
            at.send_offsets,
            at.send_sizes,
            at.land_offsets,
            at.held_sizes,
            axis_name=par.expert_axes,
        )  # [capacity, D] grouped by my experts; rows past the groups are zeros
        out = swiglu_grouped(held, at.group_sizes, w, gmm)
        back = self.exchange(
            out,
            jnp.zeros_like(rows),
            at.held_offsets,
            at.held_sizes,
            at.home_offsets,
            at.send_sizes,
            axis_name=par.expert_axes,
        )  # [R, D] in my sorted order; dropped rows stay zero
        return combine(back, order, weights), at.dropped


@dataclass(frozen=True)
class AllGather:
    """Every device's tokens gathered, local experts run, outputs reduce-scattered."""

    capacity_factor: float

    def __call__(
        self,
        x: jax.Array,
        expert_ids: jax.Array,
        weights: jax.Array,
        w: ExpertWeights,
        *,
        num_experts: int,
        par: Parallelism,
        gmm: GroupedMatmul,
    ) -> tuple[jax.Array, jax.Array]:
        """x [n, D], expert_ids/weights [n, k] -> (y [n, D], dropped assignments)."""
        if par.degree == 1:
            return dropless_local(x, expert_ids, weights, w, num_experts=num_experts, gmm=gmm)
        n, k = expert_ids.shape
        EL = num_experts // par.degree
        capacity = routed_capacity(n * k, self.capacity_factor, par.degree * n * k)
        gather = lambda a: jax.lax.all_gather(a, par.expert_axes, tiled=True)  # noqa: E731
        tokens, ids, mixing = gather(x), gather(expert_ids), gather(weights)  # [P * n, ...]
        local = ids.reshape(-1) - jax.lax.axis_index(par.expert_axes) * EL  # [P * R]
        key = jnp.where((local >= 0) & (local < EL), local, EL)  # others' experts sort last
        order = jnp.argsort(key, stable=True)[:capacity]  # by expert, then sender and token
        counts = jnp.bincount(key, length=EL + 1)[:EL]
        ends = jnp.minimum(jnp.cumsum(counts), capacity)
        group_sizes = ends - jnp.concatenate([jnp.zeros(1, ends.dtype), ends[:-1]])
        out = swiglu_grouped(tokens[order // k], group_sizes, w, gmm)  # [capacity, D]
        kept = jnp.arange(capacity) < ends[-1]
        scale = jnp.where(kept, mixing.reshape(-1)[order], 0).astype(out.dtype)
        partial = jnp.zeros_like(tokens).at[order // k].add(out * scale[:, None])  # [P * n, D]
        y = jax.lax.psum_scatter(partial, par.expert_axes, scatter_dimension=0, tiled=True)
        return y, jnp.sum(key < EL) - ends[-1]


EXCHANGES = {"all_to_all": AllToAll, "ragged": Ragged, "all_gather": AllGather}
_AUTO = {"gpu": "ragged", "tpu": "ragged"}  # on every other backend: all_to_all


def exchange_implementation(name: str) -> str:
    """The exchange `moe.ep_dispatch` names on this backend ("auto": see the module docstring)."""
    if name == "auto":
        return _AUTO.get(jax.default_backend(), "all_to_all")
    if name not in EXCHANGES:
        raise ValueError(f"unknown moe.ep_dispatch {name!r}; expected auto or {(*EXCHANGES,)}")
    return name


def make_dispatch(moe: MoeConfig) -> Dispatch:
    """How an MoE layer's assignments reach their experts, picked once when it is built: the
    capacity (GShard) blocks if moe.capacity_factor is set, else the dropless grouped matmul,
    through the configured exchange when the experts are split over devices."""
    if moe.capacity_factor is not None:
        return ExpertBlocks(moe.capacity_factor)
    return EXCHANGES[exchange_implementation(moe.ep_dispatch)](moe.ep_capacity_factor)
