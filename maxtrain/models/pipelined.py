"""The decoder with its layers in pipeline stages (parallel/pipeline.py): its parameters, and
the two ways it runs, by the schedule's kind (parallel/schedules.py).

- gpipe, circular: `__call__` runs the stages forward (parallel/pipeline.py run) and returns the
  logits; jax differentiates the whole (every forward, then every backward).
- 1f1b, interleaved_1f1b, zero_bubble: `scheduled_losses` runs the schedule's table with each
  micro-batch's loss taken on the last stage and its backward interleaved with later
  micro-batches' forwards (parallel/scheduled.py), and returns the losses, their gradient
  carried by a custom VJP. The logits are never whole: each micro-batch's live only in its tick.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
from flax import nnx

from maxtrain.layers.attention_pattern import kind_per_layer
from maxtrain.layers.spec import ModelSpec
from maxtrain.models.decoder import (
    BLOCK_KINDS,
    Decoder,
    apply_layer,
    concatenate_runs,
    head_logits,
    run_stack,
    runs_with_attention,
    stacked_blocks,
)
from maxtrain.models.stacks import STAGES, layer_runs
from maxtrain.parallel import pipeline, scheduled

if TYPE_CHECKING:  # parallel/pipeline.py imports the models package: no cycle at run time
    from maxtrain.parallel.pipeline import StageLayout


class Stages(nnx.Module):
    """The pipelined stacks (parallel/pipeline.py): per kind of layer, [R, S, per group] blocks."""

    def __init__(self, spec: ModelSpec, layout: StageLayout, rngs: nnx.Rngs):
        for layer_kind, kind in BLOCK_KINDS.items():
            counts = (
                ("repeats", layout.repeats),
                (STAGES, layout.stages),
                ("layers", layout.per_group(layer_kind)),
            )
            setattr(self, kind.stack, stacked_blocks(spec, kind, counts, rngs=rngs))


class Tail(nnx.Module):
    """A decoder's final norm and head, shared with it: what a schedule that takes each
    micro-batch's loss on the last stage runs there, on that micro-batch alone."""

    head_batch = "batch"

    def __init__(self, decoder: Decoder):
        self.final_norm = decoder.final_norm
        self.lm_head = decoder.lm_head
        self.embedding = decoder.embedding
        self.compute_dtype = decoder.compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """The last layer's output [B, T, D] -> logits [B, T, V]."""
        return head_logits(self, self.final_norm(x))


class PipelinedDecoder(Decoder):
    """The decoder with its layers in pipeline stages: the leading dense layers (prologue) in
    their stacks, run on every stage, the rest in `stages` (parallel/pipeline.py). Its
    parameters are parallel/pipeline.py to_stages of the Decoder's; it is never initialised
    itself."""

    # After the pipeline the batch is split over the stages too: each computes the logits of
    # its share instead of all of them.
    head_batch = "stage_batch"

    def __init__(self, spec: ModelSpec, layout: StageLayout, *, rngs: nnx.Rngs):
        self.layout = layout
        super().__init__(spec, rngs=rngs)

    def _build_layers(self, spec: ModelSpec, rngs: nnx.Rngs) -> None:
        prologue = self.layout.prologue
        for layer_kind, kind in BLOCK_KINDS.items():
            counts = (("layers", prologue.count(layer_kind)),)
            setattr(self, kind.stack, stacked_blocks(spec, kind, counts, rngs=rngs))
        self.stages = Stages(spec, self.layout, rngs)
        self.group_runs = runs_with_attention(layer_runs(self.layout.group), self.layout.attention)
        attention = kind_per_layer(spec.model)[: len(prologue)]
        self.prologue_runs = runs_with_attention(layer_runs(prologue), attention)

    def _stacks(self) -> dict[str, nnx.Module]:
        """The pipelined stacks present, by params key."""
        stacks = {kind.stack: getattr(self.stages, kind.stack) for kind in BLOCK_KINDS.values()}
        return {key: stack for key, stack in stacks.items() if stack is not None}

    def _layers(self, x, positions, segment_ids) -> tuple[jax.Array, dict[str, jax.Array]]:
        # dense layers: no statistics
        x, _ = self._run_layers(self.prologue_runs, x, positions, segment_ids)
        return pipeline.run(self._stacks(), self.layout, x, positions, segment_ids, self._run_group)

    def _run_group(self, graphdefs, group, x, positions, segment_ids):
        """One group's layers (per stack [per group, ...]) in model order."""
        per_run = []
        for stack, start, length, kinds in self.group_runs:
            x, stats = run_stack(
                graphdefs[stack], group[stack], start, length, x, positions, segment_ids,
                kinds=kinds, **self._run_options,
            )  # fmt: skip
            per_run.append(stats)
        return x, concatenate_runs(per_run)

    def scheduled_losses(
        self,
        batch: dict[str, jax.Array],
        token_loss: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
        aux_share: Callable[[dict[str, jax.Array]], jax.Array],
    ) -> tuple[jax.Array, scheduled.Sums]:
        """The batch's summed objective under an in-schedule table (module docstring) and its
        parts without gradient (parallel/scheduled.py loss). batch: inputs, positions,
        segment_ids, targets, loss_mask [B, T]; token_loss: the objective's loss of a
        micro-batch's logits; aux_share: some layers' share of a micro-batch's auxiliary loss
        from their statistics."""
        positions, segment_ids = batch["positions"], batch["segment_ids"]
        x = self._embed(batch["inputs"])
        x, _ = self._run_layers(self.prologue_runs, x, positions, segment_ids)
        split = {key: nnx.split(stack) for key, stack in self._stacks().items()}
        graphdefs = {key: graphdef for key, (graphdef, _) in split.items()}
        tail_graph, tail_state = nnx.split(Tail(self))

        def layer(stack, state, x, positions, segment_ids, kind):
            return apply_layer(graphdefs[stack], state, x, positions, segment_ids, kind)

        def tail(state, x, targets, loss_mask):
            return token_loss(nnx.merge(tail_graph, state)(x), targets, loss_mask)

        model = scheduled.StageModel(self.group_runs, layer, concatenate_runs, aux_share, tail)
        states = {key: state for key, (_, state) in split.items()}
        inputs = {k: batch[k] for k in ("positions", "segment_ids", "targets", "loss_mask")}
        return scheduled.loss(model, self.layout.table, states, tail_state, x, inputs)
