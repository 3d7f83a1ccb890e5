"""One device's routed rows through its experts: the single-device half of a mixture of experts.

Each token was routed to k experts, giving R = n * k (token, expert, weight) assignments on a
device of n tokens. Everything here runs on one device's rows (inside `shard_map` when there
is a mesh: parallel/experts.py) and holds no collective; when the experts are split over
devices, the exchanges of parallel/expert_exchanges.py move the rows and call these parts on
each device's share. Two ways to compute the assignments, `model.moe.expert_capacity_factor`
picks:

* **Dropless** (null, the default): sort the assignments by expert and run each expert on
  exactly its rows with one grouped matmul (`dropless`). Nothing is dropped and the work is
  exactly the routed rows'.
* **Capacity** (a number): every expert takes at most C rows per device; the rest are dropped
  (their contribution is zero, the residual connection carries the token on). Buffers are
  fixed [E, C, D] blocks and the experts run as one batched matmul (`capacity_blocks`): the
  GShard layout, which an all-to-all moves as it is (E * C rows each way) and TPUs like.

Every move of rows is a `Permutation` (layers/permutation.py): gathers, forward and backward,
derived from the layer's one sort (`sort_by_expert`). Shape letters are the package's
(maxtrain/__init__.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.kernels.grouped_matmul import ExpertMatmuls, grouped_bias
from maxtrain.layers.activations import GatedActivation, swiglu
from maxtrain.layers.permutation import Permutation


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["gate_up", "down", "gate_up_bias"],
    meta_fields=["activation"],
)
@dataclass(frozen=True)
class ExpertWeights:
    """One device's share of the experts' gated feed-forward: the gate and up projections side
    by side [EL, D, 2F] (gate first), so that one grouped matmul computes both; the down
    projection [EL, F, D]; the gate's and up's biases [EL, 2F] where the model has them (the
    down projection's is added by the MoE layer, outside the exchanges: it does not depend on
    the row); and the activation joining gate and up (static: it travels as the pytree's data).

    The parameters stay two, moe.gate and moe.up [E, D, F] (checkpoints, HF import and export,
    upcycling, adapters and quantization rules name them): `joined` puts each device's slices
    side by side once per step, before the exchanges' rounds, whose weight gradients then
    accumulate in the one [EL, D, 2F] array. Quantized training sees one grouped matmul where
    there were two: its weight scales stay per expert and output column, but a gradient rounded
    to bwd_qtype per row shares one scale over gate's and up's columns."""

    gate_up: jax.Array
    down: jax.Array
    gate_up_bias: jax.Array | None = None
    activation: GatedActivation = swiglu

    @classmethod
    def joined(
        cls,
        gate: jax.Array,
        up: jax.Array,
        down: jax.Array,
        gate_bias: jax.Array | None = None,
        up_bias: jax.Array | None = None,
        activation: GatedActivation = swiglu,
    ) -> ExpertWeights:
        """From the projections as stored: gate and up [EL, D, F], down [EL, F, D], the biases
        [EL, F]. Per device, since under tensor parallelism F is each device's slice of the
        hidden units: its gate slice must sit beside its own up slice."""
        bias = None if gate_bias is None else jnp.concatenate([gate_bias, up_bias], axis=-1)
        return cls(jnp.concatenate([gate, up], axis=-1), down, bias, activation)

    def activate(self, gate_up: jax.Array) -> jax.Array:
        """[..., 2F] rows of the joint projection -> [..., F], the down projection's input."""
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return self.activation(gate, up)


@dataclass(frozen=True)
class Parallelism:
    """Mesh axes the experts are split over, and their number of devices (none: all experts on
    every device)."""

    expert_axes: tuple[str, ...] = ()
    degree: int = 1


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["x", "expert_ids", "weights", "w"],
    meta_fields=["num_experts", "gmm", "par"],
)
@dataclass(frozen=True)
class Routed:
    """What every way of computing a device's assignments starts from (one object, built per
    layer and device by parallel/experts.py): its n tokens x [n, D], each routed to k experts
    (expert_ids [n, k], below num_experts) with weights [n, k]; its share of the experts' weights
    w (EL = num_experts / par.degree experts); and, static, the mesh axes the experts are split
    over (`par`) and the grouped matmuls that run them. A pytree, so that it passes whole
    through transformations (parallel/stage_scope.py per_stage)."""

    x: jax.Array
    expert_ids: jax.Array
    weights: jax.Array
    w: ExpertWeights
    num_experts: int
    gmm: ExpertMatmuls
    par: Parallelism = Parallelism()

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def local_experts(self) -> int:
        """EL, the experts each device holds."""
        return self.num_experts // self.par.degree


