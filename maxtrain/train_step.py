"""Loss, gradients, optimizer update and step metrics: pure functions compiled once by train.py.

A batch is a dict of [B, T] int32 arrays: `inputs`, `targets`, `loss_mask` (1 where the target
counts), `segment_ids` (document id within a packed row, 0 = padding) and `positions` (restart
at 0 in each document).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxtrain.kernels.cross_entropy import cross_entropy
from maxtrain.mesh import constrain
from maxtrain.state import ModelDef, TrainState


def token_losses(
    mdef: ModelDef, params: Any, batch: dict[str, jax.Array], z_loss: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (sum of masked token losses, number of counted tokens, sum of z-loss terms)."""
    logits = mdef.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
    nll, log_z = cross_entropy(logits, batch["targets"])  # [B, T] float32 each
    mask = batch["loss_mask"].astype(jnp.float32)
    nll = nll * mask
    # z-loss (PaLM): pulls log Z toward 0 so the logits cannot drift, which keeps bf16 stable.
    z_term = z_loss * jnp.square(log_z) * mask
    return nll.sum(), mask.sum(), z_term.sum()


def summed_grads(mdef: ModelDef, params: Any, batch: dict[str, jax.Array], z_loss: float):
    def objective(p):
        nll, count, z = token_losses(mdef, p, batch, z_loss)
        return nll + z, (nll, count, z)

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

    def accumulate(carry, micro_batch):
        grads, aux = summed_grads(mdef, state.params, micro_batch, z_loss)
        return jax.tree.map(jnp.add, carry, (grads, aux)), None

    zeros = (
        jax.tree.map(jnp.zeros_like, state.params),
        (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())),
    )
    if grad_accum_steps == 1:
        grad_sum, (nll, count, z) = summed_grads(mdef, state.params, batch, z_loss)
    else:
        (grad_sum, (nll, count, z)), _ = jax.lax.scan(accumulate, zeros, micro)
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
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
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: Any, batch: dict[str, jax.Array], *, mdef: ModelDef) -> dict[str, jax.Array]:
    nll, count, _ = token_losses(mdef, params, batch, 0.0)
    return {"nll_sum": nll, "tokens": count}
