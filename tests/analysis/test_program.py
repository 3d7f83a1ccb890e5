"""What a compiled program does (maxtrain/analysis/program.py): the matmul FLOPs and the bytes
accessed counted per loop trip, the grouped matmuls of each pass, the copies it holds."""

import jax
import jax.numpy as jnp

from maxtrain.analysis.program import (
    GroupedMatmulRun,
    bytes_accessed,
    copy_count,
    grouped_matmuls,
    loop_trip_counts,
    matmul_flops,
)
from maxtrain.kernels.grouped_matmul import xla_grouped_matmul


def _product_chain(length: int, unrolled: bool = False) -> jax.stages.Compiled:
    """A scan of `length` [64, 64] matrix products (or a Python loop of them), compiled for
    CPU."""

    def chain(x, weights):
        if unrolled:
            for w in weights:
                x = jnp.tanh(x @ w)
            return x
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, weights)[0]

    square = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    stacked = jax.ShapeDtypeStruct((length, 64, 64), jnp.float32)
    return jax.jit(chain).lower(square, stacked).compile()


def test_matmul_flops_count_each_trip_of_a_loop():
    """8 and 16 products of 2 x 64^3 FLOPs each, exactly (XLA's cost analysis counts the loop's
    body once for either length)."""
    short, long = _product_chain(8), _product_chain(16)
    assert matmul_flops(short.as_text()) == 8 * 2 * 64**3
    assert matmul_flops(long.as_text()) == 16 * 2 * 64**3


def test_bytes_accessed_count_each_trip_of_a_loop():
    """Without a loop, XLA's own count of the bytes accessed (within 1%); with one, every trip
    of it: the scanned chain moves what the unrolled one does, where XLA's cost analysis
    counts the scan's body once."""
    unrolled, scanned = _product_chain(8, unrolled=True), _product_chain(8)
    xla = unrolled.cost_analysis()["bytes accessed"]
    assert abs(bytes_accessed(unrolled.as_text()) / xla - 1) < 0.01
    assert abs(bytes_accessed(scanned.as_text()) / xla - 1) < 0.1
    assert scanned.cost_analysis()["bytes accessed"] < xla / 3


def test_copy_count_finds_the_transposes_fused_into_loops():
    """An array written in one order and read flat in another is copied into the new layout
    inside the fusion that computes it: one copy per such read, none for a read in its own
    order."""
    a = jnp.ones((64, 32))
    same_order = lambda a: jnp.sin(a).reshape(-1)  # noqa: E731
    two_transposed = lambda a: (jnp.sin(a).T.reshape(-1), jnp.cos(a).T.reshape(-1))  # noqa: E731
    counts = [
        copy_count(jax.jit(f).lower(a).compile().as_text()) for f in (same_order, two_transposed)
    ]
    assert counts == [0, 2]


def test_loop_trip_counts_name_every_scan_length():
    """A scan of 5 inside a scan of 3: both lengths, as the compiled program states them."""

    def nested(x):
        def outer(c, _):
            inner = jax.lax.scan(lambda d, _: (jnp.sin(d), None), c, None, length=5)[0]
            return inner, None

        return jax.lax.scan(outer, x, None, length=3)[0]

    hlo = jax.jit(nested).lower(jnp.ones(4)).compile().as_text()
    assert sorted(loop_trip_counts(hlo)) == [3, 5]


def test_grouped_matmuls_tell_the_forward_from_the_backward(names_in_cache_key):
    """A grouped matmul under remat, differentiated: the forward's one, and in the backward its
    recomputation and the gradients of its input and weights; the plain dot beside it and
    the dots of its backward are not grouped matmuls."""
    sizes = jnp.array([10, 20, 30, 4])

    def loss(x, w, v):
        rows = jax.checkpoint(lambda x, w: jnp.sin(xla_grouped_matmul(x, w, sizes)))(x, w)
        return jnp.sum(rows @ v)

    x, w, v = jnp.ones((64, 16)), jnp.ones((4, 16, 24)), jnp.ones((24, 8))
    program = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, w, v).compile().as_text()
    assert grouped_matmuls(program) == {
        GroupedMatmulRun(True, "f32[64,24]", False): 1,
        GroupedMatmulRun(False, "f32[64,24]", False): 1,
        GroupedMatmulRun(False, "f32[64,16]", False): 1,
        GroupedMatmulRun(False, "f32[4,16,24]", False): 1,
    }