class DispatchCounts(NamedTuple):
    """What a dispatch reports besides its output: assignments it dropped (capacity mode, or an
    exchange set to drop), and the exchange rounds it ran (parallel/expert_exchanges.py; 1
    otherwise)."""

    dropped: jax.Array
    rounds: jax.Array

    @classmethod
    def single_pass(cls, dropped: jax.Array | int = 0) -> DispatchCounts:
        """The counts of a dispatch that ran no exchange rounds, only its one pass."""
        return cls(jnp.asarray(dropped, jnp.int32), jnp.ones((), jnp.int32))


# How one device's assignments reach their experts and come back, picked once per MoE layer
# (parallel/experts.py make_dispatch): Routed -> (y [n, D], counts).
type Dispatch = Callable[[Routed], tuple[jax.Array, DispatchCounts]]


def grouped_feed_forward(
    rows: jax.Array, group_sizes: jax.Array, w: ExpertWeights, gmm: ExpertMatmuls
) -> jax.Array:
    """Each row through its expert's gated feed-forward (SwiGLU or w.activation, with w's
    biases): two grouped matmuls, gate and up in one; rows past sum(group_sizes) come out
    zero."""
    gate_up = gmm.gate_up(rows, w.gate_up, group_sizes)
    if w.gate_up_bias is not None:
        gate_up = gate_up + grouped_bias(w.gate_up_bias, group_sizes, rows.shape[0])
    return gmm.down(w.activate(gate_up), w.down, group_sizes)


def batched_feed_forward(blocks: jax.Array, w: ExpertWeights) -> jax.Array:
    """[..., EL, C, D] blocks through their experts' gated feed-forward as one batched matmul
    (no biases: config validation keeps expert biases off the capacity mode)."""
    gate_up = jnp.einsum("...ecd,edf->...ecf", blocks, w.gate_up)
    return jnp.einsum("...ecf,efd->...ecd", w.activate(gate_up), w.down)


# The name the sort's result carries, so that rematerialisation keeps it rather than sorting
# again (models/decoder.py's policies).
ASSIGNMENT_ORDER = "moe_assignment_order"


class ExpertOrder(NamedTuple):
    """One device's R assignments sorted by expert: the layer's one sort, which every move of
    its rows (forward and backward, the exchanges' included) derives its indices from."""

    sorting: Permutation  # assignment slots -> sorted rows, and back
    sorted_ids: jax.Array  # [R] each sorted row's expert
    rank: jax.Array  # [R] each sorted row's place among its expert's rows


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> ExpertOrder:
    """[R] expert ids (< num_experts, or num_experts for experts held elsewhere) -> their
    order by expert (stable: a token's earlier choices first among equal experts)."""
    order = checkpoint_name(jnp.argsort(expert_ids, stable=True), ASSIGNMENT_ORDER)
    sorted_ids = expert_ids[order]
    return ExpertOrder(
        Permutation.to(order, order.shape[0]).inverted(),
        sorted_ids,
        rank_in_group(sorted_ids, num_experts + 1),
    )


