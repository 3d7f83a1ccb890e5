"""Where a decoder's layers live: one stack of blocks per kind of layer, dense and MoE.

A model's layers are dense (attention + SwiGLU) or mixtures of experts (attention + experts),
as `model.moe`'s first_dense_layers and interval say. Blocks of one kind are stored stacked on a
leading `layers` axis under their own key of the parameter tree, in the order the layers run:

    params["layers"]       the dense blocks
    params["moe_layers"]   the MoE blocks

These keys are part of the checkpoint format (and of the module paths quantization rules match),
so they are named here once. The decoder runs the model as consecutive runs of one kind
(`layer_runs`); the transforms and converters think in model layer indices (layer 7 of 32) and
translate to positions in the stacks with these helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from maxtrain.config import ModelConfig

DENSE_STACK = "layers"
MOE_STACK = "moe_layers"
STACKS = {False: DENSE_STACK, True: MOE_STACK}  # is_moe -> the params key of that stack
# A pipelined run keeps each stack's layers after the leading dense ones in params[STAGES][stack],
# [R, S, per group, ...]: a reshape of the layers in model order (parallel/pipeline.py).
STAGES = "stages"


def stack_path(params: dict[str, Any], stack: str) -> tuple[str, ...]:
    """Where a stack's (pipelined) layers are in a params dict: (stack,) or (STAGES, stack).
    Either way, flattening the leading axes gives the layers in model order."""
    return (STAGES, stack) if STAGES in params else (stack,)


def is_moe_per_layer(cfg: ModelConfig) -> tuple[bool, ...]:
    """Per layer of the model: True where its feed-forward block is a mixture of experts."""
    return tuple(cfg.moe is not None and cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers))


def stack_members(kinds: Sequence[bool]) -> dict[bool, list[int]]:
    """{is_moe: the model layer indices that stack holds, in stack order}."""
    members: dict[bool, list[int]] = {False: [], True: []}
    for i, is_moe in enumerate(kinds):
        members[is_moe].append(i)
    return members


def stack_positions(kinds: Sequence[bool]) -> list[int]:
    """Per model layer: its position in its own stack."""
    positions = [0] * len(kinds)
    for members in stack_members(kinds).values():
        for position, i in enumerate(members):
            positions[i] = position
    return positions


def layer_runs(kinds: Sequence[bool]) -> list[tuple[bool, int, int]]:
    """Consecutive layers of one kind: [(is_moe, start in that kind's stack, length)].

    Llama is one dense run, Mixtral one MoE run, "first N dense" two.
    """
    runs: list[tuple[bool, int, int]] = []
    seen = {False: 0, True: 0}
    for is_moe in kinds:
        if runs and runs[-1][0] == is_moe:
            kind, start, length = runs[-1]
            runs[-1] = (kind, start, length + 1)
        else:
            runs.append((is_moe, seen[is_moe], 1))
        seen[is_moe] += 1
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
