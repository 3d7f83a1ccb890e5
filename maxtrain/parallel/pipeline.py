"""Pipeline parallelism: the decoder's layers split into stages that micro-batches flow through.

`mesh.stage` (within a slice) times `mesh.dcn.stage` (across slices) is S, the number of
stages. The layers after the leading dense ones are cut into S x R groups of consecutive layers
(R = `pipeline.repeats`), and stage s holds groups s, S + s, 2S + s, ...: with R = 1 one block
of consecutive layers (GPipe), with R > 1 several blocks spread over the depth (the circular,
or interleaved, schedule). Each stage's parameters and optimizer state live only on its devices
and are still split by fsdp, tensor and expert inside the stage. The leading dense layers of an
MoE model (DeepSeek-V3's first three of model.layers) may run before the pipeline on every
stage: the groups must all hold the same kinds of layers, so the period of model.layers must
divide a group's size.

The schedule. The batch is cut into M micro-batches (`pipeline.microbatches`). At iteration t,
stage s runs unit u = t - s: micro-batch u mod M through its group of repeat u div M. Every
stage works at once (the stages are one computation mapped over the `stage` mesh axis), and
after each iteration the outputs shift one stage on, stage S-1's back to stage 0 (one
collective-permute of a micro-batch's activations). Stage 0 keeps the activations that come
back in a buffer of M slots until their next repeat, which needs M >= S. R * M + S - 1
iterations run R * M units per stage, so a stage is idle for a fraction

    bubble = (S - 1) / (R * M + S - 1)

of the step: more micro-batches or more repeats shrink it (a repeat costs one more pass of
activations around the ring, and R * M units of backward activations stay in flight as with
GPipe). The backward pass is the automatic derivative of the forward loop: all forward
iterations, then all backward ones (GPipe order), each stage's gradients landing on its devices.

Checkpoints keep the layers in model order ([layers, ...] per stack, as without a pipeline), so
a run resumes with another S or R, or none, and every tool reads a pipelined run's checkpoint
as any other: `to_stages` / `to_model_order` convert at the boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config.parallel import IN_SCHEDULE
from maxtrain.models.stacks import STACKS, STAGES, LayerKind
from maxtrain.parallel import schedules, stage_scope
from maxtrain.parallel.mesh import active_rules, constrain, logical_to_spec


@dataclass(frozen=True)
class StageLayout:
    """How a model's layers are spread over pipeline stages and the schedule that runs them."""

    stages: int  # S
    repeats: int  # R: groups per stage
    microbatches: int  # M
    # the kinds (models/stacks.py) of the leading dense layers, run before the pipeline
    prologue: tuple[LayerKind, ...]
    group: tuple[LayerKind, ...]  # the kind of each layer of a group, in order
    # each layer's attention kind (layers/attention_pattern.py), alike in every group
    attention: tuple[int, ...]
    schedule: str = "gpipe"  # parallel/schedules.py

    def per_group(self, kind: LayerKind) -> int:
        return self.group.count(kind)

    @property
    def iterations(self) -> int:
        """Forward iterations of the automatic schedules (gpipe, circular)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def in_schedule(self) -> bool:
        """Whether the schedule runs the backward itself (parallel/scheduled.py)."""
        return self.schedule in IN_SCHEDULE

    @property
    def table(self) -> schedules.Table:
        return schedules.build(self.schedule, self.stages, self.repeats, self.microbatches)

    @property
    def bubble(self) -> float:
        """The share of the step each stage idles, by the schedule's table with every pass
        over a unit's layers alike: a forward, an input gradient and a weight gradient one
        each (docs/pipeline.md: gpipe's (S - 1) / (R M + S - 1))."""
        return self.table.idle_share(schedules.PASSES)


# ---- parameters: model order <-> stages ----------------------------------------------------


def to_stages(params: dict[str, Any], layout: StageLayout) -> dict[str, Any]:
    """A params dict in model order -> the pipelined one: the prologue's dense layers stay in
    their stacks, the rest of each stack becomes params["stages"][stack], [R, S, per group, ...].
    The groups are consecutive layers, so this is a reshape (row-major: group r * S + s)."""
    out = {k: v for k, v in params.items() if k not in STACKS.values()}
    for kind, key in STACKS.items():
        if (count := layout.prologue.count(kind)) and key in params:
            out[key] = jax.tree.map(lambda a, count=count: a[:count], params[key])

    def grouped(stack: Any, skip: int, count: int) -> Any:
        shape = (layout.repeats, layout.stages, count)
        return jax.tree.map(lambda a: a[skip:].reshape(*shape, *a.shape[1:]), stack)

    # A run's adapters (maxtrain/posttrain/) may sit on one kind of layer only: a stack
    # without any is absent from their tree.
    stages = {
        key: grouped(params[key], layout.prologue.count(kind), layout.per_group(kind))
        for kind, key in STACKS.items()
        if layout.per_group(kind) and key in params
    }
    return {**out, STAGES: stages} if stages else out


def to_model_order(params: dict[str, Any], layout: StageLayout) -> dict[str, Any]:
    """The inverse of to_stages."""
    out = {k: v for k, v in params.items() if k not in (STAGES, *STACKS.values())}
    for kind, key in STACKS.items():
        parts = []
        if layout.prologue.count(kind) and key in params:
            parts.append(params[key])
        if key in params.get(STAGES, {}):
            parts.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), params[STAGES][key]))
        if parts:
            out[key] = jax.tree.map(lambda *p: jnp.concatenate(p), *parts)
    return out


