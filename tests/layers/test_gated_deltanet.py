"""The Gated DeltaNet layer (maxtrain/layers/gated_deltanet.py) against transformers'
Qwen3NextGatedDeltaNet: the committed fixture (tests/fixtures/gated_deltanet/, made by
tools/make_gated_deltanet_fixture.py) loaded through maxtrain/hf/gated_deltanet.py, in
training's chunked path, packed, and in generation's step by step; and what its compiled
program costs as the sequence doubles."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import REPO

from maxtrain.analysis.program import executed, loop_trip_counts, matmul_flops
from maxtrain.hf.gated_deltanet import from_hf, to_hf
from maxtrain.layers.gated_deltanet import GatedDeltaNet

FIXTURE = REPO / "tests" / "fixtures" / "gated_deltanet"
CONFIG = json.loads((FIXTURE / "config.json").read_text())
DIMS = dict(
    num_k_heads=CONFIG["linear_num_key_heads"],
    num_v_heads=CONFIG["linear_num_value_heads"],
    head_k_dim=CONFIG["linear_key_head_dim"],
    head_v_dim=CONFIG["linear_value_head_dim"],
)
X, Y = np.load(FIXTURE / "x.npy"), np.load(FIXTURE / "y.npy")  # [2, 20, D], transformers' output


def _layer(chunk: int = 8, **sizes) -> GatedDeltaNet:
    """The layer, initialised as one compiled program (not op by op)."""
    sizes = {"hidden": CONFIG["hidden_size"], **DIMS, **sizes}
    return nnx.jit(lambda: GatedDeltaNet(
        sizes["hidden"], sizes["num_k_heads"], sizes["num_v_heads"], sizes["head_k_dim"],
        sizes["head_v_dim"], conv_kernel=CONFIG["linear_conv_kernel_dim"], chunk=chunk,
        norm_eps=CONFIG["rms_norm_eps"], init_std=0.02, param_dtype=jnp.float32,
        compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
    ))()  # fmt: skip


@pytest.fixture(scope="module")
def transformers_layer():
    """Our layer holding the fixture's weights (chunks of 8, so that its 20 tokens take three),
    as its training path, its generation step and that step under the decoder's decode
    contract (`cached`), each compiled once per input shape."""
    layer = _layer()
    for path, value in from_hf(dict(np.load(FIXTURE / "weights.npz")), **DIMS).items():
        param = getattr(functools.reduce(getattr, path[:-1], layer), path[-1])
        assert param.shape == value.shape, path
        param[...] = jnp.asarray(value)
    graph, params = nnx.split(layer)
    call = jax.jit(lambda p, x, segment_ids: nnx.merge(graph, p)(x, None, segment_ids))
    step = jax.jit(lambda p, x, carried: nnx.merge(graph, p).step(x, carried))
    cached = jax.jit(
        lambda p, x, positions, carried: nnx.merge(graph, p).cached(x, positions, carried)
    )
    partials = (functools.partial(f, params) for f in (call, step, cached))
    return *partials, layer.init_state


def test_the_fused_tensors_map_to_our_parameters_and_back_exactly():
    tensors = dict(np.load(FIXTURE / "weights.npz"))
    back = to_hf(from_hf(tensors, **DIMS))
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_training_path_equals_transformers(transformers_layer):
    """One document per row, 20 tokens in chunks of 8 (the last partial): transformers'
    output within 1e-5, where it is of order one."""
    call, *_ = transformers_layer
    out = call(X, np.ones(X.shape[:2], np.int32))
    assert np.sqrt(np.mean(Y**2)) > 1.0
    np.testing.assert_allclose(out, Y, atol=1e-5)


def test_packed_documents_equal_each_alone(transformers_layer):
    """Two documents per row, each a prefix of a fixture row, give transformers' outputs for
    each prefix alone: neither the convolution (4 taps) nor the state reaches across a
    document start, inside a chunk (9) or on a chunk's edge (16)."""
    call, *_ = transformers_layer
    first = (X[0, :9], X[1, :11]), (Y[0, :9], Y[1, :11])
    second = (X[1, :16], X[0, :4]), (Y[1, :16], Y[0, :4])
    packed = np.stack([np.concatenate(first[0]), np.concatenate(second[0])])
    want = np.stack([np.concatenate(first[1]), np.concatenate(second[1])])
    segments = np.array([[1] * 9 + [2] * 11, [1] * 16 + [2] * 4], np.int32)
    np.testing.assert_allclose(call(packed, segments), want, atol=1e-5)


def test_generation_step_by_step_and_after_a_prefill_equals_transformers(transformers_layer):
    """Decoding one token at a time from an empty state, and after a prefill of 10 tokens
    (chunked, from the state): transformers' outputs, each step carrying the convolution
    window and the rule's state."""
    _, step, _, init_state = transformers_layer
    for prefill in (1, 10):
        out, state = step(X[:, :prefill], init_state(X.shape[0]))
        outs = [out]
        for t in range(prefill, X.shape[1]):
            out, state = step(X[:, t : t + 1], state)
            outs.append(out)
        np.testing.assert_allclose(np.concatenate(outs, axis=1), Y, atol=1e-5, err_msg=prefill)


def test_a_right_padded_prefill_then_steps_equals_transformers(transformers_layer):
    """Generation's contract (`cached`, as the decoder calls it): rows of 10 and 3 prompt
    tokens in one prefill, the second right-padded to 10 with the first row's inputs at
    position -1, then one token per step at each row's own next position, give transformers'
    outputs at every real token: the padding neither decays nor writes the rule's state, and
    the convolution's window ends at the row's last prompt token, not its padding."""
    _, _, cached, init_state = transformers_layer
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
