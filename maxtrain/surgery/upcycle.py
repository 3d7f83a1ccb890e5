"""Sparse upcycling: a dense model's parameters become a mixture-of-experts model's.

Each dense SwiGLU down(silu(x @ gate) * (x @ up)) is a sum over its F hidden units, so splitting
the hidden units into G = top_k contiguous slices of F / G splits the MLP into G smaller SwiGLUs
whose outputs add up to the dense output. Expert e holds slice e % G, so the E experts are
E / G copies of the G slices (fine-grained experts: 64 experts top-8 from 8 slices is the
Kanana-MoE shape).

With a zero router every expert scores the same; top-k takes the lowest indices on ties, i.e.
experts 0..G-1, which hold each slice exactly once. Each gets the same routing weight w (1/G
when the top-k weights are renormalized, times moe.routed_scale), so the layer computes
w * dense(x). Multiplying every expert's down projection by 1/w (G in the usual case) makes the
upcycled model compute exactly the dense model's function at step 0, up to float rounding. The
factor lives in the weights rather than in moe.routed_scale so that the checkpoint is an
ordinary MoE (Mixtral- or Qwen3-MoE-style) needing no extra factor wherever it is exported.

That equality is the starting point, not the training recipe: with a zero router and identical
copies, copies of a slice differ only by the tokens they come to receive. `noise_std` perturbs
every expert weight and `router_init_std` draws a random router, both to break that symmetry;
with either, the step-0 equality no longer holds. In capacity mode (moe.expert_capacity_factor) a
zero router sends every token to experts 0..G-1, most of whose assignments then drop: upcycle
into the dropless mode.

Supported targets: every MoE layer is upcycled from the dense layer at the same depth, and the
target's dense layers (its model.layers' `dense` ones) are copied as they are. Shared
experts are not supported: the routed experts already reproduce the whole dense MLP, so there
is no part of it left for an always-on expert to start from.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.config import ConfigError, ModelConfig, MoeConfig
from maxtrain.models.stacks import (
    STACKS,
    layer_kinds,
    mixer_per_layer,
    outside_layers,
    stack_members,
    stack_positions,
    take_layers,
)


def upcycle(
    dense_params: dict[str, Any],
    dense_cfg: ModelConfig,
    moe_cfg: ModelConfig,
    *,
    noise_std: float = 0.0,
    router_init_std: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The parameters of `moe_cfg`'s model built from those of the dense `dense_cfg` model.

    Attention, norms, embedding and LM head are copied. noise_std: std of the Gaussian noise
    added to each expert weight, relative to the RMS of that layer's weight (0: exact copies).
    router_init_std: std of the router kernel (0: zeros, the step-0 equality). Raises
    ConfigError if the two configs do not describe an upcycling (see check_upcycle).
    """
    check_upcycle(dense_cfg, moe_cfg)
    m = moe_cfg.moe
    assert m is not None
    position = stack_positions(layer_kinds(dense_cfg))
    key = jax.random.key(seed)
    out = outside_layers(dense_params)
    # Each target layer is the source's at the same depth (same mixer, dense), its MLP split into
    # experts where the target's layer is MoE; the target's dense layers are copied as they are.
    for kind, members in stack_members(layer_kinds(moe_cfg)).items():
        source = dense_params[STACKS[kind._replace(is_moe=False)]]
        blocks = take_layers(source, [position[i] for i in members])
        if kind.is_moe:
            # Linear-attention MoE layers draw other noise; the attention ones keep the seed's key.
            stack_key = key if kind.mixer == "attention" else jax.random.fold_in(key, 1)
            mlp = blocks.pop("mlp")
            experts = _experts_from_mlp(mlp, m, noise_std, router_init_std, stack_key)
            blocks = {**blocks, "moe": experts}
        out[STACKS[kind]] = blocks
    return out


