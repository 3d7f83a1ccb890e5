"""Model structure: stacked layers, depth-independent scan, RoPE scaling, qk-norm presets."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain import models as model_lib
from maxtrain.config import CONFIGS_DIR, RopeScaling, load
from maxtrain.layers.rope import Rope
from maxtrain.training.run_model import model_spec


def _spec(*overrides) -> model_lib.ModelSpec:
    return model_spec(load(CONFIGS_DIR / "base.yml", ["model_name=tiny", *overrides]))


def _forward_jaxpr_size(spec) -> int:
    model = model_lib.build(spec)
    tokens = jnp.zeros((1, 8), jnp.int32)
    return len(jax.make_jaxpr(lambda: model(tokens, tokens, tokens + 1))().eqns)


def test_scanned_program_size_does_not_grow_with_depth():
    shallow = _forward_jaxpr_size(_spec("model.num_layers=2"))
    deep = _forward_jaxpr_size(_spec("model.num_layers=6"))
    unrolled = _forward_jaxpr_size(_spec("model.num_layers=6", "compute.scan_layers=false"))
    assert shallow == deep
    assert unrolled > deep  # the unrolled loop really does grow


def test_layer_parameters_are_stacked_with_a_layers_axis():
    spec = _spec("model.num_layers=3")
    cfg = spec.model
    state = nnx.state(model_lib.abstract(spec), nnx.Param)
    kernel = state["layers"]["mlp"]["up"]["kernel"]
    assert kernel.get_value().shape == (3, cfg.emb_dim, cfg.mlp_dim)
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")


def test_llama3_rope_scaling_matches_the_published_rule():
    """Wavelengths above original/low_freq are divided by factor, below original/high kept."""
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
    )
    plain = Rope(128, 500000.0).inverse_frequencies()
    scaled = Rope(128, 500000.0, scaling).inverse_frequencies()
    wavelen = 2 * np.pi / plain
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    np.testing.assert_allclose(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=1e-6)
    mid = ~(high | low)
    assert np.all((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0))


def test_llama3_rope_scaling_with_equal_band_factors_is_a_step():
    """Llama 4 Scout's low_freq_factor = high_freq_factor = 1: no blended band, wavelengths
    above original divided by factor, the rest kept (as transformers computes it)."""
    scaling = RopeScaling(
        factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position=8192
    )
    plain = Rope(128, 500000.0).inverse_frequencies()
    scaled = Rope(128, 500000.0, scaling).inverse_frequencies()
    long = 2 * np.pi / plain > 8192
    assert 0 < long.sum() < len(plain)
    np.testing.assert_allclose(scaled, np.where(long, plain / 16.0, plain), rtol=1e-6)


def test_rope_rotates_pairs_by_position_and_restarts_per_document():
    x = jax.random.normal(jax.random.key(0), (1, 4, 1, 8))
    inv = Rope(8, 10000.0).inverse_frequencies()
    positions = jnp.array([[0, 1, 0, 1]])  # two documents of two tokens
    out = Rope(8, 10000.0)(x, positions)
    np.testing.assert_allclose(out[0, 0], x[0, 0], atol=1e-6)  # position 0: identity
    np.testing.assert_allclose(out[0, 2], x[0, 2], atol=1e-6)  # restarted document
    # position 1 rotates dims (i, i + H/2) by angle inv_freq[i]
    a, b = x[0, 1, 0, :4], x[0, 1, 0, 4:]
    c, s = np.cos(inv), np.sin(inv)
    np.testing.assert_allclose(
        out[0, 1, 0], np.concatenate([a * c - b * s, b * c + a * s]), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(jnp.linalg.norm(out), jnp.linalg.norm(x), rtol=1e-5)


def test_partial_rope_rotates_the_first_dims_among_themselves():
    """GLM-4.5's partial RoPE: Rope of 4 dims on a head of 12 rotates dims (i, i + 2) of the
    first 4 by position x theta^(-2i/4) and leaves the other 8 as they are."""
    x = jax.random.normal(jax.random.key(1), (1, 2, 3, 12))
    positions = jnp.array([[0, 5]])
    out = np.asarray(Rope(4, 1000000.0)(x, positions))
    np.testing.assert_array_equal(out[..., 4:], np.asarray(x)[..., 4:])
    angle = 5 * 1000000.0 ** (-np.arange(0, 4, 2) / 4)
    a, b = np.asarray(x)[0, 1, :, :2], np.asarray(x)[0, 1, :, 2:4]
    c, s = np.cos(angle), np.sin(angle)
    rotated = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    np.testing.assert_allclose(out[0, 1, :, :4], rotated, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[0, 0], np.asarray(x)[0, 0], atol=1e-6)  # position 0


def test_qk_norm_tied_preset_builds_and_uses_the_embedding_as_head():
    cfg = load(CONFIGS_DIR / "base.yml", ["model_name=tiny-qk"]).model
    model = model_lib.build(model_lib.ModelSpec(cfg))
    assert model.lm_head is None
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    logits, _ = model(tokens, tokens, jnp.ones_like(tokens))
    # with a tied head, scaling the embedding table changes the logits' scale
    model.embedding[...] = model.embedding[...] * 2.0
    logits2, _ = model(tokens, tokens, jnp.ones_like(tokens))
    assert logits.shape == (1, 8, cfg.vocab_size)
    assert not np.allclose(logits, logits2)
    state = nnx.state(model, nnx.Param)
    assert state["layers"]["attn"]["q_norm"]["scale"].get_value().shape == (2, 32)
