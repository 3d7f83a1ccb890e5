"""What a step minimises: the objective contract, and next-token cross-entropy (pre-training,
SFT).

An objective maps (model, parameters, batch) to `LossSums`: sums over the batch, never means,
so that micro-batches, devices and held-out batches add up before the one division by the
total count (training/step.py). The loop and the step are the same for every train.task; the
task picks its objective once (maxtrain/posttrain/__init__.py `objective`). Objectives that
compare the policy with a frozen model (DPO: maxtrain/posttrain/dpo.py) say so with
`uses_reference` and get that model's parameters as `reference`; the parameter split
(training/split.py) says where they come from.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from maxtrain.kernels.cross_entropy import cross_entropy
from maxtrain.models import ModelDef
from maxtrain.parallel.context import to_layout


class LossSums(NamedTuple):
    """An objective's value on a batch (a pytree: micro-batches add up leaf by leaf)."""

    loss: jax.Array  # summed over what the objective counts
    count: jax.Array  # what it counts: target tokens (pre-training, SFT), pairs (DPO)
    z_loss: jax.Array  # summed z-loss terms (0 where the objective has none)
    aux_loss: jax.Array  # the model's auxiliary loss (router balance), a per-batch mean
    stats: dict[str, jax.Array]  # the forward pass's statistics (ModelDef.metrics reads them)
    sums: dict[str, jax.Array]  # further sums, reported per counted item (DPO: its accuracy)


class Objective(Protocol):
    """The loss a train.task minimises, in sums (LossSums)."""

    uses_reference: bool  # compares with frozen reference parameters, given as `reference`

    def __call__(
        self,
        mdef: ModelDef,
        params: Any,
        batch: dict[str, jax.Array],
        z_loss: float,
        reference: Any = None,
    ) -> LossSums: ...


class NextTokenLoss:
    """Masked next-token cross-entropy with PaLM's z-loss: pre-training, and SFT, whose data
    masks everything but the assistant's tokens (maxtrain/data/chat.py)."""

    uses_reference = False

    def __call__(
        self,
        mdef: ModelDef,
        params: Any,
        batch: dict[str, jax.Array],
        z_loss: float,
        reference: Any = None,
    ) -> LossSums:
        """The tokens are first put in the context-parallel layout (a no-op without
        mesh.context): none of the sums depends on order."""
        del reference
        batch = to_layout(batch, mdef.context_layout)
        token_loss = functools.partial(token_losses, z_loss=z_loss)
        loss, z_term, aux_loss, stats = mdef.losses(params, batch, token_loss)
        mask = batch["loss_mask"].astype(jnp.float32)
        return LossSums(loss, mask.sum(), z_term, aux_loss, stats, {})


def token_losses(
    logits: jax.Array, targets: jax.Array, loss_mask: jax.Array, z_loss: float
) -> tuple[jax.Array, jax.Array]:
    """The masked next-token cross-entropy and PaLM's z-loss of logits [B, T, V], each summed
    over the counted tokens. The z-loss pulls log Z toward 0 so the logits cannot drift, which
    keeps bf16 stable."""
    nll, log_z = cross_entropy(logits, targets)  # [B, T] float32 each
    mask = loss_mask.astype(jnp.float32)
    return (nll * mask).sum(), (z_loss * jnp.square(log_z) * mask).sum()


NEXT_TOKEN = NextTokenLoss()
