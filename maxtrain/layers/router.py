"""An MoE layer's router, and what trains it.

Routing (`Router`): logits x W (plus GPT-OSS's trained logit bias), scored by softmax or sigmoid;
each token's top-k experts are chosen on the scores plus the aux-loss-free balancing bias
(selection only, never the weights), inside its best groups where routing is group-limited
(DeepSeek-V3, `limit_to_best_groups`), or dealt evenly under the balanced diagnostic
(`balanced_choices`). A chosen expert's weight is its unbiased score, renormalised over the k
where model.moe.renormalize, times routed_scale.

Training: each MoE layer returns statistics (`router_stats`, below), from which follow the
auxiliary losses (`aux_loss`: Switch load balancing, ST-MoE z-loss), the step's metrics
(`router_metrics`) and the aux-loss-free bias's move after each step (`balance_bias_steps`).
models/router_training.py applies them to the model: it knows where each MoE layer's router sits
among the parameter stacks, which a layer does not.

The statistics are sums over the batch's tokens, so those of several micro-batches (gradient
accumulation, pipeline stages) add up to exactly those of the whole batch:
  tokens         tokens routed
  load [E]       assignments per expert (tokens x k in total)
  probs [E]      routing probability per expert, summed over tokens
  z_squares      squared log-sum-exp of the router logits, summed over tokens (ST-MoE z-loss)
  entropy        entropy of each token's routing distribution (nats), summed over tokens
and, added by the layer from its experts (layers/moe.py):
  dropped        assignments dropped (capacity mode, or an expert-parallel exchange set to
                 drop what overflows its buffers; 0 otherwise)
  rounds         expert-parallel exchange rounds the step ran (1 without), times tokens
Over a model they come with a leading axis over its MoE layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import MoeConfig
from maxtrain.layers.base import make_param

type RouterStats = dict[str, jax.Array]  # one layer's, or every MoE layer's stacked


class Routing(NamedTuple):
    """A batch's routing: the logits and routing distribution [B, T, E] (float32), each token's
    chosen experts and their weights [B, T, k]."""

    logits: jax.Array
    probs: jax.Array
    expert_ids: jax.Array
    weights: jax.Array


class Router(nnx.Module):
    """Token -> its k experts and their weights. Parameters: the kernel [D, E], the logits' own
    bias where model.moe.router_logit_bias, and the aux-loss-free balancing bias where
    model.moe.balance_bias_update_rate > 0."""

    def __init__(
        self, emb_dim: int, moe: MoeConfig, *, balanced: bool, init_std, param_dtype, rngs
    ):
        E = moe.num_experts
        self.kernel = make_param(
            rngs, (emb_dim, E), ("embed", None), std=init_std, dtype=param_dtype
        )
        # Trained like the kernel; starts at zero.
        self.logit_bias = (
            nnx.Param(jnp.zeros((E,), param_dtype), out_sharding=(None,), eager_sharding=False)
            if moe.router_logit_bias
            else None
        )
        # Not trained by the optimizer (its gradient is stopped): moved toward equal expert
        # load after each step (balance_bias_steps).
        self.bias = (
            nnx.Param(jnp.zeros((E,), jnp.float32), out_sharding=(None,), eager_sharding=False)
            if moe.balance_bias_update_rate > 0
            else None
        )
        self.num_experts, self.top_k = E, moe.top_k
        self.score, self.renormalize, self.routed_scale = (
            moe.score,
            moe.renormalize,
            moe.routed_scale,
        )
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.balanced = balanced  # compute.balanced_routing: a benchmark's diagnostic

    def __call__(self, x: jax.Array) -> Routing:
        """x [B, T, D] -> its routing, computed in float32."""
        logits = jnp.einsum(
            "btd,de->bte", x.astype(jnp.float32), self.kernel[...].astype(jnp.float32)
        )
        if self.logit_bias is not None:
            logits = logits + self.logit_bias[...].astype(jnp.float32)
        return self.route(logits)

    def route(self, logits: jax.Array) -> Routing:
        """The routing of logits [B, T, E]."""
        if self.score == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        select = scores
        if self.bias is not None:  # the bias steers the choice, never the weights
            select = scores + jax.lax.stop_gradient(self.bias[...])
        if self.topk_group < self.n_group:
            select = limit_to_best_groups(select, self.n_group, self.topk_group)
        if self.balanced:
            expert_ids = balanced_choices(logits.shape[:-1], self.top_k, self.num_experts)
        else:
            _, expert_ids = jax.lax.top_k(select, self.top_k)
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
        if self.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        return Routing(logits, probs, expert_ids, weights * self.routed_scale)


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
) -> RouterStats:
    """One layer's routing statistics, as sums over tokens (see the module docstring)."""
    log_probs = jnp.log(jnp.maximum(probs, jnp.finfo(jnp.float32).tiny))
    return {
        "tokens": jnp.asarray(expert_ids.shape[0] * expert_ids.shape[1], jnp.float32),
        "load": jnp.sum(jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32), (0, 1, 2)),
        "probs": jnp.sum(probs, axis=(0, 1)),
        "z_squares": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "entropy": jnp.sum(-jnp.sum(probs * log_probs, axis=-1)),
    }


