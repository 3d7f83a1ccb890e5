"""transformers' fused Gated DeltaNet tensors (Qwen3-Next's `linear_attn.`) and the layer's
parameters (layers/gated_deltanet.py), both ways.

transformers projects q, k, v and z with one linear map and b and a with another, their outputs
grouped by query/key head: with G = Nv / Nk value heads per query/key head, output row block g
(g < Nk) of

    in_proj_qkvz.weight [Nk (2 dk + 2 G dv), D]  is  [q_g (dk) | k_g (dk) | v_g (G dv) | z_g (G dv)]
    in_proj_ba.weight   [Nk (2 G), D]            is  [b_g (G) | a_g (G)]

where v_g, z_g, b_g and a_g hold value heads g G .. g G + G - 1 in order. The convolution is one
depthwise conv1d over the concatenation of q, k and v, each head-major:

    conv1d.weight [2 Nk dk + Nv dv, 1, K]  is  [q (Nk dk) | k (Nk dk) | v (Nv dv)]

its K taps oldest first. Our layer keeps each of them apart, heads as their own axis (so that
`heads`/`kv_heads` split them over a mesh): projections [D, heads, head dim] (b, a: [D, Nv]),
taps [K, heads, head dim].
The other tensors follow the package's general rule (maxtrain/hf/layout.py): out_proj.weight
[D, Nv dv] is our o kernel [Nv, dv, D] flattened and transposed; norm.weight [dv], A_log [Nv]
and dt_bias [Nv] are ours as they are (`a_log`, `dt_bias`, `norm.scale`).

layout.py states this once, as Slots with Parts (linear_attention_tensors), which import and
export of whole checkpoints use; from_hf and to_hf apply it to one layer's tensors (the layer's
own tests load transformers' Qwen3NextGatedDeltaNet with them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain.config import LinearAttention
from maxtrain.hf.layout import Slot, hf_tensor, linear_attention_tensors
from maxtrain.layers.gated_deltanet import GatedDeltaNet

_PREFIX = "linear_attn."


def from_hf(
    tensors: dict[str, np.ndarray],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> dict[tuple[str, ...], np.ndarray]:
    """One layer's tensors, by their names inside `linear_attn.` -> our parameters, by path in
    the layer (("q", "kernel"), ("a_log",), ...)."""
    hidden, conv_kernel = tensors["out_proj.weight"].shape[0], tensors["conv1d.weight"].shape[-1]
    linear = _sizes(num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel)
    shapes = _parameter_shapes(hidden, linear)
    return {
        slot.path: slot.to_ours(tensors[slot.hf_name], shapes[slot.path]) for slot in _slots(linear)
    }


def to_hf(params: dict[tuple[str, ...], np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameters of one layer, by path (`from_hf`'s) -> its tensors by their names inside
    `linear_attn.`."""
    _, num_k_heads, head_k_dim = params[("q", "kernel")].shape
    conv_kernel, num_v_heads, head_v_dim = params[("v_conv",)].shape
    linear = _sizes(num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel)
    by_name: dict[str, list[Slot]] = {}
    for slot in _slots(linear):
        by_name.setdefault(slot.hf_name, []).append(slot)
    return {
        name: hf_tensor(parts, [np.asarray(params[slot.path]) for slot in parts])
        for name, parts in by_name.items()
    }


def _sizes(
    num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int
) -> LinearAttention:
    return LinearAttention(
        num_key_heads=num_k_heads, num_value_heads=num_v_heads, key_head_dim=head_k_dim,
        value_head_dim=head_v_dim, conv_kernel=conv_kernel,
    )  # fmt: skip


def _slots(linear: LinearAttention) -> list[Slot]:
    """layout.py's Slots of one layer, named inside `linear_attn.`, paths inside the layer."""
    return [
        Slot(name.removeprefix(_PREFIX), path[1:], (), in_axes, part, unit_axis)
        for path, name, in_axes, part, unit_axis in linear_attention_tensors(linear)
    ]


def _parameter_shapes(hidden: int, linear: LinearAttention) -> dict[tuple[str, ...], tuple]:
    """Our layer's parameter shapes by path, as the layer itself builds them."""
    layer = nnx.eval_shape(
        lambda: GatedDeltaNet(
            hidden,
            linear.num_key_heads,
            linear.num_value_heads,
            linear.key_head_dim,
            linear.value_head_dim,
            conv_kernel=linear.conv_kernel,
            init_std=0.02,
            param_dtype=jnp.float32,
            compute_dtype=jnp.float32,
            rngs=nnx.Rngs(0),
        )  # fmt: skip
    )
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))[0]
    return {tuple(key.key for key in path): leaf.shape for path, leaf in flat}
