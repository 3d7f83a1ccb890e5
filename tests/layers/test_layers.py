"""Attention (GQA with RoPE and qk-norm, MLA), the SwiGLU and GeGLU MLPs and RMSNorm against NumPy
written from the papers' formulas, on random parameters and a batch of two packed documents
(positions restart and attention stops at the boundary)."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxtrain.layers.attention import Attention
from maxtrain.layers.attention_pattern import model_kinds
from maxtrain.layers.mla import LATENT_NORM_EPS, MLA
from maxtrain.layers.mlp import MLP
from maxtrain.layers.norms import RMSNorm
from maxtrain.training.run_model import model_spec

B, T = 2, 12
RNG = np.random.default_rng(0)
# Two documents per row: 7 tokens then 5 (positions restart at the second one).
SEGMENTS = np.array([[1] * 7 + [2] * 5] * B, np.int32)
POSITIONS = np.array([list(range(7)) + list(range(5))] * B, np.int32)


def _randomised(module: nnx.Module) -> dict:
    """Every parameter of `module` set to a random normal (norm scales around 1), as NumPy."""
    state = nnx.state(module, nnx.Param)
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: (
            1 + 0.3 * RNG.standard_normal(p.shape) if "scale" in str(path[-1])
            else 0.2 * RNG.standard_normal(p.shape)
        ).astype(np.float32),
        nnx.to_pure_dict(state),
    )  # fmt: skip
    nnx.replace_by_pure_dict(state, params)
    nnx.update(module, state)
    return params


def _layer(cls, cfg):
    """The layer of a run's config (float32 on CPU: compute.compute_dtype auto), initialised
    as one compiled program (eagerly, each operation would compile on its own)."""
    spec = model_spec(cfg)
    return nnx.jit(lambda: cls(spec, rngs=nnx.Rngs(0)))()


def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x, positions, theta):
    """Rotate-half RoPE (Su et al. 2021, Llama's pairing): dims i and i + H/2 rotate together."""
    h = x.shape[-1]
    angles = positions[..., None] * (1.0 / theta ** (np.arange(0, h, 2) / h))  # [B, T, H/2]
    sin, cos = np.sin(angles)[:, :, None], np.cos(angles)[:, :, None]
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attend(q, k, v, chunk=None, scale_dim=None):
    """Causal softmax attention within each document (and chunk of positions, if given);
    query head n reads kv head n // G; the logits divided by sqrt(scale_dim), by default the
    head size."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(scale_dim or q.shape[-1])
    causal = np.tril(np.ones((T, T), bool))
    allowed = causal & (SEGMENTS[:, :, None] == SEGMENTS[:, None, :])  # [B, T, S]
    if chunk is not None:
        allowed &= POSITIONS[:, :, None] // chunk == POSITIONS[:, None, :] // chunk
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


def _call(layer, *args):
    """layer(*args) as one compiled program, the arguments its constants."""
    return nnx.jit(lambda layer: layer(*args))(layer)


def _run(layer, x, *args):
    return np.asarray(_call(layer, x, POSITIONS, SEGMENTS, *args))


@pytest.mark.parametrize("plus_one", [False, True], ids=["llama", "gemma"])
def test_rms_norm(plus_one):
    """Llama's scales by w, Gemma's by 1 + w; both start as the plain normalisation."""
    layer = RMSNorm(32, eps=1e-5, param_dtype=np.float32, rngs=nnx.Rngs(0), plus_one=plus_one)
    x = RNG.standard_normal((B, T, 32)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(layer(x)), rms_norm(x, 1.0, 1e-5), rtol=1e-5)
    w = _randomised(layer)["scale"]
    scale = 1 + w if plus_one else w
    np.testing.assert_allclose(np.asarray(layer(x)), rms_norm(x, scale, 1e-5), rtol=1e-5)


def gelu_tanh(x):
    """GELU's tanh approximation (Hendrycks and Gimpel 2016), transformers' gelu_pytorch_tanh."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize(
    "activation, gate_fn",
    [("silu", lambda g: g / (1 + np.exp(-g))), ("gelu_tanh", gelu_tanh)],
    ids=["swiglu", "geglu"],
)
def test_swiglu_mlp(make_cfg, activation, gate_fn):
    run = make_cfg("model_name=tiny", f"model.mlp_activation={activation}")
    cfg, layer = run.model, _layer(MLP, run)
    p = _randomised(layer)
    x = RNG.standard_normal((B, T, cfg.emb_dim)).astype(np.float32)
    gate, up = x @ p["gate"]["kernel"], x @ p["up"]["kernel"]
    expected = (gate_fn(gate) * up) @ p["down"]["kernel"]  # act(gate) * up
    out, stats = _call(layer, x)
    assert stats == {}
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        ("model_name=tiny",),
        ("model_name=tiny-qk",),
        # Gemma 3: 1 + w qk-norms, logits over sqrt(24) where the head size is 32
        ("model_name=tiny-qk", "model.norm_scale_plus_one=true", "model.softmax_scale_dim=24"),
    ],
    ids=["tiny", "tiny-qk", "gemma-qk-norm-softmax-scale"],
)
def test_grouped_query_attention(make_cfg, overrides):
    run = make_cfg(*overrides, "compute.attention=xla")
    cfg, layer = run.model, _layer(Attention, run)
    p = _randomised(layer)
    x = RNG.standard_normal((B, T, cfg.emb_dim)).astype(np.float32)
    q = np.einsum("btd,dnh->btnh", x, p["q"]["kernel"])
    k = np.einsum("btd,dkh->btkh", x, p["k"]["kernel"])
    v = np.einsum("btd,dkh->btkh", x, p["v"]["kernel"])
    if cfg.qk_norm == "rms":
        offset = 1.0 if cfg.norm_scale_plus_one else 0.0
        q = rms_norm(q, offset + p["q_norm"]["scale"], cfg.norm_eps)
        k = rms_norm(k, offset + p["k_norm"]["scale"], cfg.norm_eps)
    q, k = rope(q, POSITIONS, cfg.rope.theta), rope(k, POSITIONS, cfg.rope.theta)
    out = attend(q, k, v, scale_dim=cfg.softmax_scale_dim)
    expected = np.einsum("btnh,nhd->btd", out, p["o"]["kernel"])
    np.testing.assert_allclose(_run(layer, x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["nope", "chunked"], ids=["nope_tempered", "chunked_rope"])
def test_llama4_attention_kinds(make_cfg, kind):
    """Llama 4's two kinds of layer on one set of weights: nope layers without RoPE or
    qk-norm, their queries times 1 + s ln(1 + floor((p + 1) / f)); chunked layers with RoPE
    and a qk-norm that has no scale (an RMS norm of each head)."""
    run = make_cfg(
        "model_name=tiny",
        "compute.attention=xla",
        "model.qk_norm=rms_unscaled",
        "model.layers=[nope-dense, chunked-dense]",
        "model.attention_chunk=3",
        "model.attention_temperature={floor: 2, scale: 0.5}",
    )
    cfg, layer = run.model, _layer(Attention, run)
    p = _randomised(layer)
    assert "q_norm" not in p  # nothing learned in the norm
    x = RNG.standard_normal((B, T, cfg.emb_dim)).astype(np.float32)
    q = np.einsum("btd,dnh->btnh", x, p["q"]["kernel"])
    k = np.einsum("btd,dkh->btkh", x, p["k"]["kernel"])
    v = np.einsum("btd,dkh->btkh", x, p["v"]["kernel"])
    if kind == "nope":
        q = q * (1 + 0.5 * np.log(1 + np.floor((POSITIONS + 1) / 2)))[..., None, None]
        chunk = None
    else:
        q, k = rms_norm(q, 1.0, cfg.norm_eps), rms_norm(k, 1.0, cfg.norm_eps)
        q, k = rope(q, POSITIONS, cfg.rope.theta), rope(k, POSITIONS, cfg.rope.theta)
        chunk = 3
    expected = np.einsum("btnh,nhd->btd", attend(q, k, v, chunk), p["o"]["kernel"])
    got = _run(layer, x, model_kinds(cfg).index(kind))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_multi_head_latent_attention(make_cfg):
    """DeepSeek-V2's MLA: queries through a low-rank latent, keys and values from one shared
    normed latent, a rotary key part shared by all heads beside each head's own."""
    run = make_cfg("model_name=tiny-mla", "compute.attention=xla", "model.rope.interleaved=false")
    cfg, layer = run.model, _layer(MLA, run)
    m = cfg.mla
    p = _randomised(layer)
    x = RNG.standard_normal((B, T, cfg.emb_dim)).astype(np.float32)
    if m.q_lora_rank is None:
        q = np.einsum("btd,dnh->btnh", x, p["q"]["kernel"])
    else:
        q_latent = rms_norm(x @ p["q_a"]["kernel"], p["q_norm"]["scale"], LATENT_NORM_EPS)
        q = np.einsum("btr,rnh->btnh", q_latent, p["q_b"]["kernel"])
    fused = x @ p["kv_a"]["kernel"]
    latent, k_rope = fused[..., : m.kv_lora_rank], fused[..., m.kv_lora_rank :]
    kv = np.einsum(
        "btr,rnh->btnh",
        rms_norm(latent, p["kv_norm"]["scale"], LATENT_NORM_EPS),
        p["kv_b"]["kernel"],
    )
    k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
    k_rope = rope(k_rope[:, :, None], POSITIONS, cfg.rope.theta)  # one for every head
    q_rope = rope(q[..., m.qk_nope_head_dim :], POSITIONS, cfg.rope.theta)
    k = np.concatenate(
        [k_nope, np.broadcast_to(k_rope, (*k_nope.shape[:3], m.qk_rope_head_dim))], -1
    )
    q = np.concatenate([q[..., : m.qk_nope_head_dim], q_rope], -1)
    expected = np.einsum("btnh,nhd->btd", attend(q, k, v), p["o"]["kernel"])
    np.testing.assert_allclose(_run(layer, x), expected, rtol=1e-4, atol=1e-5)
