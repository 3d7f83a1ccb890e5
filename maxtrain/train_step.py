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

from maxtrain.kernels.cross_entropy import cross_entropy
from maxtrain.layers.context_parallel import to_layout
from maxtrain.mesh import constrain
from maxtrain.models import ModelDef
from maxtrain.state import TrainState


def token_losses(
    mdef: ModelDef, params: Any, batch: dict[str, jax.Array], z_loss: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """Returns (sum of masked token losses, number of counted tokens, sum of z-loss terms, the
    model's auxiliary loss, its forward-pass statistics). The tokens are first put in the
    context-parallel layout (a no-op without mesh.context): none of the sums depends on order."""
    batch = to_layout(batch, mdef.context_layout)
    logits, aux_loss, stats = mdef.apply(
        params, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    nll, log_z = cross_entropy(logits, batch["targets"])  # [B, T] float32 each
    mask = batch["loss_mask"].astype(jnp.float32)
    nll = nll * mask
    # z-loss (PaLM): pulls log Z toward 0 so the logits cannot drift, which keeps bf16 stable.
    z_term = z_loss * jnp.square(log_z) * mask
    return nll.sum(), mask.sum(), z_term.sum(), aux_loss, stats


def summed_grads(mdef: ModelDef, params: Any, batch: dict[str, jax.Array], z_loss: float):
    """Gradients of the summed token losses. The model's auxiliary loss is a per-batch mean,
    scaled by the token count so that the step's division by the total count leaves its
    configured weight."""

    def objective(p):
        nll, count, z, aux_loss, stats = token_losses(mdef, p, batch, z_loss)
        aux = aux_loss * count
        return nll + z + aux, (nll, count, z, aux, stats)

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
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over the global batch, split into `grad_accum_steps` micro-batches.

    Gradients are sums over tokens divided by the token count of the whole batch, so any number
    of micro-batches gives the update one big batch would (up to float rounding). The model's
    statistics are summed over the micro-batches.

    A step whose loss or gradient is NaN/inf (metrics["finite"] false) leaves the parameters and
    optimizer state as they were (only the step count moves on): the state is never poisoned,
    whatever train.on_nonfinite then decides (skip: go on; stop: end the run), and a save can
    only ever hold finite values. The cost is an elementwise select beside the update.
    """

    def split(x: jax.Array) -> jax.Array:
        # [B, T] -> [M, B/M, T] taking every M-th row: each device keeps its own rows in every
        # micro-batch, so the split moves no data (a leading [M, B/M] reshape would reshard).
        M = grad_accum_steps
        micro_x = x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)
        return constrain(micro_x, (None, "batch", "length"))

    micro = jax.tree.map(split, batch)
    grads_and_aux = functools.partial(summed_grads, mdef, state.params, z_loss=z_loss)
    if grad_accum_steps == 1:
        grad_sum, (nll, count, z, aux, stats) = grads_and_aux(batch)
    else:
        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grads_and_aux, first)
        )

        def accumulate(carry, micro_batch):
            return jax.tree.map(jnp.add, carry, grads_and_aux(micro_batch)), None

        (grad_sum, (nll, count, z, aux, stats)), _ = jax.lax.scan(accumulate, zeros, micro)
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = mdef.after_update(optax.apply_updates(state.params, updates), state.params, stats)
    finite = jnp.isfinite(nll) & jnp.isfinite(grad_norm)
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
    metrics.update(mdef.metrics(stats, aux / denom))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: Any, batch: dict[str, jax.Array], *, mdef: ModelDef) -> dict[str, jax.Array]:
    nll, count, *_ = token_losses(mdef, params, batch, 0.0)
    return {"nll_sum": nll, "tokens": count}
