"""The experts' quantized grouped matmul on tokamax (kernels/quantized_grouped_matmul.py).

On CPU tokamax runs its XLA implementation, which dequantizes the QArrays it is given: the
numbers below check the custom VJP's contract (quantize -> multiply forward, straight-through
backward), which is the same on every backend; the kernels themselves run on GPU/TPU only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
import tokamax

from maxtrain.kernels.quantized_grouped_matmul import GroupedMatmulQuant, quantized_ragged_dot

M, K, N, GROUP_SIZES = 64, 32, 48, (10, 20, 4, 22)  # 8 rows past the groups: parked rows


@pytest.fixture
def operands():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (M, K))
    w = jax.random.normal(keys[1], (len(GROUP_SIZES), K, N))
    g = jax.random.normal(keys[2], (M, N))
    return x, w, g, jnp.array(GROUP_SIZES, jnp.int32)


def _grid(a, qtype, axes):
    """a's values on qtype's grid: what a quantized operand stands for."""
    return a if qtype is None else qwix.dequantize(qwix.quantize(a, qtype, channelwise_axes=axes))


def _float_vjp(x, w, sizes, g):
    out, pullback = jax.vjp(
        lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32), x, w
    )
    return out, pullback(g)


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize(
    "quant",
    [
        GroupedMatmulQuant("int8", "int8"),
        GroupedMatmulQuant("float8_e4m3fn", "float8_e4m3fn"),
        GroupedMatmulQuant("int4"),  # weight-only: activations stay float
    ],
    ids=lambda q: f"{q.weight_qtype}-{q.act_qtype}",
)
def test_forward_quantizes_and_backward_is_straight_through(operands, quant):
    """Forward: the float product of the operands on their grids (activations per row, weights
    per expert and output channel). Backward: the float gradients at those same values."""
    x, w, g, sizes = operands
    xq, wq = _grid(x, quant.act_qtype, (0,)), _grid(w, quant.weight_qtype, (0, 2))
    ref_out, (ref_dx, ref_dw) = _float_vjp(xq, wq, sizes, g)

    fn = jax.jit(lambda a, b: quantized_ragged_dot(a, b, sizes, quant, jnp.float32))
    out, pullback = jax.vjp(fn, x, w)
    dx, dw = pullback(g)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)
    assert _rel(out, _float_vjp(x, w, sizes, g)[0]) > 1e-3  # it did quantize
    assert not np.any(out[sum(GROUP_SIZES) :])  # parked rows stay zero, as the MoE relies on


def test_tokamax_own_gradient_through_a_quantized_weight_is_not_straight_through(operands):
    """Why the custom VJP exists: tokamax differentiated through its own in-kernel weight
    quantization (AsQArray) gets the weight gradient wrong (measured: 106% off)."""
    from tokamax._src.quantization import AsQArray

    x, w, g, sizes = operands
    _, (_, ref_dw) = _float_vjp(x, _grid(w, "int8", (0, 2)), sizes, g)

    def loss(b):
        q = AsQArray(b, jnp.int8, channelwise_axes=(0, 2))
        return jnp.sum(tokamax.ragged_dot(x, q, sizes, preferred_element_type=jnp.float32) * g)

    assert _rel(jax.grad(loss)(w), ref_dw) > 0.5
    ours = jax.grad(
        lambda b: jnp.sum(
            quantized_ragged_dot(x, b, sizes, GroupedMatmulQuant("int8"), jnp.float32) * g
        )
    )(w)
    assert _rel(ours, ref_dw) < 1e-5


def test_backward_rounds_the_incoming_gradient_to_bwd_qtype(operands):
    """With bwd_qtype the gradient is put on that grid before each backward matmul (per row for
    the input gradient, per column for the weight's): close to the unrounded one, not equal
    (measured 4.9% for both: e5m2 keeps 2 mantissa bits)."""
    x, w, g, sizes = operands
    xq, wq = _grid(x, "int8", (0,)), _grid(w, "int8", (0, 2))
    _, (ref_dx, _) = _float_vjp(xq, wq, sizes, _grid(g, "float8_e5m2", (0,)))
    _, (_, ref_dw) = _float_vjp(xq, wq, sizes, _grid(g, "float8_e5m2", (1,)))
    _, (plain_dx, plain_dw) = _float_vjp(xq, wq, sizes, g)

    quant = GroupedMatmulQuant("int8", "int8", "float8_e5m2")
    _, pullback = jax.vjp(lambda a, b: quantized_ragged_dot(a, b, sizes, quant, jnp.float32), x, w)
    dx, dw = pullback(g)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)
    assert 1e-3 < _rel(dx, plain_dx) < 0.1 and 1e-3 < _rel(dw, plain_dw) < 0.1
