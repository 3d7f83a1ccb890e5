"""The attention kernels by name (kernels/attention.py) and their backends: reference numerics
(xla_attention.py), document isolation, tokamax's k_start (tokamax_attention.py), splash
attention in Pallas's interpreter (splash.py) and the kernels' per-device runs on a mesh
(parallel/per_device.py); sliding windows and attention sinks in every kernel, against the
reference (itself checked against a NumPy statement of the window and the sink's softmax in
test_attention_pattern.py)."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.config import ComputeConfig, MeshConfig
from maxtrain.config.attention_kernels import ATTENTION_KERNELS
from maxtrain.kernels import attention as attn
from maxtrain.kernels import splash
from maxtrain.kernels.tokamax_attention import segment_starts
from maxtrain.kernels.xla_attention import banded_attention, reference_attention
from maxtrain.parallel.mesh import build_mesh, constrain, sharding_rules
from maxtrain.parallel.per_device import per_device

B, T, N, K, H = 2, 16, 4, 2, 8
# Several documents per row; the second row ends in padding (id 0), which is its own segment.
SEGMENT_IDS = np.array(
    [
        [1, 1, 1, 2, 2, 3, 3, 3, 3, 4, 5, 5, 5, 5, 6, 6],
        [1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 0, 0, 0, 0],
    ],
    dtype=np.int32,
)


# Jitted once per implementation: eager op-by-op dispatch is several times slower on CPU.
def _attention(q, k, v, seg, *, implementation: str) -> jax.Array:
    return jax.jit(attn.attention_kernel(implementation))(q, k, v, seg)


def _qkv(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, T, N, H), jnp.float32),
        jax.random.normal(kk, (B, T, K, H), jnp.float32),
        jax.random.normal(kv, (B, T, K, H), jnp.float32),
    )


def _numpy_attention(q, k, v, seg) -> np.ndarray:
    """Independent float64 loop: for each (b, query, head), softmax over allowed keys."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, n_, h_ = q.shape
    group = n_ // k.shape[2]
    out = np.zeros(q.shape[:3] + v.shape[3:])
    for b in range(b_):
        for i in range(t_):
            keys = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
            for n in range(n_):
                kh = n // group
                s = np.array([q[b, i, n] @ k[b, j, kh] for j in keys]) / np.sqrt(h_)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, i, n] = sum(pj * v[b, j, kh] for pj, j in zip(p, keys, strict=True))
    return out


def test_reference_matches_numpy_loop():
    q, k, v = _qkv()
    got = jax.jit(reference_attention)(q, k, v, jnp.asarray(SEGMENT_IDS))
    assert got.shape == (B, T, N, H) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, SEGMENT_IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "tokamax_xla"])
def test_value_heads_may_be_smaller_than_query_key_heads(impl):
    """Multi-head latent attention's layout: tokamax gets V zero-padded, sliced back."""
    q, k, v = _qkv(3)
    v = v[..., :5]
    got = _attention(q, k, v, jnp.asarray(SEGMENT_IDS), implementation=impl)
    assert got.shape == (B, T, N, 5)
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, SEGMENT_IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "tokamax_xla"])
def test_documents_are_isolated(impl):
    q, k, v = _qkv()
    seg = jnp.asarray(SEGMENT_IDS)
    doc1 = jnp.asarray(SEGMENT_IDS == 1)[:, :, None, None]  # [B, T, 1, 1]
    doc2 = SEGMENT_IDS == 2  # [B, T]
    base = _attention(q, k, v, seg, implementation=impl)
    moved = _attention(q, k + 3.0 * doc1, v - 5.0 * doc1, seg, implementation=impl)
    np.testing.assert_array_equal(np.asarray(moved)[doc2], np.asarray(base)[doc2])
    assert np.abs(np.asarray(moved - base)[SEGMENT_IDS == 1]).min() > 1e-3


