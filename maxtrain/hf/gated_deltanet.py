"""transformers' fused Gated DeltaNet tensors (Qwen3-Next's `linear_attn.`), or Kimi Delta
Attention's (Kimi Linear's `self_attn.`, with channel_decay) <-> one layer's parameters
(layers/gated_deltanet.py), for the layer's own tests, which load transformers'
Qwen3NextGatedDeltaNet and KimiLinearDeltaAttention with them. The layouts (which rows of
in_proj_qkvz, in_proj_ba and conv1d are which of our projections and taps) are stated once, as
Slots with Parts, in maxtrain/hf/families/qwen3_next.py and maxtrain/hf/kimi_delta.py, which
import and export of whole checkpoints use too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain.config import LinearAttention
from maxtrain.hf.families.qwen3_next import linear_attention_tensors
from maxtrain.hf.kimi_delta import kimi_delta_attention_tensors
from maxtrain.hf.layout import Slot, hf_tensor
from maxtrain.layers.gated_deltanet import GatedDeltaNet


def from_hf(
    tensors: dict[str, np.ndarray],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    channel_decay: bool = False,
) -> dict[tuple[str, ...], np.ndarray]:
    """One layer's tensors, by their names inside `linear_attn.` (`self_attn.` with
    channel_decay) -> our parameters, by path in the layer (("q", "kernel"), ("a_log",), ...)."""
    output, conv = ("o_proj", "q_conv1d") if channel_decay else ("out_proj", "conv1d")
    hidden, conv_kernel = tensors[f"{output}.weight"].shape[0], tensors[f"{conv}.weight"].shape[-1]
    linear = _sizes(num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel, channel_decay)
    shapes = _parameter_shapes(hidden, linear)
    return {
        slot.path: slot.to_ours(tensors[slot.hf_name], shapes[slot.path]) for slot in _slots(linear)
    }


def to_hf(params: dict[tuple[str, ...], np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameters of one layer, by path (`from_hf`'s) -> its tensors by their names inside
    `linear_attn.`."""
    _, num_k_heads, head_k_dim = params[("q", "kernel")].shape
    conv_kernel, num_v_heads, head_v_dim = params[("v_conv",)].shape
    channel_decay = ("a_down", "kernel") in params
    linear = _sizes(num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel, channel_decay)
    by_name: dict[str, list[Slot]] = {}
    for slot in _slots(linear):
        by_name.setdefault(slot.hf_name, []).append(slot)
    return {
        name: hf_tensor(parts, [np.asarray(params[slot.path]) for slot in parts])
        for name, parts in by_name.items()
    }


def _sizes(
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
    channel_decay: bool,
) -> LinearAttention:
    return LinearAttention(
        num_key_heads=num_k_heads, num_value_heads=num_v_heads, key_head_dim=head_k_dim,
        value_head_dim=head_v_dim, conv_kernel=conv_kernel, channel_decay=channel_decay,
    )  # fmt: skip


def _slots(linear: LinearAttention) -> list[Slot]:
    """qwen3_next.py's (kimi_delta.py's) Slots of one layer, named inside their prefix, paths
    inside the layer."""
    layout = kimi_delta_attention_tensors if linear.channel_decay else linear_attention_tensors
    return [
        Slot(name.split(".", 1)[1], path[1:], (), in_axes, part, unit_axis)
        for path, name, in_axes, part, unit_axis in layout(linear)
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
            channel_decay=linear.channel_decay,
            init_std=0.02,
            param_dtype=jnp.float32,
            compute_dtype=jnp.float32,
            rngs=nnx.Rngs(0),
        )  # fmt: skip
    )
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))[0]
    return {tuple(key.key for key in path): leaf.shape for path, leaf in flat}
