"""The model as the rest of maxtrain sees it: a pure function of a params dict, plus its extras.

Parameters are kept as a plain nested dict of arrays (`nnx.to_pure_dict`): what optax, Orbax and
the checkpoint converters all handle natively. `ModelDef` holds what is needed to run the model
on such a dict inside jit (the graph definition and the logical-axis metadata of every
parameter) and what the model adds to training (models/router_training.py). The train step, the
evaluation and the tools use only this interface, so they read the same for a dense model, a
mixture of experts and whatever family comes next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.layers.base import ADAPTER_A, ADAPTER_B
from maxtrain.layers.kv_cache import StackCache
from maxtrain.layers.spec import ModelSpec
from maxtrain.models.indexer_training import IndexerTraining
from maxtrain.models.mtp import MultiTokenTraining
from maxtrain.models.qk_clip import MAX_LOGIT, QKClip
from maxtrain.models.router_training import (
    AuxiliaryTraining,
    NoAuxiliary,
    RouterTraining,
    Stats,
    moe_rows_per_stack,
)
from maxtrain.models.stacks import layer_kinds

if TYPE_CHECKING:  # parallel/pipeline.py imports the models package: no cycle at run time
    from maxtrain.parallel.pipeline import StageLayout

# (logits [B, T, V], targets, loss_mask [B, T]) -> (summed token loss, summed z-loss)
TokenLoss = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


class ModelOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] in compute dtype
    aux_loss: jax.Array  # scalar, weighted, added to the mean token loss
    stats: Stats  # forward-pass statistics (router load, ...); {} for a dense model


@dataclass(frozen=True)
class ModelDef:
    """Everything needed to run and train the model on a params dict inside jit."""

    graphdef: nnx.GraphDef
    abstract_state: nnx.State  # nnx.Param tree with shapes and logical-axis metadata
    auxiliary: AuxiliaryTraining
    layout: StageLayout | None = None  # pipeline stages (parallel/pipeline.py), or none
    context_layout: str = "contiguous"  # token order over mesh.context (parallel/context.py)
    # With adapters: the dtype they compute in, the model's compute dtype. They are kept
    # float32 (maxtrain/posttrain/) and cast here, as a projection casts its kernel: left
    # float32,
    # every adapted projection would run its low-rank products in float32.
    adapter_dtype: Any = None
    qk_clip: QKClip | None = None  # optim.qk_clip_threshold's rescale (models/qk_clip.py)
    stat_rows: int = 0  # the layers whose statistics the auxiliary loss means over (MoE's)

    def apply(
        self, params: Any, tokens, positions, segment_ids, targets=None, loss_mask=None
    ) -> ModelOutput:
        """tokens/positions/segment_ids [B, T] int32 -> logits, auxiliary loss, statistics.
        targets/loss_mask [B, T]: for a model with training objectives of its own beyond the
        next token (multi-token prediction, models/mtp.py); without them it has none."""
        model = self._module(params)
        logits, stats = model(tokens, positions, segment_ids, targets, loss_mask)
        return ModelOutput(logits, self.auxiliary.aux_loss(stats), stats)

    def losses(
        self, params: Any, batch: dict[str, jax.Array], token_loss: TokenLoss
    ) -> tuple[jax.Array, jax.Array, jax.Array, Stats]:
        """A batch's (summed token loss, summed z-loss, auxiliary loss, statistics), the first
        two by `token_loss` of the logits (an objective's: training/objectives.py); batch:
        inputs, positions, segment_ids, targets, loss_mask [B, T].

        Under a pipeline schedule that runs the backward itself (parallel/scheduled.py) the
        logits exist one micro-batch at a time on the last stage, and the auxiliary loss is each
        micro-batch's own, weighted by its counted tokens as gradient accumulation weighs it
        (the balance loss reads the routing load, which is not known for the whole batch when
        a micro-batch is differentiated); the gradient of the whole objective the train step
        sums (token loss + z-loss + auxiliary loss x count: training/step.py) rides on the token
        loss, the other two come without."""
        if self.layout is None or not self.layout.in_schedule:
            out = self.apply(
                params, *(batch[k] for k in ("inputs", "positions", "segment_ids", "targets")),
                batch["loss_mask"],
            )  # fmt: skip
            loss, z_loss = token_loss(out.logits, batch["targets"], batch["loss_mask"])
            return loss, z_loss, out.aux_loss, out.stats
        model = self._module(params)
        value, sums = model.scheduled_losses(batch, token_loss, self._layers_share)
        loss = sums.loss + (value - jax.lax.stop_gradient(value))
        count = jnp.maximum(jnp.sum(batch["loss_mask"]), 1).astype(jnp.float32)
        return loss, sums.z_loss, sums.aux_loss / count, sums.stats

    def _layers_share(self, stats: Stats) -> jax.Array:
        """Some MoE layers' share of one pipeline micro-batch's auxiliary loss from their
        statistics [rows, ...]: the loss is a mean over the layers (models/router_training.py),
        so theirs is its value on them times their share of the layers."""
        if not self.stat_rows:
            return jnp.zeros(())
        rows = jax.tree.leaves(stats)[0].shape[0]
        return self.auxiliary.aux_loss(stats) * (rows / self.stat_rows)

    def decode(
        self, params: Any, tokens, positions, cache: dict[str, StackCache]
    ) -> tuple[jax.Array, dict[str, StackCache]]:
        """Generation's forward: new tokens [B, T] at positions [B, T] (-1: a prefill's
        padding) -> their logits and the decode cache with them added (models/decoder.py
        Decoder.decode)."""
        return self._module(params).decode(tokens, positions, cache)

    def _module(self, params: Any) -> nnx.Module:
        """The model holding `params`, rebuilt from a fresh copy of the abstract state."""
        if self.adapter_dtype is not None:
            params = jax.tree_util.tree_map_with_path(
                lambda path, x: x.astype(self.adapter_dtype) if _is_adapter(path) else x, params
            )
        state = jax.tree.map(lambda v: v, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def after_update(self, params: Any, old_params: Any, stats: Stats) -> Any:
        """Called by the train step after the optimizer's update (see models/router_training.py),
        then QK-clip where the run asks for it (models/qk_clip.py)."""
        params = self.auxiliary.after_update(params, old_params, stats)
        return params if self.qk_clip is None else self.qk_clip(params, stats)

    def metrics(self, stats: Stats, aux_loss: jax.Array) -> Stats:
        """The model's own step metrics, from the step's summed statistics."""
        metrics = self.auxiliary.metrics(stats, aux_loss)
        if MAX_LOGIT in stats:  # the largest attention logit of the step, over layers and heads
            metrics["attention/max_logit"] = jnp.max(stats[MAX_LOGIT])
        if self.layout is not None:  # the schedule's idle share (parallel/pipeline.py)
            metrics["pipeline/bubble"] = jnp.asarray(self.layout.bubble, jnp.float32)
        return metrics


# Statistics that are maxima, not sums: combined over micro-batches by taking the larger.
MAXIMA = frozenset({MAX_LOGIT})


def combine_stats(a: Stats, b: Stats) -> Stats:
    """Two micro-batches' statistics as one batch's: summed, or the larger for MAXIMA."""
    return {k: (jnp.maximum if k in MAXIMA else jnp.add)(a[k], b[k]) for k in a}


def no_stats(shapes: Stats) -> Stats:
    """The statistics of no batch yet, of these shapes: zero sums, maxima at finfo.min."""
    return {
        k: jnp.full(v.shape, jnp.finfo(v.dtype).min if k in MAXIMA else 0, v.dtype)
        for k, v in shapes.items()
    }


def _is_adapter(path: tuple) -> bool:
    """An adapter's leaf, by its key path (maxtrain/posttrain/ adds them; it imports Qwix)."""
    return str(getattr(path[-1], "key", "")) in (ADAPTER_A, ADAPTER_B)


