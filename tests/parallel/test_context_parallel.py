"""Context parallelism (parallel/context.py): a sequence split over mesh.context devices
attends exactly as the whole sequence does, trains to the unsplit run's loss and parameters,
moves the bytes its exchange should, and the balanced layout evens out the causal work."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxtrain.analysis.collectives import collective_bytes
from maxtrain.config import MeshConfig
from maxtrain.data import to_global
from maxtrain.data.streams import data_streams
from maxtrain.kernels.xla_attention import reference_attention
from maxtrain.parallel.context import attention_pairs, context_attention, layout_order
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.parallel.pipeline import to_model_order
from maxtrain.training import loop as train_lib

RULES = {"batch": ["fsdp"], "length": ["context"], "heads": ["tensor"], "kv_heads": ["tensor"]}
B, T, N, K, H = 2, 32, 4, 2, 8  # GQA: two query heads per key/value head


def _qkv():
    ks = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(ks[0], (B, T, N, H)),
        jax.random.normal(ks[1], (B, T, K, H)),
        jax.random.normal(ks[2], (B, T, K, H)),
    )


PACKED = np.array([[1] * 10 + [2] * 15 + [3] * 7, [1] * 3 + [2] * 26 + [0] * 3], np.int32)
ONE_DOCUMENT = np.ones((B, T), np.int32)


@pytest.mark.parametrize("exchange", ["all_gather", "ring"])
def test_split_attention_equals_the_whole_sequence(exchange):
    """Both layouts, C = 2 and 4, packed rows and one document per row: the split attention
    is the reference's, token by token (the mask is built from original indices and
    documents, not block positions)."""
    q, k, v = _qkv()
    for context, layout in ((2, "contiguous"), (4, "balanced")):
        mesh = build_mesh(MeshConfig(fsdp=8 // context, context=context))
        order = layout_order(T, context, layout)
        attend = jax.jit(context_attention(exchange, layout))
        for segments in (PACKED, ONE_DOCUMENT):
            want = reference_attention(q, k, v, jnp.asarray(segments))[:, order]
            with sharding_rules(mesh, RULES):
                got = attend(q[:, order], k[:, order], v[:, order], segments[:, order])
            np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"{context} {layout}")


@pytest.mark.parametrize("context, layout", [(4, "balanced"), (2, "contiguous")])
@pytest.mark.parametrize("exchange", ["all_gather", "ring"])
def test_split_window_and_sinks_equal_the_whole_sequence(exchange, context, layout):
    """A sliding window (by original token index) and sinks (applied once, to the merge of
    every block): values and the gradients of q, k, v and the sinks equal the unsplit
    reference's."""
    q, k, v = _qkv()
    sinks = jax.random.normal(jax.random.key(5), (N,))
    cot = jax.random.normal(jax.random.key(6), q.shape)
    window = 6  # shorter than a device's block: most blocks hold none of a query's keys
    mesh = build_mesh(MeshConfig(fsdp=8 // context, context=context))
    order = layout_order(T, context, layout)
    split = context_attention(exchange, layout)

    def loss_split(q, k, v, sinks):
        with sharding_rules(mesh, RULES):
            out = split(q, k, v, PACKED[:, order], sinks, window=window)
        return jnp.sum(out * cot[:, order])

    def loss_whole(q, k, v, sinks):
        out = reference_attention(q, k, v, jnp.asarray(PACKED), sinks, window=window)
        return jnp.sum(out[:, order] * cot[:, order])

    grad = partial(jax.value_and_grad, argnums=(0, 1, 2, 3))
    got_value, got = jax.jit(grad(loss_split))(q[:, order], k[:, order], v[:, order], sinks)
    want_value, want = jax.jit(grad(loss_whole))(q, k, v, sinks)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    want = [w[:, order] for w in want[:3]] + [want[3]]  # q, k, v gradients in the layout
    for name, g, w in zip("q k v sinks".split(), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"d{name}")


def test_balanced_layout_evens_the_causal_work():
    """2C chunks, device i holding chunks i and 2C-1-i: every device's causal (query, key)
    pairs within 5% of each other; the contiguous split is far off (the last device does
    2C - 1 times the first's work)."""
    for context in (2, 4, 8, 16):
        balanced = attention_pairs(131072, context, "balanced")
        assert max(balanced) / min(balanced) < 1.05, balanced
        contiguous = attention_pairs(131072, context, "contiguous")
        assert max(contiguous) / min(contiguous) > 2, contiguous
        assert sum(balanced) == sum(contiguous) == 131072 * 131073 // 2


def _largest_f32_buffer(hlo: str) -> int:
    return max(
        int(np.prod([int(d) for d in dims.split(",")]))
        for dims in re.findall(r"f32\[([\d,]+)\]", hlo)
    )


@pytest.mark.parametrize("exchange", ["all_gather", "ring"])
def test_exchange_bytes_and_per_device_activations(exchange):
    """Read from the compiled program, C = 2 and 4 (batch over the remaining devices, so each
    rows stay whole): all_gather gathers the whole sequence's K and V (plus the int32
    documents and indices) once; ring passes a block C - 1 times. The largest activation is the
    score block: (T / C) x T per head for all_gather, (T / C)^2 for ring."""
    q, k, v = _qkv()
    for context in (2, 4):
        mesh = build_mesh(MeshConfig(fsdp=8 // context, context=context))
        rows, length = B, T // context  # rows replicated: only the context split is measured
        tokens, heads = (
            NamedSharding(mesh, P(None, "context")),
            NamedSharding(mesh, P(None, "context", None, None)),
        )
        attend = jax.jit(
            context_attention(exchange, "balanced"), in_shardings=(heads, heads, heads, tokens)
        )
        with sharding_rules(mesh, RULES):
            hlo = attend.lower(q, k, v, PACKED).compile().as_text()
        moved = collective_bytes(hlo)
        kv_block = 2 * rows * length * K * H * 4  # K and V, float32
        ids_block = rows * length * 4 + length * 4  # segment ids, token indices
        if exchange == "all_gather":
            assert moved == {"all-gather": context * (kv_block + ids_block)}, moved
            keys = T
        else:
            assert moved == {"collective-permute": (context - 1) * (kv_block + ids_block)}, moved
            keys = length
        assert _largest_f32_buffer(hlo) == rows * N * length * keys, context


def _train(cfg, steps: int = 2):
    trainer = train_lib.build_trainer(cfg)
    batches, _ = data_streams(cfg)
    state, losses = trainer.state, []
    for _ in range(steps):
        state, metrics = trainer.step_fn(state, to_global(next(batches), trainer.batch_sharding))
        losses.append(float(metrics["loss"]))
    params = state.params
    if trainer.mdef.layout is not None:
        params = to_model_order(params, trainer.mdef.layout)
    return losses, jax.device_get(params)


# Every other layer a sliding window shorter than a device's block of the sequence, beside
# global layers: 4 layers, so that two stages hold one (sliding, global) group each.
WINDOWED = "model.num_layers=4 model.layers=[sliding-dense,global-dense] model.sliding_window=5"
CASES = {
    # (model, its overrides, the split's): each exchange, C in {2, 4}, dense and MoE, with
    # fsdp, expert, stage; the dense cases share one model, so one unsplit run
    "windowed all_gather C=2 fsdp=4": ("tiny", WINDOWED, "mesh.context=2 mesh.fsdp=4"),
    "windowed ring C=4 stage=2": (
        "tiny",
        WINDOWED,
        "mesh.context=4 mesh.stage=2 mesh.fsdp=1 compute.context_exchange=ring",
    ),
    "moe ring C=2 expert=2 fsdp=2": (
        "tiny-moe",
        "",
        "mesh.context=2 mesh.expert=2 mesh.fsdp=2 compute.context_exchange=ring "
        "compute.expert_exchange_capacity=2",  # no row dropped: drops depend on token order
    ),
}


@pytest.fixture(scope="module")
def unsplit_runs(tmp_path_factory):
    return {}


@pytest.mark.parametrize("case", list(CASES))
def test_training_matches_the_unsplit_run(case, make_cfg, unsplit_runs):
    """Two steps on packed synthetic rows: the loss of every step and the parameters after them
    equal mesh.context=1's to float32 rounding."""
    model, model_overrides, overrides = CASES[case]
    # Adam's eps at 1e-3 keeps its update linear in gradients near 0: with 1e-8 a gradient
    # within rounding of 0 moves a weight by about +-lr, whichever sign the rounding gave it.
    common = (f"model_name={model}", "checkpoint.enabled=false", "optim.warmup_steps=0",
              "optim.eps=1e-3", *model_overrides.split())  # fmt: skip
    if common not in unsplit_runs:
        unsplit_runs[common] = _train(make_cfg(*common))
    want_losses, want_params = unsplit_runs[common]
    losses, params = _train(make_cfg(*common, *overrides.split()))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params, want_params)
