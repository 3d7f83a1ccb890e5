"""Post-training quantization of a parameter tree (tools/quantize.py): int8/int4 values
plus scales.

A quantized checkpoint (tools/quantize.py's output) holds {qvalue, scale} where the model
has a kernel, so load_parameters cannot read it into the model; load_parameters_dequantized can, for
evaluation and generation: it reads the stored values and multiplies them out on the fly.

Weights are quantized directly, array by array, rather than through Qwix's PtqProvider: the
provider quantizes only what its interception sees, and it does not intercept ragged_dot, so
the experts' stacked kernels (most of an MoE model's weights) would stay float.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from maxtrain.checkpointing import integrity
from maxtrain.checkpointing.checkpointer import load_parameters, resolve_step_dir
from maxtrain.checkpointing.common import absolute
from maxtrain.checkpointing.integrity import CheckpointError
from maxtrain.common.errors import first_line
from maxtrain.models.stacks import STAGES, is_stacked

# Logical axes that index whole matmuls (stacked layers, pipeline repeats and stages: see
# models/decoder.py Stages; experts), never contracted.
_STACK_AXES = ("layers", "repeats", STAGES, "exp")


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
    import qwix  # here, not at import: loading a quantized checkpoint needs no Qwix (2 s)

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


def quantized_kind(step_dir: epath.Path) -> str | None:
    """The qtype ('int8', 'int4') of a tools/quantize.py checkpoint step, or None for a
    float one. Read from the meta the tool saves, else from the stored leaves' names (qvalue)."""
    meta = epath.Path(step_dir) / "meta" / "metadata"  # what Orbax's JsonSave wrote
    try:
        quantization = json.loads(meta.read_text()).get("quantization")
    except (OSError, ValueError):
        quantization = None
    if quantization:
        return str(quantization.get("qtype", "quantized"))
    try:
        saved = integrity.read_state_shapes(step_dir)
    except integrity.Corrupt:
        return None
    return "quantized" if any(p.endswith("/qvalue") for p in saved) else None


def load_parameters_dequantized(path: str | epath.PathLike, abstract_params: Any) -> Any:
    """The model's float parameters from a checkpoint, quantized (tools/quantize.py: each
    kernel becomes qvalue x scale, in the model's dtype and sharding) or not (load_parameters).

    path: a step, tier or run directory, as load_parameters takes. CheckpointError, one line,
    if the checkpoint is incomplete or holds another model (the first leaf that differs)."""
    step_dir = resolve_step_dir(absolute(path))
    if quantized_kind(step_dir) is None:
        return load_parameters(step_dir, abstract_params)
    try:
        import orbax.checkpoint as ocp

        checkpointer, directory = ocp.PyTreeCheckpointer(), integrity.state_dir(step_dir)
        # As host arrays: read with the sharding it was saved with, Orbax warns that this is
        # unsafe on another topology; the values are put on the model's sharding below.
        tree = checkpointer.metadata(directory).item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restore = ocp.args.PyTreeRestore(restore_args=as_numpy)
        stored = checkpointer.restore(directory, args=restore)["params"]
    except Exception as e:
        raise CheckpointError(
            f"cannot read parameters from {step_dir}: {first_line(e, 300, typed=True)}"
        ) from e
    params = dequantize_params(jax.tree.map(np.asarray, stored))
    expected = integrity.flat_shapes({"params": abstract_params})
    integrity.check_shapes(integrity.flat_shapes({"params": params}), expected, str(step_dir))
    return jax.tree.map(
        lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding), params, abstract_params
    )
