"""Multi-head latent attention and YaRN: what the transformers fixtures (test_convert_hf.py)
do not cover: the rope bands, the FLOP count, sharded runs equal to one device, and NoPE MLA
(model.mla.rope false, Kimi Linear's) seeing no position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.numerics import assert_trees_close, loss_and_grads, synthetic_batch

from maxtrain import models as model_lib
from maxtrain.config import CONFIGS_DIR, ComputeConfig, RopeScaling, load
from maxtrain.layers.rope import Rope
from maxtrain.training import metrics
from maxtrain.training.loop import build_trainer

BASE = CONFIGS_DIR / "base.yml"


def test_yarn_keeps_fast_pairs_divides_slow_ones_and_blends_between():
    """Pairs making more than beta_fast turns over the original context keep their frequency,
    fewer than beta_slow turns are divided by factor; in between, strictly between the two."""
    scaling = RopeScaling(type="yarn", factor=40.0, original_max_position=4096)
    plain = Rope(64, 10000.0).inverse_frequencies()
    yarn = Rope(64, 10000.0, scaling).inverse_frequencies()
    turns = 4096 * plain / (2 * np.pi)
    fast, slow = turns > 32 * 1.5, turns < 1 / 1.5  # clear of the ramp's rounded ends
    assert fast.any() and slow.any()
    np.testing.assert_allclose(yarn[fast], plain[fast], rtol=1e-6)
    np.testing.assert_allclose(yarn[slow], plain[slow] / 40.0, rtol=1e-6)
    middle = (turns < 32) & (turns > 1)
    assert np.all((yarn[middle] < plain[middle]) & (yarn[middle] > plain[middle] / 40.0))


def test_untruncated_yarn_ramps_between_the_exact_ends():
    """GPT-OSS's YaRN (truncate: false, 64 dims, base 150000, factor 32 over 4096): pair j
    keeps the share 1 - clip((j - low) / (high - low), 0, 1) of its frequency, low and high
    the exact pair indices of beta_fast (32) and beta_slow (1) turns (8.09 and 17.40), not
    their floor and ceiling (8 and 18, the truncated ramp's)."""
    scaling = RopeScaling(type="yarn", factor=32.0, original_max_position=4096, truncate=False)
    plain = Rope(64, 150000.0).inverse_frequencies().astype(np.float64)
    pair = lambda turns: 64 * np.log(4096 / (turns * 2 * np.pi)) / (2 * np.log(150000.0))  # noqa: E731
    low, high = pair(32.0), pair(1.0)
    assert 8 < low < 8.1 and 17.3 < high < 17.5
    kept = 1 - np.clip((np.arange(32) - low) / (high - low), 0, 1)
    expected = plain * kept + plain / 32.0 * (1 - kept)
    got = Rope(64, 150000.0, scaling).inverse_frequencies()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    truncated = Rope(64, 150000.0, scaling.model_copy(update={"truncate": True}))
    assert not np.allclose(truncated.inverse_frequencies(), got, rtol=1e-3)


def test_interleaved_pairs_rotate_like_rotate_half_on_deinterleaved_dims():
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    positions = jax.numpy.arange(5)[None]
    deinterleaved = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    np.testing.assert_array_equal(
        Rope(8, 10000.0, interleaved=True)(x, positions), Rope(8, 10000.0)(deinterleaved, positions)
    )


def test_mla_flops_count_its_projections_and_both_head_sizes():
    m = load(BASE, ["model_name=tiny-mla"]).model  # D 128, N 4, q/k 16 + 8, v 16
    q = 128 * 64 + 64 * 4 * 24  # q_a, q_b
    kv = 128 * (32 + 8) + 32 * 4 * (16 + 16)  # kv_a, kv_b
    o = 4 * 16 * 128
    assert metrics.attention_proj_params(m) == q + kv + o
    attention = 3 * 64 * (4 * 24 + 4 * 16) * 3  # 3 x seq x (N H_qk + N H_v) x layers
    assert metrics.attention_flops_per_token(m, seq_len=64) == attention


def test_sparse_attention_flops_count_top_k_keys_and_the_indexer():
    """With an indexer choosing 16 of 64 keys, a query attends to min(its position + 1, 16):
    16 - 16^2 / (2 x 64) = 14 on average; the indexer's q, k and head weights are projections."""
    indexer = "model.mla.indexer={heads: 4, head_dim: 16, top_k: 16}"
    m = load(BASE, ["model_name=tiny-mla", indexer]).model
    dense = load(BASE, ["model_name=tiny-mla"]).model
    extra = 64 * 4 * 16 + 128 * 16 + 128 * 4
    assert metrics.attention_proj_params(m) == metrics.attention_proj_params(dense) + extra
    attention = 6 * 14 * (4 * 24 + 4 * 16) * 3
    assert metrics.attention_flops_per_token(m, seq_len=64) == attention


@pytest.fixture(scope="module")
def tiny_mla_reference(tmp_path_factory):
    overrides = [
        "model_name=tiny-mla",
        "model.num_layers=2",  # the dense layer and one MoE layer
        "data.kind=synthetic",
        "train.global_batch_size=8",
        "train.seq_len=16",
        "mesh.fsdp=1",
        f"run.output_dir={tmp_path_factory.mktemp('mla')}",
    ]
    cfg = load(BASE, overrides)
    trainer = build_trainer(cfg, devices=jax.devices()[:1])
    return overrides, loss_and_grads(trainer, synthetic_batch(cfg))


@pytest.mark.slow  # a training step on the 8-device mesh and on one device
def test_tiny_mla_with_expert_parallelism_equals_one_device(tiny_mla_reference):
    overrides, (ref_loss, ref_grads) = tiny_mla_reference
    # Buffers for every routed row (expert_exchange_capacity >= mesh.expert): nothing drops.
    capacity = "compute.expert_exchange_capacity=4"
    cfg = load(BASE, [*overrides, "mesh.expert=4", "mesh.fsdp=2", capacity])
    trainer = build_trainer(cfg)
    assert trainer.mesh.size == 8
    loss, grads = loss_and_grads(trainer, synthetic_batch(cfg))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize(
    "override", ["model.num_kv_heads=2", "model.qk_norm=rms", "model.rope.fraction=0.5"]
)
def test_a_grouped_query_key_beside_mla_is_a_config_error_naming_it(override):
    from maxtrain.config import ConfigError

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key} applies to grouped-query attention") as e:
        load(BASE, ["model_name=tiny-mla", override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("rope", [False, True])
def test_nope_mla_sees_which_tokens_came_before_not_their_order(rope):
    """With model.mla.rope false the layer sees no position: one layer's logits at the last
    token are the same whichever order the tokens before it came in (their keys' rotary parts
    and its query's unrotated); with RoPE they are not."""
    overrides = ["model.num_layers=1", "model.layers=[global-dense]", "model.moe=null"]
    cfg = load(BASE, ["model_name=tiny-mla", *overrides, f"model.mla.rope={str(rope).lower()}"])
    cfg = cfg.model
    model = model_lib.build(model_lib.ModelSpec(cfg, ComputeConfig(compute_dtype="float32")))
    tokens = jnp.array([[5, 17, 3, 250, 9, 42], [17, 250, 5, 3, 9, 42]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), tokens.shape)
    logits = nnx.jit(lambda m, t: m(t, positions, jnp.ones_like(t))[0])(model, tokens)
    moved = float(jnp.max(jnp.abs(logits[0, -1] - logits[1, -1])))
    assert moved > 1e-3 if rope else moved < 1e-5, moved


def test_nope_mla_with_rope_scaling_is_a_config_error():
    with pytest.raises(Exception, match="model.mla.rope is false"):
        load(
            BASE,
            [
                "model_name=tiny-mla",
                "model.mla.rope=false",
                "model.rope.scaling={type: linear, factor: 2.0}",
            ],
        )