def balance_loss(stats: RouterStats) -> jax.Array:
    """Per layer, the Switch Transformer load-balancing loss E * sum_e f_e * p_e (1 when
    uniform): f_e the expert's share of the assignments, p_e its mean routing probability."""
    load, tokens = stats["load"], stats["tokens"][..., None]
    fraction_routed = load / jnp.sum(load, axis=-1, keepdims=True)
    mean_prob = stats["probs"] / tokens
    return load.shape[-1] * jnp.sum(fraction_routed * mean_prob, axis=-1)


def z_loss(stats: RouterStats) -> jax.Array:
    """Per layer, the ST-MoE router z-loss: the mean over tokens of the logits' squared
    log-sum-exp."""
    return stats["z_squares"] / stats["tokens"]


def aux_loss(stats: RouterStats, moe: MoeConfig) -> jax.Array:
    """Load-balancing and router z-loss: weights x their mean over MoE layers."""
    return moe.aux_loss_weight * jnp.mean(
        balance_loss(stats)
    ) + moe.router_z_loss_weight * jnp.mean(z_loss(stats))


def router_metrics(stats: RouterStats, aux_loss: jax.Array, top_k: int) -> RouterStats:
    """Router health over the whole batch, averaged over MoE layers, plus each layer's expert
    load.

    `moe/load` [layers, experts] is each expert's share of the assignments (1/E when
    balanced); `moe/max_load` is the busiest expert's share relative to fair, 1.0 = perfectly
    balanced; `moe/dropped` the share of assignments dropped; `moe/rounds` the expert-parallel
    exchange rounds of the busiest MoE layer (mean over micro-batches).
    """
    load, tokens = stats["load"], stats["tokens"]
    share = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1.0)
    return {
        "moe/router_loss": aux_loss,
        "moe/balance_loss": jnp.mean(balance_loss(stats)),
        "moe/router_z_loss": jnp.mean(z_loss(stats)),
        "moe/entropy": jnp.mean(stats["entropy"] / tokens),
        "moe/dropped": jnp.mean(stats["dropped"] / (tokens * top_k)),
        "moe/max_load": jnp.max(share) * load.shape[-1],
        "moe/rounds": jnp.max(stats["rounds"] / tokens),
        "moe/load": share,
    }


def balance_bias_steps(load: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): the step of each layer's routing bias [layers, E]
    from its load [layers, E], added after each optimizer update. An expert's bias rises by
    `rate` when its load is below its layer's mean and falls when above, so that busy experts
    become less attractive to the top-k choice and idle ones more."""
    return rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
