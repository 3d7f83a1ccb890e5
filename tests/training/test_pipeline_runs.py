"""Pipelined runs through the train loop: stop and resume, resume with another stage count, and
the checkpoint tools (HF export, upcycling, depth upscaling) around a pipelined run.

The small 4-layer model in two stages of 4 devices (circular schedule, 2 repeats) on 8 simulated
CPU devices, with a constant learning rate after warmup so that a run stopped at step 3 and
continued to step 6 follows the same schedule as a run straight to 6.
"""

import json
import shutil

import jax
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.hf import cli as hf_cli
from maxtrain.parallel.mesh import build_mesh
from maxtrain.surgery.initialize import abstract_params
from maxtrain.training.loop import run

PIPELINED = [
    "model_name=small",  # 4 layers, and a preset: the source model of the transforms below
    "data.kind=synthetic",
    "train.global_batch_size=8",
    "train.seq_len=32",
    "train.log_every=1",
    "train.eval_every=0",
    "optim.warmup_steps=1",
    "optim.schedule=constant",
    "mesh.stage=2",
    "mesh.fsdp=4",
    "pipeline.schedule=circular",
    "pipeline.repeats=2",
    "checkpoint.local.every_steps=100",
    "checkpoint.persistent.every_steps=3",
    "run.name=pipelined",
]


def config(output_dir, *overrides: str) -> config_lib.Config:
    return config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [*PIPELINED, f"run.output_dir={output_dir}", *overrides],
    )


def losses(cfg: config_lib.Config) -> dict[int, float]:
    records = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def saved_params(cfg: config_lib.Config, step: int) -> dict:
    """A step's parameters as checkpoints hold them (model order), read for the plain model."""
    abstract = abstract_params(cfg, build_mesh(cfg.mesh))
    path = cfg.run_dir / "checkpoints" / "persistent" / str(step)
    return jax.device_get(load_parameters(path, abstract))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps without a stop, and the same run stopped after 3 (its checkpoint to resume)."""
    out = tmp_path_factory.mktemp("pipelined")
    full = config(out / "straight", "train.steps=6")
    run(full)
    half = config(out / "half", "train.steps=3")
    run(half)
    return full, half


def resumed(tmp_path, half: config_lib.Config, *overrides: str) -> config_lib.Config:
    """The stopped run's directory, copied, continued to step 6 with overrides."""
    shutil.copytree(half.run_dir, tmp_path / "pipelined")
    cfg = config(tmp_path, "train.steps=6", *overrides)
    run(cfg)
    return cfg


def test_stopped_and_resumed_with_stages_is_bit_exact(tmp_path, straight):
    full, half = straight
    cfg = resumed(tmp_path, half)
    assert losses(cfg) == losses(full)  # steps 1-3 from the first part, 4-6 after the resume
    for a, b in zip(
        jax.tree.leaves(saved_params(cfg, 6)), jax.tree.leaves(saved_params(full, 6)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "stages",
    [
        ["mesh.stage=4", "mesh.fsdp=2", "pipeline.schedule=gpipe", "pipeline.repeats=1"],
        ["mesh.stage=1", "mesh.fsdp=8"],
    ],
    ids=["4-stages", "none"],
)
def test_resume_with_another_stage_count_continues_the_loss(tmp_path, straight, stages):
    """The checkpoint reshards into 4 stages, or none; the loss goes on as the 2-stage run's
    within float32 rounding (another partition of the sums: see test_pipeline_parallel.py)."""
    full, half = straight
    got, want = losses(resumed(tmp_path, half, *stages)), losses(full)
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)], rtol=1e-5)


def test_hf_export_of_a_pipelined_run_round_trips(tmp_path, straight):
    full, _ = straight
    hf_dir, back = tmp_path / "hf", tmp_path / "imported"
    checkpoint = full.run_dir / "checkpoints" / "persistent" / "6"
    assert hf_cli.main(["export", "--checkpoint", str(checkpoint), "--output", str(hf_dir)]) == 0
    assert hf_cli.main(["import", "--hf-dir", str(hf_dir), "--output", str(back)]) == 0
    abstract = abstract_params(full, build_mesh(full.mesh))
    reimported = jax.device_get(load_parameters(back, abstract))
    for a, b in zip(
        jax.tree.leaves(reimported), jax.tree.leaves(saved_params(full, 6)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "init",
    [
        [
            "init.mode=upcycle",
            "model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 192}",
            "model.mlp_dim=null",  # every layer MoE
        ],
        ["init.mode=depth_upscale", "model.num_layers=6", "init.layer_map=[0..3, 2..3]"],
    ],
    ids=["upcycle", "depth-upscale"],
)
def test_a_pipelined_run_starts_from_a_transformed_checkpoint_as_a_plain_run(
    tmp_path, straight, init
):
    """Upcycling and depth upscaling into stages: the first steps' losses equal the same
    transformed start without stages."""
    full, _ = straight
    source = full.run_dir / "checkpoints" / "persistent" / "6"
    start = [*init, "init.source_model=small", f"checkpoint.load_parameters_path={source}"]
    start += ["train.steps=2", "checkpoint.enabled=false"]
    # 6 layers: two stages of 3 (gpipe); 4 MoE layers: two stages of 2 blocks of 1.
    layers = ["pipeline.schedule=gpipe", "pipeline.repeats=1"] if "depth" in init[0] else []
    piped = config(tmp_path / "piped", *start, *layers)
    plain = config(tmp_path / "plain", *start, "mesh.stage=1", "mesh.fsdp=8")
    for cfg in (piped, plain):
        run(cfg)
    got, want = losses(piped), losses(plain)
    np.testing.assert_allclose([got[1], got[2]], [want[1], want[2]], rtol=1e-5)
