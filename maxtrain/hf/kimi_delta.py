"""Kimi Delta Attention's checkpoint tensors (Kimi Linear's linear layers, inside `self_attn.`)
<-> the layer's parameters (layers/gated_deltanet.py with channel_decay), as transformers 5.23.0
saves KimiLinearDeltaAttention:

    q_proj, k_proj, v_proj.weight [H d, D]       our q, k, v kernels [D, H, d]
    q_conv1d, k_conv1d, v_conv1d.weight [H d, 1, K]   our taps [K, H, d]
    f_a_proj.weight [d, D], f_b_proj.weight [H d, d]  the decay's rank-d projection (a_down, a)
    dt_bias [H d], A_log [1, 1, H, 1]            ours [H, d] and [H]
    g_a_proj.weight [d, D], g_b_proj.weight [H d, d]  the output gate's (z_down, z)
    b_proj.weight [H, D], o_norm.weight [d], o_proj.weight [D, H d]

(H heads of d dims: query/key and value heads alike). Kept apart from maxtrain/hf/families/ so
that a family module and the layer's own tests can both import it.
"""

from __future__ import annotations

from maxtrain.config import LinearAttention

PREFIX = "self_attn"  # the tensors' (ours: the decoder block's linear_attn)


def kimi_delta_attention_tensors(linear: LinearAttention) -> tuple:
    """The layer's tensors inside `self_attn.`: (our path, Hugging Face name, input axes, Part,
    unit axes), as maxtrain/hf/families/qwen3_next.py's linear_attention_tensors."""
    del linear  # every tensor maps whole: the sizes do not enter the layout
    la, sa = "linear_attn", PREFIX
    linear_maps = (
        ("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("b", "b_proj"),
        ("a_down", "f_a_proj"), ("a", "f_b_proj"), ("z_down", "g_a_proj"), ("z", "g_b_proj"),
    )  # fmt: skip
    return (
        *(
            ((la, ours, "kernel"), f"{sa}.{name}.weight", 1, None, None)
            for ours, name in linear_maps
        ),
        *(((la, f"{ours}_conv"), f"{sa}.{ours}_conv1d.weight", 1, None, 1) for ours in "qkv"),
        ((la, "dt_bias"), f"{sa}.dt_bias", 0, None, None),  # flattened, as a bias
        ((la, "a_log"), f"{sa}.A_log", None, None, (0, 1, 3)),
        ((la, "norm", "scale"), f"{sa}.o_norm.weight", None, None, None),
        ((la, "o", "kernel"), f"{sa}.o_proj.weight", 2, None, None),
    )
