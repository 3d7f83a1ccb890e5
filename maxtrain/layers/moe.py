"""Mixture-of-experts feed-forward layer: a router picks k of E gated experts per token.

Its parts: the router and what trains it (layers/router.py), one device's rows through its
experts (layers/routed_experts.py), the experts over the mesh (parallel/experts.py) and the
exchanges of rows between devices (parallel/expert_exchanges.py). Here: the parameters, and the
output of the routed experts, the chosen weight on each expert's output or (model.moe.weight_on
input, Llama 4) on its input, plus the shared experts; and the router's statistics with what
the experts dropped and the exchange rounds they ran (layers/router.py lists them).

GPT-OSS's experts (moe.expert_projection_bias, clamped_swiglu): the gate's and up projection's
biases and the activation travel with the expert weights through the exchanges; the down
projection's bias is added per token from its routing weights, outside them, so that experts
whose hidden units are split over `tensor` add it once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.layers.base import Projection, make_param
from maxtrain.layers.mlp import SwiGLU
from maxtrain.layers.routed_experts import DispatchCounts
from maxtrain.layers.router import Router, router_stats
from maxtrain.layers.spec import ModelSpec
from maxtrain.parallel.experts import IN_AXES, OUT_AXES, ExpertProjections, ShardedExperts


class ExpertKernel(nnx.Module):
    """The stacked [E, in, out] weights of one projection of every expert, their [E, out] biases
    where the model has them (moe.expert_projection_bias, starting at zero), and their low-rank
    adapters when a run trains adapters (maxtrain/posttrain/ sets them)."""

    def __init__(self, shape, axes, *, init_std: float, param_dtype, bias: bool, rngs: nnx.Rngs):
        self.kernel = make_param(rngs, shape, axes, std=init_std, dtype=param_dtype)
        self.bias = (
            nnx.Param(
                jnp.zeros((shape[0], shape[2]), param_dtype),
                out_sharding=(axes[0], axes[2]),
                eager_sharding=False,
            )
            if bias
            else None
        )
        # Declared as data (nnx.data), so that adapter parameters may replace them.
        self.kernel_lora_a: nnx.LoRAParam | None = nnx.data(None)  # [E, in, rank]
        self.kernel_lora_b: nnx.LoRAParam | None = nnx.data(None)  # [E, rank, out]
        self.adapter_scale = 0.0  # alpha / rank

    def weight(self, dtype) -> jax.Array:
        """The [E, in, out] weights in dtype: W, or W + scale * A B with adapters (formed here,
        before the experts run: Qwix's adapter provider does not intercept grouped matmuls)."""
        w = self.kernel[...]
        if self.kernel_lora_a is not None:
            a, b = self.kernel_lora_a[...], self.kernel_lora_b[...]
            w = w + self.adapter_scale * jnp.einsum("eir,ero->eio", a, b).astype(w.dtype)
        return w.astype(dtype)

    def bias_in(self, dtype) -> jax.Array | None:
        """The [E, out] biases in dtype, or None without."""
        return None if self.bias is None else self.bias[...].astype(dtype)


class MoE(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        m = spec.model.moe
        assert m is not None
        D, E, F = spec.model.emb_dim, m.num_experts, m.expert_mlp_dim
        self.num_experts, self.weigh_inputs = E, m.weight_on == "input"
        self.experts = ShardedExperts.of(m, spec.compute)  # how they run, picked once
        compute_dtype = self.compute_dtype = spec.compute_dtype
        kw = dict(init_std=spec.init_std, param_dtype=spec.param_dtype, rngs=rngs)
        self.router = Router(D, m, balanced=spec.compute.balanced_routing, **kw)
        bias = m.expert_projection_bias
        self.gate = ExpertKernel((E, D, F), IN_AXES, bias=bias, **kw)
        self.up = ExpertKernel((E, D, F), IN_AXES, bias=bias, **kw)
        self.down = ExpertKernel((E, F, D), OUT_AXES, bias=bias, **kw)
        self.shared = (
            SwiGLU(D, m.shared_experts * F, compute_dtype=compute_dtype, **kw)
            if m.shared_experts
            else None
        )
        # Qwen3-Next: the shared experts' output times sigmoid(x w) per token.
        self.shared_gate = (
            Projection("btd,do->bto", (D, 1), ("embed", None), compute_dtype=compute_dtype, **kw)
            if m.shared_expert_gate
            else None
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D] -> (y [B, T, D], router statistics)."""
        routing = self.router(x)
        expert_ids, weights = routing.expert_ids, routing.weights
        if self.weigh_inputs:
            y, counts = self._experts_on_weighted_inputs(x, expert_ids, weights)
        else:
            y, counts = self._experts(x.astype(self.compute_dtype), expert_ids, weights)
        if self.down.bias is not None:  # sum_k weight_k * down bias of expert_k, per token
            routed = jnp.einsum(
                "btk,btke->bte", weights, jax.nn.one_hot(expert_ids, self.num_experts)
            )
            y = y + jnp.einsum(
                "bte,ed->btd", routed.astype(y.dtype), self.down.bias[...].astype(y.dtype)
            )
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                gate = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32))
                shared = shared * gate.astype(shared.dtype)
            y = y + shared
        stats = router_stats(routing.logits, routing.probs, expert_ids, self.num_experts)
        stats["dropped"] = counts.dropped.astype(jnp.float32)
        stats["rounds"] = counts.rounds.astype(jnp.float32) * stats["tokens"]
        return y, stats

    def _experts_on_weighted_inputs(
        self, x, expert_ids, weights
    ) -> tuple[jax.Array, DispatchCounts]:
        """Llama 4's routing (model.moe.weight_on input): each chosen expert e computes
        SwiGLU_e(w_e x), and a token's output is the sum over its k experts. Each of a token's
        k assignments becomes a row of its own, [B, T * k, D], routed to its one expert with
        weight 1: the same rows the dispatch gathers anyway (one per assignment)."""
        b, t, k = expert_ids.shape
        rows = (x[:, :, None, :] * weights[..., None]).astype(self.compute_dtype)
        y, counts = self._experts(
            rows.reshape(b, t * k, -1),
            expert_ids.reshape(b, t * k, 1),
            jnp.ones((b, t * k, 1), weights.dtype),
        )
        return jnp.sum(y.reshape(b, t, k, -1), axis=2), counts

    def _experts(self, x, expert_ids, weights) -> tuple[jax.Array, DispatchCounts]:
        """The routed experts on each device's own tokens (parallel/experts.py)."""
        dt = self.compute_dtype
        gate, up, down = (kernel.weight(dt) for kernel in (self.gate, self.up, self.down))
        projections = ExpertProjections(gate, up, down, self.gate.bias_in(dt), self.up.bias_in(dt))
        return self.experts(x, expert_ids, weights, projections)
