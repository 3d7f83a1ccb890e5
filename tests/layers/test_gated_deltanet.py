"""The Gated DeltaNet layer (maxtrain/layers/gated_deltanet.py) against transformers'
Qwen3NextGatedDeltaNet, and with channel_decay against KimiLinearDeltaAttention (Kimi Delta
Attention): the committed fixtures (tests/fixtures/gated_deltanet/ and kimi_delta_attention/,
made by tools/make_gated_deltanet_fixture.py) loaded through maxtrain/hf/gated_deltanet.py, in
training's chunked path, packed, and in generation's step by step; and what its compiled
program costs as the sequence doubles."""

import functools
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import REPO

from maxtrain.analysis.program import executed, loop_trip_counts, matmul_flops
from maxtrain.hf.gated_deltanet import from_hf, to_hf
from maxtrain.layers.gated_deltanet import GatedDeltaNet

FIXTURES = REPO / "tests" / "fixtures"
VARIANTS = ["gated_deltanet", "kimi_delta_attention"]  # fixture directories


def _dims(variant: str) -> dict:
    """A fixture's layer sizes, as from_hf and the layer name them."""
    config = json.loads((FIXTURES / variant / "config.json").read_text())
    if variant == "kimi_delta_attention":  # one set of heads for q/k and v
        heads, dim = config["linear_num_heads"], config["linear_head_dim"]
        sizes = dict(num_k_heads=heads, num_v_heads=heads, head_k_dim=dim, head_v_dim=dim)
        return dict(sizes, channel_decay=True)
    return dict(
        num_k_heads=config["linear_num_key_heads"],
        num_v_heads=config["linear_num_value_heads"],
        head_k_dim=config["linear_key_head_dim"],
        head_v_dim=config["linear_value_head_dim"],
    )


def _layer(chunk: int = 8, variant: str = "gated_deltanet", **sizes) -> GatedDeltaNet:
    """The layer, initialised as one compiled program (not op by op)."""
    config = json.loads((FIXTURES / variant / "config.json").read_text())
    sizes = {"hidden": config["hidden_size"], **_dims(variant), **sizes}
    return nnx.jit(lambda: GatedDeltaNet(
        sizes["hidden"], sizes["num_k_heads"], sizes["num_v_heads"], sizes["head_k_dim"],
        sizes["head_v_dim"], conv_kernel=config["linear_conv_kernel_dim"], chunk=chunk,
        channel_decay=sizes.get("channel_decay", False), norm_eps=config["rms_norm_eps"],
        init_std=0.02, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
    ))()  # fmt: skip


