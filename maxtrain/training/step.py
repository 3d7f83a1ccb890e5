"""Loss, gradients, optimizer update and step metrics: pure functions compiled once by
training/loop.py.

A batch is a dict of [B, T] int32 arrays: `inputs`, `targets`, `loss_mask` (1 where the target
counts), `segment_ids` (document id within a packed row, 0 = padding) and `positions` (restart
at 0 in each document).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from maxtrain.models import ModelDef, combine_stats, no_stats
from maxtrain.parallel import pipeline
from maxtrain.parallel.mesh import constrain
from maxtrain.training.objectives import NEXT_TOKEN, LossSums, Objective
from maxtrain.training.split import ParameterSplit, WholeModel
from maxtrain.training.state import TrainState

WHOLE_MODEL = WholeModel()


def summed_grads(
    mdef: ModelDef,
    params: Any,
    batch: dict[str, jax.Array],
    z_loss: float,
    objective: Objective = NEXT_TOKEN,
    frozen: Any = None,
    split: ParameterSplit = WHOLE_MODEL,
) -> tuple[Any, LossSums]:
    """Gradients of the summed losses with respect to `params` (the split's trained part,
    beside its `frozen` one: training/split.py), and the objective's sums. The model's
    auxiliary loss is a per-batch mean, scaled by the count so that the step's division by the
    total count leaves its configured weight; LossSums.aux_loss holds it scaled."""
    reference = split.start(params, frozen) if objective.uses_reference else None

    def total(p):
        sums = objective(mdef, split.combine(p, frozen), batch, z_loss, reference)
        sums = sums._replace(aux_loss=sums.aux_loss * sums.count)
        return sums.loss + sums.z_loss + sums.aux_loss, sums

    (_, sums), grads = jax.value_and_grad(total, has_aux=True)(params)
    return grads, sums


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    mdef: ModelDef,
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    grad_accum_steps: int,
    z_loss: float,
    objective: Objective = NEXT_TOKEN,
    split: ParameterSplit = WHOLE_MODEL,
    guard_nonfinite: Literal["cond", "select", "off"] = "cond",
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over the global batch, split into `grad_accum_steps` micro-batches.

    Gradients are sums over tokens divided by the token count of the whole batch, so any number
    of micro-batches gives the update one big batch would (up to float rounding). The model's
    statistics are summed over the micro-batches (its maxima, the attention's max logits,
    maxed: models/definition.py MAXIMA).

    A step whose loss or gradient is NaN/inf (metrics["finite"] false) leaves the parameters and
    optimizer state as they were (only the step count moves on): the state is never poisoned,
    whatever train.on_nonfinite then decides (skip: go on; stop: end the run), and a save can
    only ever hold finite values. How the guard is written is the compiler's business, chosen
    by platform (trainer.NONFINITE_GUARD) so that it costs no state copy and no pass over
    memory where it runs: "cond" runs the update under a conditional; "select" computes it and
    keeps the old values where the step was not finite. "off" drops the guard; only the tests
    that hold the guarded step's compiled program to the unguarded one's use that.
    """

    grads_and_aux = functools.partial(
        summed_grads, mdef, state.params, z_loss=z_loss, objective=objective, split=split,
        frozen=state.frozen,
    )  # fmt: skip
    grad_sum, sums = _summed_over_micro_batches(grads_and_aux, batch, grad_accum_steps)
    denom = jnp.maximum(sums.count, 1.0)
    grad_norm = optax.tree.norm(grad_sum) / denom
    finite = jnp.isfinite(sums.loss) & jnp.isfinite(grad_norm)

    def update(params, opt_state):
        # A scalar multiply, not a divide: XLA fuses it into each leaf's optimizer update.
        grads = jax.tree.map(lambda g: g * (1.0 / denom), grad_sum)
        updates, new_opt_state = tx.update(grads, opt_state, params, grad_norm=grad_norm)
        new_params = optax.apply_updates(params, updates)
        return mdef.after_update(new_params, params, sums.stats), new_opt_state

    params, opt_state = _guarded(update, finite, state, guard_nonfinite)
    metrics = {
        "loss": sums.loss / denom,
        "z_loss": sums.z_loss / denom,
        "grad_norm": grad_norm,
        "lr": lr_schedule(state.step),
        "tokens": sums.count,
        "finite": finite,
        **{k: v / denom for k, v in sums.sums.items()},
        **mdef.metrics(sums.stats, sums.aux_loss / denom),
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _summed_over_micro_batches(
    grads_and_aux, batch: dict[str, jax.Array], grad_accum_steps: int
) -> tuple[Any, LossSums]:
    """grads_and_aux(batch), as sums over `grad_accum_steps` micro-batches run one after the
    other (a scan): gradients and loss sums added, the model's statistics combined."""
    if grad_accum_steps == 1:
        return grads_and_aux(batch)

    # The rows a pipeline's micro-batches take (each device keeps its own rows in every
    # micro-batch), so that an in-schedule pipeline table's auxiliary loss, per micro-batch,
    # is the one accumulation over as many micro-batches computes.
    split = lambda x: pipeline.to_micro(x, grad_accum_steps)
    micro = jax.tree.map(lambda x: constrain(split(x), (None, "batch", "length")), batch)
    first = jax.tree.map(lambda x: x[0], micro)
    grad_shapes, sum_shapes = jax.eval_shape(grads_and_aux, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grad_shapes, sum_shapes))
    start = (zeros[0], zeros[1]._replace(stats=no_stats(sum_shapes.stats)))

    def accumulate(carry, micro_batch):
        (grads, sums), (more_grads, more) = carry, grads_and_aux(micro_batch)
        grads = jax.tree.map(jnp.add, grads, more_grads)
        stats = combine_stats(sums.stats, more.stats)
        sums = jax.tree.map(jnp.add, sums._replace(stats={}), more._replace(stats={}))
        return (grads, sums._replace(stats=stats)), None

    (grad_sum, sums), _ = jax.lax.scan(accumulate, start, micro)
    return grad_sum, sums


def _guarded(
    update, finite: jax.Array, state: TrainState, guard: Literal["cond", "select", "off"]
) -> tuple[Any, Any]:
    """(params, optimizer state): update(params, opt_state) where the step is finite, else the
    old ones, written as train_step's docstring says for each guard."""
    if guard == "cond":
        return jax.lax.cond(finite, update, lambda p, o: (p, o), state.params, state.opt_state)
    if guard == "select":
        new_params, new_opt_state = update(state.params, state.opt_state)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, new_params, state.params)
        return params, jax.tree.map(keep, new_opt_state, state.opt_state)
    return update(state.params, state.opt_state)


def eval_step(
    params: Any,
    batch: dict[str, jax.Array],
    *,
    mdef: ModelDef,
    objective: Objective = NEXT_TOKEN,
    reference: Any = None,
) -> dict[str, jax.Array]:
    """The objective's summed loss and count (and its further sums) on a held-out batch.
    params: those the model runs on (ParameterSplit.combine); reference: the objective's
    reference model where it uses one (ParameterSplit.start)."""
    sums = objective(mdef, params, batch, 0.0, reference)
    return {"nll_sum": sums.loss, "tokens": sums.count, **sums.sums}
