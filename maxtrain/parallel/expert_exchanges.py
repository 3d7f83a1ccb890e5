"""Expert parallelism: each device's routed rows travel to the devices holding their experts.

The experts are split over P devices (mesh axes `mesh.rules.exp`), EL = E / P on each, and the
tokens are split over the same devices. Each device routes its n tokens to k experts: R = n * k
rows, sorted by expert, of which each row must reach the device owning its expert, run through
that expert, and come back. Static shapes are the difficulty: how many rows a device sends to
each peer, and receives from all of them, is known only at run time. A buffer for the worst
case (every row bound for one device) is P times the rows the routing fills, and so is the
traffic of an all-to-all of it: what maxtrain did before, 8x the routed volume at P = 8.

Each exchange takes one device's `Routed` (layers/routed_experts.py: its tokens, their routing,
its experts' weights), moves the rows, runs the single-device parts there (the grouped
feed-forward, the combine) and brings the outputs back. Three dropless exchanges, each with
buffers of `compute.expert_exchange_capacity` (f) times the routed rows per round (the whole
buffer is never more than the worst case; `Rounds` sizes them):

  all_to_all  every device sends each peer a block of Q = ceil(f * R / P) rows. Moves f x R
              rows each way, on any backend (the CPU default). A round is full when a device
              sends one peer more than Q rows: a pair's imbalance, the strictest of the three.
  ragged      `jax.lax.ragged_all_to_all` sends each peer exactly its rows, and they arrive
              grouped by expert, so the receiver runs its grouped matmul without re-sorting.
              Sends R rows, receives into a buffer of ceil(f * R); full only when a device's
              experts receive more than that (device imbalance). GPU and TPU only: XLA:CPU
              does not implement the op (the GPU/TPU default; see below).
  all_gather  every device gathers all P * n tokens, runs its experts on the rows routed to
              them (ceil(f * R) a round) and the outputs return by reduce-scatter. Moves P / k
              times the routed rows, so it pays when k >= P (Kanana-MoE: k = 8, P = 8); its
              rounds are local (the gathered tokens are all there), only compute is split.

What does not fit, `compute.expert_exchange_overflow` decides:

  rounds (default)  dropless. The rows beyond a round's buffers go in the next round, the
              experts computing each round's rows before the next, until every row has been
              there and back. Balanced routing needs one round, and a step runs only the rounds
              its routing needs (`moe/rounds`); the worst case, every row bound for one device,
              ceil(P / f). The buffers keep their size whatever the routing.
  drop        one round; rows that do not fit are dropped (their expert contributes nothing,
              the residual stream carries the token on), counted in `moe/dropped`.

How the rounds run (`in_rounds`), and why. Static shapes: the compiled program must hold every
round it might need, and run only those the routing asks for, with the same collectives on
every device. Round 0 runs always; the later ones in a `fori_loop` whose trip count is the
rounds needed by the busiest buffer of any device in the exchange (pmax: one number for all).
The backward pass is a custom VJP that replays the same plan (the sort order and counts,
integers) round by round: round 0 from the residuals its forward saved, the later rounds
recomputed from the inputs, one at a time. Two alternatives were measured against it
(worst-case routing, every row for one device: P = 8 devices, 256 tokens, top-2, width 64,
float32, 8 simulated CPU devices on a 2-core machine, the compiled program's
memory_analysis and compile time):
  - plain autodiff through the rounds, each under a `lax.cond`: jax keeps every compiled
    round's residuals for the backward, run or not, 2.99 MiB of temporaries per device
    against 1.69 MiB for the replay, and compiles every round twice (forward and
    backward: 52.9 s against 44.2 s);
  - one round with buffers for the worst case (f = P): P x the routed rows moved and held in
    every step, balanced or not, where the rounds move f x (1.25 x) while balanced.
The replay costs a further round one more trip of its rows to the experts in the backward
(5 exchanges of its rows instead of 4); round 0, the only one balanced routing runs, none.
The rounds' collectives sit in a loop whose trip count XLA cannot know, so
`analysis.collectives.collective_bytes` reports them apart, per trip ("all-to-all per loop trip").

Which exchange is fastest depends on the interconnect and the routing. The defaults are those
whose cost is bounded whatever k and P: `ragged` on GPU/TPU (the routed rows exactly),
`all_to_all` on CPU (f times them). The ragged exchange has not yet run on a GPU or TPU here:
its index arithmetic is tested on CPU against an emulation of the op's documented semantics
(tests/parallel/test_moe_dispatch.py), and the op's transpose (the backward pass) is jax's.

The capacity (GShard) mode's fixed [E, C, D] blocks (`ExpertBlocks`, set by
`model.moe.expert_capacity_factor`) cross one all-to-all as they are, E * C rows each way; what
does not fit an expert's C rows was dropped before they leave.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

from maxtrain.layers.permutation import Permutation
from maxtrain.layers.routed_experts import (
    DispatchCounts,
    ExpertWeights,
    Parallelism,
    Routed,
    batched_feed_forward,
    capacity_blocks,
    combine,
    dropless,
    grouped_feed_forward,
    rank_in_group,
    sort_by_expert,
)

type RaggedAllToAll = Callable[..., jax.Array]  # the signature of jax.lax.ragged_all_to_all
type Overflow = Literal["rounds", "drop"]
# One round r of an exchange: (r, plan, inputs) -> its rows' outputs, zero for other rounds'.
type Round = Callable[[int, Any, Any], jax.Array]


def routed_capacity(rows: int, factor: float, most: int) -> int:
    """Rows a buffer holds for `rows` routed rows at capacity factor `factor`; never more than
    `most`, the rows that could arrive at all (the worst case)."""
    return max(1, min(math.ceil(factor * rows), most))


def max_rounds(worst: int, capacity: int, overflow: Overflow) -> int:
    """Rounds compiled: enough for `worst` rows through buffers of `capacity`, or 1 (drop)."""
    return 1 if overflow == "drop" else -(-worst // capacity)


def rounds_needed(busiest: jax.Array, capacity: int, axes: tuple[str, ...]) -> jax.Array:
    """Rounds the busiest buffer of any device of the exchange needs: the same number on all
    of them (pmax over the expert axes), so that they run the same collectives."""
    return jax.lax.pmax((busiest + capacity - 1) // capacity, axes)


def in_rounds(one_round: Round, most: int, needed: jax.Array, plan: Any, inputs: Any):
    """The sum of one_round(r, plan, inputs) over the rounds r < needed (at most `most`).

    Round 0 always runs; the later ones run in a loop whose trip count, `needed`, is the same
    on every device of the exchange, so a step runs only the rounds its routing needs, and
    those devices the same collectives (devices of other exchange groups, e.g. other
    data-parallel replicas or pipeline stages, may run a different number: nothing in the loop
    joins them; inside the stage map each stage's dispatch is traced on its own for this,
    parallel/stage_scope.py `per_stage`).
    The backward pass replays the rounds: round 0 from the residuals its forward saved (one
    round's buffers), every later one recomputed from the inputs and the plan, one at a time,
    so that no more than one round's buffers are ever alive.
    """
    if most == 1:
        return one_round(0, plan, inputs)
    needed = jnp.minimum(needed, most)

    def later_rounds(total, needed, plan, inputs):
        more = lambda r, total: total + one_round(r, plan, inputs)  # noqa: E731
        return jax.lax.fori_loop(1, needed, more, total)

    @jax.custom_vjp
    def run(needed, plan, inputs):
        return later_rounds(one_round(0, plan, inputs), needed, plan, inputs)

    def forward(needed, plan, inputs):
        first, replay_first = jax.vjp(lambda inputs: one_round(0, plan, inputs), inputs)
        return later_rounds(first, needed, plan, inputs), (replay_first, needed, plan, inputs)

    def backward(saved, grad_out):
        replay_first, needed, plan, inputs = saved

        def replay(r, grads):
            _, round_vjp = jax.vjp(lambda inputs: one_round(r, plan, inputs), inputs)
            return jax.tree.map(jnp.add, grads, round_vjp(grad_out)[0])

        return None, None, jax.lax.fori_loop(1, needed, replay, replay_first(grad_out)[0])

    run.defvjp(forward, backward)
    return run(needed, plan, inputs)


@dataclass(frozen=True)
class Rounds:
    """The setup every dropless exchange shares: buffers of `capacity` rows a round, and the
    `most` rounds compiled, which a step runs as many of as its busiest buffer needs."""

    capacity: int
    most: int

    @classmethod
    def sized(cls, rows: int, factor: float, worst: int, overflow: Overflow) -> Rounds:
        """Buffers for `factor` x `rows` routed rows (never more than `worst`, the rows that
        could arrive at all), and rounds enough for `worst` rows through them (1: drop)."""
        capacity = routed_capacity(rows, factor, worst)
        return cls(capacity, max_rounds(worst, capacity, overflow))

    def run(
        self, one_round: Round, busiest: jax.Array, par: Parallelism, plan: Any, inputs: Any
    ) -> tuple[Any, jax.Array]:
        """one_round run as many times as the busiest buffer of any device of the exchange
        needs (`busiest`: its rows), see `in_rounds`: their summed outputs, and the number of
        rounds run (at most `most`)."""
        needed = rounds_needed(busiest, self.capacity, par.expert_axes)
        total = in_rounds(one_round, self.most, needed, plan, inputs)
        return total, jnp.minimum(needed, self.most)


def _counts(dropped: jax.Array, rounds: jax.Array, par: Parallelism) -> DispatchCounts:
    """The counts, varying over the expert axes like everything per device (the rounds, made
    equal over them, are not), so that callers may reduce them over any token axes."""
    rounds = jax.lax.pcast(rounds, par.expert_axes, to="varying")
    return DispatchCounts(jnp.asarray(dropped, jnp.int32), rounds.astype(jnp.int32))


@dataclass(frozen=True)
class AllToAll:
    """Blocks of Q rows per peer and round, exchanged by all-to-all (see the module docstring)."""

    capacity_factor: float
    overflow: Overflow = "rounds"

    def __call__(self, routed: Routed) -> tuple[jax.Array, DispatchCounts]:
        if routed.par.degree == 1:
            return dropless(routed)
        n, k = routed.expert_ids.shape
        par, gmm, P, EL = routed.par, routed.gmm, routed.par.degree, routed.local_experts
        # Q rows per peer and round; the worst case: every row for one peer.
        rounds = Rounds.sized(n * k, self.capacity_factor / P, n * k, self.overflow)
        Q = rounds.capacity
        experts = sort_by_expert(routed.expert_ids.reshape(-1), routed.num_experts)
        dest = experts.sorted_ids // EL  # [R] the device holding each row's expert
        slot = rank_in_group(dest, P)  # [R] the row's place among those for its peer

        def one_round(r, plan, inputs):
            """The rows of places rQ .. rQ + Q - 1 for each peer: there and back."""
            dest, slot, local_ids, position = plan
            x, w = inputs
            place = slot - r * Q
            place = jnp.where((place >= 0) & (place < Q), dest * Q + place, P * Q)
            to_send = Permutation.to(place[position], P * Q)  # P * Q: not in this round
            send = to_send.take(x, copies=k).reshape(P, Q, -1)
            send_ids = jnp.take(local_ids[position], to_send.index, mode="fill", fill_value=EL)
            received = jax.lax.all_to_all(send, par.expert_axes, 0, 0, tiled=True)
            received_ids = jax.lax.all_to_all(
                send_ids.reshape(P, Q), par.expert_axes, 0, 0, tiled=True
            )
            grouping, group_sizes = group_received(received_ids, EL)
            rows = grouping.take(received.reshape(P * Q, -1))
            out = grouping.inverted().take(grouped_feed_forward(rows, group_sizes, w, gmm))
            back = jax.lax.all_to_all(out.reshape(P, Q, -1), par.expert_axes, 0, 0, tiled=True)
            # Each assignment's output; zero for other rounds' assignments.
            return to_send.inverted().take(back.reshape(P * Q, -1))

        plan = (dest, slot, experts.sorted_ids % EL, experts.sorting.inverse)
        per_assignment, ran = rounds.run(
            one_round, jnp.max(slot) + 1, par, plan, (routed.x, routed.w)
        )
        counts = _counts(jnp.sum(slot >= rounds.most * Q), ran, par)
        return combine(per_assignment, routed.weights), counts


def group_received(ids: jax.Array, num_experts: int) -> tuple[Permutation, jax.Array]:
    """Blocks of rows received from P senders, ids [P, Q] of their local experts (num_experts:
    an empty slot) -> the permutation putting the rows in expert order (then by sender) and
    each expert's row count, the grouped matmul's groups.

    Every sender's block is its rows for this device in its sorted order, empty slots last, so
    a row's place follows from counts: the rows of smaller experts, those of its expert from
    earlier senders, its rank in its own block's run. No sort."""
    P, Q = ids.shape
    senders = jnp.arange(P)[:, None]
    per_sender = jnp.bincount(
        (senders * (num_experts + 1) + ids).reshape(-1), length=P * (num_experts + 1)
    )
    counts = per_sender.reshape(P, num_experts + 1)[:, :num_experts]  # [P, EL]
    group_sizes = counts.sum(axis=0)
    expert_start = jnp.cumsum(group_sizes) - group_sizes  # [EL]
    sender_start = jnp.cumsum(counts, axis=0) - counts  # [P, EL] within the expert's rows
    run_start = jnp.cumsum(counts, axis=1) - counts  # [P, EL] within the sender's block
    e = jnp.minimum(ids, num_experts - 1)
    place = expert_start[e] + sender_start[senders, e] + jnp.arange(Q) - run_start[senders, e]
    place = jnp.where(ids < num_experts, place, P * Q)
    return Permutation.to(place.reshape(-1), P * Q), group_sizes


@dataclass(frozen=True)
class RaggedLayout:
    """Where the routed rows of one round go, for one device, as sender and as expert holder.

    C[s, d, e] counts the rows device s sends to local expert e of device d. On the holder the
    rows are laid out by expert, then by sender: expert e's rows from every sender are
    contiguous, so they are the grouped matmul's groups as they arrive. A round carries the
    places [first, first + capacity) of that layout: a slice may be split between rounds.
    Slices are indexed (peer, expert), as ragged_all_to_all wants them (slice i goes to, or
    comes from, peer i // EL).
    """

    send_offsets: jax.Array  # [P * EL] (d, e): where my rows for it this round start
    send_sizes: jax.Array  # [P * EL] (d, e): how many of them go this round
    land_offsets: jax.Array  # [P * EL] (d, e): where they land in d's buffer
    held_offsets: jax.Array  # [P * EL] (s, e): where s's rows for my expert e landed here
    held_sizes: jax.Array  # [P * EL] (s, e): how many rows of them
    home_offsets: jax.Array  # [P * EL] (s, e): where they came from in s's sorted rows
    group_sizes: jax.Array  # [EL] rows each of my experts holds this round


def ragged_layout(counts: jax.Array, me: jax.Array, capacity: int, first: int = 0) -> RaggedLayout:
    """The layout of the round holding places [first, first + capacity) of every holder's
    rows, from every device's counts C [P, P, EL] (all-gathered), for device `me`."""
    P, _, EL = counts.shape
    per_expert = counts.sum(axis=0)  # [P_d, EL] rows each device's experts hold in all
    expert_start = jnp.cumsum(per_expert, axis=1) - per_expert  # [P_d, EL] expert-major...
    sender_start = jnp.cumsum(counts, axis=0) - counts  # [P_s, P_d, EL] ...then by sender
    lands = expert_start[None] + sender_start  # [P_s, P_d, EL] place among the holder's rows
    sent_before = jnp.clip(first - lands, 0, counts)  # rows of the slice earlier rounds took
    kept = jnp.clip(first + capacity - lands, 0, counts) - sent_before  # rows of this round
    lands = jnp.clip(lands + sent_before - first, 0, capacity)  # in this round's buffer
    flat = counts.reshape(P, P * EL)
    starts = (jnp.cumsum(flat, axis=1) - flat).reshape(P, P, EL) + sent_before  # sender side
    return RaggedLayout(
        send_offsets=starts[me].reshape(-1),
        send_sizes=kept[me].reshape(-1),
        land_offsets=lands[me].reshape(-1),
        held_offsets=lands[:, me].reshape(-1),
        held_sizes=kept[:, me].reshape(-1),
        home_offsets=starts[:, me].reshape(-1),
        group_sizes=kept[:, me].sum(axis=0),
    )


@dataclass(frozen=True)
class Ragged:
    """Exactly the routed rows, by ragged all-to-all (see the module docstring).

    `exchange` is `jax.lax.ragged_all_to_all`; tests pass an emulation of its documented
    semantics built from dense collectives, which runs on CPU.
    """

    capacity_factor: float
    overflow: Overflow = "rounds"
    exchange: RaggedAllToAll = jax.lax.ragged_all_to_all

    def __call__(self, routed: Routed) -> tuple[jax.Array, DispatchCounts]:
        if routed.par.degree == 1:
            return dropless(routed)
        n, k = routed.expert_ids.shape
        par, gmm, P, EL = routed.par, routed.gmm, routed.par.degree, routed.local_experts
        # The worst case: every device's rows to one device.
        rounds = Rounds.sized(n * k, self.capacity_factor, P * n * k, self.overflow)
        capacity = rounds.capacity
        experts = sort_by_expert(routed.expert_ids.reshape(-1), routed.num_experts)
        rows = experts.sorting.take(routed.x, copies=k)  # [R, D] by global expert: (device, expert)
        mine = jnp.bincount(experts.sorted_ids, length=routed.num_experts).reshape(P, EL)
        counts = jax.lax.all_gather(mine, par.expert_axes)  # [P, P, EL] integers: tiny
        me = jax.lax.axis_index(par.expert_axes)

        def one_round(r, plan, inputs):
            counts, me = plan
            rows, w = inputs
            at = ragged_layout(counts, me, capacity, first=r * capacity)
            held = self.exchange(
                rows,
                jnp.zeros((capacity, rows.shape[-1]), rows.dtype),
                at.send_offsets,
                at.send_sizes,
                at.land_offsets,
                at.held_sizes,
                axis_name=par.expert_axes,
            )  # [capacity, D] grouped by my experts; rows past the groups are zeros
            out = grouped_feed_forward(held, at.group_sizes, w, gmm)
            return self.exchange(
                out,
                jnp.zeros_like(rows),
                at.held_offsets,
                at.held_sizes,
                at.home_offsets,
                at.send_sizes,
                axis_name=par.expert_axes,
            )  # [R, D] in my sorted order; rows of other rounds stay zero

        busiest = jnp.max(counts.sum(axis=(0, 2)))  # rows bound for the busiest device
        back, ran = rounds.run(one_round, busiest, par, (counts, me), (rows, routed.w))
        sent = ragged_layout(counts, me, rounds.most * capacity).send_sizes.sum()
        counts = _counts(n * k - sent, ran, par)
        return combine(experts.sorting.inverted().take(back), routed.weights), counts


@dataclass(frozen=True)
class AllGather:
    """Every device's tokens gathered, local experts run, outputs reduce-scattered."""

    capacity_factor: float
    overflow: Overflow = "rounds"

    def __call__(self, routed: Routed) -> tuple[jax.Array, DispatchCounts]:
        if routed.par.degree == 1:
            return dropless(routed)
        n, k = routed.expert_ids.shape
        par, gmm, P, EL = routed.par, routed.gmm, routed.par.degree, routed.local_experts
        # The worst case: every device's rows to one device.
        rounds = Rounds.sized(n * k, self.capacity_factor, P * n * k, self.overflow)
        capacity = rounds.capacity
        gather = lambda a: jax.lax.all_gather(a, par.expert_axes, tiled=True)  # noqa: E731
        tokens, ids, mixing = map(gather, (routed.x, routed.expert_ids, routed.weights))
        local = ids.reshape(-1) - jax.lax.axis_index(par.expert_axes) * EL  # [P * R]
        key = jnp.where((local >= 0) & (local < EL), local, EL)  # others' experts sort last
        experts = sort_by_expert(key, EL)  # by expert, then sender and token
        counts = jnp.bincount(experts.sorted_ids, length=EL + 1)[:EL]

        def one_round(r, plan, inputs):
            """My experts' rows of places [r C, r C + C), as partial outputs of every token."""
            position, counts = plan
            tokens, mixing, w = inputs
            first, last = r * capacity, (r + 1) * capacity
            place = position - first  # past my experts' rows: someone else's assignment
            in_round = (place >= 0) & (place < capacity) & (position < jnp.sum(counts))
            to_rows = Permutation.to(jnp.where(in_round, place, capacity), capacity)
            ends = jnp.cumsum(counts)
            group_sizes = jnp.clip(ends, first, last) - jnp.clip(ends - counts, first, last)
            out = grouped_feed_forward(to_rows.take(tokens, copies=k), group_sizes, w, gmm)
            return combine(to_rows.inverted().take(out), mixing)  # zero for others' rows

        total = jnp.sum(counts)  # rows for my experts
        plan, inputs = (experts.sorting.inverse, counts), (tokens, mixing, routed.w)
        partial, ran = rounds.run(one_round, total, par, plan, inputs)
        y = jax.lax.psum_scatter(partial, par.expert_axes, scatter_dimension=0, tiled=True)
        return y, _counts(total - jnp.minimum(total, rounds.most * capacity), ran, par)


@dataclass(frozen=True)
class ExpertBlocks:
    """The capacity (GShard) mode (layers/routed_experts.py capacity_blocks), its [E, C, D]
    blocks crossing an all-to-all as they are when the experts are split over devices: E / P
    experts' blocks to each peer, and their outputs back."""

    capacity_factor: float

    def __call__(self, routed: Routed) -> tuple[jax.Array, DispatchCounts]:
        if routed.par.degree == 1:
            return capacity_blocks(routed, self.capacity_factor)
        axes, P = routed.par.expert_axes, routed.par.degree

        def exchanged(blocks: jax.Array, w: ExpertWeights) -> jax.Array:
            local = blocks.reshape(P, routed.local_experts, *blocks.shape[1:])
            received = jax.lax.all_to_all(local, axes, 0, 0, tiled=True)
            computed = batched_feed_forward(received, w)
            return jax.lax.all_to_all(computed, axes, 0, 0, tiled=True)

        return capacity_blocks(routed, self.capacity_factor, exchanged)


EXCHANGES = {"all_to_all": AllToAll, "ragged": Ragged, "all_gather": AllGather}
_AUTO = {"gpu": "ragged", "tpu": "ragged"}  # on every other platform: all_to_all


def ragged_supported(device_kind: str, chips_per_slice: int) -> bool:
    """Whether XLA compiles the ragged all-to-all for these devices. The TPU compiler needs full
    ICI routing for it, which a v5e slice beyond 16 chips lacks: compiled for v5e:8x8 or
    v5e:16x16 it stops with "Ragged all-to-all is currently not supported in limited ICI
    routing settings" (v5e:4x4 compiles; docs/tpu.md)."""
    return not (device_kind.lower().startswith("tpu v5 lite") and chips_per_slice > 16)


def exchange_implementation(
    name: str, platform: str | None = None, device_kind: str = "", chips_per_slice: int = 1
) -> str:
    """The exchange `compute.expert_exchange` names on the devices the program is built for
    (platform None: the default backend); "auto": see the module docstring, all_to_all where the
    ragged exchange does not compile (`ragged_supported`)."""
    if name == "auto":
        auto = _AUTO.get(platform or jax.default_backend(), "all_to_all")
        return auto if ragged_supported(device_kind, chips_per_slice) else "all_to_all"
    if name not in EXCHANGES:
        raise ValueError(
            f"unknown compute.expert_exchange {name!r}; expected auto or {(*EXCHANGES,)}"
        )
    return name