def check_upcycle(dense_cfg: ModelConfig, moe_cfg: ModelConfig) -> None:
    """Raises ConfigError unless the dense model's MLPs split evenly into the MoE's experts."""
    m = moe_cfg.moe
    if dense_cfg.moe is not None:
        raise ConfigError("upcycling needs a dense source model; the source has model.moe set")
    if m is None:
        raise ConfigError("upcycling needs a mixture-of-experts target: set model.moe")
    if dense_cfg.num_layers != moe_cfg.num_layers:
        raise ConfigError(
            f"upcycling keeps the depth: the source has {dense_cfg.num_layers} layers, "
            f"model.num_layers is {moe_cfg.num_layers}"
        )
    if mixer_per_layer(dense_cfg) != mixer_per_layer(moe_cfg):
        raise ConfigError(
            "upcycling keeps each layer's token mixer: the source's attention and "
            "linear-attention layers must be where the target's are"
        )
    if m.shared_experts:
        raise ConfigError(
            "upcycling does not support shared experts (the routed experts already hold the "
            "whole dense MLP); set model.moe.shared_experts=0"
        )
    gpt_oss = [
        k
        for k in ("router_logit_bias", "expert_projection_bias", "clamped_swiglu")
        if getattr(m, k)
    ]
    if gpt_oss:
        raise ConfigError(
            f"upcycling copies the source's SwiGLU MLPs into SwiGLU experts without biases; "
            f"model.moe.{gpt_oss[0]} is not supported"
        )
    f, g = dense_cfg.mlp_dim, m.top_k
    if f % g:
        raise ConfigError(
            f"upcycling splits each dense MLP into model.moe.top_k={g} slices, but the source's "
            f"mlp_dim {f} is not divisible by {g}"
        )
    if m.expert_mlp_dim != f // g:
        raise ConfigError(
            f"model.moe.expert_mlp_dim must be the source's mlp_dim / top_k = {f} / {g} = "
            f"{f // g} to upcycle (got {m.expert_mlp_dim})"
        )
    if m.num_experts % g:
        raise ConfigError(
            f"model.moe.num_experts ({m.num_experts}) must be a multiple of model.moe.top_k "
            f"({g}): each of the {g} slices of the dense MLP is copied num_experts / top_k times"
        )


def step0_weight(m: MoeConfig) -> float:
    """The routing weight each of the top_k chosen experts gets from a zero router."""
    if m.renormalize:
        weight = 1.0 / m.top_k
    elif m.score == "softmax":
        weight = 1.0 / m.num_experts  # uniform softmax
    else:
        weight = 0.5  # sigmoid(0)
    return weight * m.routed_scale


def _experts_from_mlp(
    mlp: dict[str, Any], m: MoeConfig, noise_std: float, router_init_std: float, key: jax.Array
) -> dict[str, Any]:
    """{router, gate, up, down} of stacked MoE layers from the stacked dense SwiGLUs `mlp`."""
    g, copies = m.top_k, m.num_experts // m.top_k
    gate, up, down = (mlp[name]["kernel"] for name in ("gate", "up", "down"))
    layers, emb_dim, hidden = gate.shape

    def columns(w):  # [L, D, F] -> [L, G, D, F/G]: slice s = hidden units s*F/G .. (s+1)*F/G-1
        return w.reshape(layers, emb_dim, g, hidden // g).transpose(0, 2, 1, 3)

    def rows(w):  # [L, F, D] -> [L, G, F/G, D], the same slices
        return w.reshape(layers, g, hidden // g, emb_dim)

    def replicate(slices):  # [L, G, ...] -> [L, E, ...]: expert e holds slice e % G
        return jnp.tile(slices, (1, copies, 1, 1))

    keys = jax.random.split(key, 4)
    experts = {
        "gate": replicate(columns(gate)),
        "up": replicate(columns(up)),
        "down": replicate(rows(down) * jnp.asarray(1.0 / step0_weight(m), down.dtype)),
    }
    experts = {
        name: {"kernel": _perturb(w, k, noise_std)}
        for (name, w), k in zip(experts.items(), keys[:3], strict=True)
    }
    router_shape = (layers, emb_dim, m.num_experts)
    router = {
        "kernel": (router_init_std * jax.random.normal(keys[3], router_shape)).astype(gate.dtype)
    }
    if m.balance_bias_update_rate > 0:  # aux-loss-free balancing starts from no preference
        router["bias"] = jnp.zeros((layers, m.num_experts), jnp.float32)
    return {"router": router, **experts}


def _perturb(w: jax.Array, key: jax.Array, noise_std: float) -> jax.Array:
    """w plus Gaussian noise of std noise_std x (RMS of w in each layer); w itself if 0."""
    if noise_std == 0:
        return w
    x = w.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=tuple(range(1, x.ndim)), keepdims=True))
    return (x + noise_std * rms * jax.random.normal(key, x.shape)).astype(w.dtype)
