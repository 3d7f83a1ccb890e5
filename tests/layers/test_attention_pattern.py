"""Sliding-window, chunked and sink attention (layers/attention_pattern.py and the
reference kernel), against a NumPy statement of the masks and the sink's softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.config import ConfigError
from maxtrain.kernels import attention as attn
from maxtrain.kernels.xla_attention import cached_attention
from maxtrain.layers.attention_pattern import chunk_segments, kind_per_layer, model_kinds
from maxtrain.models import ModelSpec, abstract, build
from maxtrain.training.run_model import model_spec

B, T, N, K, H = 2, 24, 4, 2, 8
# Two packed documents per row, of lengths that leave their starts off the chunk grid.
SEGMENTS = np.array([[1] * 11 + [2] * 13, [5] * 17 + [6] * 7], np.int32)
POSITIONS = np.concatenate(
    [np.concatenate([np.arange(11), np.arange(13)]), np.concatenate([np.arange(17), np.arange(7)])]
).reshape(B, T)


def _inputs():
    kq, kk, kv, ks = jax.random.split(jax.random.key(0), 4)
    return (
        jax.random.normal(kq, (B, T, N, H), jnp.float32),
        jax.random.normal(kk, (B, T, K, H), jnp.float32),
        jax.random.normal(kv, (B, T, K, H), jnp.float32),
        2.0 * jax.random.normal(ks, (N,), jnp.float32),
    )


def _numpy_mask(window=None, chunk=None) -> np.ndarray:
    """[B, T, S]: same document, causal, within the window, within the chunk of positions."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = (SEGMENTS[:, :, None] == SEGMENTS[:, None, :]) & (j <= i)
    if window is not None:
        mask &= i - j < window
    if chunk is not None:
        mask &= POSITIONS[:, :, None] // chunk == POSITIONS[:, None, :] // chunk
    return mask


def _naive(q, k, v, mask, sinks=None):
    """softmax over the visible keys (and the sink, a logit with no value), in plain jnp:
    autodiff of this is the gradients' oracle."""
    g = N // K
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    scores = jnp.where(jnp.asarray(mask)[:, None], scores, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))
        scores = jnp.concatenate([scores, sink], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)[..., :T]
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_window_and_sinks_equal_the_formula(window, with_sinks):
    q, k, v, sinks = _inputs()
    args = (q, k, v) + ((sinks,) if with_sinks else ())
    segments, mask = jnp.asarray(SEGMENTS), _numpy_mask(window)
    cot = jax.random.normal(jax.random.key(3), q.shape)
    kernel = attn.attention_kernel("xla", window)
    fns = (
        lambda q, k, v, *s: kernel(q, k, v, segments, *s),
        lambda *a: _naive(*a[:3], mask, *a[3:]),
    )

    @jax.jit  # the kernel's and the formula's outputs and gradients: one program, not op by op
    def outputs_and_grads(*args):
        argnums = tuple(range(len(args)))
        return [
            (fn(*args), jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * cot), argnums)(*args))
            for fn in fns
        ]

    (got, got_grads), (want, want_grads) = outputs_and_grads(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for got_g, want_g in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-5)


def test_tokamax_k_start_path_honours_the_window():
    """The mask the GPU kernels receive (k_start = the later of the document's start and
    i - window + 1), through tokamax's own XLA kernel on CPU."""
    q, k, v, _ = _inputs()
    kernel = attn.attention_kernel("tokamax_xla", 5)
    got, want = jax.jit(  # one program, not op by op
        lambda q, k, v: (kernel(q, k, v, jnp.asarray(SEGMENTS)), _naive(q, k, v, _numpy_mask(5)))
    )(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [4, 8])
