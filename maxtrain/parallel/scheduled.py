"""A pipeline schedule's table (parallel/schedules.py) run as one SPMD program, the backward
inside the schedule.

The program is a scan over ticks per phase of the table (a run of ticks with the same live
slots). In each tick every stage runs each live slot on its own unit or on nothing:

    forward   the chunk's layers, keeping each layer's input in the stage's buffer; on the
              last stage's last chunk the tail (final norm, head, loss) and its gradient
    backward  layer by layer in reverse, each layer's forward recomputed from its kept input
              and differentiated (compute.remat=full's residuals, for the units in flight
              only); or, splitting it (zero bubble), the input gradient alone, which keeps
              each layer's output gradient for
    weight    the layers' weight gradients from their kept inputs and output gradients

then the forward outputs move one stage on and the backward ones one stage back (one
collective-permute each). Stages are one computation mapped over the `stage` mesh axis
(jax.vmap with spmd_axis_name), each layer's derivative taken outside that map (jax.vjp of
the mapped layer) so that what the map does inside a stage (parallel/stage_scope.py per_stage:
the MoE exchange's rounds) is differentiated as in the automatic schedules.

Every micro-batch's loss and auxiliary loss are summed where they arise, so the function's
value and gradient are those of the whole batch's summed objective: `loss` hands jax both
through a custom VJP whose forward runs the whole table and whose backward scales the
gradients it kept by the objective's cotangent. Without a derivative (evaluation) only the
forward slots run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.stacks import STAGES
from maxtrain.parallel import stage_scope
from maxtrain.parallel.mesh import constrain
from maxtrain.parallel.pipeline import TOKENS, shift, to_micro
from maxtrain.parallel.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Table

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
    # statistics of some layers [rows, ...] -> their share of one micro-batch's auxiliary loss
    aux: Callable[[dict[str, jax.Array]], jax.Array]
    # (tail state, x [mb, T, D], targets, loss_mask) -> (summed token loss, summed z-loss)
    tail: Callable[..., tuple[jax.Array, jax.Array]]


class Sums(NamedTuple):
    """The step's sums: token loss, z-loss, each micro-batch's auxiliary loss times its count of
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
    """The batch's summed objective (token loss + z-loss + auxiliary loss, each micro-batch's
    auxiliary loss weighted by its counted tokens) and its parts, the parts without gradient.

    stages: per stack the chunks' layer states [R, S, per chunk, ...]; tail: the tail's state;
    x [B, T, D]: the pipeline's input; batch: positions, segment_ids, targets, loss_mask [B, T].
    """
    M = table.microbatches
    micro = {key: to_micro(value, M) for key, value in batch.items()}
    counts = jnp.sum(micro["loss_mask"], axis=(1, 2)).astype(jnp.float32)

    @jax.custom_vjp
    def objective(stages, tail, xs, micro, counts):
        sums, _ = _Program(model, table, micro, counts).run(stages, tail, xs, backward=False)
        return _total(sums), sums

    def forward(stages, tail, xs, micro, counts):
        sums, grads = _Program(model, table, micro, counts).run(stages, tail, xs, backward=True)
        return (_total(sums), sums), grads

    def backward(grads, cotangents):
        scale = cotangents[0]  # the objective's; the sums are handed on without gradient
        return (*jax.tree.map(lambda g: scale * g.astype(scale.dtype), grads), None, None)

    objective.defvjp(forward, backward)
    value, sums = objective(stages, tail, to_micro(x, M), micro, counts)
    return value, jax.lax.stop_gradient(sums)


def _total(sums: Sums) -> jax.Array:
    return sums.loss + sums.z_loss + sums.aux_loss


def stage_map(fn: Callable) -> Callable:
    """fn over the stages: one computation mapped over the `stage` mesh axis, traced as one
    stage's work (stage_scope.IN_STAGE)."""
    mapped = jax.vmap(fn, spmd_axis_name="stage")

    def call(*args):
        token = stage_scope.IN_STAGE.set(True)
        try:
            return mapped(*args)
        finally:
            stage_scope.IN_STAGE.reset(token)

    return call


