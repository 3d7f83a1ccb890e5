"""Projections recorded for a backward split in two: the input gradient now, the weights'
gradient later (a zero-bubble pipeline schedule: parallel/schedules.py).

Inside `recording`, every Projection (layers/base.py) computes with its weights held constant,
adds a zero probe to its output and records the call: its input, and the projection function
itself. Differentiating a layer with respect to its input and the probes then gives the input
gradient and, as each probe's gradient, its projection's output gradient, without computing
any weight gradient of the projections. Those follow later from the recorded inputs and output
gradients, each by the projection function's own derivative (x^T dy, and the bias's sum of
dy): the same matmuls the whole backward would have run, at another time.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import jax


@dataclass(frozen=True)
class Call:
    """One projection call: its function (kernel, bias, x) -> y, the kernel and bias arrays it
    read (identified by the caller among a layer's parameters), its input and output."""

    project: Callable[[jax.Array, jax.Array | None, jax.Array], jax.Array]
    kernel: jax.Array
    bias: jax.Array | None
    x: jax.Array
    y: jax.ShapeDtypeStruct


@dataclass
class Recording:
    """The calls made while recording, in order; probes: one zero array per call to add to its
    output (None: the calls are only being discovered)."""

    probes: list[jax.Array] | None = None
    calls: list[Call] = field(default_factory=list)


_RECORDING: contextvars.ContextVar[Recording | None] = contextvars.ContextVar(
    "maxtrain_weight_taps", default=None
)


@contextlib.contextmanager
def recording(probes: list[jax.Array] | None = None) -> Iterator[Recording]:
    """Projections called inside are recorded (module docstring)."""
    record = Recording(probes)
    token = _RECORDING.set(record)
    try:
        yield record
    finally:
        _RECORDING.reset(token)


def active() -> Recording | None:
    return _RECORDING.get()


def record(
    record: Recording,
    project: Callable[[jax.Array, jax.Array | None, jax.Array], jax.Array],
    kernel: jax.Array,
    bias: jax.Array | None,
    x: jax.Array,
) -> jax.Array:
    """A projection's output under `record`: its weights held constant, plus its probe."""
    held = None if bias is None else jax.lax.stop_gradient(bias)
    y = project(jax.lax.stop_gradient(kernel), held, x)
    index = len(record.calls)
    record.calls.append(Call(project, kernel, bias, x, jax.ShapeDtypeStruct(y.shape, y.dtype)))
    return y if record.probes is None else y + record.probes[index]
