"""Loss, gradients, optimizer update and step metrics: pure functions compiled once by
training/loop.py.

A batch is a dict of [B, T] int32 arrays: `inputs`, `targets`, `loss_mask` (1 where the target
counts), `segment_ids` (document id within a packed row, 0 = padding) and `positions` (restart
at 0 in each document).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from maxtrain.model import ModelDef
from maxtrain.model.kernels.cross_entropy import cross_entropy
from maxtrain.parallel.context import to_layout
from maxtrain.parallel.mesh import constrain
from maxtrain.training import state as state_lib
from maxtrain.training.state import TrainState


def token_losses(
    mdef: ModelDef, params: Any, batch: dict[str, jax.Array], z_loss: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, dict[str, jax.Array], dict]:
    """Returns (sum of masked token losses, number of counted tokens, sum of z-loss terms, the
    model's auxiliary loss, its forward-pass statistics, no further sums). The tokens are first
    put in the context-parallel layout (a no-op without mesh.context): none of the sums depends
    on order."""
    batch = to_layout(batch, mdef.context_layout)
    logits, aux_loss, stats = mdef.apply(
        params,
        batch["inputs"],
        batch["positions"],
        batch["segment_ids"],
        batch["targets"],
        batch["loss_mask"],
    )
    nll, log_z = cross_entropy(logits, batch["targets"])  # [B, T] float32 each
    mask = batch["loss_mask"].astype(jnp.float32)
    nll = nll * mask
    # z-loss (PaLM): pulls log Z toward 0 so the logits cannot drift, which keeps bf16 stable.
    z_term = z_loss * jnp.square(log_z) * mask
    return nll.sum(), mask.sum(), z_term.sum(), aux_loss, stats, {}


def summed_grads(
    mdef: ModelDef,
    params: Any,
    batch: dict[str, jax.Array],
    z_loss: float,
    objective: Callable = token_losses,
    frozen: Any = None,
):
    """Gradients of the summed losses with respect to `params` (a LoRA run's adapters, beside
    the `frozen` base: training/state.py). The model's auxiliary loss is a per-batch mean, scaled
    by the
    count so that the step's division by the total count leaves its configured weight."""

    def total(p):
        model_params = state_lib.model_params(p, frozen)
        loss, count, z, aux_loss, stats, sums = objective(mdef, model_params, batch, z_loss)
        aux = aux_loss * count
        return loss + z + aux, (loss, count, z, aux, stats, sums)

    (_, aux), grads = jax.value_and_grad(total, has_aux=True)(params)
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
    objective: Callable = token_losses,
    guard_nonfinite: Literal["cond", "select", "off"] = "cond",
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over the global batch, split into `grad_accum_steps` micro-batches.

    Gradients are sums over tokens divided by the token count of the whole batch, so any number
    of micro-batches gives the update one big batch would (up to float rounding). The model's
    statistics are summed over the micro-batches.

    A step whose loss or gradient is NaN/inf (metrics["finite"] false) leaves the parameters and
    optimizer state as they were (only the step count moves on): the state is never poisoned,
    whatever train.on_nonfinite then decides (skip: go on; stop: end the run), and a save can
    only ever hold finite values. How the guard is written is the compiler's business, chosen
    by platform (trainer.NONFINITE_GUARD) so that it costs no state copy and no pass over
    memory where it runs: "cond" runs the update under a conditional; "select" computes it and
    keeps the old values where the step was not finite. "off" drops the guard; only the tests
    that hold the guarded step's compiled program to the unguarded one's use that.
    """

    def split(x: jax.Array) -> jax.Array:
        # [B, T] -> [M, B/M, T] taking every M-th row: each device keeps its own rows in every
        # micro-batch, so the split moves no data (a leading [M, B/M] reshape would reshard).
        M = grad_accum_steps
        micro_x = x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)
        return constrain(micro_x, (None, "batch", "length"))

    micro = jax.tree.map(split, batch)
    grads_and_aux = functools.partial(
        summed_grads, mdef, state.params, z_loss=z_loss, objective=objective, frozen=state.frozen
    )
    if grad_accum_steps == 1:
        grad_sum, (nll, count, z, aux, stats, sums) = grads_and_aux(batch)
    else:
        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grads_and_aux, first)
        )

        def accumulate(carry, micro_batch):
            return jax.tree.map(jnp.add, carry, grads_and_aux(micro_batch)), None

        (grad_sum, (nll, count, z, aux, stats, sums)), _ = jax.lax.scan(accumulate, zeros, micro)
    denom = jnp.maximum(count, 1.0)
    grad_norm = optax.tree.norm(grad_sum) / denom
    finite = jnp.isfinite(nll) & jnp.isfinite(grad_norm)

    def update(params, opt_state):
        # A scalar multiply, not a divide: XLA fuses it into each leaf's optimizer update.
        grads = jax.tree.map(lambda g: g * (1.0 / denom), grad_sum)
        updates, new_opt_state = tx.update(grads, opt_state, params, grad_norm=grad_norm)
        new_params = optax.apply_updates(params, updates)
        return mdef.after_update(new_params, params, stats), new_opt_state

    if guard_nonfinite == "cond":
        params, opt_state = jax.lax.cond(
            finite, update, lambda p, o: (p, o), state.params, state.opt_state
        )
    elif guard_nonfinite == "select":
        new_params, new_opt_state = update(state.params, state.opt_state)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, new_params, state.params)
        opt_state = jax.tree.map(keep, new_opt_state, state.opt_state)
    else:
        params, opt_state = update(state.params, state.opt_state)
    metrics = {
        "loss": nll / denom,
        "z_loss": z / denom,
        "grad_norm": grad_norm,
        "lr": lr_schedule(state.step),
        "tokens": count,
        "finite": finite,
    }
    metrics.update({k: v / denom for k, v in sums.items()})
    metrics.update(mdef.metrics(stats, aux / denom))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(
    params: Any,
    batch: dict[str, jax.Array],
    *,
    mdef: ModelDef,
    objective: Callable = token_losses,
    frozen: Any = None,
) -> dict[str, jax.Array]:
    """The objective's summed loss and count (and its further sums) on a held-out batch."""
    nll, count, _, _, _, sums = objective(mdef, state_lib.model_params(params, frozen), batch, 0.0)
    return {"nll_sum": nll, "tokens": count, **sums}
