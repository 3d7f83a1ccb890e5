"""Parameter creation with logical axis names, and the einsum projection every layer uses.

Shape letters are the package's (maxtrain/__init__.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.layers import weight_taps

LogicalAxes = tuple[str | None, ...]

# A kernel's low-rank adapters (a parameter split's: maxtrain/posttrain/) sit beside it under
# the names Qwix's adapter provider looks up.
ADAPTER_A, ADAPTER_B = "kernel_lora_a", "kernel_lora_b"


def make_param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    axes: LogicalAxes,
    *,
    std: float | None,
    dtype: jnp.dtype,
) -> nnx.Param:
    """A Param with logical axis names in its `sharding` metadata (std=None: ones).

    Eager sharding is off: the mesh is applied from outside (maxtrain/parallel/mesh.py) when the
    whole parameter tree is materialised under jit, so layers never need a mesh in scope.
    """
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape)).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class Projection(nnx.Module):
    """y = einsum(spec, x, W) (+ b): a linear map between named dims, computed in compute dtype.
    The bias, where asked for, spans the output dims the kernel makes (e.g. "nh" of
    "btd,dnh->btnh") and starts at zero."""

    def __init__(
        self,
        spec: str,
        shape: Sequence[int],
        axes: LogicalAxes,
        *,
        init_std: float,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        bias: bool = False,
    ):
        self.spec = spec
        self.compute_dtype = compute_dtype
        self.kernel = make_param(rngs, shape, axes, std=init_std, dtype=param_dtype)
        kernel_dims, out_dims = spec.split(",")[1].split("->")
        made = [kernel_dims.index(d) for d in out_dims if d in kernel_dims]
        self.bias = (
            nnx.Param(
                jnp.zeros([shape[i] for i in made], param_dtype),
                out_sharding=tuple(axes[i] for i in made),
                eager_sharding=False,
            )
            if bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value()
        bias = None if self.bias is None else self.bias.get_value()
        project = functools.partial(projected, self.spec, self.compute_dtype)
        if (record := weight_taps.active()) is not None:  # a zero-bubble input gradient's
            return weight_taps.record(record, project, kernel, bias, x)
        return project(kernel, bias, x)


def projected(
    spec: str, compute_dtype: jnp.dtype, kernel: jax.Array, bias: jax.Array | None, x: jax.Array
) -> jax.Array:
    """A Projection's output: einsum(spec, x, kernel) (+ bias), in compute dtype."""
    y = jnp.einsum(spec, x.astype(compute_dtype), kernel.astype(compute_dtype))
    return y if bias is None else y + bias.astype(compute_dtype)