@pytest.fixture(scope="module", params=VARIANTS)
def oracle(request):
    """A fixture's input x [2, 20, D] and transformers' output y, and our layer holding its
    weights (chunks of 8, so that its 20 tokens take three), as its training path (`call`),
    its generation step and that step under the decoder's decode contract (`cached`), each
    compiled once per input shape."""
    variant = request.param
    layer = _layer(variant=variant)
    weights = dict(np.load(FIXTURES / variant / "weights.npz"))
    for path, value in from_hf(weights, **_dims(variant)).items():
        param = getattr(functools.reduce(getattr, path[:-1], layer), path[-1])
        assert param.shape == value.shape, path
        param[...] = jnp.asarray(value)
    graph, params = nnx.split(layer)
    call = jax.jit(lambda p, x, segment_ids: nnx.merge(graph, p)(x, None, segment_ids))
    step = jax.jit(lambda p, x, carried: nnx.merge(graph, p).step(x, carried))
    cached = jax.jit(
        lambda p, x, positions, carried: nnx.merge(graph, p).cached(x, positions, carried)
    )
    call, step, cached = (functools.partial(f, params) for f in (call, step, cached))
    x, y = (np.load(FIXTURES / variant / f"{name}.npy") for name in ("x", "y"))
    return SimpleNamespace(
        x=x, y=y, call=call, step=step, cached=cached, init_state=layer.init_state
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_tensors_map_to_our_parameters_and_back_exactly(variant):
    tensors = dict(np.load(FIXTURES / variant / "weights.npz"))
    back = to_hf(from_hf(tensors, **_dims(variant)))
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert back[name].shape == value.shape, name
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_training_path_equals_transformers(oracle):
    """One document per row, 20 tokens in chunks of 8 (the last partial): transformers'
    output within 1e-5, where it is of order one."""
    out = oracle.call(oracle.x, np.ones(oracle.x.shape[:2], np.int32))
    assert np.sqrt(np.mean(oracle.y**2)) > 0.9
    np.testing.assert_allclose(out, oracle.y, atol=1e-5)


def test_kimi_decays_differ_across_a_heads_channels():
    """Kimi Delta Attention's fixture exercises per-channel decay: its forget gate gives a
    head's channels different rates at one token (so a per-head kernel could not pass)."""
    weights = dict(np.load(FIXTURES / "kimi_delta_attention" / "weights.npz"))
    x = np.load(FIXTURES / "kimi_delta_attention" / "x.npy")
    pre = x[0, 0] @ weights["f_a_proj.weight"].T @ weights["f_b_proj.weight"].T
    pre = (pre + weights["dt_bias"]).reshape(4, -1)
    g = -np.exp(weights["A_log"].reshape(4, 1)) * np.log1p(np.exp(pre))
    assert (g.max(axis=1) - g.min(axis=1)).min() > 0.1


def test_packed_documents_equal_each_alone(oracle):
    """Two documents per row, each a prefix of a fixture row, give transformers' outputs for
    each prefix alone: neither the convolution (4 taps) nor the state reaches across a
    document start, inside a chunk (9) or on a chunk's edge (16)."""
    X, Y = oracle.x, oracle.y
    first = (X[0, :9], X[1, :11]), (Y[0, :9], Y[1, :11])
    second = (X[1, :16], X[0, :4]), (Y[1, :16], Y[0, :4])
    packed = np.stack([np.concatenate(first[0]), np.concatenate(second[0])])
    want = np.stack([np.concatenate(first[1]), np.concatenate(second[1])])
    segments = np.array([[1] * 9 + [2] * 11, [1] * 16 + [2] * 4], np.int32)
    np.testing.assert_allclose(oracle.call(packed, segments), want, atol=1e-5)


def test_generation_step_by_step_and_after_a_prefill_equals_transformers(oracle):
    """Decoding one token at a time from an empty state, and after a prefill of 10 tokens
    (chunked, from the state): transformers' outputs, each step carrying the convolution
    window and the rule's state."""
    X, Y, step, init_state = oracle.x, oracle.y, oracle.step, oracle.init_state
    for prefill in (1, 10):
        out, state = step(X[:, :prefill], init_state(X.shape[0]))
        outs = [out]
        for t in range(prefill, X.shape[1]):
            out, state = step(X[:, t : t + 1], state)
            outs.append(out)
        np.testing.assert_allclose(np.concatenate(outs, axis=1), Y, atol=1e-5, err_msg=prefill)


def test_a_right_padded_prefill_then_steps_equals_transformers(oracle):
    """Generation's contract (`cached`, as the decoder calls it): rows of 10 and 3 prompt
    tokens in one prefill, the second right-padded to 10 with the first row's inputs at
    position -1, then one token per step at each row's own next position, give transformers'
    outputs at every real token: the padding neither decays nor writes the rule's state, and
    the convolution's window ends at the row's last prompt token, not its padding."""
    X, Y, cached, init_state = oracle.x, oracle.y, oracle.cached, oracle.init_state
    lengths, width = np.array([10, 3]), 10
    prompt = X[:, :width].copy()
    prompt[1, lengths[1] :] = X[0, lengths[1] : width]
    positions = np.where(np.arange(width) < lengths[:, None], np.arange(width), -1)
    out, state = cached(prompt, positions, init_state(2))
    outs = [[out[0, :width]], [out[1, : lengths[1]]]]
    for step in range(X.shape[1] - lengths[1]):
        at = np.minimum(lengths + step, X.shape[1] - 1)  # row 0 repeats its last token: unchecked
        out, state = cached(X[[0, 1], at][:, None], at[:, None], state)
        for row in (0, 1):
            outs[row].append(out[row])
    for row in (0, 1):
        got = np.concatenate(outs[row])[: X.shape[1]]
        np.testing.assert_allclose(got, Y[row], atol=1e-5, err_msg=f"row {row}")


def _compiled(length: int) -> jax.stages.Compiled:
    """The compiled CPU program of a layer's forward and backward (gradients of every
    parameter and the input) over one row of `length` tokens in chunks of 64."""
    layer = _layer(chunk=64, hidden=32, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    graph, params = nnx.split(layer)

    def loss(params, x, segment_ids):
        return jnp.sum(nnx.merge(graph, params)(x, None, segment_ids))

    x = jax.ShapeDtypeStruct((1, length, 32), jnp.float32)
    segments = jax.ShapeDtypeStruct((1, length), jnp.int32)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, segments).compile()


@pytest.mark.slow  # compiles the layer's step at two long sequences
def test_a_layer_is_matmuls_in_one_loop_over_chunks_linear_in_the_sequence():
    """What the compiled program runs: no library call (XLA:CPU ran a batch of triangular
    solves through LAPACK one matrix at a time, the layer's bulk of time, and its threads spun
    on a loaded machine) and no loop but the one over the 32 or 64 chunks (none per token).
    At 4096 tokens the layer does at most 2.2 times the matmul FLOPs of 2048 and holds at
    most 2.2 times the temporaries (softmax attention's grow about 4 times). FLOPs are counted
    per loop trip (analysis.program.matmul_flops): XLA's own cost analysis counts the scan
    over chunks once, which would hide a body that grew."""
    short, long = _compiled(2048), _compiled(4096)
    for length, compiled in ((2048, short), (4096, long)):
        hlo = compiled.as_text()
        assert [op.opcode for op in executed(hlo) if op.opcode == "custom-call"] == []
        assert set(loop_trip_counts(hlo)) == {length // 64}, loop_trip_counts(hlo)
    flops = matmul_flops(long.as_text()) / matmul_flops(short.as_text())
    temporaries = [c.memory_analysis().temp_size_in_bytes for c in (short, long)]
    assert 1.8 < flops <= 2.2, flops
    assert 1.8 < temporaries[1] / temporaries[0] <= 2.2, temporaries
