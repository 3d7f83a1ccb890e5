"""Parameter creation with logical axis names, and the einsum projection every layer uses.

Shape letters are the package's (maxtrain/__init__.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

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
        kernel = self.kernel[...].astype(self.compute_dtype)
        y = jnp.einsum(self.spec, x.astype(self.compute_dtype), kernel)
        return y if self.bias is None else y + self.bias[...].astype(self.compute_dtype)
