"""What LoRA and QLoRA cost and say: the dry-run's estimate against the train state a LoRA run
builds, the start-up line, and a LoRA run's checkpoint (adapters and their moments only)."""

import json
import math

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from support import BASE, FIXTURES
from support.data import load_tool

from maxtrain import models as model_lib
from maxtrain.analysis import memory
from maxtrain.checkpointing import integrity
from maxtrain.hf.convert import import_checkpoint
from maxtrain.posttrain.lora import adapter_count
from maxtrain.training import loop as train
from maxtrain.training import run_summary
from maxtrain.training.trainer import build_trainer

HF_FIXTURES = FIXTURES / "hf"


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded shapes: each leaf's shard (its sharding's
    shard_shape) times its element size in bits / 8: int4 and nf4 (stored as uint4) values
    count half a byte each, packed two per byte, whatever a backend pads them to."""
    return sum(
        math.ceil(
            math.prod(leaf.sharding.shard_shape(leaf.shape))
            * jax.dtypes.itemsize_bits(leaf.dtype)
            / 8
        )
        for leaf in jax.tree.leaves(tree)
    )


@pytest.mark.parametrize("quantization", ["none", "nf4", "int8"])
def test_estimate_counts_adapter_state_and_the_frozen_base_as_the_train_state_holds_them(
    make_cfg, quantization
):
    """tiny over fsdp=8 with rank-4 adapters on attention and MLP: the estimate's parameters
    are the adapters' shards, its optimizer state Adam's two float32 moments of them, and its
    frozen part the base's leaves as the train state keeps them (quantized values and scales
    under QLoRA), all per device, against build_trainer's own state."""
    cfg = make_cfg(
        "mesh.fsdp=8",
        "lora.rank=4",
        "checkpoint.load_parameters_path=unused",  # the base is read only by training/loop.py
        f"lora.base_quantization={quantization}",
    )
    estimate = memory.estimate(cfg, num_devices=8)
    state = build_trainer(cfg, abstract=True).state

    names = {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert names == {"kernel_lora_a", "kernel_lora_b"}
    assert sum(x.size for x in jax.tree.leaves(state.params)) == adapter_count(cfg.model, cfg.lora)
    adapters = device_bytes(state.params)
    moments = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert estimate.params == adapters == estimate.gradients
    assert estimate.optimizer == device_bytes(moments) == 2 * adapters
    assert all(x.dtype == jnp.float32 for x in moments)

    assert estimate.frozen == device_bytes(state.frozen)
    frozen_dtypes = {str(x.dtype) for x in jax.tree.leaves(state.frozen)}
    expected = {"none": {"float32"}, "nf4": {"float32", "uint4"}, "int8": {"float32", "int8"}}
    assert frozen_dtypes == expected[quantization]


def test_without_lora_nothing_is_frozen(make_cfg):
    estimate = memory.estimate(make_cfg("mesh.fsdp=8"), num_devices=8)
    assert estimate.frozen == 0 and estimate.optimizer == 2 * estimate.params


def test_dry_run_prints_the_trained_parameters_and_the_frozen_bytes(capsys):
    """tiny (2 layers; q, o 64x64, k, v 64x32, gate, up 64x128, down 128x64): rank 4 adapters
    on all seven hold 4 x (in + out) each, 4 x 2 x 1024 in all; the frozen base is every other
    parameter, float32, over 8 devices."""
    argv = [str(BASE), "model_name=tiny", "data.kind=synthetic", "mesh.fsdp=8", "lora.rank=4"]
    argv += ["checkpoint.load_parameters_path=unused", "--dry-run", "--devices=8"]
    assert load_tool("benchmark").main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    lora = result["lora"]
    per_layer = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)
    assert lora["trained_params"] == 4 * 2 * per_layer == 8192
    assert lora["base_quantization"] == "none"
    assert lora["frozen_bytes_per_device"] >= result["total_params"] * 4 // 8
    assert lora["whole_model_state_factor"] == round(result["total_params"] / 8192, 2)
    assert lora["optimizer_factor_per_device"] == pytest.approx(
        lora["full_fine_tuning_optimizer_bytes_per_device"] / lora["optimizer_bytes_per_device"],
        abs=0.01,
    )


def test_start_line_says_how_many_parameters_train_and_on_what_base(make_cfg):
    cfg = make_cfg(
        "lora.rank=4",
        "lora.modules=[attention]",
        "lora.base_quantization=nf4",
        "checkpoint.load_parameters_path=runs/pre/checkpoints/persistent",
    )
    line = run_summary.describe_start(cfg)
    adapters = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64))  # q, k, v, o of both layers
    total = model_lib.param_count(cfg.model)
    assert line.startswith(
        f"maxtrain: {total / 1e3:.3g}K parameters ({total / 1e3:.3g}K active per token), "
        f"{adapters / 1e3:.3g}K of them trained (LoRA rank 4 on attention; "
        "base runs/pre/checkpoints/persistent, stored nf4), 4 steps of "
    )
    assert "of them trained" not in run_summary.describe_start(make_cfg())


def saved_arrays(run_dir) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """Path -> (shape, dtype) of every array in the run's newest persistent checkpoint, read
    from Orbax's metadata (no array data)."""
    _, step_dir = integrity.newest_complete(run_dir / "checkpoints" / "persistent")
    metadata = ocp.PyTreeCheckpointHandler().metadata(integrity.state_dir(step_dir))
    tree = getattr(metadata, "tree", metadata)
    return {
        tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): (
            tuple(leaf.shape),
            str(leaf.dtype),
        )
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def array_bytes(arrays) -> int:
    return sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in arrays)


def test_lora_checkpoint_of_an_imported_hf_model_holds_the_adapters_and_two_moments_only(
    make_cfg, tmp_path
):
    """LoRA on a Hugging Face Llama (the committed fixture, imported): the run's checkpoint holds
    the step, the adapters (A and B of the seven matmuls, stacked over the layers) and Adam's
    two moments of them, no base; read from Orbax's metadata, each array counted at its shape
    times its dtype's size. Full fine-tuning would save every parameter and two moments."""
    base = tmp_path / "hf-llama"
    import_checkpoint(HF_FIXTURES / "llama_gqa_untied_sharded", base)
    cfg = make_cfg(
        f"model_name={base / 'model.yml'}",
        f"checkpoint.load_parameters_path={base}",
        "lora.rank=4",
        "train.steps=1",
    )
    train.run(cfg)
    saved = saved_arrays(cfg.run_dir)
    assert {path[0] for path in saved} == {"step", "params", "opt_state"}
    params = {path: array for path, array in saved.items() if path[0] == "params"}
    assert {path[-1] for path in params} == {"kernel_lora_a", "kernel_lora_b"}
    assert len(params) == 2 * 7
    adapters = adapter_count(cfg.model, cfg.lora)
    assert array_bytes(params.values()) == 4 * adapters
    moments = [a for path, a in saved.items() if path[0] == "opt_state" and a[0] != ()]
    assert array_bytes(moments) == 2 * 4 * adapters
    assert model_lib.param_count(cfg.model) > 3 * adapters
