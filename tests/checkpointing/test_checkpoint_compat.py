"""A checkpoint written by an earlier maxtrain still resumes exactly.

`tests/fixtures/pre_refactor/` holds step 3 of a run written by commit 230578b (before the model,
checkpointer and kernel interfaces were reorganised), with what that commit read back from it:
the sha256 of every leaf of the restored train state, the next batch its data iterator yielded,
and the metrics of steps 4 to 6 of the same run continued. Its model, tiny-moe with a dense first
layer and the aux-loss-free bias, has both layer stacks and every MoE parameter. Regenerate it
only for a deliberate format change (`README.md` in that directory says how).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import yaml
from support import FIXTURES

from maxtrain import config as config_lib
from maxtrain.checkpointing import open_checkpointer, read_saved_config
from maxtrain.checkpointing.saved_config import saved_config
from maxtrain.data.streams import data_streams
from maxtrain.hf.convert import checkpoint_model
from maxtrain.training.run_identity import differences
from maxtrain.training.trainer import build_trainer

FIXTURE = FIXTURES / "pre_refactor"
ARGS = (FIXTURE / "args.txt").read_text().split()


def copy_run(tmp_path: Path) -> list[str]:
    """The fixture's checkpoint as the run directory <tmp>/run; returns the run's overrides."""
    shutil.copytree(FIXTURE / "checkpoints", tmp_path / "run" / "checkpoints")
    return [*ARGS, f"run.output_dir={tmp_path}", "run.name=run", "train.steps=6"]


def test_the_old_checkpoint_restores_bit_identical_state_and_data_position(tmp_path):
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", copy_run(tmp_path))
    trainer = build_trainer(cfg, devices=jax.devices()[:1])
    batches, _ = data_streams(cfg)
    abstract = trainer.saved.abstract(trainer.state)  # what the train loop restores into
    ckpt = open_checkpointer(cfg.checkpoint, cfg.run_dir, config_lib.to_yaml(cfg), abstract)
    try:
        state, step = ckpt.restore_latest(abstract, batches)
    finally:
        ckpt.close()
    assert step == 3
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    got = {
        jax.tree_util.keystr(path): hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
        + f" {x.dtype} {list(np.shape(x))}"
        for path, x in leaves
    }
    assert got == json.loads((FIXTURE / "state_sha256.json").read_text())
    expected = np.load(FIXTURE / "next_batch.npz")
    batch = next(batches)
    assert sorted(batch) == sorted(expected.files)
    for key in expected.files:
        np.testing.assert_array_equal(batch[key], expected[key], err_msg=key)


def test_training_continues_from_the_old_checkpoint_as_the_old_code_did(tmp_path):
    overrides = copy_run(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "maxtrain.train", str(config_lib.CONFIGS_DIR / "base.yml")]
        + overrides,
        capture_output=True,
        text=True,
        # XLA's default flags: the old code's metrics in the fixture were computed under them.
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed at step 3" in result.stdout

    def deterministic(path: Path) -> dict[int, dict[str, float]]:
        """Per step, every metric but the timings."""
        out: dict[int, dict[str, float]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(record.pop("step"), {}).update(
                {k: v for k, v in record.items() if "time" not in k and "per_sec" not in k}
            )
        for metrics in out.values():
            for timing in ("train/data_wait_fraction", "train/tflops_per_device", "train/mfu"):
                metrics.pop(timing, None)
        return out

    got = deterministic(tmp_path / "run" / "metrics.jsonl")
    for metrics in got.values():
        metrics.pop("train/moe/rounds")  # added since (the expert-parallel exchange's rounds)
    want = deterministic(FIXTURE / "metrics_steps_4_to_6.jsonl")
    assert sorted(got) == [4, 5, 6]
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), step
        for key, value in want[step].items():
            # Same machine type: identical. Float rounding may differ on another CPU (XLA:CPU
            # vectorises reductions per instruction set), hence the tolerance; the state and
            # data position above are compared bit for bit.
            np.testing.assert_allclose(got[step][key], value, rtol=1e-6, err_msg=f"{step} {key}")


def test_the_old_checkpoints_saved_config_reads_as_todays_keys(tmp_path, capsys):
    """Its config was saved in the keys of before (model.moe.first_dense_layers, model.remat,
    ...): the run identity, generation's loading and export read it as the same run and model
    args.txt states today, with one note naming the moved keys."""
    step_dir = FIXTURE / "checkpoints" / "local" / "3"
    saved = yaml.safe_load(read_saved_config(step_dir))
    assert "first_dense_layers" in saved["model"]["moe"]
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", copy_run(tmp_path))
    assert differences(config_lib.validate_saved(saved, "fixture"), cfg) == []
    assert saved_config(step_dir).model == cfg.model
    model, param_dtype, std = checkpoint_model(step_dir)
    assert (model, param_dtype, std) == (cfg.model, "float32", 0.02)
    notes = capsys.readouterr().err.splitlines()
    assert notes[0].startswith("maxtrain: note: fixture: model.param_dtype is now compute.")
    assert "model.moe.first_dense_layers is now model.layers" in notes[0]
