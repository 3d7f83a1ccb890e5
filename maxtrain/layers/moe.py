"""Mixture-of-experts feed-forward layer: a router picks k of E SwiGLU experts per token.

The router runs on the global (auto-sharded) activations like any other layer. The experts run
per device inside `shard_map` (layers/moe_dispatch.py): tokens stay on the device that holds
them, expert weights arrive gathered over FSDP and split over the `expert` mesh axis (expert
parallelism: rows travel to their experts by one of the exchanges of parallel/experts.py)
and the `tensor` axis (each device computes a slice of every expert's hidden units; the partial
outputs are summed).

GPT-OSS's experts (moe.router_logit_bias, expert_projection_bias, clamped_swiglu): a bias on the
router's logits;
the gate's and up projection's biases and the activation travel with the expert weights through
the exchanges (moe_dispatch.ExpertWeights); the down projection's bias is added per token from
its routing weights, outside them, so that experts whose hidden units are split over `tensor`
add it once.

Besides its output the layer returns router statistics, for the auxiliary losses, the
aux-loss-free bias update and the metrics (models/router_training.py turns them into
those). They are sums over the batch's tokens, so the statistics of several micro-batches (gradient
accumulation, pipeline stages) add up to exactly those of the whole batch:
  tokens         tokens routed
  load [E]       assignments per expert (tokens x k in total)
  probs [E]      routing probability per expert, summed over tokens
  z_squares      squared log-sum-exp of the router logits, summed over tokens (ST-MoE z-loss)
  entropy        entropy of each token's routing distribution (nats), summed over tokens
  dropped        assignments dropped (capacity mode, or an expert-parallel exchange set to
                 drop what overflows its buffers; 0 otherwise)
  rounds         expert-parallel exchange rounds the step ran (1 without), times tokens
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from maxtrain.config import named_tiles
from maxtrain.kernels.grouped_matmul import expert_matmuls
from maxtrain.layers import moe_dispatch
from maxtrain.layers.activations import gated_activation
from maxtrain.layers.base import Projection, make_param
from maxtrain.layers.mlp import SwiGLU
from maxtrain.layers.spec import ModelSpec
from maxtrain.parallel import stage_scope
from maxtrain.parallel.experts import make_dispatch
from maxtrain.parallel.mesh import active_rules, logical_to_spec, spec_axes

_TOKENS = ("batch", "length", "act_embed")
_ROUTES = ("batch", "length", None)
# Expert weights as stored (embed sharded by FSDP) and as the per-device code receives them:
# gathered over FSDP, still split over experts and hidden units.
_IN_AXES = ("exp", "embed", "mlp")
_OUT_AXES = ("exp", "mlp", "embed")


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


class Router(nnx.Module):
    """Token -> expert logits (plus the logits' own bias where moe.router_logit_bias), and the
    optional load-balancing bias (aux-loss-free mode)."""

    def __init__(
        self, emb_dim: int, num_experts: int, *, init_std, param_dtype, use_bias, logit_bias, rngs
    ):
        self.kernel = make_param(
            rngs, (emb_dim, num_experts), ("embed", None), std=init_std, dtype=param_dtype
        )
        # Trained like the kernel; starts at zero.
        self.logit_bias = (
            nnx.Param(
                jnp.zeros((num_experts,), param_dtype), out_sharding=(None,), eager_sharding=False
            )
            if logit_bias
            else None
        )
        # Not trained by the optimizer: models/router_training.py moves it toward equal expert load.
        self.bias = (
            nnx.Param(
                jnp.zeros((num_experts,), jnp.float32), out_sharding=(None,), eager_sharding=False
            )
            if use_bias
            else None
        )


class MoE(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        m, compute = spec.model.moe, spec.compute
        assert m is not None
        D, E, F = spec.model.emb_dim, m.num_experts, m.expert_mlp_dim
        self.num_experts, self.top_k = E, m.top_k
        self.score, self.renormalize, self.routed_scale = m.score, m.renormalize, m.routed_scale
        self.weigh_inputs = m.weight_on == "input"
        self.n_group, self.topk_group = m.n_group, m.topk_group
        self.balanced_routing = compute.balanced_routing  # a benchmark's diagnostic
        self.gmm = expert_matmuls(
            compute.grouped_matmul, named_tiles(compute.grouped_matmul_tiles)
        )  # picked once
        self.dispatch = make_dispatch(m, compute)  # how rows reach their experts, picked once
        compute_dtype = self.compute_dtype = spec.compute_dtype
        kw = dict(init_std=spec.init_std, param_dtype=spec.param_dtype, rngs=rngs)
        self.router = Router(
            D, E, use_bias=m.balance_bias_update_rate > 0, logit_bias=m.router_logit_bias, **kw
        )
        bias = m.expert_projection_bias
        self.gate = ExpertKernel((E, D, F), _IN_AXES, bias=bias, **kw)
        self.up = ExpertKernel((E, D, F), _IN_AXES, bias=bias, **kw)
        self.down = ExpertKernel((E, F, D), _OUT_AXES, bias=bias, **kw)
        self.activation = gated_activation(m.clamped_swiglu)  # picked once
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
        logits = jnp.einsum(
            "btd,de->bte", x.astype(jnp.float32), self.router.kernel[...].astype(jnp.float32)
        )
        if self.router.logit_bias is not None:
            logits = logits + self.router.logit_bias[...].astype(jnp.float32)
        probs, expert_ids, weights = self._route(logits)
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
                shared = shared * jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32)).astype(
                    shared.dtype
                )
            y = y + shared
        stats = router_stats(logits, probs, expert_ids, self.num_experts)
        stats["dropped"] = counts.dropped.astype(jnp.float32)
        stats["rounds"] = counts.rounds.astype(jnp.float32) * stats["tokens"]
        return y, stats

    def _route(self, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns (routing distribution [B,T,E], chosen experts [B,T,k], their weights)."""
        if self.score == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        select = scores
        if self.router.bias is not None:  # the bias steers the choice, never the weights
            select = scores + jax.lax.stop_gradient(self.router.bias[...])
        if self.topk_group < self.n_group:
            select = limit_to_best_groups(select, self.n_group, self.topk_group)
        if self.balanced_routing:
            expert_ids = balanced_choices(logits.shape[:-1], self.top_k, self.num_experts)
        else:
            _, expert_ids = jax.lax.top_k(select, self.top_k)
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
        if self.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        return probs, expert_ids, weights * self.routed_scale

    def _experts_on_weighted_inputs(
        self, x, expert_ids, weights
    ) -> tuple[jax.Array, moe_dispatch.DispatchCounts]:
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

    def _experts(self, x, expert_ids, weights) -> tuple[jax.Array, moe_dispatch.DispatchCounts]:
        """Runs the routed experts on each device's own tokens; returns (y, dropped, rounds)."""
        dt = self.compute_dtype
        bias = lambda kernel: None if kernel.bias is None else kernel.bias[...].astype(dt)  # noqa: E731
        projections = (
            self.gate.weight(dt),
            self.up.weight(dt),
            self.down.weight(dt),
            bias(self.gate),
            bias(self.up),
        )
        active = active_rules()
        if active is None:  # no mesh: one device holds everything
            w = moe_dispatch.ExpertWeights.joined(*projections, self.activation)
            return self._local(
                x, expert_ids, weights, w, self.num_experts, moe_dispatch.Parallelism(), ()
            )
        gate, up, down, gate_bias, up_bias = projections
        mesh, rules = active
        gathered = {**rules, "embed": []}
        x_spec = logical_to_spec(_TOKENS, rules, mesh, x.shape)
        route_spec = logical_to_spec(_ROUTES, rules, mesh, expert_ids.shape)
        in_spec = logical_to_spec(_IN_AXES, gathered, mesh, gate.shape)
        out_spec = logical_to_spec(_OUT_AXES, gathered, mesh, down.shape)
        bias_spec = None if gate_bias is None else P(in_spec[0], in_spec[2])
        expert_axes, tensor_axes = spec_axes(in_spec[0]), spec_axes(in_spec[2])
        token_axes = tuple(a for part in x_spec for a in spec_axes(part))
        par = moe_dispatch.Parallelism(expert_axes, math.prod(mesh.shape[a] for a in expert_axes))
        # Normally tokens are split over the expert axes too and travel by all-to-all. A batch
        # too small to split (e.g. a short eval batch) leaves them replicated there instead.
        replicated = par.degree > 1 and not set(expert_axes) <= set(token_axes)
        partial_axes = tensor_axes + (expert_axes if replicated else ())

        # The weights are the same on every device of these token axes: marked per-device at
        # once, their gradients are summed over them once, here, rather than inside the
        # exchange's rounds, whose number may differ between the devices of these axes.
        shared_axes = tuple(a for a in token_axes if a not in expert_axes + tensor_axes)

        def per_device(x, expert_ids, weights, gate, up, down, gate_bias, up_bias):
            weights_and_biases = (gate, up, down, gate_bias, up_bias)
            if shared_axes:
                weights_and_biases = jax.lax.pcast(weights_and_biases, shared_axes, to="varying")
            w = moe_dispatch.ExpertWeights.joined(*weights_and_biases, self.activation)
            num_experts = self.num_experts
            if replicated:
                # Mark the shared inputs as per-device: their gradients then get summed over
                # the expert axes (each device saw only its own experts' share of them).
                x, weights = jax.lax.pcast((x, weights), expert_axes, to="varying")
                expert_ids, weights = moe_dispatch.keep_local_experts(
                    expert_ids, weights, num_experts, par
                )
                num_experts //= par.degree
            y, counts = self._local(
                x,
                expert_ids,
                weights,
                w,
                num_experts,
                moe_dispatch.Parallelism() if replicated else par,
                partial_axes,
            )
            count_axes = token_axes + (expert_axes if replicated else ())
            if not count_axes:
                return y, counts
            return y, moe_dispatch.DispatchCounts(
                jax.lax.psum(counts.dropped, count_axes), jax.lax.pmax(counts.rounds, count_axes)
            )

        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(x_spec, route_spec, route_spec, in_spec, in_spec, out_spec)
            + (bias_spec, bias_spec),
            out_specs=(x_spec, P()),
        )(x, expert_ids, weights, *projections)

    def _local(
        self, x, expert_ids, weights, w, num_experts, par, partial_axes
    ) -> tuple[jax.Array, moe_dispatch.DispatchCounts]:
        """One device's tokens through its experts; partial_axes: mesh axes over which each
        device computed only part of the output (hidden-unit or expert slices), summed here."""
        b, t, d = x.shape
        flat_x = x.reshape(b * t, d)
        flat_ids = expert_ids.reshape(b * t, -1)
        flat_w = weights.reshape(b * t, -1)
        dispatch = functools.partial(self.dispatch, num_experts=num_experts, par=par, gmm=self.gmm)
        # Inside pipeline stages, each stage's dispatch is traced on its own (its rounds' loop
        # and custom VJP are not batched over the stages): see parallel/stage_scope.py per_stage.
        y, counts = stage_scope.per_stage(dispatch)(flat_x, flat_ids, flat_w, w)
        if partial_axes:
            y = jax.lax.psum(y, partial_axes)
        return y.reshape(b, t, d), counts


