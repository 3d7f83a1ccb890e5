"""An MoE layer's routed experts over the mesh: each device runs its own tokens through its share
of the experts, inside `shard_map`.

The router runs on the global (auto-sharded) activations like any other layer; the experts run
per device. Tokens stay on the device that holds them. The experts' weights arrive as stored,
each device's FSDP shard: gate and up are joined on the shards, 1/FSDP of the bytes, and then
gathered; the gather's transpose sums their gradients as a reduce-scatter (the TPU compiler
may still lower it as an all-reduce and a slice, as it does MaxText's). They stay split over
the mesh axes of the `exp` rule (expert parallelism: rows travel to the devices holding their
experts by an exchange of parallel/expert_exchanges.py) and of the `mlp` rule (each device
computes a slice of every expert's hidden units; the partial outputs are summed). A batch too
small to split over the expert axes (a short eval batch) stays replicated there: each device
computes its own experts' share of every token and a sum over the expert axes completes the
output, with no exchange.

`ShardedExperts` is what the layer holds, picked once when it is built: the dispatch
(`make_dispatch`: the capacity blocks, or the dropless grouped matmul through an exchange), the
grouped matmuls and the activation. Called on the layer's global arrays, it reads the split
from the mesh and rules being traced for (`ExpertSplit`) and hands each device's share to the
dispatch as one `Routed` (layers/routed_experts.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtrain.config import ComputeConfig, MoeConfig, named_tiles
from maxtrain.kernels.grouped_matmul import ExpertMatmuls, expert_matmuls
from maxtrain.layers.activations import GatedActivation, gated_activation
from maxtrain.layers.routed_experts import (
    Dispatch,
    DispatchCounts,
    ExpertWeights,
    Parallelism,
    Routed,
)
from maxtrain.parallel import stage_scope
from maxtrain.parallel.expert_exchanges import EXCHANGES, ExpertBlocks, exchange_implementation
from maxtrain.parallel.mesh import active_rules, logical_to_spec, spec_axes

# The experts' weights as stored (embed sharded by FSDP) and as the per-device code receives
# them; it gathers the embed dim over FSDP, keeping the split over experts and hidden units.
IN_AXES = ("exp", "embed", "mlp")  # gate and up [E, D, F]
OUT_AXES = ("exp", "mlp", "embed")  # down [E, F, D]
_TOKENS = ("batch", "length", "act_embed")
_ROUTES = ("batch", "length", None)


class ExpertProjections(NamedTuple):
    """The experts' weights as the layer holds them, in its compute dtype: gate and up
    [E, D, F], down [E, F, D], and gate's and up's biases [E, F] where the model has them."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None


def make_dispatch(moe: MoeConfig, compute: ComputeConfig) -> Dispatch:
    """How an MoE layer's assignments reach their experts, picked once when it is built: the
    capacity (GShard) blocks if moe.expert_capacity_factor is set, else the dropless grouped
    matmul, through compute.expert_exchange when the experts are split over devices."""
    if moe.expert_capacity_factor is not None:
        return ExpertBlocks(moe.expert_capacity_factor)
    exchange = EXCHANGES[exchange_implementation(compute.expert_exchange)]
    return exchange(compute.expert_exchange_capacity, overflow=compute.expert_exchange_overflow)


def keep_local_experts(
    expert_ids: jax.Array, weights: jax.Array, num_experts: int, par: Parallelism
) -> tuple[jax.Array, jax.Array]:
    """For tokens replicated over the expert axes: re-number this device's experts 0..EL-1 and
    mark the rest EL with weight 0. Each device then computes its experts' share of every
    token, and a sum over the expert axes completes the output (no exchange needed)."""
    local = num_experts // par.degree
    ids = expert_ids - jax.lax.axis_index(par.expert_axes) * local
    mine = (ids >= 0) & (ids < local)
    return jnp.where(mine, ids, local), jnp.where(mine, weights, 0)


