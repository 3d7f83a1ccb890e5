"""Where a decoder's layers live: one stack of blocks per kind of layer.

A layer's kind is its token mixer (softmax attention, or a linear-attention recurrence such as
Gated DeltaNet) and whether its feed-forward block is dense or a mixture of experts, both as
model.layers says. Blocks of one kind are stored stacked on a
leading `layers` axis under their own key of the parameter tree, in the order the layers run:

    params["layers"]             attention + dense feed-forward
    params["moe_layers"]         attention + MoE
    params["linear_layers"]      linear attention + dense feed-forward
    params["linear_moe_layers"]  linear attention + MoE

These keys are part of the checkpoint format (and of the module paths quantization rules match),
so they are named here once. The decoder runs the model as consecutive runs of one kind
(`layer_runs`); the transforms and converters think in model layer indices (layer 7 of 32) and
translate to positions in the stacks with these helpers, which take any hashable kind.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from maxtrain.config import ModelConfig
from maxtrain.config.model import Mixer


class LayerKind(NamedTuple):
    """What a layer's block holds: its token mixer and whether its feed-forward is MoE."""

    mixer: Mixer
    is_moe: bool


ATTENTION = LayerKind("attention", False)
ATTENTION_MOE = LayerKind("attention", True)
LINEAR = LayerKind("linear", False)
LINEAR_MOE = LayerKind("linear", True)
DENSE_STACK = "layers"
MOE_STACK = "moe_layers"
# kind -> the params key of its stack. In this order the decoder creates its stacks, so that a
# model of attention layers initialises as it did before the linear kinds existed.
STACKS = {
    ATTENTION: DENSE_STACK,
    ATTENTION_MOE: MOE_STACK,
    LINEAR: "linear_layers",
    LINEAR_MOE: "linear_moe_layers",
}
STACK_KINDS = {stack: kind for kind, stack in STACKS.items()}  # the inverse: stack -> kind
# A pipelined run keeps each stack's layers after the leading dense ones in params[STAGES][stack],
# [R, S, per group, ...]: a reshape of the layers in model order (parallel/pipeline.py).
STAGES = "stages"


def stack_path(params: dict[str, Any], stack: str) -> tuple[str, ...]:
    """Where a stack's (pipelined) layers are in a params dict: (stack,) or (STAGES, stack).
    Either way, flattening the leading axes gives the layers in model order."""
    return (STAGES, stack) if STAGES in params else (stack,)


def is_moe_per_layer(cfg: ModelConfig) -> tuple[bool, ...]:
    """Per layer of the model: True where its feed-forward block is a mixture of experts."""
    return tuple(t.ffn == "moe" for t in cfg.layer_types)


def mixer_per_layer(cfg: ModelConfig) -> tuple[Mixer, ...]:
    """Per layer of the model: its token mixer, as the architecture says (layer_mixer)."""
    return tuple(cfg.layer_mixer(i) for i in range(cfg.num_layers))


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    """Per layer of the model: its kind, hence its stack (STACKS)."""
    return tuple(
        LayerKind(mixer, is_moe)
        for mixer, is_moe in zip(mixer_per_layer(cfg), is_moe_per_layer(cfg), strict=True)
    )


def stack_members[K: Hashable](kinds: Sequence[K]) -> dict[K, list[int]]:
    """{kind: the model layer indices its stack holds, in stack order}, for the kinds present
    (in order of first appearance)."""
    members: dict[K, list[int]] = {}
    for i, kind in enumerate(kinds):
        members.setdefault(kind, []).append(i)
    return members


def rows_per_stack(kinds: Sequence[LayerKind]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Per stack, the rows its layers are among `kinds` (some of the model's layers in model
    order, e.g. those with MoE: the rows of their statistics), in stack order."""
    return tuple((STACKS[kind], tuple(rows)) for kind, rows in stack_members(kinds).items())


def stack_positions(kinds: Sequence[Hashable]) -> list[int]:
    """Per model layer: its position in its own stack."""
    positions = [0] * len(kinds)
    for members in stack_members(kinds).values():
        for position, i in enumerate(members):
            positions[i] = position
    return positions


def layer_runs[K: Hashable](kinds: Sequence[K]) -> list[tuple[K, int, int]]:
    """Consecutive layers of one kind: [(kind, start in that kind's stack, length)].

    Llama is one dense run, Mixtral one MoE run, "first N dense" two.
    """
    runs: list[tuple[K, int, int]] = []
    seen: dict[K, int] = {}
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            _, start, length = runs[-1]
            runs[-1] = (kind, start, length + 1)
        else:
            runs.append((kind, seen.get(kind, 0), 1))
        seen[kind] = seen.get(kind, 0) + 1
    return runs


def take_layers(stack: Any, positions: Sequence[int]) -> Any:
    """The layers at `positions` of a stacked tree, restacked in that order: exact copies, and a
    position may repeat."""
    index = np.asarray(positions, dtype=np.int32)
    return jax.tree.map(lambda a: a[index], stack)


def outside_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Everything but the layer stacks: embedding, final norm, LM head."""
    return {k: v for k, v in params.items() if k not in STACKS.values()}


def is_stacked(params_path: Sequence[str]) -> bool:
    """Whether the parameter at this path of the params dict has a leading layer axis."""
    return bool(params_path) and params_path[0] in STACKS.values()
