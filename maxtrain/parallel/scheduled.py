"""A pipeline schedule's table (parallel/schedules.py) run as one SPMD program, the backward
inside the schedule.

The program is a scan over ticks per phase of the table (a run of ticks with the same live
slots). In each tick every stage runs each live slot on its own unit or on nothing:

    forward   the chunk's layers, keeping each layer's input in the stage's buffer; on the
              last stage's last chunk the tail (final norm, head, loss) and its gradient
    backward  layer by layer in reverse, each layer's forward recomputed from its kept input
              and differentiated (compute.remat=full's residuals, for the units in flight
              only); zero bubble: the input gradient alone, keeping what the weights' needs
              (parallel/split_backward.py)
    weight    zero bubble: the projections' weight gradients from what the input gradient kept

then the forward outputs move one stage on and the input gradients one stage back (one
collective-permute each). Stages are one computation mapped over the `stage` mesh axis
(stage_scope.stage_map), each layer's derivative taken outside that map (jax.vjp of the mapped
layer) so that what the map does inside a stage (stage_scope.per_stage: the MoE exchange's
rounds) is differentiated as in the automatic schedules.

Every micro-batch's losses are summed where they arise, so the function's value and gradient
are those of the batch's summed objective: `loss` hands jax both through a custom VJP whose
forward runs the whole table and whose backward scales the gradients it kept by the
objective's cotangent. Without a derivative (evaluation) only the forward slots run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.stacks import STAGES
from maxtrain.parallel import pipeline, split_backward  # pipeline: a module, as it imports models
from maxtrain.parallel.mesh import constrain
from maxtrain.parallel.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Table
from maxtrain.parallel.stage_scope import stage_map

# A chunk's layers as consecutive runs of one stack: (stack key, the run's first layer in the
# chunk's part of that stack, its length, each layer's attention kind).
Run = tuple[str, int, int, tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class StageModel:
    """The model's side of the schedule, as functions of arrays (models/pipelined.py)."""

    runs: tuple[Run, ...]  # one chunk's layers, in model order
    # (stack, one layer's state, x [mb, T, D], positions, segment_ids, attention kind)
    #   -> (x, the layer's statistics)
    layer: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    # per-run statistics ([layers, ...] each) -> the chunk's, in layer order
    join: Callable[[list[dict[str, jax.Array]]], dict[str, jax.Array]]
    # statistics of some layers on one micro-batch [rows, ...] -> their share of the
    # micro-batch's auxiliary loss (a mean over tokens: the objective counts it times the
    # micro-batch's counted tokens, as gradient accumulation does)
    aux: Callable[[dict[str, jax.Array]], jax.Array]
    # (tail state, x [mb, T, D], targets, loss_mask) -> (summed token loss, summed z-loss)
    tail: Callable[..., tuple[jax.Array, jax.Array]]


class Sums(NamedTuple):
    """The step's sums: token loss, z-loss, the micro-batches' auxiliary losses each times its
    counted tokens, and the layers' statistics summed over micro-batches ([layers, ...] in
    model order)."""

    loss: jax.Array
    z_loss: jax.Array
    aux_loss: jax.Array
    stats: dict[str, jax.Array]


def loss(
    model: StageModel,
    table: Table,
    stages: dict[str, Any],
    tail: Any,
    x: jax.Array,
    batch: dict[str, jax.Array],
) -> tuple[jax.Array, Sums]:
    """The batch's summed objective (token loss + z-loss + each micro-batch's auxiliary loss x
    its counted tokens, as training/step.py sums them over `train.grad_accum_steps` micro-batches)
    and its parts, the parts without gradient. The auxiliary loss is taken per micro-batch
    because a micro-batch's backward starts before the last micro-batch's forward: the batch's
    routing load, which the balance loss reads, is not known yet.

    stages: per stack the chunks' layer states [R, S, per chunk, ...]; tail: the tail's state;
    x [B, T, D]: the pipeline's input; batch: positions, segment_ids, targets, loss_mask [B, T].
    """
    M = table.microbatches
    micro = {key: pipeline.to_micro(value, M) for key, value in batch.items()}

    @jax.custom_vjp
    def objective(stages, tail, xs, micro):
        sums, _ = _Program(model, table, micro).run(stages, tail, xs, backward=False)
        return _total(sums), sums

    def forward(stages, tail, xs, micro):
        sums, grads = _Program(model, table, micro).run(stages, tail, xs, backward=True)
        return (_total(sums), sums), grads

    def backward(grads, cotangents):
        scale = cotangents[0]  # the objective's; the sums are handed on without gradient
        return (*jax.tree.map(lambda g: (scale * g).astype(g.dtype), grads), None)

    objective.defvjp(forward, backward)
    value, sums = objective(stages, tail, pipeline.to_micro(x, M), micro)
    return value, jax.lax.stop_gradient(sums)


