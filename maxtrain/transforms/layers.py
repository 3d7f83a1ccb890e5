"""Addressing layers by their index in the model, across the two layer stacks.

A model keeps its dense blocks in `params["layers"]` and its mixture-of-experts blocks in
`params["moe_layers"]`, each stacked on a leading axis in the order the layers run
(models/decoder.py). The transforms think in model layer indices (layer 7 of 32); these helpers
translate to and from positions in the stacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

STACKS = {False: "layers", True: "moe_layers"}  # is_moe -> the params key of that stack


def stack_members(moe_layers: Sequence[bool]) -> dict[bool, list[int]]:
    """{is_moe: the model layer indices that stack holds, in stack order}."""
    members: dict[bool, list[int]] = {False: [], True: []}
    for i, is_moe in enumerate(moe_layers):
        members[is_moe].append(i)
    return members


def stack_positions(moe_layers: Sequence[bool]) -> list[int]:
    """Per model layer: its position in its own stack."""
    positions = [0] * len(moe_layers)
    for members in stack_members(moe_layers).values():
        for position, i in enumerate(members):
            positions[i] = position
    return positions


def take_layers(stack: Any, positions: Sequence[int]) -> Any:
    """The layers at `positions` of a stacked tree, restacked in that order: exact copies, and a
    position may repeat."""
    index = np.asarray(positions, dtype=np.int32)
    return jax.tree.map(lambda a: a[index], stack)


def outside_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Everything but the layer stacks: embedding, final norm, LM head."""
    return {k: v for k, v in params.items() if k not in STACKS.values()}