def define(
    module: nnx.Module,
    spec: ModelSpec,
    layout: StageLayout | None = None,
    adapter_dtype=None,
    qk_clip_threshold: float | None = None,
) -> ModelDef:
    """The ModelDef of a built (usually abstract) model: its graph and parameter metadata, and
    what its architecture adds to training (router statistics and load balancing, multi-token
    prediction). What the run wraps around the model first (adapters, quantized matmuls) and
    whether it clips the attention's logits (qk_clip_threshold: optim.qk_clip_threshold) are
    the run's choice: training/run_model.py."""
    graphdef, abstract_state = nnx.split(module)
    cfg = spec.model
    auxiliary = (
        RouterTraining(cfg.moe, moe_rows_per_stack(cfg)) if cfg.moe is not None else NoAuxiliary()
    )
    if cfg.mtp.depth:
        auxiliary = MultiTokenTraining(auxiliary, cfg.mtp)
    if cfg.mla is not None and cfg.mla.indexer is not None:
        indexer = cfg.mla.indexer
        auxiliary = IndexerTraining(auxiliary, indexer.loss_weight, indexer.stage == "warmup")
    qk_clip = None if qk_clip_threshold is None else QKClip.of(cfg, qk_clip_threshold)
    return ModelDef(
        graphdef,
        abstract_state,
        auxiliary,
        layout,
        spec.compute.context_layout,
        adapter_dtype,
        qk_clip,
        sum(kind.is_moe for kind in layer_kinds(cfg)) if cfg.moe is not None else 0,
    )