def balanced_choices(tokens: tuple[int, ...], top_k: int, num_experts: int) -> jax.Array:
    """[*tokens, top_k] expert ids that load every expert equally (compute.balanced_routing):
    token n's j-th choice is expert (n top_k + j) mod E, so any run of E consecutive
    assignments, a device's share of the batch included, visits each expert once, and a token's
    k choices differ (k <= E)."""
    n = math.prod(tokens)
    ids = (jnp.arange(n)[:, None] * top_k + jnp.arange(top_k)) % num_experts
    return ids.reshape(*tokens, top_k).astype(jnp.int32)


def limit_to_best_groups(select: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Group-limited routing (DeepSeek-V3): select [..., E] scores with the experts outside each
    token's `topk_group` best groups set to -inf, so that top-k picks only inside them.

    The experts form `n_group` groups of consecutive ids; a group's score is the sum of its two
    best experts' scores (its one expert's, for groups of one): a group is worth visiting when
    it has more than one good expert, as a token sends at most top_k rows to it. Consecutive ids
    are what expert parallelism places on one block of devices, so the rule also bounds the
    devices a token's rows travel to (node-limited routing).

    Written with maxima and comparisons rather than top_k: XLA's SPMD partitioner gathers the
    whole batch's operand of a top_k (measured on CPU), while these stay split like the tokens.
    """
    *lead, num_experts = select.shape
    grouped = select.reshape(*lead, n_group, num_experts // n_group)
    best = jnp.max(grouped, axis=-1)
    group_score = best
    if grouped.shape[-1] > 1:  # plus the second best: the best of the rest
        slot = jnp.arange(grouped.shape[-1])
        first = slot == jnp.argmax(grouped, axis=-1)[..., None]
        group_score = best + jnp.max(jnp.where(first, -jnp.inf, grouped), axis=-1)
    # A group's rank: the groups scoring higher, or equal with a lower id (top_k's tie order).
    ids = jnp.arange(n_group)
    other, this = group_score[..., None, :], group_score[..., :, None]
    beaten_by = (other > this) | ((other == this) & (ids[None, :] < ids[:, None]))
    kept = jnp.sum(beaten_by, axis=-1) < topk_group  # [..., G]
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(select.shape)


def router_stats(
    logits: jax.Array, probs: jax.Array, expert_ids: jax.Array, num_experts: int
) -> dict[str, jax.Array]:
    """One layer's routing statistics, as sums over tokens (see the module docstring)."""
    log_probs = jnp.log(jnp.maximum(probs, jnp.finfo(jnp.float32).tiny))
    return {
        "tokens": jnp.asarray(expert_ids.shape[0] * expert_ids.shape[1], jnp.float32),
        "load": jnp.sum(jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32), (0, 1, 2)),
        "probs": jnp.sum(probs, axis=(0, 1)),
        "z_squares": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "entropy": jnp.sum(-jnp.sum(probs * log_probs, axis=-1)),
    }
