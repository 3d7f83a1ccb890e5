"""GPT-OSS's layer features in training: what the transformers fixtures (tests/hf/,
tests/inference/) do not cover. The fixture's model (sliding windows, sinks, biases, the clamped
SwiGLU) trained on 8 simulated devices, its experts, hidden units and heads split, has the
loss and gradients it has on one."""

import jax
import numpy as np
from support import FIXTURES
from support.numerics import assert_trees_close, loss_and_grads, synthetic_batch

from maxtrain.config import CONFIGS_DIR, load
from maxtrain.hf import read_hf_model
from maxtrain.hf.convert import model_yaml
from maxtrain.training.loop import build_trainer


def test_sharded_step_equals_one_device_with_sinks_and_biases_trained(tmp_path):
    cfg, _ = read_hf_model(FIXTURES / "hf" / "gpt_oss_window_sinks_yarn_v5")
    (tmp_path / "gpt-oss-tiny.yml").write_text(model_yaml(cfg, "the GPT-OSS fixture's shapes"))
    overrides = [
        f"model_name={tmp_path / 'gpt-oss-tiny.yml'}",
        "data.kind=synthetic",
        "train.global_batch_size=8",
        "train.seq_len=16",  # four windows of 4
        "mesh.fsdp=1",
        "compute.expert_exchange_capacity=2",  # >= mesh.expert: nothing dropped
        f"run.output_dir={tmp_path}",
    ]
    one = load(CONFIGS_DIR / "base.yml", overrides)
    ref_loss, ref_grads = loss_and_grads(
        build_trainer(one, devices=jax.devices()[:1]), synthetic_batch(one)
    )
    split = ["mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=2"]
    eight = load(CONFIGS_DIR / "base.yml", [*overrides, *split])
    trainer = build_trainer(eight)
    assert trainer.mesh.size == 8
    loss, grads = loss_and_grads(trainer, synthetic_batch(eight))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)
    layers = ref_grads["moe_layers"]
    trained = [layers["attn"]["sinks"], layers["attn"]["o"]["bias"], layers["moe"]["gate"]["bias"]]
    trained += [layers["moe"]["down"]["bias"], layers["moe"]["router"]["logit_bias"]]
    assert all(np.abs(g).max() > 0 for g in trained)
