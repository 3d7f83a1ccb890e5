"""What a model adds to the train step besides its logits, behind one small interface.

The train step (training/step.py) is the same for every model: it adds the model's auxiliary loss
to the token loss, calls `after_update` once the optimizer has updated the parameters, and
reports `metrics`. What those mean is the model's business:

- a dense decoder adds nothing (`NoAuxiliary`);
- a mixture-of-experts decoder (`RouterTraining`) adds the router losses, moves its
  aux-loss-free balancing bias after each update, and reports the router's health.

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
from maxtrain.models.stacks import MOE_STACK, layer_kinds, rows_per_stack, stack_path

Stats = dict[str, jax.Array]


class AuxiliaryTraining(Protocol):
    def aux_loss(self, stats: Stats) -> jax.Array:
        """A scalar added to the step's mean token loss (already weighted)."""
        ...

    def part_loss(self, stats: Stats, parts: int) -> jax.Array:
        """The auxiliary loss of one of `parts` equal parts of a batch (a pipeline
        micro-batch: parallel/scheduled.py) from its statistics, such that the parts' values add
        up to the whole batch's where the loss is a linear function of the sums, and to the
        mean of the parts' own losses where it needs the whole batch's statistics at once."""
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

    def part_loss(self, stats: Stats, parts: int) -> jax.Array:
        return jnp.zeros(())

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        return params

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        return {}


@dataclass(frozen=True)
class RouterTraining:
    """The MoE layers' training extras. Their statistics (layers/moe.py `router_stats`: sums
    over tokens) come with a leading axis over the MoE layers: load and probs [layers, E];
    tokens, z_squares, entropy, dropped and rounds [layers]."""

    moe: MoeConfig
    # Where each MoE stack's layers are among the statistics' rows (the MoE layers in model
    # order): (stack key, its rows in stack order), from moe_rows_per_stack. Empty: every MoE
    # layer is in MOE_STACK, as in a model whose every layer attends.
    moe_stacks: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def aux_loss(self, stats: Stats) -> jax.Array:
        """Load-balancing and router z-loss: weights x their mean over MoE layers."""
        return self.moe.aux_loss_weight * jnp.mean(
            balance_loss(stats)
        ) + self.moe.router_z_loss_weight * jnp.mean(stats["z_squares"] / stats["tokens"])

    def part_loss(self, stats: Stats, parts: int) -> jax.Array:
        """The loss with the part's tokens counted as the whole batch's (parts x as many):
        the z-loss is then the part's share of the whole batch's exactly, the balance loss its
        own load's balance over the parts' count (the whole batch's load is not yet known when
        a pipeline differentiates one micro-batch)."""
        return self.aux_loss({**stats, "tokens": stats["tokens"] * parts})

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        """Aux-loss-free balancing (DeepSeek-V3): one step of the per-expert routing bias.

        Each MoE layer's bias rises by `balance_bias_update_rate` for experts below the mean
        load and falls for those above it. The new value is computed from the bias before this
        step (the optimizer never trains it: its gradient is stopped), and returned in a copy of
        `params`.
        """
        if self.moe.balance_bias_update_rate <= 0:
            return params
        load = stats["load"]  # [MoE layers, E] in model order
        below_mean = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        step = self.moe.balance_bias_update_rate * below_mean
        for stack, rows in self.moe_stacks or ((MOE_STACK, tuple(range(len(load)))),):
            path = stack_path(params, stack)
            blocks, old_blocks = _at(params, path), _at(old_params, path)
            bias = old_blocks["moe"]["router"]["bias"]  # [its layers, E], or pipelined [R, S, ., E]
            moved = bias + step[jnp.asarray(rows)].reshape(bias.shape)
            router = {**blocks["moe"]["router"], "bias": moved}
            params = _replace(params, path, {**blocks, "moe": {**blocks["moe"], "router": router}})
        return params

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        """Router health over the whole batch, averaged over MoE layers, plus each layer's
        expert load.

        `moe/load` [layers, experts] is each expert's share of the assignments (1/E when
        balanced); `moe/max_load` is the busiest expert's share relative to fair, 1.0 =
        perfectly balanced; `moe/dropped` the share of assignments dropped; `moe/rounds` the
        expert-parallel exchange rounds of the busiest MoE layer (mean over micro-batches).
        """
        load, tokens = stats["load"], stats["tokens"]
        share = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1.0)
        return {
            "moe/router_loss": aux_loss,
            "moe/balance_loss": jnp.mean(balance_loss(stats)),
            "moe/router_z_loss": jnp.mean(stats["z_squares"] / tokens),
            "moe/entropy": jnp.mean(stats["entropy"] / tokens),
            "moe/dropped": jnp.mean(stats["dropped"] / (tokens * self.moe.top_k)),
            "moe/max_load": jnp.max(share) * load.shape[-1],
            "moe/rounds": jnp.max(stats["rounds"] / tokens),
            "moe/load": share,
        }


def moe_rows_per_stack(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """RouterTraining.moe_stacks of a model: per MoE stack (attention's, linear attention's),
    the rows of the MoE layers' statistics (model order) its layers are, in stack order."""
    return rows_per_stack([kind for kind in layer_kinds(cfg) if kind.is_moe])


def balance_loss(stats: Stats) -> jax.Array:
    """Per layer, the Switch Transformer load-balancing loss E * sum_e f_e * p_e (1 when
    uniform): f_e the expert's share of the assignments, p_e its mean routing probability."""
    load, tokens = stats["load"], stats["tokens"][..., None]
    fraction_routed = load / jnp.sum(load, axis=-1, keepdims=True)
    mean_prob = stats["probs"] / tokens
    return load.shape[-1] * jnp.sum(fraction_routed * mean_prob, axis=-1)


def _at(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _replace(tree: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of the nested dict with tree[path] = value."""
    if not path:
        return value
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}
