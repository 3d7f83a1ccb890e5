"""Loss, gradients, optimizer update and step metrics: pure functions compiled once by train.py.

A batch is a dict of [B, T] int32 arrays: `inputs`, `targets`, `loss_mask` (1 where the target
counts), `segment_ids` (document id within a packed row, 0 = padding) and `positions` (restart
at 0 in each document).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxtrain.config import MoeConfig
from maxtrain.kernels.cross_entropy import cross_entropy
from maxtrain.layers.moe import balance_router_bias
from maxtrain.mesh import constrain
from maxtrain.state import ModelDef, TrainState


def token_losses(
    mdef: ModelDef, params: Any, batch: dict[str, jax.Array], z_loss: float
) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """Returns (sum of masked token losses, number of counted tokens, sum of z-loss terms,
    router statistics of the MoE layers, each with a leading layer axis; {} for dense models)."""
    logits, moe_stats = mdef.apply(
        params, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    nll, log_z = cross_entropy(logits, batch["targets"])  # [B, T] float32 each
    mask = batch["loss_mask"].astype(jnp.float32)
    nll = nll * mask
    # z-loss (PaLM): pulls log Z toward 0 so the logits cannot drift, which keeps bf16 stable.
    z_term = z_loss * jnp.square(log_z) * mask
    return nll.sum(), mask.sum(), z_term.sum(), moe_stats


def router_loss(moe_stats: dict[str, jax.Array], moe: MoeConfig | None) -> jax.Array:
    """The MoE auxiliary losses of one batch: weights x (mean over MoE layers)."""
    if moe is None:
        return jnp.zeros(())
    return moe.aux_loss_weight * jnp.mean(
        moe_stats["balance_loss"]
    ) + moe.router_z_loss_weight * jnp.mean(moe_stats["router_z_loss"])


def summed_grads(
    mdef: ModelDef,
    params: Any,
    batch: dict[str, jax.Array],
    z_loss: float,
    moe: MoeConfig | None = None,
):
    """Gradients of the summed token losses. Router losses are per-batch means, scaled by the
    token count so that the step's division by the total count leaves their configured weight."""

    def objective(p):
        nll, count, z, moe_stats = token_losses(mdef, p, batch, z_loss)
        aux = router_loss(moe_stats, moe) * count
        return nll + z + aux, (nll, count, z, aux, moe_stats)

    (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return grads, aux


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    mdef: ModelDef,
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    grad_accum_steps: int,
    z_loss: float,
    moe: MoeConfig | None = None,
    skip_nonfinite: bool = False,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over the global batch, split into `grad_accum_steps` micro-batches.

    Gradients are sums over tokens divided by the token count of the whole batch, so any number
    of micro-batches gives the update one big batch would (up to float rounding).
    """

    def split(x: jax.Array) -> jax.Array:
        # [B, T] -> [A, B/A, T] taking every A-th row: each device keeps its own rows in every
        # micro-batch, so the split moves no data (a leading [A, B/A] reshape would reshard).
        A = grad_accum_steps
        micro_x = x.reshape(x.shape[0] // A, A, *x.shape[1:]).swapaxes(0, 1)
        return constrain(micro_x, (None, "batch", "length"))

    micro = jax.tree.map(split, batch)
    grads_and_aux = functools.partial(summed_grads, mdef, state.params, z_loss=z_loss, moe=moe)
    if grad_accum_steps == 1:
        grad_sum, (nll, count, z, aux, moe_stats) = grads_and_aux(batch)
    else:
        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grads_and_aux, first)
        )

        def accumulate(carry, micro_batch):
            return jax.tree.map(jnp.add, carry, grads_and_aux(micro_batch)), None

        (grad_sum, (nll, count, z, aux, moe_stats)), _ = jax.lax.scan(accumulate, zeros, micro)
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if moe is not None and moe.bias_update_rate > 0:
        params = balance_router_bias(params, state.params, moe_stats["load"], moe.bias_update_rate)
    finite = jnp.isfinite(nll) & jnp.isfinite(grad_norm)
    if skip_nonfinite:  # a NaN/inf step leaves parameters and optimizer state untouched
        keep_old = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep_old, params, state.params)
        opt_state = jax.tree.map(keep_old, opt_state, state.opt_state)
    metrics = {
        "loss": nll / denom,
        "z_loss": z / denom,
        "grad_norm": grad_norm,
        "lr": lr_schedule(state.step),
        "tokens": count,
        "finite": finite,
    }
    if moe is not None:
        metrics.update(moe_metrics(moe_stats, grad_accum_steps, aux / denom))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: Any, batch: dict[str, jax.Array], *, mdef: ModelDef) -> dict[str, jax.Array]:
    nll, count, _, _ = token_losses(mdef, params, batch, 0.0)
    return {"nll_sum": nll, "tokens": count}


def moe_metrics(
    moe_stats: dict[str, jax.Array], num_micro_batches: int, router_loss_value: jax.Array
) -> dict[str, jax.Array]:
    """Router health, averaged over MoE layers, plus each layer's expert load.

    `moe/load` [layers, experts] is each expert's share of the assignments (1/E when balanced);
    `moe/max_load` is the busiest expert's share relative to fair, 1.0 = perfectly balanced.
    """
    load = moe_stats["load"]
    share = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1.0)
    mean = lambda name: jnp.mean(moe_stats[name]) / num_micro_batches  # noqa: E731
    return {
        "moe/router_loss": router_loss_value,
        "moe/balance_loss": mean("balance_loss"),
        "moe/router_z_loss": mean("router_z_loss"),
        "moe/entropy": mean("entropy"),
        "moe/dropped": mean("dropped"),
        "moe/max_load": jnp.max(share) * load.shape[-1],
        "moe/load": share,
    }
