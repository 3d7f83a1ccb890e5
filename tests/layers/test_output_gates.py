"""Qwen3-Next's two gates, each against its formula written out here in NumPy on the layer's own
parameters: the attention output times sigmoid(x W_gate) per head and dim before the output
projection, and the shared experts' output times sigmoid(x w) per token."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain.config import ComputeConfig, ModelConfig, MoeConfig
from maxtrain.layers.attention import Attention
from maxtrain.layers.moe import MoE
from maxtrain.layers.spec import ModelSpec

CFG = dict(vocab_size=16, emb_dim=8, num_layers=1, num_heads=2, num_kv_heads=1)


def _layer(kind, **fields):
    """The layer, initialised as one compiled program (op by op, each op would compile alone)."""
    cfg = ModelConfig(**CFG, **({"mlp_dim": 12} if "moe" not in fields else {}), **fields)
    spec = ModelSpec(cfg, ComputeConfig(compute_dtype="float32"))
    return nnx.jit(lambda: kind(spec, rngs=nnx.Rngs(0)))()


@nnx.jit
def _apply(layer, *args):
    return layer(*args)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_attention_output_gate_scales_each_head_and_dim_before_the_output_projection():
    gated = _layer(Attention, attention_output_gate=True)
    gated.output_gate.kernel[...] = jax.random.normal(jax.random.key(1), (8, 2, 4))
    plain = _layer(Attention)
    nnx.update(plain, nnx.state(gated).filter(lambda path, _: "output_gate" not in path))
    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    segments = jnp.ones((2, 5), jnp.int32)
    o = np.asarray(plain.o.kernel[...])  # [N, H, D]
    # The ungated attention output, recovered through the (invertible here) output projection.
    flat_o = o.reshape(8, 8)
    heads = np.asarray(_apply(plain, x, positions, segments)) @ np.linalg.inv(flat_o)
    gate = _sigmoid(np.einsum("btd,dnh->btnh", np.asarray(x), gated.output_gate.kernel[...]))
    want = (heads.reshape(2, 5, 2, 4) * gate).reshape(2, 5, 8) @ flat_o
    np.testing.assert_allclose(_apply(gated, x, positions, segments), want, rtol=2e-4, atol=2e-5)


def test_shared_expert_gate_scales_the_shared_experts_per_token():
    moe = dict(num_experts=4, top_k=2, expert_mlp_dim=6, shared_experts=1)
    gated = _layer(MoE, moe=MoeConfig(**moe, shared_expert_gate=True))
    gated.shared_gate.kernel[...] = jax.random.normal(jax.random.key(3), (8, 1))
    for i, p in enumerate((gated.shared.gate, gated.shared.up, gated.shared.down)):
        p.kernel[...] = jax.random.normal(jax.random.key(10 + i), p.kernel.shape)
    plain = _layer(MoE, moe=MoeConfig(**moe))
    nnx.update(plain, nnx.state(gated).filter(lambda path, _: "shared_gate" not in path))
    no_shared = _layer(MoE, moe=MoeConfig(**{**moe, "shared_experts": 0}))
    nnx.update(no_shared, nnx.state(plain).filter(lambda path, _: "shared" not in path))
    x = jax.random.normal(jax.random.key(4), (2, 5, 8))
    routed = np.asarray(_apply(no_shared, x)[0])
    shared = np.asarray(_apply(plain, x)[0]) - routed
    gate = _sigmoid(np.asarray(x) @ np.asarray(gated.shared_gate.kernel[...]))  # [B, T, 1]
    np.testing.assert_allclose(_apply(gated, x)[0], routed + gate * shared, rtol=1e-5, atol=1e-6)
    assert np.abs(shared).mean() > 0.01 and np.ptp(gate) > 0.1  # both matter here