@dataclass(frozen=True)
class ExpertSplit:
    """How the mesh splits one MoE call: the shard_map's specs of its arrays, the expert axes
    (`par`), and the mesh axes the tokens and the experts' hidden units are split over."""

    tokens: P  # x and y [B, T, D]
    routes: P  # expert ids and weights [B, T, k]
    # gate and up: as stored, but gathered over the FSDP axes the tokens are not split over
    weights_in: P
    weights_out: P  # down: likewise
    biases: P | None  # gate's and up's biases, if any
    par: Parallelism
    token_axes: tuple[str, ...]
    tensor_axes: tuple[str, ...]
    fsdp_in: tuple[str, ...] = ()  # mesh axes gate's and up's embed dim enters split over
    fsdp_out: tuple[str, ...] = ()  # and down's

    @classmethod
    def of(
        cls, mesh: Mesh, rules: dict[str, list[str]], x: jax.Array, expert_ids: jax.Array,
        projections: ExpertProjections,
    ) -> ExpertSplit:  # fmt: skip
        tokens = logical_to_spec(_TOKENS, rules, mesh, x.shape)
        token_axes = tuple(a for part in tokens for a in spec_axes(part))
        stored_in = logical_to_spec(IN_AXES, rules, mesh, projections.gate.shape)
        stored_out = logical_to_spec(OUT_AXES, rules, mesh, projections.down.shape)
        expert_axes, tensor_axes = spec_axes(stored_in[0]), spec_axes(stored_in[2])

        def inside(embed) -> tuple[str, ...]:
            """The FSDP axes gathered inside: those the tokens are split over too (over the
            others, the weights enter gathered, as the tokens enter the same on each device)."""
            return tuple(a for a in spec_axes(embed) if a in token_axes)

        fsdp_in, fsdp_out = inside(stored_in[1]), inside(stored_out[2])
        return cls(
            tokens=tokens,
            routes=logical_to_spec(_ROUTES, rules, mesh, expert_ids.shape),
            weights_in=P(stored_in[0], fsdp_in or None, stored_in[2]),
            weights_out=P(stored_out[0], stored_out[1], fsdp_out or None),
            biases=None if projections.gate_bias is None else P(stored_in[0], stored_in[2]),
            par=Parallelism(expert_axes, math.prod(mesh.shape[a] for a in expert_axes)),
            token_axes=token_axes,
            tensor_axes=tensor_axes,
            fsdp_in=fsdp_in,
            fsdp_out=fsdp_out,
        )

    def gathered(self, w: ExpertWeights) -> ExpertWeights:
        """One device's joined FSDP shards of the experts, gathered over the FSDP axes."""
        gate_up, down = w.gate_up, w.down
        if self.fsdp_in:
            gate_up = jax.lax.all_gather(gate_up, self.fsdp_in, axis=1, tiled=True)
        if self.fsdp_out:
            down = jax.lax.all_gather(down, self.fsdp_out, axis=2, tiled=True)
        return dataclasses.replace(w, gate_up=gate_up, down=down)

    @property
    def in_specs(self) -> tuple[P | None, ...]:
        """Of (x, expert ids, weights, *ExpertProjections)."""
        experts = (self.weights_in, self.weights_in, self.weights_out, self.biases, self.biases)
        return (self.tokens, self.routes, self.routes, *experts)

    @property
    def replicated(self) -> bool:
        """Normally the tokens are split over the expert axes too and travel by an exchange. A
        batch too small to split (e.g. a short eval batch) leaves them replicated there."""
        return self.par.degree > 1 and not set(self.par.expert_axes) <= set(self.token_axes)

    @property
    def partial_axes(self) -> tuple[str, ...]:
        """Mesh axes over which each device computes only part of the output (hidden-unit or,
        for replicated tokens, expert slices), summed over them."""
        return self.tensor_axes + (self.par.expert_axes if self.replicated else ())

    @property
    def shared_axes(self) -> tuple[str, ...]:
        """Token axes the experts' weights are the same on: marked per-device at once, their
        gradients are summed over them once, here, rather than inside the exchange's rounds,
        whose number may differ between the devices of these axes."""
        return tuple(a for a in self.token_axes if a not in self.par.expert_axes + self.tensor_axes)

    def shared_axes_of(self, projection: int) -> tuple[str, ...]:
        """The shared axes an ExpertProjections entry (by index) is to be marked per-device
        over: all but the FSDP axes it is stored split over, which `gathered` gathers."""
        stored = (self.fsdp_in, self.fsdp_in, self.fsdp_out, (), ())[projection]
        return tuple(a for a in self.shared_axes if a not in stored)

    @property
    def count_axes(self) -> tuple[str, ...]:
        """Mesh axes the dispatch counts are reduced over (each device counts its own)."""
        return self.token_axes + (self.par.expert_axes if self.replicated else ())


