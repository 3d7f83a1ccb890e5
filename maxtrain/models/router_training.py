"""What a model adds to the train step besides its logits, behind one small interface.

The train step (training/step.py) is the same for every model: it adds the model's auxiliary loss
to the token loss, calls `after_update` once the optimizer has updated the parameters, and
reports `metrics`. What those mean is the model's business:

- a dense decoder adds nothing (`NoAuxiliary`);
- a mixture-of-experts decoder (`RouterTraining`) adds the router losses, moves its
  aux-loss-free balancing bias after each update, and reports the router's health. What those
  are is the router's (layers/router.py); where each MoE layer's router sits among the
  parameter stacks is the model's, and is all this module adds.

A new model family with training-time extras implements `AuxiliaryTraining` and is picked in
`model.define` (models/definition.py).

Statistics (`stats`) are whatever the model's forward pass returns beside its logits; over the
micro-batches of one step the train step sums them, so they are sums over tokens, from which
the metrics of the whole batch follow exactly; those named in definition.MAXIMA (the attention's
max logits) are maxima instead, combined by taking the larger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from maxtrain.config import ModelConfig, MoeConfig
from maxtrain.layers import router
from maxtrain.models.stacks import MOE_STACK, layer_kinds, rows_per_stack, stack_path

Stats = dict[str, jax.Array]


class AuxiliaryTraining(Protocol):
    def aux_loss(self, stats: Stats) -> jax.Array:
        """A scalar added to the step's mean token loss (already weighted)."""
        ...

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        """The parameters after the optimizer's update, changed by any non-gradient rule."""
        ...

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        """Step metrics from the step's summed statistics; aux_loss: its mean over tokens."""
        ...


class NoAuxiliary:
    """A model that trains on its token loss alone."""

    def aux_loss(self, stats: Stats) -> jax.Array:
        return jnp.zeros(())

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        return params

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        return {}


@dataclass(frozen=True)
class RouterTraining:
    """The MoE layers' training extras: the router's losses, metrics and balancing-bias rule
    (layers/router.py), applied here to the model's MoE stacks. Their statistics come with a
    leading axis over the MoE layers: load and probs [layers, E]; tokens, z_squares, entropy,
    dropped and rounds [layers]."""

    moe: MoeConfig
    # Where each MoE stack's layers are among the statistics' rows (the MoE layers in model
    # order): (stack key, its rows in stack order), from moe_rows_per_stack. Empty: every MoE
    # layer is in MOE_STACK, as in a model whose every layer attends.
    moe_stacks: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def aux_loss(self, stats: Stats) -> jax.Array:
        return router.aux_loss(stats, self.moe)

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        """Each MoE layer's balancing bias moved by one step (router.balance_bias_steps) from
        its value before this step (the optimizer never trains it), in a copy of `params`."""
        if self.moe.balance_bias_update_rate <= 0:
            return params
        load = stats["load"]  # [MoE layers, E] in model order
        step = router.balance_bias_steps(load, self.moe.balance_bias_update_rate)
        for stack, rows in self.moe_stacks or ((MOE_STACK, tuple(range(len(load)))),):
            path = stack_path(params, stack)
            blocks, old_blocks = _at(params, path), _at(old_params, path)
            bias = old_blocks["moe"]["router"]["bias"]  # [its layers, E], or pipelined [R, S, ., E]
            moved = bias + step[jnp.asarray(rows)].reshape(bias.shape)
            moved_router = {**blocks["moe"]["router"], "bias": moved}
            moe = {**blocks["moe"], "router": moved_router}
            params = _replace(params, path, {**blocks, "moe": moe})
        return params

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        return router.router_metrics(stats, aux_loss, self.moe.top_k)


def moe_rows_per_stack(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """RouterTraining.moe_stacks of a model: per MoE stack (attention's, linear attention's),
    the rows of the MoE layers' statistics (model order) its layers are, in stack order."""
    return rows_per_stack([kind for kind in layer_kinds(cfg) if kind.is_moe])


def _at(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _replace(tree: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of the nested dict with tree[path] = value."""
    if not path:
        return value
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}