@pytest.mark.parametrize("impl", ["tokamax_xla", "xla_chunked"])
def test_tokamax_k_start_path_matches_reference_forward_and_grad(impl):
    q, k, v = _qkv(1)
    seg = jnp.asarray(SEGMENT_IDS)
    cot = jax.random.normal(jax.random.key(2), (B, T, N, H), jnp.float32)

    def loss(impl):
        return lambda q, k, v: jnp.sum(_attention(q, k, v, seg, implementation=impl) * cot)

    want = _attention(q, k, v, seg, implementation="xla")
    got = _attention(q, k, v, seg, implementation=impl)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    grads_want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    grads_got = jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(grads_got, grads_want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def test_auto_resolves_to_xla_on_cpu_and_unknown_names_raise():
    assert jax.default_backend() == "cpu"
    assert attn.attention_implementation("auto") == "xla"
    assert attn.attention_kernel("auto") is reference_attention
    assert attn.attention_implementation("triton") == "triton"
    # ... and for the platform of the devices a program is built for, whatever this host is
    assert attn.attention_implementation("auto", "tpu") == "splash"
    assert attn.attention_implementation("auto", "gpu") == "mosaic_gpu"
    assert attn.attention_implementation("mosaic", "tpu") == "mosaic_tpu"
    with pytest.raises(ValueError, match="valid: .*xla.*tokamax_xla"):
        attn.attention_implementation("flash")
    with pytest.raises(ValueError, match="'flash'"):
        attn.attention_kernel("flash")
    # A GPU/TPU kernel can be picked on CPU (a dry run builds the model) but not run.
    mosaic = attn.attention_kernel("mosaic")
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="gpu or tpu"):
        mosaic(q, k, v, jnp.asarray(SEGMENT_IDS))


def test_every_configurable_name_builds_a_kernel():
    """The names table (config/attention_kernels.py) is all there is: the config takes each
    name, the registry builds each from its backend, and the names of the Pallas kernels'
    calls in a compiled program are their backends' (analysis/program.py checks for them)."""
    for name in ATTENTION_KERNELS:
        assert ComputeConfig(attention=name).attention == name
        assert callable(attn.attention_kernel(name, window=8))
    calls = {name: attn.program_call(name) for name in ATTENTION_KERNELS}
    assert calls == {
        "xla": None,
        "splash": r"^splash_mha",
        "mosaic_gpu": r"^mosaic_gpu",
        "mosaic_tpu": r"^splash_mha",  # tokamax's TPU kernel is splash attention too
        "cudnn": r"^__cudnn",
        "triton": r"triton",
        "xla_chunked": None,
        "tokamax_xla": None,
    }


def test_segment_starts():
    got = segment_starts(jnp.array([[1, 1, 2, 2, 2, 3]], jnp.int32))
    np.testing.assert_array_equal(got, [[0, 0, 2, 2, 2, 5]])
    got = segment_starts(jnp.asarray(SEGMENT_IDS))
    np.testing.assert_array_equal(got[1], [0, 0, 0, 0, 0, 5, 5, 5, 8, 8, 8, 8, 12, 12, 12, 12])


# The TPU kernel tiles the sequence in lanes of 128 tokens: the same documents, 8 tokens a step.
LONG = 128
LONG_SEGMENT_IDS = np.repeat(SEGMENT_IDS, LONG // T, axis=1)


def _long_qkv(seed: int, heads: int = N, kv_heads: int = K, rows: int = B):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (rows, LONG, heads, H), jnp.float32),
        jax.random.normal(kk, (rows, LONG, kv_heads, H), jnp.float32),
        jax.random.normal(kv, (rows, LONG, kv_heads, H), jnp.float32),
    )


def _splash(q, k, v, seg, sinks=None, window=None):
    """The TPU kernel in Pallas's interpreter: the same kernel code, run on CPU."""
    return splash.splash_attention(q, k, v, seg, sinks, window=window, interpret=True)


def _sinks(heads: int = N) -> jax.Array:
    return 2.0 * jax.random.normal(jax.random.key(11), (heads,), jnp.float32)


def _value_and_grads(fn, q, k, v, seg, sinks, cot):
    """sum(fn(...) * cot) and its gradients in q, k, v and the sinks."""
    loss = lambda q, k, v, sinks: jnp.sum(fn(q, k, v, seg, sinks) * cot)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)


def _assert_same(got, want, atol):
    (got_value, got_grads), (want_value, want_grads) = got, want
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    for name, g, w in zip("q k v sinks".split(), got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"d{name}")


