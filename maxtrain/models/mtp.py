"""Multi-token prediction (DeepSeek-V3): `model.mtp.depth` extra modules, each predicting one
token further ahead than the one before it, trained beside the decoder and dropped at inference.

Module j (1..D) at position t takes two inputs: the previous depth's hidden state h^{j-1}_t
(h^0: the decoder's residual stream after its last layer, before the final norm) and the
embedding of token t + j. Each is RMS-normalised, the two are concatenated [embedding; hidden]
and projected 2D -> D, then one transformer block (of the kind of the decoder's last layer, dense
or MoE) gives h^j_t. The module's own RMSNorm and the decoder's output head (shared, as is the
embedding table) turn h^j_t into logits for token t + j + 1. The modules run in sequence, so
depth j conditions on everything depth j - 1 computed, and the prediction keeps its causal chain.

Token t + j + 1 is `targets[t + j]` (targets are the inputs shifted by one). A depth-j target
counts where t + j is still inside the row, in the same document as t (packed rows: equal segment
ids) and wanted by the data's loss mask; the embeddings past the row's end are zeros, and their
positions never count.

Loss and statistics. The decoder returns, beside the router statistics, `mtp_nll` [D] (the summed
loss of each depth) and `mtp_tokens` [D] (the targets counted): sums over tokens, so that those of
micro-batches add up to the batch's. `MultiTokenTraining` adds loss_weight x the mean over depths
of each depth's mean loss to the model's auxiliary loss and reports `mtp/loss_1` ... per depth.

The parameters are their own subtree, params["mtp"] ("depth_1" ... "depth_D"), which a Hugging Face
export leaves out. Each MTP block's MoE routes with the decoder's rules, but its router statistics
are not part of the balancing losses or the aux-loss-free bias update (its bias stays at zero).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import MtpConfig
from maxtrain.kernels.cross_entropy import cross_entropy
from maxtrain.layers.base import Projection
from maxtrain.layers.norms import RMSNorm
from maxtrain.layers.spec import ModelSpec
from maxtrain.models.router_training import AuxiliaryTraining, Stats
from maxtrain.parallel.mesh import constrain

# The block one module runs: () -> a decoder block taking (x, positions, segment_ids).
BlockFactory = Callable[[], nnx.Module]


class MtpModule(nnx.Module):
    """One depth: [norm(embedding); norm(hidden)] -> 2D -> D projection -> a decoder block."""

    def __init__(self, spec: ModelSpec, make_block: BlockFactory, *, rngs: nnx.Rngs):
        cfg = spec.model
        D = cfg.emb_dim
        norm_kw = dict(
            eps=cfg.norm_eps,
            param_dtype=spec.param_dtype,
            rngs=rngs,
            plus_one=cfg.norm_scale_plus_one,
        )
        self.embed_norm = RMSNorm(D, **norm_kw)
        self.hidden_norm = RMSNorm(D, **norm_kw)
        self.project = Projection(
            "btc,cd->btd", (2 * D, D), (None, "embed"), **spec.projection(rngs)
        )
        self.block = make_block()
        self.final_norm = RMSNorm(D, **norm_kw)

    def __call__(self, hidden, embedded, positions, segment_ids) -> jax.Array:
        """hidden: h^{j-1} [B, T, D]; embedded: the embeddings of tokens t + j -> h^j."""
        joined = jnp.concatenate([self.embed_norm(embedded), self.hidden_norm(hidden)], axis=-1)
        h = constrain(self.project(joined), ("batch", "length", "act_embed"))
        h, _ = self.block(h, positions, segment_ids)  # router statistics: see the docstring
        return h


class MultiTokenPrediction(nnx.Module):
    """The D modules, run in sequence on the decoder's last hidden states."""

    def __init__(self, spec: ModelSpec, make_block: BlockFactory, *, rngs: nnx.Rngs):
        self.depth = spec.model.mtp.depth
        for j in range(1, self.depth + 1):  # params["mtp"]["depth_1"], ...
            setattr(self, f"depth_{j}", MtpModule(spec, make_block, rngs=rngs))

    def __call__(
        self,
        hidden: jax.Array,
        embedded: jax.Array,
        head: Callable[[jax.Array], jax.Array],
        positions: jax.Array,
        segment_ids: jax.Array,
        targets: jax.Array,
        loss_mask: jax.Array,
    ) -> Stats:
        """hidden [B, T, D]: the decoder's output before its final norm; embedded [B, T, D]: the
        input tokens' embeddings; head: normalised states -> logits. Returns the statistics
        `mtp_nll` and `mtp_tokens`, [D] each."""
        nll, counted = [], []
        for j in range(1, self.depth + 1):
            module = getattr(self, f"depth_{j}")
            hidden = module(hidden, ahead(embedded, j), positions, segment_ids)
            mask = depth_mask(segment_ids, loss_mask, j)
            token_nll, _ = cross_entropy(head(module.final_norm(hidden)), ahead(targets, j))
            nll.append(jnp.sum(token_nll * mask))
            counted.append(jnp.sum(mask))
        return {"mtp_nll": jnp.stack(nll), "mtp_tokens": jnp.stack(counted)}


def ahead(a: jax.Array, j: int) -> jax.Array:
    """a[:, t + j] at position t ([B, T, ...]); zeros past the row's end."""
    pad = [(0, 0)] * a.ndim
    pad[1] = (0, j)
    return jnp.pad(a[:, j:], pad)


def depth_mask(segment_ids: jax.Array, loss_mask: jax.Array, j: int) -> jax.Array:
    """[B, T] float32: 1 where the depth-j target of position t counts (see the docstring)."""
    same_document = ahead(segment_ids, j) == segment_ids
    wanted = ahead(loss_mask, j) > 0  # 0 past the row's end
    return (same_document & wanted).astype(jnp.float32)


@dataclass(frozen=True)
class MultiTokenTraining:
    """The model's other training extras (`inner`: router losses, ...) plus MTP's loss."""

    inner: AuxiliaryTraining
    mtp: MtpConfig

    def mtp_loss(self, stats: Stats) -> jax.Array:
        """loss_weight x the mean over depths of each depth's mean token loss."""
        per_depth = stats["mtp_nll"] / jnp.maximum(stats["mtp_tokens"], 1.0)
        return self.mtp.loss_weight * jnp.mean(per_depth)

    def aux_loss(self, stats: Stats) -> jax.Array:
        """The inner auxiliary loss, plus MTP's where the forward pass had the targets."""
        extra = self.mtp_loss(stats) if "mtp_nll" in stats else 0.0
        return self.inner.aux_loss(stats) + extra

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        return self.inner.after_update(params, old_params, stats)

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        """The inner metrics (given the auxiliary loss less MTP's) and `mtp/loss_<j>`, each
        depth's mean token loss (unweighted, comparable to `loss`)."""
        metrics = self.inner.metrics(stats, aux_loss - self.mtp_loss(stats))
        per_depth = stats["mtp_nll"] / jnp.maximum(stats["mtp_tokens"], 1.0)
        for j in range(self.mtp.depth):
            metrics[f"mtp/loss_{j + 1}"] = per_depth[j]
        return metrics
