"""Quantized training of the experts through tokamax's grouped matmul.

On GPU/TPU the experts run through ``tokamax.ragged_dot`` (grouped_matmul.py), which Qwix does
not intercept. Tokamax does accept Qwix ``QArray`` operands, and picks the kernel that reads
them (per its source; not yet run here): on H100 one that streams int8/fp8/int4 weights and
scales them to bf16 in registers (a quantized activation is dequantized first; on B200 it can
multiply both quantized), falling back to its XLA implementation where no kernel fits. What it
cannot do is train: its gradient runs through the quantizer's rounding, and the weight gradient
comes out wrong (measured on CPU: 106% relative error against the straight-through one).

``quantized_ragged_dot`` wraps it in a custom VJP, the same contract as Qwix's own quantized
matmuls:

  * forward: activations quantized per row, weights per expert and output channel (the scales
    factor out of the contraction, which is what the kernels need), multiplied by tokamax;
  * backward: straight-through. The gradients are those of the forward's dequantized operands,
    each computed by tokamax in the compute dtype; with a ``bwd_qtype`` the incoming gradient
    is first rounded to that type's grid (per row for the input gradient, per column for the
    weight gradient, as Qwix does), which reproduces its numerics without a kernel for it.

The residuals are the quantized operands, so the backward holds int8/fp8 copies, not float ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import qwix
import tokamax

from maxtrain.kernels.grouped_matmul import manual_axis_type

# Bound at import, before Qwix's interception can patch `tokamax.ragged_dot` (quantization/
# training.py routes that name here): the calls below must reach the kernel itself, never the
# interceptor.
_RAGGED_DOT_GENERAL = tokamax.ragged_dot_general


# x [M, K] @ w [G, K, N] (forward); g [M, N] @ w[G, K, N] contracted over N (input gradient);
# x [M, K] with g [M, N] contracted over the ragged rows, one [K, N] per group (weight gradient).
def _dims(lhs_contract: int, rhs_contract: int, rhs_group: list[int]):
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([lhs_contract], [rhs_contract]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=rhs_group,
    )


_FORWARD, _INPUT_GRAD, _WEIGHT_GRAD = _dims(1, 1, [0]), _dims(1, 2, [0]), _dims(0, 0, [])


@dataclasses.dataclass(frozen=True)
class GroupedMatmulQuant:
    """How one grouped matmul is quantized: a Qwix rule's fields (None leaves that side float)."""

    weight_qtype: str
    act_qtype: str | None = None
    bwd_qtype: str | None = None
    weight_calibration: str = "absmax"
    act_calibration: str = "absmax"


def _quantize(x: jax.Array, qtype: str | None, channelwise_axes, calibration: str):
    if qtype is None:
        return x
    return qwix.quantize(
        x, qtype, channelwise_axes=channelwise_axes, calibration_method=calibration
    )


def _as_float(x) -> jax.Array:
    """The values a possibly quantized operand stands for, in its original dtype."""
    return qwix.dequantize(x) if isinstance(x, qwix.QArray) else x


def _round_to_grid(g: jax.Array, qtype: str | None, channelwise_axes) -> jax.Array:
    """g on qtype's grid (absmax scale per element of channelwise_axes), back in g's dtype."""
    return _as_float(_quantize(g, qtype, channelwise_axes, "absmax"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def quantized_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    quant: GroupedMatmulQuant,
    preferred_element_type=None,
) -> jax.Array:
    """lhs [M, K] (rows sorted by group), rhs [G, K, N] -> [M, N], quantized as `quant` says."""
    return _forward(lhs, rhs, group_sizes, quant, preferred_element_type)[0]


def _forward(lhs, rhs, group_sizes, quant, preferred_element_type):
    qlhs = _quantize(lhs, quant.act_qtype, (0,), quant.act_calibration)
    qrhs = _quantize(rhs, quant.weight_qtype, (0, 2), quant.weight_calibration)
    out = _RAGGED_DOT_GENERAL(
        qlhs, qrhs, group_sizes, _FORWARD, preferred_element_type=preferred_element_type,
        manual_axis_type=manual_axis_type(lhs, rhs),
    )  # fmt: skip
    return out, (qlhs, qrhs, group_sizes)


def _backward(quant, preferred_element_type, residuals, g):
    del preferred_element_type
    qlhs, qrhs, group_sizes = residuals
    lhs, rhs = _as_float(qlhs), _as_float(qrhs)
    g = g.astype(lhs.dtype)
    varying = manual_axis_type(g, lhs, rhs)
    dlhs = _RAGGED_DOT_GENERAL(
        _round_to_grid(g, quant.bwd_qtype, (0,)), rhs.astype(lhs.dtype), group_sizes,
        _INPUT_GRAD, preferred_element_type=lhs.dtype, manual_axis_type=varying,
    )  # fmt: skip
    drhs = _RAGGED_DOT_GENERAL(
        lhs, _round_to_grid(g, quant.bwd_qtype, (1,)), group_sizes,
        _WEIGHT_GRAD, preferred_element_type=rhs.dtype, manual_axis_type=varying,
    )  # fmt: skip
    return dlhs, drhs, None


quantized_ragged_dot.defvjp(_forward, _backward)
