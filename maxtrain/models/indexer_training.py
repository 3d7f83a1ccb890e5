"""DeepSeek sparse attention's training extra (layers/indexer.py): the indexer's KL loss.

Every attention layer with an indexer reports, per forward pass, its KL from the attention's
head-averaged distribution to the indexer's, summed over the real tokens, and their count
(layers/mla.py). Summed over micro-batches, their ratio per layer is the step's mean KL per
token; the loss adds model.mla.indexer.loss_weight times its mean over the layers. Which keys
the KL runs over, and what trains, is the stage's (model.mla.indexer.stage: warm-up over every
visible key with all but the indexer frozen, posttrain/indexer_warmup.py; sparse over the
chosen keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.layers.indexer import INDEXER_KL, INDEXER_TOKENS
from maxtrain.models.router_training import AuxiliaryTraining, Stats


def mean_kl(stats: Stats) -> jax.Array:
    """The indexers' KL per token, averaged over their layers (stats [layers] each)."""
    return jnp.mean(stats[INDEXER_KL] / jnp.maximum(stats[INDEXER_TOKENS], 1.0))


@dataclass(frozen=True)
class IndexerTraining:
    """The model's other training extras (`inner`: router losses, ...) plus the indexers'."""

    inner: AuxiliaryTraining
    loss_weight: float
    warmup: bool  # the stage: all but the indexers frozen

    def aux_loss(self, stats: Stats) -> jax.Array:
        """The inner auxiliary loss, plus the weighted KL where the forward pass trained."""
        extra = self.loss_weight * mean_kl(stats) if INDEXER_KL in stats else 0.0
        return self.inner.aux_loss(stats) + extra

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        """The inner rules (the router's balancing bias), except in the warm-up, where the
        trained parameters are the indexers alone and the rest stays as it was loaded."""
        return params if self.warmup else self.inner.after_update(params, old_params, stats)

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        """The inner metrics (given the auxiliary loss less the indexers') and `indexer/kl`,
        the unweighted mean KL."""
        kl = mean_kl(stats)
        return {**self.inner.metrics(stats, aux_loss - self.loss_weight * kl), "indexer/kl": kl}
