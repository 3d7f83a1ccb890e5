"""The objective each train.task minimises, picked once (`objective`); the train step and loop
are the same for all (maxtrain/training/step.py describes an objective's contract).

pretrain, sft  next-token cross-entropy on loss_mask (train_step.token_losses); SFT data masks
               everything but the assistant's tokens (maxtrain/data/chat.py)
dpo            Direct Preference Optimisation (Rafailov et al., 2023). Each batch row holds one
               pair: segment 1 the prompt and chosen answer, segment 2 the prompt and rejected
               one, loss_mask on the answers. With log-probabilities summed over each answer,
               policy pi and the frozen reference ref,
                   h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
               sigmoid: -log sigmoid(beta * h);  ipo (Azar et al., 2023): (h - 1 / (2 beta))^2.
               The reference's per-token log-probabilities come in the batch
               (`reference_logps`), computed once per batch by `reference_logps` on the same mesh
               from the parameters the run started from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.config import TrainConfig
from maxtrain.model import ModelDef
from maxtrain.model.kernels.cross_entropy import cross_entropy
from maxtrain.training.step import token_losses

REFERENCE = "reference_logps"  # the batch key DPO's reference log-probabilities come in
CHOSEN, REJECTED = 1, 2  # their segment ids in a preference row (data/chat.py PreferenceRows)


def target_logps(mdef: ModelDef, params: Any, batch: dict[str, jax.Array]):
    """([B, T] float32 log-probability of each target, 0 where loss_mask is 0; the model's
    auxiliary loss; its statistics)."""
    logits, aux_loss, stats = mdef.apply(
        params, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    nll, _ = cross_entropy(logits, batch["targets"])
    return -nll * batch["loss_mask"].astype(jnp.float32), aux_loss, stats


def reference_logps(mdef: ModelDef, reference: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """The frozen reference's target log-probabilities, to put in the batch as REFERENCE."""
    return jax.lax.stop_gradient(target_logps(mdef, reference, batch)[0])


def answer_logps(logps: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, T] per-token log-probabilities -> ([B] chosen, [B] rejected) answer totals."""
    chosen = jnp.where(segment_ids == CHOSEN, logps, 0.0).sum(-1)
    rejected = jnp.where(segment_ids == REJECTED, logps, 0.0).sum(-1)
    return chosen, rejected


def preference_losses(
    policy: jax.Array, reference: jax.Array, segment_ids: jax.Array, beta: float, kind: str
) -> tuple[jax.Array, jax.Array]:
    """([B] loss per pair, [B] log-ratio difference h) from [B, T] token log-probabilities."""
    pi_chosen, pi_rejected = answer_logps(policy, segment_ids)
    ref_chosen, ref_rejected = answer_logps(reference, segment_ids)
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if kind == "sigmoid":
        return -jax.nn.log_sigmoid(beta * h), h
    return jnp.square(h - 1.0 / (2.0 * beta)), h


def dpo_losses(
    mdef: ModelDef,
    params: Any,
    batch: dict[str, jax.Array],
    z_loss: float,
    *,
    beta: float,
    kind: str,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, dict, dict[str, jax.Array]]:
    """The DPO objective in train_step's contract: summed over the batch's pairs (rows)."""
    del z_loss  # a token-level regulariser; DPO's loss is per pair
    policy, aux_loss, stats = target_logps(mdef, params, batch)
    losses, h = preference_losses(policy, batch[REFERENCE], batch["segment_ids"], beta, kind)
    pairs = jnp.any(batch["segment_ids"] == CHOSEN, axis=-1).astype(jnp.float32)  # not padding
    sums = {
        "dpo/reward_margin": (beta * h * pairs).sum(),  # beta * h: the implicit reward's margin
        # The share of pairs the policy ranks right, relative to the reference; a tie (h = 0, as
        # at the start) counts half, so that the start reads as chance, 0.5.
        "dpo/accuracy": ((jnp.sign(h) + 1) / 2 * pairs).sum(),
    }
    return (losses * pairs).sum(), pairs.sum(), jnp.zeros(()), aux_loss, stats, sums


def objective(train: TrainConfig) -> Callable:
    """The train step's objective for train.task."""
    if train.task == "dpo":
        return functools.partial(dpo_losses, beta=train.dpo.beta, kind=train.dpo.loss)
    return token_losses