def _per_stage(fn: Callable, *args) -> Any:
    """fn applied to each stage's part of args (leading axis S), without the stage map's
    tracing of a stage's work: buffer reads and writes."""
    return jax.vmap(fn)(*args)


def _where(flags: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """Per stage: a where flags[s], else b ([S, ...] each)."""
    return jnp.where(flags.reshape(-1, *[1] * (a.ndim - 1)), a, b)


class _Carry(NamedTuple):
    forward: jax.Array  # [S, mb, T, D]: last tick's forward outputs, sent on at the next
    backward: jax.Array  # [S, mb, T, D]: last tick's input gradients, sent back at the next
    inputs: tuple[jax.Array, ...]  # per run [S, slots + 1, layers, mb, T, D]
    pending: tuple[jax.Array, ...]  # per run [S, slots + 1, layers, 2, mb, T, D]: zero bubble
    grads: dict[str, Any]  # the stages' gradients, shaped as their states
    tail_grads: Any
    input_grads: jax.Array  # [S, M + 1, mb, T, D]: stage 0's gradients of the micro-batches
    sums: jax.Array  # [S, 3]: token loss, z-loss, weighted auxiliary loss
    stats: dict[str, jax.Array]  # [S, R, rows, ...]


class _Program:
    """The table run on one batch (see the module docstring)."""

    def __init__(self, model: StageModel, table: Table, micro: dict, counts: jax.Array):
        self.model, self.table, self.micro, self.counts = model, table, micro, counts
        self.S, self.R, self.M = table.stages, table.repeats, table.microbatches
        self.stage = jnp.arange(self.S)
        self.ring = self.R > 1  # a unit's next chunk starts on stage 0 again

    # ---- the whole table --------------------------------------------------------------------

    def run(self, stages, tail, xs, backward: bool) -> tuple[Sums, tuple]:
        slots = None if backward else (FORWARD,)
        self.stages, self.tail_state, self.xs = stages, tail, xs
        carry = self._start(stages, tail, xs, backward)
        rows = self._rows()
        for start, end, kinds in self.table.phases(slots):
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
        rows = {
            "forward": t.units[FORWARD],
            "backward": t.units[BACKWARD],
            "write": t.inputs[0],
            "read": t.inputs[1],
        }
        if t.splits_backward:
            rows |= {"weight": t.units[WEIGHT], "keep": t.pending[0], "take": t.pending[1]}
        return {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in rows.items()}

    def _start(self, stages, tail, xs, backward: bool) -> _Carry:
        S, M = self.S, self.M
        mb = xs.shape[1:]
        activations = lambda: constrain(jnp.zeros((S, *mb), xs.dtype), (STAGES, *TOKENS))
        slots = self.table.buffer_slots(self.table.inputs) + 1  # the last: idle slots' writes
        pending = self.table.buffer_slots(self.table.pending) + 1
        layers = [length for _, _, length, _ in self.model.runs] if backward else []
        split = backward and self.table.splits_backward
        buffer = lambda n, *shape: constrain(
            jnp.zeros((S, n, *shape, *mb), xs.dtype), (STAGES, None, *[None] * len(shape), *TOKENS)
        )
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        shapes = jax.eval_shape(self._chunk_forward, _chunk(stages, 0, 0), xs[0], *self._inputs(0))
        return _Carry(
            activations(),
            activations(),
            tuple(buffer(slots, n) for n in layers),
            tuple(buffer(pending, n, 2) for n in layers) if split else (),
            zeros(stages) if backward else {},
            zeros(tail) if backward else {},
            buffer(M + 1) if backward else jnp.zeros(()),
            jnp.zeros((S, 3), jnp.float32),
            jax.tree.map(lambda s: jnp.zeros((S, self.R, *s.shape), s.dtype), shapes[1]),
        )

    def _inputs(self, m) -> tuple[jax.Array, jax.Array]:
        """Positions and segment ids of micro-batch m (an index, or one per stage)."""
        return self.micro["positions"][m], self.micro["segment_ids"][m]

    def _tick(self, kinds: tuple[str, ...], backward: bool, carry: _Carry, row) -> _Carry:
        if FORWARD in kinds:
            carry, dy_tail = self._forward(carry, row, backward)
        if BACKWARD in kinds:
            carry = self._backward(carry, row, dy_tail if FORWARD in kinds else None)
        if WEIGHT in kinds:
            carry = self._weight(carry, row)
        return carry

    def _unit(self, units: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per stage: (whether the slot works, its micro-batch, its chunk)."""
        valid = units != IDLE
        u = jnp.where(valid, units, 0)
        return valid, u % self.M, u // self.M

    # ---- forward -----------------------------------------------------------------------------

    def _forward(self, carry: _Carry, row, backward: bool) -> tuple[_Carry, jax.Array | None]:
        S, R = self.S, self.R
        valid, m, r = self._unit(row["forward"])
        arriving = shift(carry.forward, +1, self.ring)
        x = _where((self.stage == 0) & (r == 0), self.xs[m], arriving)
        positions, segment_ids = self._inputs(m)
        y, stats, inputs = stage_map(self._chunk_forward)(
            _chunk(self.stages, r, None), x, positions, segment_ids
        )
        kept = carry.inputs
        if backward:  # each layer's input, until the unit's backward on this stage
            slot = jnp.where(valid, row["write"], carry.inputs[0].shape[1] - 1)
            kept = tuple(
                _per_stage(lambda b, k, v: b.at[k].set(v), buf, slot, layer_inputs)
                for buf, layer_inputs in zip(carry.inputs, inputs, strict=True)
            )
        aux = _per_stage(self.model.aux, stats) if stats else jnp.zeros((S,), jnp.float32)
        aux = aux * self.counts[m] * valid
        add = lambda total, s: _per_stage(
            lambda t, s, r, ok: t.at[r].add(jnp.where(ok, s, 0)), total, s, r, valid
        )
        carry = carry._replace(
            forward=constrain(jnp.where(valid[:, None, None, None], y, 0), (STAGES, *TOKENS)),
            inputs=kept,
            stats=jax.tree.map(add, carry.stats, stats),
            sums=carry.sums.at[:, 2].add(aux),
        )
        # The tail, on the last stage's output where it ends a unit's last chunk.
        last = valid[S - 1] & (r[S - 1] == R - 1)
        return self._tail(carry, y[S - 1], m[S - 1], last, backward)

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
        if not backward:
            nll, z = loss(self.tail_state, y)
            dy, tail_grads = None, carry.tail_grads
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
        unit = self._slot_unit(row["backward"])
        dy = shift(carry.backward, -1, self.ring)
        if dy_tail is not None:  # the last stage starts a unit's backward from the loss
            last = (self.stage == S - 1) & (unit.chunk == R - 1)
            dy = _where(last, jnp.broadcast_to(dy_tail, dy.shape), dy)
        read = _read(carry.inputs, row["read"])
        split = self.table.splits_backward
        grads, pending = carry.grads, list(carry.pending)
        if split:  # the slot where each stage keeps its layers' inputs and output gradients
            keep = jnp.where(unit.valid, row["keep"], pending[0].shape[1] - 1)
        for index in reversed(range(len(self.model.runs))):
            stack, start, length, kinds = self.model.runs[index]

            def layer(carried, i, stack=stack, start=start, kinds=kinds, index=index):
                dy, grads, kept = carried
                state, x = unit.layer_state(stack, start + i), read[index][:, i]
                f = unit.mapped_layer(stack, _layer_kind(kinds, i))
                if split:  # zero bubble: the input gradient now, the weights' later
                    _, pullback = jax.vjp(lambda x: f(state, x), x)
                    (dx,) = pullback((dy, unit.aux_cotangent))
                    pair = jnp.stack([x, dy], axis=1)  # [S, 2, mb, T, D]
                    kept = _per_stage(lambda b, k, v: b.at[k, i].set(v), kept, keep, pair)
                    return (dx, grads, kept), None
                _, pullback = jax.vjp(f, state, x)
                d_state, dx = pullback((dy, unit.aux_cotangent))
                return (dx, unit.accumulate(grads, stack, start + i, d_state), kept), None

            carried = (dy, grads, pending[index] if split else jnp.zeros(()))
            (dy, grads, kept), _ = jax.lax.scan(layer, carried, jnp.arange(length), reverse=True)
            if split:
                pending[index] = kept
        first = (self.stage == 0) & (unit.chunk == 0) & unit.valid
        spot = jnp.where(first, unit.micro, self.M)
        input_grads = _per_stage(lambda b, k, v: b.at[k].set(v), carry.input_grads, spot, dy)
        return carry._replace(
            backward=constrain(_where(unit.valid, dy, jnp.zeros_like(dy)), (STAGES, *TOKENS)),
            grads=grads,
            pending=tuple(pending),
            input_grads=input_grads,
        )

    def _weight(self, carry: _Carry, row) -> _Carry:
        """Zero bubble's weight gradients, each layer's from its kept input and output
        gradient (the layer's forward recomputed, its weights differentiated)."""
        unit = self._slot_unit(row["weight"])
        pending = _read(carry.pending, row["take"])
        grads = carry.grads
        for index, (stack, start, length, kinds) in enumerate(self.model.runs):

            def layer(grads, i, stack=stack, start=start, kinds=kinds, index=index):
                x, dy = pending[index][:, i, 0], pending[index][:, i, 1]
                f = unit.mapped_layer(stack, _layer_kind(kinds, i))
                _, pullback = jax.vjp(lambda s: f(s, x), unit.layer_state(stack, start + i))
                (d_state,) = pullback((dy, unit.aux_cotangent))
                return unit.accumulate(grads, stack, start + i, d_state), None

            grads, _ = jax.lax.scan(layer, grads, jnp.arange(length))
        return carry._replace(grads=grads)

    def _slot_unit(self, units: jax.Array) -> _SlotUnit:
        valid, m, r = self._unit(units)
        return _SlotUnit(self, valid, m, r)


class _SlotUnit:
    """What one slot of a tick works on, per stage: its unit (valid, micro-batch, chunk), and
    the layers' states, function and gradient sums for it."""

    def __init__(self, program: _Program, valid, micro, chunk):
        self.program, self.valid, self.micro, self.chunk = program, valid, micro, chunk
        self.params = _chunk(program.stages, chunk, None)  # per stack [S, per chunk, ...]
        self.positions, self.segment_ids = program._inputs(micro)
        # The auxiliary loss of a layer enters the objective times the micro-batch's count.
        self.aux_weight = program.counts[micro] * valid
        self.aux_cotangent = jnp.ones((program.S,), jnp.float32)

    def layer_state(self, stack: str, layer) -> Any:
        """Layer `layer` of the chunk's part of `stack`, every stage's: [S, ...]."""
        return jax.tree.map(lambda a: a[:, layer], self.params[stack])

    def mapped_layer(self, stack: str, kind) -> Callable:
        """(states [S, ...], x [S, mb, T, D]) -> (y, each stage's weighted auxiliary loss):
        one layer on every stage, the function a backward differentiates."""
        model = self.program.model

        def one(state, x, positions, segment_ids, weight):
            y, stats = model.layer(stack, state, x, positions, segment_ids, kind)
            aux = model.aux(jax.tree.map(lambda a: a[None], stats)) if stats else 0.0
            return y, weight * aux

        mapped = stage_map(one)
        return lambda state, x: mapped(state, x, self.positions, self.segment_ids, self.aux_weight)

    def accumulate(self, grads: dict[str, Any], stack: str, layer, d_state) -> dict[str, Any]:
        """grads[stack][chunk_s, s, layer] += d_state[s] where the slot works."""

        def add(g, d):
            def one(g, d, chunk, valid):
                return g.at[chunk, layer].add(jnp.where(valid, d, 0).astype(g.dtype))

            return jax.vmap(one, in_axes=(1, 0, 0, 0), out_axes=1)(g, d, self.chunk, self.valid)

        return {**grads, stack: jax.tree.map(add, grads[stack], d_state)}


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


def _read(buffers: tuple[jax.Array, ...], slots: jax.Array) -> tuple[jax.Array, ...]:
    """Each stage's slot of each buffer [S, slots, ...] -> [S, ...]; IDLE reads slot 0."""
    slots = jnp.maximum(slots, 0)
    return tuple(_per_stage(lambda b, k: b[k], buffer, slots) for buffer in buffers)