@dataclass(frozen=True)
class ShardedExperts:
    """An MoE layer's routed experts, picked once when it is built (`of`)."""

    dispatch: Dispatch
    gmm: ExpertMatmuls
    activation: GatedActivation
    num_experts: int

    @classmethod
    def of(cls, moe: MoeConfig, compute: ComputeConfig) -> ShardedExperts:
        gmm = expert_matmuls(compute.grouped_matmul, named_tiles(compute.grouped_matmul_tiles))
        activation = gated_activation(moe.clamped_swiglu)
        return cls(make_dispatch(moe, compute), gmm, activation, moe.num_experts)

    def __call__(
        self, x: jax.Array, expert_ids: jax.Array, weights: jax.Array, experts: ExpertProjections
    ) -> tuple[jax.Array, DispatchCounts]:
        """x [B, T, D], expert_ids/weights [B, T, k] -> (y [B, T, D], the dispatch's counts),
        each device running its own tokens through its experts."""
        active = active_rules()
        if active is None:  # no mesh: one device holds everything
            w = ExpertWeights.joined(*experts, self.activation)
            return self._on_device(x, expert_ids, weights, w, self.num_experts, Parallelism(), ())
        mesh, rules = active
        split = ExpertSplit.of(mesh, rules, x, expert_ids, experts)
        return jax.shard_map(
            functools.partial(self._per_device, split),
            mesh=mesh,
            in_specs=split.in_specs,
            out_specs=(split.tokens, P()),
        )(x, expert_ids, weights, *experts)

    def _per_device(self, split: ExpertSplit, x, expert_ids, weights, *experts):
        """One device's share, inside shard_map: its tokens, its slices of the experts."""
        experts = [
            jax.lax.pcast(p, shared, to="varying")
            if (shared := split.shared_axes_of(i)) and p is not None
            else p
            for i, p in enumerate(experts)
        ]
        # gate and up joined on this device's shards, 1/FSDP of the bytes, then gathered
        w = split.gathered(ExpertWeights.joined(*experts, self.activation))
        num_experts, par = self.num_experts, split.par
        if split.replicated:
            # Mark the shared inputs as per-device: their gradients then get summed over
            # the expert axes (each device saw only its own experts' share of them).
            x, weights = jax.lax.pcast((x, weights), par.expert_axes, to="varying")
            expert_ids, weights = keep_local_experts(expert_ids, weights, num_experts, par)
            num_experts, par = num_experts // par.degree, Parallelism()
        y, counts = self._on_device(x, expert_ids, weights, w, num_experts, par, split.partial_axes)
        if not split.count_axes:
            return y, counts
        return y, DispatchCounts(
            jax.lax.psum(counts.dropped, split.count_axes),
            jax.lax.pmax(counts.rounds, split.count_axes),
        )

    def _on_device(
        self, x, expert_ids, weights, w, num_experts, par, partial_axes
    ) -> tuple[jax.Array, DispatchCounts]:
        """One device's tokens through its experts; partial_axes: mesh axes over which each
        device computed only part of the output, summed here."""
        b, t, d = x.shape
        routed = Routed(
            x.reshape(b * t, d),
            expert_ids.reshape(b * t, -1),
            weights.reshape(b * t, -1),
            w,
            num_experts,
            self.gmm,
            par,
        )
        # Inside pipeline stages, each stage's dispatch is traced on its own (its rounds' loop
        # and custom VJP are not batched over the stages): see parallel/stage_scope.py per_stage.
        y, counts = stage_scope.per_stage(self.dispatch)(routed)
        if partial_axes:
            y = jax.lax.psum(y, partial_axes)
        return y.reshape(b, t, d), counts