def map_params(tree: Any, convert: Callable[[dict], dict]) -> Any:
    """`convert` applied to every params dict in a train state: the parameters and each
    optimizer moment shaped like them. They are recognised by their layer stacks (in model
    order or in stages), the outermost dict holding one: an adapted run trains only its adapters,
    whose tree has no embedding or final norm but the stacks of the layers they adapt."""

    def is_params(node: Any) -> bool:
        return isinstance(node, dict) and any(k in node for k in (STAGES, *STACKS.values()))

    return jax.tree.map(lambda n: convert(n) if is_params(n) else n, tree, is_leaf=is_params)


# ---- the schedule -----------------------------------------------------------------------------

# (the states of one group's stacks {stack: [per group, ...]}, x [mb, T, D], positions,
# segment_ids [mb, T]) -> (x, statistics of the group's layers)
GroupFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def run(
    stacks: dict[str, nnx.Module],
    layout: StageLayout,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    run_group: GroupFn,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, D] through every group of every stage, in the schedule of the module docstring.

    stacks: the pipelined stacks, parameters [R, S, per group, ...]. Returns the output [B, T, D]
    and the statistics of the MoE layers, [layers, ...] in model order (sums over tokens).
    """
    S, R, M = layout.stages, layout.repeats, layout.microbatches
    split = {key: nnx.split(module) for key, module in stacks.items()}
    graphdefs, states = ({key: parts[i] for key, parts in split.items()} for i in (0, 1))
    xs, pos, seg = (to_micro(a, M) for a in (x, positions, segment_ids))
    # Every stage holds a buffer of M slots (only stage 0's is used: the micro-batches before
    # their first repeat, then each one back from stage S-1 until its next), so that all the
    # bookkeeping below is local to a stage and the one exchange per iteration is the shift.
    slots = constrain(jnp.broadcast_to(xs, (S, *xs.shape)), (STAGES, None, *TOKENS))
    out = constrain(jnp.zeros((S, *xs.shape[1:]), x.dtype), (STAGES, *TOKENS))

    def one_stage(state, slots, arriving, stage, t, totals):
        first = stage == 0
        back = t - S  # the unit stage S-1 finished last iteration, arriving at stage 0 now
        returned = first & (back >= 0) & (back < R * M)
        slots = slots.at[back % M].set(jnp.where(returned, arriving, slots[back % M]))
        x = jnp.where(first, slots[t % M], arriving)
        unit = t - stage  # micro-batch unit % M of repeat unit // M, if 0 <= unit < R * M
        valid = (unit >= 0) & (unit < R * M)
        m, repeat = unit % M, jnp.clip(unit // M, 0, R - 1)
        group = jax.tree.map(lambda a: a[repeat], state)  # this stage's group of the repeat
        y, stats = run_group(graphdefs, group, x, pos[m], seg[m])
        totals = jax.tree.map(lambda t, s: t.at[repeat].add(jnp.where(valid, s, 0)), totals, stats)
        return y, slots, totals

    stage_map = stage_scope.stage_map(one_stage, in_axes=(1, 0, 0, 0, None, 0))
    shapes = jax.eval_shape(
        lambda: run_group(graphdefs, _group_state(states), xs[0], pos[0], seg[0])[1]
    )
    totals = jax.tree.map(lambda s: jnp.zeros((S, R, *s.shape), s.dtype), shapes)
    stage_ids = jnp.arange(S)

    def iteration(carry, t):
        out, slots, totals = carry
        arriving = shift(out, +1, ring=True)  # stage s gets stage s-1's output, 0 gets S-1's
        out, slots, totals = stage_map(states, slots, arriving, stage_ids, t, totals)
        slots = constrain(slots, (STAGES, None, *TOKENS))
        return (constrain(out, (STAGES, *TOKENS)), slots, totals), None

    (out, slots, totals), _ = jax.lax.scan(
        iteration, (out, slots, totals), jnp.arange(layout.iterations)
    )
    # The last unit (micro-batch M - 1 of repeat R - 1) is still on stage S - 1.
    final = slots[0].at[(R * M - 1) % M].set(out[S - 1])  # [M, mb, T, D]
    y = from_micro(final)
    # [S, R, per group, ...] -> [R * S * per group, ...]: model order
    stats = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), totals)
    return y, stats


TOKENS = ("batch", "length", "act_embed")  # the logical axes of activations [B, T, D]


def to_micro(a: jax.Array, microbatches: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] taking every M-th row: each device keeps its own rows in every
    micro-batch, so the split moves no data."""
    return a.reshape(a.shape[0] // microbatches, microbatches, *a.shape[1:]).swapaxes(0, 1)


def from_micro(a: jax.Array) -> jax.Array:
    """The inverse of to_micro."""
    return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])


def shift(out: jax.Array, step: int, ring: bool) -> jax.Array:
    """[S, ...] per-stage blocks moved `step` (+1 or -1) stages on: one collective-permute in
    which every device sends its block once (jnp.roll over the sharded stage axis compiles to
    two permutes, each declaring the whole block). ring: the last stage's block goes to the
    first (or the first's to the last); else the block that would wrap is dropped (zeros
    arrive instead), and no transfer carries it."""
    stages = out.shape[0]
    pairs = [(i, (i + step) % stages) for i in range(stages) if ring or 0 <= i + step < stages]
    active = active_rules()
    if active is None:  # no mesh: nothing to exchange
        moved = jnp.roll(out, step, axis=0)
        if ring:
            return moved
        edge = 0 if step > 0 else stages - 1
        return moved.at[edge].set(jnp.zeros_like(moved[edge]))
    mesh, rules = active
    spec = logical_to_spec((STAGES, *TOKENS), rules, mesh, out.shape)
    return jax.shard_map(
        lambda block: jax.lax.ppermute(block, "stage", pairs),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )(out)


def _group_state(states: dict[str, Any]) -> dict[str, Any]:
    """One group's parameter state (shapes only), for eval_shape."""
    return jax.tree.map(lambda a: a[0, 0], states)