def rank_in_group(sorted_keys: jax.Array, num_keys: int) -> jax.Array:
    """[R] keys in 0..num_keys-1, ascending -> each one's position among equal keys.

    Counting (a group starts after all smaller keys) rather than a search: jnp.searchsorted is a
    loop, which jax cannot yet batch inside shard_map under a pipeline's stage map."""
    counts = jnp.bincount(sorted_keys, length=num_keys)
    starts = jnp.cumsum(counts) - counts
    return jnp.arange(sorted_keys.shape[0]) - starts[sorted_keys]


def combine(per_assignment: jax.Array, weights: jax.Array) -> jax.Array:
    """Each assignment's output [R, D], in assignment order (token a // k) -> the weighted sum
    of every token's k outputs [n, D], accumulated in float32.

    Written as a product and a sum over k, not an einsum, which XLA made a dot of depth k (a
    batched matrix-vector product, a library call on GPUs) over the gathered rows, and two more
    in the backward. As element-wise work it fuses with what is next to it: the weights and the
    sum into one pass over the output rows, the weights' gradient into a row-wise product and
    sum, the rows' into a broadcast product. Whether the un-permute's gather joins that fusion
    is the backend's choice: the CPU and TPU compilers keep a gather its own fusion."""
    n, k = weights.shape
    rows = per_assignment.reshape(n, k, -1)
    mixed = rows.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]
    return mixed.sum(axis=1).astype(per_assignment.dtype)


def dropless(routed: Routed) -> tuple[jax.Array, DispatchCounts]:
    """Every assignment computed on this device, each expert on exactly its rows. Ids equal to
    num_experts (experts held elsewhere: parallel/experts.py keep_local_experts) sort last and
    stay outside every group."""
    E = routed.num_experts
    experts = sort_by_expert(routed.expert_ids.reshape(-1), E)
    group_sizes = jnp.bincount(experts.sorted_ids, length=E + 1)[:E]
    rows = experts.sorting.take(routed.x, copies=routed.top_k)
    out = grouped_feed_forward(rows, group_sizes, routed.w, routed.gmm)
    return combine(
        experts.sorting.inverted().take(out), routed.weights
    ), DispatchCounts.single_pass()


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Rows each expert takes per device: factor x its fair share of the assignments."""
    return max(1, math.ceil(factor * num_tokens * top_k / num_experts))


# [E, C, D] blocks -> the experts' outputs in the same places. On one device the batched
# feed-forward; over devices, the blocks' exchange around it (ExpertBlocks of
# parallel/expert_exchanges.py).
type ThroughExperts = Callable[[jax.Array, ExpertWeights], jax.Array]


def capacity_blocks(
    routed: Routed, capacity_factor: float, through_experts: ThroughExperts = batched_feed_forward
) -> tuple[jax.Array, DispatchCounts]:
    """The capacity (GShard) mode: fixed [E, C, D] blocks; earlier tokens win a full expert."""
    E, k = routed.num_experts, routed.top_k
    cap = capacity(routed.expert_ids.shape[0], k, E, capacity_factor)
    experts = sort_by_expert(routed.expert_ids.reshape(-1), E)
    kept = (experts.rank < cap) & (experts.sorted_ids < E)
    # Each assignment's place in the [E * C] blocks (past them: dropped, or not ours),
    # composed with the sort so that the rows move once each way.
    block = jnp.where(kept, experts.sorted_ids * cap + experts.rank, E * cap)
    to_blocks = Permutation.to(block[experts.sorting.inverse], E * cap)
    blocks = to_blocks.take(routed.x, copies=k).reshape(E, cap, -1)
    out_blocks = through_experts(blocks, routed.w)
    out = to_blocks.inverted().take(out_blocks.reshape(E * cap, -1))
    dropped = jnp.sum(~kept & (experts.sorted_ids < E))  # others' experts: not ours
    return combine(out, routed.weights), DispatchCounts.single_pass(dropped)
