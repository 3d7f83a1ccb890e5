"""The train step computes the same function under every mesh, layer layout and schedule."""

import jax
import numpy as np
import pytest
from support.numerics import assert_trees_close, loss_and_grads, synthetic_batch

from maxtrain.data import to_global
from maxtrain.training.loop import build_trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny model on one device: the yardstick for every other layout."""
    from maxtrain import config as config_lib

    base = config_lib.CONFIGS_DIR / "base.yml"
    overrides = [
        "model_name=tiny",
        "data.kind=synthetic",
        "train.global_batch_size=8",
        "train.seq_len=32",
        "mesh.fsdp=1",
        f"run.output_dir={tmp_path_factory.mktemp('ref')}",
    ]
    cfg = config_lib.load(base, overrides)
    trainer = build_trainer(cfg, devices=jax.devices()[:1])
    return overrides, loss_and_grads(trainer, synthetic_batch(cfg))


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=8", "mesh.fsdp=1"],
        ["mesh.fsdp=8"],
        ["mesh.fsdp=4", "mesh.tensor=2"],
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
        ["mesh.fsdp=2", "mesh.tensor=2", "mesh.num_slices=2", "mesh.dcn.data=2"],
    ],
    ids=["data8", "fsdp8", "fsdp4xtensor2", "data2xfsdp2xtensor2", "dcn2xfsdp2xtensor2"],
)
def test_sharded_loss_and_grads_equal_single_device(reference, mesh):
    from maxtrain import config as config_lib

    overrides, (ref_loss, ref_grads) = reference
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [*overrides, *mesh])
    trainer = build_trainer(cfg)
    assert trainer.mesh.size == 8
    loss, grads = loss_and_grads(trainer, synthetic_batch(cfg))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize(
    "variant",
    [
        ["compute.scan_layers=false"],
        ["compute.remat=none"],
        ["compute.remat=minimal"],
        ["compute.scan_layers=false", "compute.remat=none"],
    ],
    ids=["unrolled", "remat-none", "remat-minimal", "unrolled-remat-none"],
)
def test_layer_layout_and_remat_do_not_change_numbers(reference, variant):
    from maxtrain import config as config_lib

    overrides, (ref_loss, ref_grads) = reference
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [*overrides, *variant])
    trainer = build_trainer(cfg, devices=jax.devices()[:1])
    loss, grads = loss_and_grads(trainer, synthetic_batch(cfg))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)


def test_four_micro_batches_equal_one_big_batch(make_cfg):
    results = []
    for accum in (1, 4):
        cfg = make_cfg(
            f"train.grad_accum_steps={accum}",
            "train.global_batch_size=32",
            "mesh.fsdp=2",
            "mesh.data=4",
        )
        trainer = build_trainer(cfg)
        batch = to_global(synthetic_batch(cfg), trainer.batch_sharding)
        state, metrics = trainer.step_fn(trainer.state, batch)
        results.append(jax.device_get((state.params, metrics)))
    (params_1, metrics_1), (params_4, metrics_4) = results
    np.testing.assert_allclose(metrics_4["loss"], metrics_1["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics_4["grad_norm"], metrics_1["grad_norm"], rtol=1e-5)
    assert metrics_4["tokens"] == metrics_1["tokens"]
    assert_trees_close(params_4, params_1, rtol=1e-5, atol=1e-6)


# Sliding or chunked layers beside global ones: a sliding window (with attention biases) or
# Llama 4's chunks.
PATTERNS = {
    "window": ["model.layers=[sliding-dense, global-dense]", "model.sliding_window=8",
               "model.attention_projection_bias=qkvo"],
    "chunk": ["model.layers=[chunked-dense*2, global-dense]", "model.attention_chunk=8",
              "model.num_layers=3"],
}  # fmt: skip


@pytest.fixture(scope="module", params=list(PATTERNS))
def patterned_reference(request, tmp_path_factory):
    """A model with sliding or chunked layers on one device."""
    from maxtrain import config as config_lib

    overrides = [
        "model_name=tiny", "data.kind=synthetic", "train.global_batch_size=8",
        "train.seq_len=32", "mesh.fsdp=1", *PATTERNS[request.param],
        f"run.output_dir={tmp_path_factory.mktemp('pattern')}",
    ]  # fmt: skip
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", overrides)
    trainer = build_trainer(cfg, devices=jax.devices()[:1])
    return overrides, loss_and_grads(trainer, synthetic_batch(cfg))


@pytest.mark.parametrize("mesh", [["mesh.fsdp=4", "mesh.tensor=2"]], ids=["fsdp4xtensor2"])
def test_local_attention_layers_train_on_eight_devices_like_one(patterned_reference, mesh):
    from maxtrain import config as config_lib

    overrides, (ref_loss, ref_grads) = patterned_reference
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [*overrides, *mesh])
    trainer = build_trainer(cfg)
    loss, grads = loss_and_grads(trainer, synthetic_batch(cfg))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)


# Qwen3-Next's shape: Gated DeltaNet layers beside a gated attention layer, MoE with a gated
# shared expert, packed documents (the synthetic batch's) resetting the recurrence; 16 tokens a
# row: two DeltaNet chunks of 8, the second carrying the first's state.
HYBRID = [
    "model_name=tiny-moe", "data.kind=synthetic", "train.global_batch_size=8",
    "train.seq_len=16", "mesh.fsdp=1", "model.num_layers=3",
    "model.layers=[linear-moe*2, global-moe]",
    "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, "
    "value_head_dim: 8, chunk: 8}",
    "model.attention_output_gate=true", "model.moe.shared_experts=1",
    "model.moe.shared_expert_gate=true", "model.rope.fraction=0.25",
]  # fmt: skip


def test_linear_attention_layers_train_on_eight_devices_like_one(tmp_path):
    """On expert 2 x fsdp 2 x tensor 2, the DeltaNet's heads split over tensor (value heads as
    attention's heads, query/key heads as its key/value heads), the weights over fsdp, the
    MoE's experts over expert: the same loss and gradients as one device."""
    from maxtrain import config as config_lib

    overrides = [*HYBRID, f"run.output_dir={tmp_path}"]
    reference = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", overrides)
    ref_loss, ref_grads = loss_and_grads(
        build_trainer(reference, devices=jax.devices()[:1]), synthetic_batch(reference)
    )
    mesh = ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [*overrides, *mesh])
    trainer = build_trainer(cfg)
    assert sorted(trainer.state.params) == sorted(
        ["embedding", "final_norm", "lm_head", "linear_moe_layers", "moe_layers"]
    )
    loss, grads = loss_and_grads(trainer, synthetic_batch(cfg))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)
