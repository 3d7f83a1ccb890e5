"""transformers' fused Gated DeltaNet tensors (Qwen3-Next's `linear_attn.`) and the layer's
parameters (model/layers/gated_deltanet.py), both ways.

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
"""

from __future__ import annotations

import numpy as np


def split_qkvz(
    weight: np.ndarray, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> dict[str, np.ndarray]:
    """in_proj_qkvz.weight -> our q, k [D, Nk, dk] and v, z [D, Nv, dv] kernels."""
    group = num_v_heads // num_k_heads
    per_head = weight.T.reshape(weight.shape[1], num_k_heads, -1)  # [D, Nk, 2 dk + 2 G dv]
    bounds = np.cumsum([head_k_dim, head_k_dim, group * head_v_dim])
    q, k, v, z = np.split(per_head, bounds, axis=-1)
    as_value_heads = lambda x: x.reshape(x.shape[0], num_v_heads, head_v_dim)  # noqa: E731
    return dict(q=q, k=k, v=as_value_heads(v), z=as_value_heads(z))


def fuse_qkvz(q: np.ndarray, k: np.ndarray, v: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Our q, k [D, Nk, dk] and v, z [D, Nv, dv] kernels -> in_proj_qkvz.weight."""
    d, num_k_heads = q.shape[:2]
    grouped = lambda x: x.reshape(d, num_k_heads, -1)  # noqa: E731  [D, Nk, G dv]
    return np.concatenate([q, k, grouped(v), grouped(z)], axis=-1).reshape(d, -1).T


def split_ba(weight: np.ndarray, *, num_k_heads: int) -> dict[str, np.ndarray]:
    """in_proj_ba.weight -> our b, a [D, Nv] kernels."""
    per_head = weight.T.reshape(weight.shape[1], num_k_heads, -1)  # [D, Nk, 2 G]
    b, a = np.split(per_head, 2, axis=-1)
    return dict(b=b.reshape(b.shape[0], -1), a=a.reshape(a.shape[0], -1))


def fuse_ba(b: np.ndarray, a: np.ndarray, *, num_k_heads: int) -> np.ndarray:
    """Our b, a [D, Nv] kernels -> in_proj_ba.weight."""
    grouped = lambda x: x.reshape(x.shape[0], num_k_heads, -1)  # noqa: E731
    return np.concatenate([grouped(b), grouped(a)], axis=-1).reshape(b.shape[0], -1).T


def split_conv(
    weight: np.ndarray, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> dict[str, np.ndarray]:
    """conv1d.weight [C, 1, K] -> our q_conv, k_conv [K, Nk, dk] and v_conv [K, Nv, dv] taps."""
    taps = weight[:, 0, :].T  # [K, C]
    key = num_k_heads * head_k_dim
    q, k, v = np.split(taps, [key, 2 * key], axis=-1)
    return dict(
        q_conv=q.reshape(-1, num_k_heads, head_k_dim),
        k_conv=k.reshape(-1, num_k_heads, head_k_dim),
        v_conv=v.reshape(-1, num_v_heads, head_v_dim),
    )


def fuse_conv(q_conv: np.ndarray, k_conv: np.ndarray, v_conv: np.ndarray) -> np.ndarray:
    """Our q_conv, k_conv, v_conv taps -> conv1d.weight [C, 1, K]."""
    flat = [x.reshape(x.shape[0], -1) for x in (q_conv, k_conv, v_conv)]
    return np.concatenate(flat, axis=-1).T[:, None, :]


# Tensors whose layout is ours as it is: (Hugging Face name, our parameter path).
_AS_THEY_ARE = (
    ("A_log", ("a_log",)),
    ("dt_bias", ("dt_bias",)),
    ("norm.weight", ("norm", "scale")),
)


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
    dims = dict(
        num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
    )  # fmt: skip
    ours: dict[tuple[str, ...], np.ndarray] = {}
    for name, kernel in split_qkvz(tensors["in_proj_qkvz.weight"], **dims).items():
        ours[(name, "kernel")] = kernel
    for name, kernel in split_ba(tensors["in_proj_ba.weight"], num_k_heads=num_k_heads).items():
        ours[(name, "kernel")] = kernel
    for name, taps in split_conv(tensors["conv1d.weight"], **dims).items():
        ours[(name,)] = taps
    ours[("o", "kernel")] = tensors["out_proj.weight"].T.reshape(num_v_heads, head_v_dim, -1)
    for hf_name, path in _AS_THEY_ARE:
        ours[path] = tensors[hf_name]
    return ours


def to_hf(params: dict[tuple[str, ...], np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameters of one layer, by path (`from_hf`'s) -> its tensors by their names inside
    `linear_attn.`."""
    kernel = lambda name: params[(name, "kernel")]  # noqa: E731
    num_k_heads = kernel("q").shape[1]
    o = kernel("o")
    tensors = {
        "in_proj_qkvz.weight": fuse_qkvz(kernel("q"), kernel("k"), kernel("v"), kernel("z")),
        "in_proj_ba.weight": fuse_ba(kernel("b"), kernel("a"), num_k_heads=num_k_heads),
        "conv1d.weight": fuse_conv(params[("q_conv",)], params[("k_conv",)], params[("v_conv",)]),
        "out_proj.weight": o.reshape(-1, o.shape[-1]).T,
    }
    for hf_name, path in _AS_THEY_ARE:
        tensors[hf_name] = params[path]
    return tensors