def test_splash_window_and_sinks_match_reference(monkeypatch):
    """Splash's own LocalMask and sinks: 128-token tiles over 384 tokens (3 x 3 blocks), a
    window of 100 keys, which leaves query block 2 nothing of key block 0 (the block tables
    skip it), packed documents and GQA; values and gradients, the sinks' included."""
    monkeypatch.setattr(splash, "BLOCK", 128)
    length, window = 384, 100
    kq, kk, kv, kc = jax.random.split(jax.random.key(12), 4)
    q = jax.random.normal(kq, (B, length, N, H), jnp.float32)
    k, v = (jax.random.normal(key, (B, length, K, H), jnp.float32) for key in (kk, kv))
    cot = jax.random.normal(kc, q.shape, jnp.float32)
    seg = jnp.asarray(np.repeat(SEGMENT_IDS, length // T, axis=1))
    got = _value_and_grads(partial(_splash, window=window), q, k, v, seg, _sinks(), cot)
    want = _value_and_grads(attn.attention_kernel("xla", window), q, k, v, seg, _sinks(), cot)
    _assert_same(got, want, atol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_tokamax_sinks_match_reference(window):
    """Sinks around a tokamax kernel (kernels/sinks.py): the k_start mask, the
    log-sum-exp from its forward's residuals, a backward called with dO * w and the sink
    output. tokamax's XLA kernel has no backward that reads the output, so the reference's
    stands in here; a Pallas kernel's own backward is the next test's."""
    q, k, v = _qkv(8)
    cot = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    seg = jnp.asarray(SEGMENT_IDS)
    got = _value_and_grads(
        attn.attention_kernel("tokamax_xla", window), q, k, v, seg, _sinks(), cot
    )
    want = _value_and_grads(attn.attention_kernel("xla", window), q, k, v, seg, _sinks(), cot)
    _assert_same(got, want, atol=1e-5)


def test_tokamax_tpu_kernel_sinks_through_its_own_backward(monkeypatch):
    """tokamax's TPU kernel (splash behind a dense mask) and its own Pallas VJP, run in
    Pallas's interpreter: the sinks' identity holds for a backward that reads the output it is
    given (tokamax's cross-compile switch lets it be built without a TPU)."""
    from tokamax._src import config as tokamax_config
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as tokamax_splash,
    )

    default = tokamax_splash.SplashConfig.get_default()
    monkeypatch.setattr(
        tokamax_splash.SplashConfig,
        "get_default",
        classmethod(lambda cls: dataclasses.replace(default, interpret=True)),
    )
    q, k, v = _long_qkv(13, heads=2, kv_heads=1, rows=1)
    q, k, v = (jnp.tile(x, (1, 1, 1, 128 // H)) for x in (q, k, v))  # the kernel's 128 lanes
    cot = jax.random.normal(jax.random.key(14), q.shape, jnp.float32)
    seg = jnp.asarray(LONG_SEGMENT_IDS[:1])
    with tokamax_config.cross_compile(True):
        got = _value_and_grads(
            attn.attention_kernel("mosaic_tpu", 20), q, k, v, seg, _sinks(2), cot
        )
    want = _value_and_grads(attn.attention_kernel("xla", 20), q, k, v, seg, _sinks(2), cot)
    _assert_same(got, want, atol=1e-4)


@pytest.mark.parametrize(
    "kernel, instead", [("xla_chunked", "tokamax_xla"), ("cudnn", "mosaic_gpu")]
)
def test_kernels_without_a_log_sum_exp_refuse_sinks(kernel, instead):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=f"{kernel!r} .*compute.attention={instead}"):
        attn.attention_kernel(kernel)(q, k, v, jnp.asarray(SEGMENT_IDS), _sinks())


def test_splash_kernel_matches_reference_forward_and_grad():
    """Splash attention with packed documents as segment ids, GQA, and value heads smaller
    than query/key heads (multi-head latent attention's layout), against the reference."""
    q, k, v = _long_qkv(4)
    v = v[..., :6]
    seg = jnp.asarray(LONG_SEGMENT_IDS)
    cot = jax.random.normal(jax.random.key(5), (B, LONG, N, 6), jnp.float32)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, seg) * cot)  # noqa: E731
    got = jax.jit(_splash)(q, k, v, seg)
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, LONG_SEGMENT_IDS), rtol=0, atol=1e-5)
    grads_want = jax.jit(jax.grad(loss(reference_attention), argnums=(0, 1, 2)))(q, k, v)
    grads_got = jax.jit(jax.grad(loss(_splash), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(grads_got, grads_want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)


def test_splash_refuses_lengths_it_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 128"):
        splash.check_length(200)
    with pytest.raises(ValueError, match="multiple of 128 .and of 512"):
        splash.check_length(640)
    splash.check_length(384)  # one tile of the whole sequence
    splash.check_length(2048)


# (query heads, K/V heads, mesh degrees, rules of heads and kv_heads): heads split alike;
# K/V heads fewer than the tensor degree (each device takes its query heads' K/V head); K/V
# heads kept whole by the rules while query heads split (each device takes its groups').
_SHARDED_CASES = {
    "split_alike": (4, 2, dict(data=2, fsdp=2, tensor=2), {}),
    "kv_fewer_than_tensor": (8, 2, dict(fsdp=2, tensor=4), {}),
    "kv_kept_whole": (8, 4, dict(fsdp=4, tensor=2), {"kv_heads": []}),
}


@pytest.mark.parametrize("case", list(_SHARDED_CASES))
@pytest.mark.parametrize("kernel", ["splash", "tokamax_xla"])
def test_kernels_run_per_device_on_a_mesh(case, kernel):
    """A Pallas kernel cannot be partitioned by XLA: on a mesh it runs inside shard_map, each
    device on its rows and heads, each with its heads' sinks, a sliding window in the mask.
    Forward and gradients (the sinks' summed over the devices' rows) equal the unsharded
    reference's."""
    heads, kv_heads, degrees, rules_update = _SHARDED_CASES[case]
    cfg = MeshConfig(**{"data": 1, "fsdp": 1, "tensor": 1, **degrees})
    mesh = build_mesh(cfg)
    rules = {**config_lib.load(config_lib.CONFIGS_DIR / "base.yml").mesh.rules, **rules_update}
    window = 48
    if kernel == "splash":
        fn = per_device(partial(_splash, window=window))
    else:
        fn = attn.attention_kernel(kernel, window)
    q, k, v = _long_qkv(6, heads, kv_heads, rows=4)
    cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    seg = jnp.asarray(np.concatenate([LONG_SEGMENT_IDS, LONG_SEGMENT_IDS[::-1]]))

    def sharded(fn):
        def f(q, k, v, seg, sinks):
            with sharding_rules(mesh, rules):
                q = constrain(q, ("batch", "length", "heads", "head_dim"))
                return fn(q, k, v, seg, sinks)

        return f

    want = _value_and_grads(sharded(attn.attention_kernel("xla", window)), q, k, v, seg,
                            _sinks(heads), cot)  # fmt: skip
    got = _value_and_grads(sharded(fn), q, k, v, seg, _sinks(heads), cot)
    _assert_same(got, want, atol=1e-4)


@pytest.mark.parametrize("window", [1, 3, 7])
def test_banded_kernel_equals_the_whole_mask(window):
    """Local layers' plain-XLA kernel (blocks of `window` queries; 16 tokens leave a partial
    last block for 3 and 7) against the reference's whole [T, T] mask, sinks included."""
    q, k, v = _qkv(15)
    cot = jax.random.normal(jax.random.key(16), q.shape, jnp.float32)
    seg = jnp.asarray(SEGMENT_IDS)
    banded = partial(banded_attention, window=window)
    whole = partial(reference_attention, window=window)
    want = _value_and_grads(whole, q, k, v, seg, _sinks(), cot)
    _assert_same(_value_and_grads(banded, q, k, v, seg, _sinks(), cot), want, atol=1e-5)


def _compiled_costs(kernel: str, window: int | None, length: int) -> np.ndarray:
    """(FLOPs, bytes accessed, temporary bytes) of the compiled CPU program of the kernel's
    forward and backward, as XLA's cost and memory analyses report them."""
    fn = attn.attention_kernel(kernel, window)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    loss = lambda q, k, v, seg: jnp.sum(fn(q, k, v, seg))  # noqa: E731
    args = (f32(1, length, N, H), f32(1, length, K, H), f32(1, length, K, H))
    segments = jax.ShapeDtypeStruct((1, length), jnp.int32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args, segments).compile()
    cost = compiled.cost_analysis()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return np.array([cost["flops"], cost["bytes accessed"], temp])


def test_windowed_xla_kernel_does_sequence_times_window_work():
    """The plain-XLA kernel of a local layer (banded_attention: blocks of `window` queries
    against their block and the previous one): XLA's cost analysis of the compiled CPU
    program counts every matmul and elementwise op (no loops here to hide a trip count), and
    its memory analysis the temporaries. At twice the sequence the windowed kernel's FLOPs,
    bytes accessed and temporaries double (O(T x window)); the global kernel's quadruple."""
    windowed, causal = (
        {length: _compiled_costs("xla", window, length) for length in (1024, 2048)}
        for window in (64, None)
    )
    np.testing.assert_allclose(windowed[2048] / windowed[1024], 2.0, rtol=0.01)
    np.testing.assert_allclose(causal[2048] / causal[1024], 4.0, rtol=0.02)
    # and at 2048 tokens a window of 64 costs a fraction of the causal kernel's work
    assert windowed[2048][0] < causal[2048][0] / 10