def test_chunked_attention_is_causal_attention_over_chunk_segments(chunk):
    """Chunks follow each document's positions, not the row's index: a document starting at
    index 11 starts a chunk there."""
    q, k, v, _ = _inputs()
    kernel = attn.attention_kernel("xla", chunk)

    @jax.jit  # one program, not op by op
    def got_and_want(q, k, v):
        segments = chunk_segments(jnp.asarray(SEGMENTS), jnp.asarray(POSITIONS), chunk)
        return kernel(q, k, v, segments), _naive(q, k, v, _numpy_mask(chunk=chunk))

    got, want = got_and_want(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cached_attention_masks_window_and_chunk_by_position():
    q, k, v, sinks = _inputs()
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    one_doc = np.ones((B, T), np.int32)
    for window, chunk in ((6, None), (None, 5)):
        got = cached_attention(q, k, v, positions, sinks, window=window, chunk=chunk)
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        mask = np.broadcast_to(j <= i, (B, T, T))
        mask = mask & (i - j < window) if window else mask & (i // chunk == j // chunk)
        want = _naive(q, k, v, mask & (one_doc[:, :, None] > 0), sinks)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _pattern_model(*overrides) -> ModelSpec:
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        ["model_name=tiny", "data.kind=synthetic", "compute.remat=none", *overrides],
    )
    return model_spec(cfg)


def _logits(spec, params_of, args):
    """Logits of a model built from spec, holding the parameters of module params_of."""
    module = abstract(spec)  # its own initialisation would be overwritten: none traced
    nnx.update(module, nnx.state(params_of, nnx.Param))
    return module(*args)[0]


def test_a_window_covering_the_sequence_is_global_attention():
    """Sliding layers with a window no shorter than the sequence compute what global layers do
    (the kinds change masks, not parameters), and a short window changes the logits."""
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 256)
    args = (tokens, jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS))
    layers = ["model.layers=[sliding-dense, global-dense]"]
    plain_spec = _pattern_model()
    specs = [_pattern_model(*layers, f"model.sliding_window={w}") for w in (64, 3)]

    @jax.jit  # the three models built and run as one program, not op by op
    def logits():
        plain = build(plain_spec, seed=0)
        return plain(*args)[0], [_logits(spec, plain, args) for spec in specs]

    want, (wide, short) = logits()
    np.testing.assert_allclose(wide, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(short - want).max()) > 1e-3


def test_scanned_and_unrolled_layers_of_mixed_kinds_agree():
    """A run of layers of several kinds is scanned with each layer's kind as data
    (lax.switch); unrolled, each layer's kind is a constant. Same logits."""
    overrides = ["model.layers=[sliding-dense, global-dense]", "model.sliding_window=3"]
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 256)
    args = (tokens, jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS))
    scanned_spec = _pattern_model(*overrides)
    unrolled_spec = _pattern_model(*overrides, "compute.scan_layers=false")

    @jax.jit  # both models built and run as one program, not op by op
    def logits():
        scanned = build(scanned_spec, seed=0)
        return scanned(*args)[0], _logits(unrolled_spec, scanned, args)

    scanned, unrolled = logits()
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)


def test_layers_repeat_over_the_model_or_are_cut_at_its_depth():
    """model.layers' expanded list repeats over num_layers, a last repetition partial, and a
    list longer than the model is cut at its depth; a layer's kind index is its kind's place
    among the model's own kinds (global before chunked)."""
    repeated = _pattern_model(
        "model.num_layers=5", "model.layers=[chunked-dense*2, global-dense]",
        "model.attention_chunk=8",
    ).model  # fmt: skip
    assert model_kinds(repeated) == ("global", "chunked")
    assert kind_per_layer(repeated) == (1, 1, 0, 1, 1)
    cut = _pattern_model("model.layers=[global-dense*3, sliding-dense*9]", "model.num_layers=3")
    assert [t.attention for t in cut.model.layer_types] == ["global"] * 3
    assert cut.model.layers is None  # as said: every layer global (the list is made canonical)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.layers=[sliding-dense, global-dense]"], "which need model.sliding_window"),
        (["model.sliding_window=4"], "model.sliding_window is set but model.layers has no"),
        (["model.layers=[local-dense]"], r"'model.layers\[0\]' must be ATTENTION-FFN or"),
        (["model.layers=[global-dense*0]"], "COUNT >= 1"),
        (["model.layers=[global-moe]"], "model.layers has moe layers, which need model.moe"),
        (["model.attention_temperature={floor: 4}"], "model.layers has no nope layers"),
        (["model.rope.local_theta=100"], "model.layers has no sliding or chunked layers"),
    ],
)
def test_layer_mistakes_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _pattern_model(*overrides)
