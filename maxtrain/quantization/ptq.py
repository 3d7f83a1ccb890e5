"""Post-training quantization of a parameter tree (tools/quantize.py): int8/int4 values plus scales.

Weights are quantized directly, array by array, rather than through Qwix's PtqProvider: the
provider quantizes only what its interception sees, and it does not intercept ragged_dot, so
the experts' stacked kernels (most of an MoE model's weights) would stay float.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from maxtrain.models.stacks import is_stacked

# Logical axes that index whole matmuls (stacked layers, experts), never contracted.
_STACK_AXES = ("layers", "exp")


def contraction_axes(axes: tuple[str | None, ...]) -> tuple[int, ...]:
    """Which axes of a kernel its matmul sums over, from the kernel's logical axes.

    Kernels that write the embedding (attention o, MLP/expert down) read everything else;
    every other kernel (q/k/v, gate/up, lm_head) reads the embedding. A scale is kept per
    element of the remaining axes: per output channel, per layer and per expert.
    """
    if axes[-1] == "embed":
        return tuple(i for i, a in enumerate(axes[:-1]) if a not in _STACK_AXES)
    return tuple(i for i, a in enumerate(axes) if a == "embed")


def quantizable_kernels(abstract_state: nnx.State) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Path in the params dict -> contraction axes, for every matmul kernel PTQ quantizes.

    The router stays float (a flipped top-k is a different computation, not a less precise
    one), as do the embedding table (a lookup, and the tied logits' weights) and norm scales.
    """
    kernels = {}
    for path, var in nnx.to_flat_state(abstract_state):
        names = tuple(str(p) for p in path)
        if names[-1] != "kernel" or "router" in names:
            continue
        axes = var.get_metadata().get("out_sharding")
        kernels[names] = contraction_axes(tuple(axes))
    return kernels


def quantize_params(
    params: dict, kernels: dict[tuple[str, ...], tuple[int, ...]], qtype: str
) -> tuple[dict, dict[str, list[float]]]:
    """Returns (params with each kernel replaced by {qvalue, scale}, relative L2 error of each
    dequantized kernel per stacked layer: the per-layer error report). Symmetric absmax."""
    out = jax.tree.map(lambda x: x, params)
    errors = {}
    for path, reduce_axes in kernels.items():
        node = out
        for key in path[:-1]:
            node = node[key]
        w = node[path[-1]]
        keep = tuple(i for i in range(w.ndim) if i not in reduce_axes)
        q = qwix.quantize(w, qtype, channelwise_axes=keep)
        node[path[-1]] = {"qvalue": q.qvalue, "scale": q.scale}
        # Stacked kernels (leading layer axis) get one error per layer; lm_head a single one.
        rows = w.shape[0] if is_stacked(path) else 1
        diff = (qwix.dequantize(q) - w).reshape(rows, -1)
        relative = jnp.linalg.norm(diff, axis=1) / jnp.linalg.norm(w.reshape(rows, -1), axis=1)
        errors["/".join(path)] = [float(e) for e in relative]
    return out, errors


def dequantize_params(qparams: dict) -> dict:
    """The float params a quantized tree stands for (qvalue x scale, broadcast)."""

    def is_quantized(node) -> bool:
        return isinstance(node, dict) and set(node) == {"qvalue", "scale"}

    return jax.tree.map(
        lambda n: n["qvalue"].astype(n["scale"].dtype) * n["scale"] if is_quantized(n) else n,
        qparams,
        is_leaf=is_quantized,
    )