def _total(sums: Sums) -> jax.Array:
    return sums.loss + sums.z_loss + sums.aux_loss


class _Carry(NamedTuple):
    forward: jax.Array  # [S, mb, T, D]: last tick's forward outputs, sent on at the next
    backward: jax.Array  # [S, mb, T, D]: last tick's input gradients, sent back at the next
    inputs: tuple[jax.Array, ...]  # per run [S, slots + 1, layers, mb, T, D]
    # zero bubble: per run, per projection (its inputs, its output gradients), each
    # [S, slots + 1, layers, ...]
    pending: tuple[tuple[tuple[jax.Array, jax.Array], ...], ...]
    grads: dict[str, Any]  # the stages' gradients, shaped as their states
    tail_grads: Any
    input_grads: jax.Array  # [S, M + 1, mb, T, D]: stage 0's gradients of the micro-batches
    sums: jax.Array  # [S, 3]: token loss, z-loss, auxiliary loss x counted tokens
    stats: dict[str, jax.Array]  # [S, R, rows, ...]


class _Program:
    """The table run on one batch (see the module docstring)."""

    def __init__(self, model: StageModel, table: Table, micro: dict):
        self.model, self.table, self.micro = model, table, micro
        self.counts = jnp.sum(micro["loss_mask"], axis=(1, 2)).astype(jnp.float32)  # [M]
        self.S, self.R, self.M = table.stages, table.repeats, table.microbatches
        self.stage = jnp.arange(self.S)
        self.ring = self.R > 1  # a unit's next chunk starts on stage 0 again

    def run(self, stages, tail, xs, backward: bool) -> tuple[Sums, tuple]:
        self.stages, self.tail_state, self.xs = stages, tail, xs
        split = backward and self.table.splits_backward
        self.taps = tuple(self._discover(i) for i in range(len(self.model.runs))) if split else ()
        carry = self._start(backward)
        rows = self._rows()
        for start, end, kinds in self.table.phases(None if backward else (FORWARD,)):
            body = lambda c, row, kinds=kinds: (self._tick(kinds, backward, c, row), None)
            carry, _ = jax.lax.scan(body, carry, {k: v[start:end] for k, v in rows.items()})
        totals = jnp.sum(carry.sums, axis=0)
        # [S, R, rows, ...] -> [R * S * rows, ...]: model order
        stats = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), carry.stats)
        sums = Sums(totals[0], totals[1], totals[2], stats)
        return sums, (carry.grads, carry.tail_grads, carry.input_grads[0, : self.M])

    def _rows(self) -> dict[str, jax.Array]:
        """The table as the scans' per-tick inputs: [ticks, S] each."""
        t = self.table
        rows = {FORWARD: t.units[FORWARD], BACKWARD: t.units[BACKWARD]}
        rows |= {"write": t.inputs[0], "read": t.inputs[1]}
        if t.splits_backward:
            rows |= {WEIGHT: t.units[WEIGHT], "keep": t.pending[0], "take": t.pending[1]}
        return {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in rows.items()}

    def _discover(self, index: int) -> tuple[split_backward.Tap, ...]:
        """The projections a layer of run `index` calls (the run's layers are alike)."""
        stack, start, _, kinds = self.model.runs[index]
        state = jax.tree.map(lambda a: a[0, 0, start], self.stages[stack])
        positions, segment_ids = self._inputs(0)
        kind = _layer_kind(kinds, 0)
        layer = lambda s, x: self.model.layer(stack, s, x, positions, segment_ids, kind)
        return split_backward.discover(layer, state, self.xs[0])

    def _start(self, backward: bool) -> _Carry:
        S, xs = self.S, self.xs
        activations = lambda: constrain(
            jnp.zeros((S, *xs.shape[1:]), xs.dtype), (STAGES, *pipeline.TOKENS)
        )
        slots = self.table.buffer_slots(self.table.inputs) + 1  # the last: masked slots' writes
        layers = [length for _, _, length, _ in self.model.runs] if backward else []

        def buffer(n, *shape, like=xs[0]):
            zeros = jnp.zeros((S, n, *shape, *like.shape), like.dtype)
            return constrain(
                zeros, (STAGES, None, *[None] * len(shape), *pipeline.TOKENS[: like.ndim])
            )

        pending_slots = self.table.buffer_slots(self.table.pending) + 1
        pending = tuple(
            tuple(
                (buffer(pending_slots, n, like=tap.x), buffer(pending_slots, n, like=tap.y))
                for tap in taps
            )
            for n, taps in zip(layers, self.taps, strict=False)
        )
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        chunk = _chunk(self.stages, 0, 0)
        shapes = jax.eval_shape(self._chunk_forward, chunk, xs[0], *self._inputs(0))
        return _Carry(
            activations(),
            activations(),
            tuple(buffer(slots, n) for n in layers),
            pending,
            zeros(self.stages) if backward else {},
            zeros(self.tail_state) if backward else {},
            buffer(self.M + 1) if backward else jnp.zeros(()),
            jnp.zeros((S, 3), jnp.float32),
            jax.tree.map(lambda s: jnp.zeros((S, self.R, *s.shape), s.dtype), shapes[1]),
        )

    def _inputs(self, m) -> tuple[jax.Array, jax.Array]:
        """Positions and segment ids of micro-batch m (an index, or one per stage)."""
        return self.micro["positions"][m], self.micro["segment_ids"][m]

    def _tick(self, kinds: tuple[str, ...], backward: bool, carry: _Carry, row) -> _Carry:
        dy_tail = None
        if FORWARD in kinds:
            carry, dy_tail = self._forward(carry, row, backward)
        if BACKWARD in kinds:
            carry = self._backward(carry, row, dy_tail)
        if WEIGHT in kinds:
            carry = self._weight(carry, row)
        return carry

    def _slot(self, units: jax.Array) -> _Slot:
        valid = units != IDLE
        unit = jnp.where(valid, units, 0)
        return _Slot(self, valid, unit % self.M, unit // self.M)

    # ---- forward -----------------------------------------------------------------------------

    def _forward(self, carry: _Carry, row, backward: bool) -> tuple[_Carry, jax.Array | None]:
        S, R = self.S, self.R
        slot = self._slot(row[FORWARD])
        arriving = pipeline.shift(carry.forward, +1, self.ring)
        x = _where((self.stage == 0) & (slot.chunk == 0), self.xs[slot.micro], arriving)
        y, stats, inputs = stage_map(self._chunk_forward)(
            slot.params, x, slot.positions, slot.segment_ids
        )
        kept = carry.inputs
        if backward:  # each layer's input, until the unit's backward on this stage
            where = _masked(slot.valid, row["write"], carry.inputs[0])
            kept = tuple(
                _per_stage(lambda b, k, v: b.at[k].set(v), buffer, where, layer_inputs)
                for buffer, layer_inputs in zip(carry.inputs, inputs, strict=True)
            )
        aux = _per_stage(self.model.aux, stats) if stats else jnp.zeros((S,), jnp.float32)

        def add(total, value):
            one = lambda t, v, r, ok: t.at[r].add(jnp.where(ok, v, 0))
            return _per_stage(one, total, value, slot.chunk, slot.valid)

        carry = carry._replace(
            forward=constrain(_where(slot.valid, y, jnp.zeros_like(y)), (STAGES, *pipeline.TOKENS)),
            inputs=kept,
            stats=jax.tree.map(add, carry.stats, stats),
            sums=carry.sums.at[:, 2].add(aux * slot.aux_weight),
        )
        # The tail, on the last stage's output where it ends a unit's last chunk.
        last = slot.valid[S - 1] & (slot.chunk[S - 1] == R - 1)
        return self._tail(carry, y[S - 1], slot.micro[S - 1], last, backward)

    def _chunk_forward(self, chunk, x, positions, segment_ids):
        """One stage's chunk on one micro-batch: (output, statistics, per run its layers'
        inputs [layers, mb, T, D])."""
        inputs, per_run = [], []
        for stack, start, length, kinds in self.model.runs:

            def step(x, i, stack=stack, start=start, kinds=kinds):
                state = jax.tree.map(lambda a: a[start + i], chunk[stack])
                kind = _layer_kind(kinds, i)
                y, stats = self.model.layer(stack, state, x, positions, segment_ids, kind)
                return y, (x, stats)

            x, (xs, stats) = jax.lax.scan(step, x, jnp.arange(length))
            inputs.append(xs)
            per_run.append(stats)
        return x, self.model.join(per_run), tuple(inputs)

    def _tail(self, carry: _Carry, y, m, valid, backward: bool) -> tuple[_Carry, jax.Array | None]:
        """The loss of the last stage's output y [mb, T, D] (micro-batch m), and with backward
        its gradient: the tail's, kept, and y's, returned for this tick's backward slot."""
        y = constrain(y, ("stage_batch", "length", "act_embed"))
        targets, mask = self.micro["targets"][m], self.micro["loss_mask"][m]
        loss = lambda tail, y: self.model.tail(tail, y, targets, mask)
        dy, tail_grads = None, carry.tail_grads
        if not backward:
            nll, z = loss(self.tail_state, y)
        else:
            (nll, z), pullback = jax.vjp(loss, self.tail_state, y)
            scale = valid.astype(nll.dtype)
            d_tail, dy = pullback((scale, scale))
            tail_grads = jax.tree.map(jnp.add, carry.tail_grads, d_tail)
        sums = carry.sums.at[self.S - 1, :2].add(jnp.where(valid, jnp.stack([nll, z]), 0))
        return carry._replace(sums=sums, tail_grads=tail_grads), dy

    # ---- backward ----------------------------------------------------------------------------

    def _backward(self, carry: _Carry, row, dy_tail: jax.Array | None) -> _Carry:
        S, R = self.S, self.R
        slot = self._slot(row[BACKWARD])
        dy = pipeline.shift(carry.backward, -1, self.ring)
        if dy_tail is not None:  # the last stage starts a unit's backward from the loss
            last = (self.stage == S - 1) & (slot.chunk == R - 1)
            dy = _where(last, jnp.broadcast_to(dy_tail, dy.shape), dy)
        read = _read(carry.inputs, row["read"])
        grads, pending = carry.grads, list(carry.pending)
        for index in reversed(range(len(self.model.runs))):
            stack, start, length, kinds = self.model.runs[index]
            keep = None
            if self.taps and self.taps[index]:  # zero bubble: where to keep what W needs
                keep = _masked(slot.valid, row["keep"], pending[index][0][0])

            def layer(carried, i, stack=stack, start=start, kinds=kinds, index=index, keep=keep):
                dy, grads, kept = carried
                state, x = slot.layer_state(stack, start + i), read[index][:, i]
                one, extras = slot.layer(stack, _layer_kind(kinds, i))
                if not self.taps:
                    mapped = stage_map(one)
                    _, pullback = jax.vjp(lambda s, x: mapped(s, x, *extras), state, x)
                    d_state, dx = pullback((dy, slot.aux_cotangent))
                    d_leaves = dict(enumerate(jax.tree.leaves(d_state)))
                    return (dx, slot.accumulate(grads, stack, start + i, d_leaves), kept), None
                dx, d_leaves, pairs = split_backward.input_gradient(
                    one, extras, self.taps[index], state, x, (dy, slot.aux_cotangent)
                )
                kept = tuple(
                    tuple(
                        _per_stage(lambda b, k, v: b.at[k, i].set(v), buffer, keep, value)
                        for buffer, value in zip(buffers, pair, strict=True)
                    )
                    for buffers, pair in zip(kept, pairs, strict=True)
                )
                return (dx, slot.accumulate(grads, stack, start + i, d_leaves), kept), None

            carried = (dy, grads, pending[index] if self.taps else ())
            (dy, grads, kept), _ = jax.lax.scan(layer, carried, jnp.arange(length), reverse=True)
            if self.taps:
                pending[index] = kept
        first = (self.stage == 0) & (slot.chunk == 0) & slot.valid
        spot = jnp.where(first, slot.micro, self.M)
        input_grads = _per_stage(lambda b, k, v: b.at[k].set(v), carry.input_grads, spot, dy)
        return carry._replace(
            backward=constrain(
                _where(slot.valid, dy, jnp.zeros_like(dy)), (STAGES, *pipeline.TOKENS)
            ),
            grads=grads,
            pending=tuple(pending),
            input_grads=input_grads,
        )

    def _weight(self, carry: _Carry, row) -> _Carry:
        """Zero bubble's weight gradients of the projections, from what each layer's input
        gradient kept (parallel/split_backward.py)."""
        slot = self._slot(row[WEIGHT])
        take = jnp.maximum(row["take"], 0)
        grads = carry.grads
        for index, (stack, start, length, _) in enumerate(self.model.runs):
            taps, pending = self.taps[index], carry.pending[index]
            if not taps:
                continue

            def layer(grads, i, stack=stack, start=start, taps=taps, pending=pending):
                kept = [
                    tuple(_per_stage(lambda b, k: b[k, i], buffer, take) for buffer in buffers)
                    for buffers in pending
                ]
                state = slot.layer_state(stack, start + i)
                d_leaves = split_backward.weight_gradient(taps, state, kept)
                return slot.accumulate(grads, stack, start + i, d_leaves), None

            grads, _ = jax.lax.scan(layer, grads, jnp.arange(length))
        return carry._replace(grads=grads)


class _Slot:
    """One slot of a tick, per stage: whether it works, its unit's micro-batch and chunk, and
    the layers' states, function and gradient sums for them."""

    def __init__(self, program: _Program, valid, micro, chunk):
        self.program, self.valid, self.micro, self.chunk = program, valid, micro, chunk
        self.params = _chunk(program.stages, chunk, None)  # per stack [S, per chunk, ...]
        self.positions, self.segment_ids = program._inputs(micro)
        # A layer's share of the micro-batch's auxiliary loss enters the objective times the
        # micro-batch's counted tokens.
        self.aux_weight = program.counts[micro] * valid
        self.aux_cotangent = jnp.ones((program.S,), jnp.float32)

    def layer_state(self, stack: str, layer) -> Any:
        """Layer `layer` of the chunk's part of `stack`, every stage's: [S, ...]."""
        return jax.tree.map(lambda a: a[:, layer], self.params[stack])

    def layer(self, stack: str, kind) -> tuple[Callable, tuple]:
        """(one stage's (state, x, *extras) -> (y, its weighted share of the auxiliary loss),
        the extras per stage): the function a backward differentiates, to map over the
        stages."""
        model = self.program.model

        def one(state, x, positions, segment_ids, weight):
            y, stats = model.layer(stack, state, x, positions, segment_ids, kind)
            aux = model.aux(jax.tree.map(lambda a: a[None], stats)) if stats else 0.0
            return y, weight * aux

        return one, (self.positions, self.segment_ids, self.aux_weight)

    def accumulate(self, grads: dict[str, Any], stack: str, layer, d_leaves: dict) -> dict:
        """grads[stack][chunk_s, s, layer] += d_leaves[s] where the slot works, for the leaves
        (of a layer's state, by index) that d_leaves holds."""
        leaves, tree = jax.tree.flatten(grads[stack])

        def one(g, d, chunk, valid):
            return g.at[chunk, layer].add(jnp.where(valid, d, 0).astype(g.dtype))

        add = jax.vmap(one, in_axes=(1, 0, 0, 0), out_axes=1)
        for index, d in d_leaves.items():
            leaves[index] = add(leaves[index], d, self.chunk, self.valid)
        return {**grads, stack: tree.unflatten(leaves)}


def _layer_kind(kinds: tuple[int, ...], i: jax.Array) -> jax.Array | int:
    """Layer i's attention kind within its run: a constant where the run has one kind (the
    layer then traces that kind alone), else read from the run's kinds."""
    return kinds[0] if len(set(kinds)) == 1 else jnp.asarray(kinds, jnp.int32)[i]


def _chunk(stages: dict[str, Any], r, s) -> dict[str, Any]:
    """Per stack, chunk r's layers: of stage s ([per chunk, ...]), or with s None of every
    stage, r per stage ([S, per chunk, ...])."""
    if s is not None:
        return jax.tree.map(lambda a: a[r, s], stages)
    return jax.tree.map(lambda a: _per_stage(lambda a, r: a[r], a.swapaxes(0, 1), r), stages)


def _per_stage(fn: Callable, *args) -> Any:
    """fn applied to each stage's part of args (leading axis S), without the stage map's
    tracing of a stage's work: buffer reads and writes."""
    return jax.vmap(fn)(*args)


def _where(flags: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """Per stage: a where flags[s], else b ([S, ...] each)."""
    return jnp.where(flags.reshape(-1, *[1] * (a.ndim - 1)), a, b)


def _masked(valid: jax.Array, slots: jax.Array, buffer: jax.Array) -> jax.Array:
    """Per stage, the buffer slot to write: the table's, or the spare last one where the slot
    is masked."""
    return jnp.where(valid, slots, buffer.shape[1] - 1)


def _read(buffers: tuple[jax.Array, ...], slots: jax.Array) -> tuple[jax.Array, ...]:
    """Each stage's slot of each buffer [S, slots, ...] -> [S, ...]; IDLE reads slot 0."""
    slots = jnp.maximum(slots, 0)
    return tuple(_per_stage(lambda b, k: b[k], buffer, slots) for buffer in buffers)
