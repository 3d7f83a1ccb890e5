"""Zero bubble's backward of a layer in two passes (parallel/schedules.py zero_bubble): the
input gradient, on the schedule's critical path, and the projections' weight gradient, later.

The input gradient differentiates the layer with its projections recorded
(layers/weight_taps.py): with respect to its input, its other parameters (norms, router,
experts: their gradients come with it) and the projections' probes, whose gradients are the
projections' output gradients. What it keeps per projection, its input and output gradient,
is all the weight gradient needs: each projection's own derivative with respect to its kernel
and bias (x^T dy), the matmuls the whole backward would have run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.layers import weight_taps
from maxtrain.parallel.stage_scope import stage_map


@dataclass(frozen=True)
class Tap:
    """A projection a layer calls: where its kernel and bias are among the layer state's leaves,
    its function, and one stage's input and output."""

    kernel: int
    bias: int | None
    project: Callable[[jax.Array, jax.Array | None, jax.Array], jax.Array]
    x: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct

    @property
    def leaves(self) -> tuple[int, ...]:
        return (self.kernel,) if self.bias is None else (self.kernel, self.bias)


def discover(layer: Callable[[Any, jax.Array], Any], state: Any, x: jax.Array) -> tuple[Tap, ...]:
    """The projections layer(state, x) calls (one stage's state and input), from one trace of
    shapes: a projection reads its kernel and bias as the very arrays of the state it is given."""
    found: list[Tap] = []

    def trace(state, x):
        leaves = {id(leaf): index for index, leaf in enumerate(jax.tree.leaves(state))}
        with weight_taps.recording() as record:
            layer(state, x)
        for call in record.calls:
            bias = None if call.bias is None else leaves[id(call.bias)]
            x_shape = jax.ShapeDtypeStruct(call.x.shape, call.x.dtype)
            found.append(Tap(leaves[id(call.kernel)], bias, call.project, x_shape, call.y))

    jax.eval_shape(trace, state, x)
    return tuple(found)


def input_gradient(
    layer: Callable[..., Any],
    extras: tuple,
    taps: tuple[Tap, ...],
    state: Any,
    x: jax.Array,
    cotangent: Any,
) -> tuple[jax.Array, dict[int, jax.Array], list[tuple[jax.Array, jax.Array]]]:
    """(dx, the untapped leaves' gradients by leaf index, per tap (its input, its output
    gradient)) of one stage's layer(state, x, *extras) over the stages (state, x, extras:
    [S, ...]) at `cotangent`."""
    leaves, tree = jax.tree.flatten(state)
    tapped = {index for tap in taps for index in tap.leaves}
    others = [i for i in range(len(leaves)) if i not in tapped]
    S = x.shape[0]
    probes = [jnp.zeros((S, *tap.y.shape), tap.y.dtype) for tap in taps]

    def recorded(state, x, probes, *extras):
        with weight_taps.recording(probes) as record:
            out = layer(state, x, *extras)
        return out, [call.x for call in record.calls]

    mapped = stage_map(recorded)

    def differentiated(rest, x, probes):
        full = list(leaves)
        for index, leaf in zip(others, rest, strict=True):
            full[index] = leaf
        return mapped(tree.unflatten(full), x, probes, *extras)

    rest = [leaves[i] for i in others]
    _, pullback, inputs = jax.vjp(differentiated, rest, x, probes, has_aux=True)
    d_rest, dx, d_probes = pullback(cotangent)
    return dx, dict(zip(others, d_rest, strict=True)), list(zip(inputs, d_probes, strict=True))


def weight_gradient(
    taps: tuple[Tap, ...], state: Any, kept: list[tuple[jax.Array, jax.Array]]
) -> dict[int, jax.Array]:
    """The tapped leaves' gradients (by leaf index, summed over calls) from each tap's kept input
    and output gradient, over the stages ([S, ...])."""
    leaves = jax.tree.leaves(state)
    grads: dict[int, jax.Array] = {}
    for tap, (x, dy) in zip(taps, kept, strict=True):
        bias = None if tap.bias is None else leaves[tap.bias]
        mapped = stage_map(tap.project)
        _, pullback = jax.vjp(lambda k, b, x=x, m=mapped: m(k, b, x), leaves[tap.kernel], bias)
        for index, grad in zip(tap.leaves, pullback(dy), strict=False):
            grads[index] = grads[index] + grad if index in grads else grad
    return grads
