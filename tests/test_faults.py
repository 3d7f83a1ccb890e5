"""Faults at the command line: bad numbers, a different model, damaged checkpoints, and
starting from another run's parameters. Every one ends in a clear line, nothing lost."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.models import model_def

TINY = [
    "model_name=tiny",
    "data.kind=synthetic",
    "train.log_every=1",
    "train.eval_every=0",
    "train.seq_len=32",
    "train.global_batch_size=8",
]


def cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    base = str(config_lib.CONFIGS_DIR / "base.yml")
    cmd = [sys.executable, "-m", "maxtrain.train", base, *TINY,
           f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", *args]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def params_at(step_dir: Path, *overrides: str):
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [*TINY, *overrides])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nnx.to_pure_dict(model_def(cfg).abstract_state),
    )
    return jax.device_get(load_parameters(step_dir, abstract))


BLOW_UP = ["optim.lr=1e12", "optim.warmup_steps=0", "optim.clip_norm=0"]


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = cli(run_dir, "train.steps=12", "checkpoint.local.every_steps=1", *BLOW_UP)
    assert result.returncode == 1
    assert "the loss is not finite at step 2" in result.stderr
    assert "the newest checkpoint, step 1, is kept" in result.stderr
    assert "Traceback" not in result.stderr
    local = run_dir / "checkpoints" / "local"
    assert sorted(p.name for p in local.iterdir()) == ["1"]  # complete, nothing after it


def test_nonfinite_loss_skip_policy_drops_the_bad_updates(tmp_path):
    run_dir = tmp_path / "run"
    result = cli(run_dir, "train.steps=6", "train.on_nonfinite=skip", *BLOW_UP)
    assert result.returncode == 0, result.stderr[-2000:]
    params = params_at(run_dir / "checkpoints" / "persistent" / "6")
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_checkpoint_of_another_model_exits_2_naming_the_parameter_and_touches_nothing(tmp_path):
    run_dir = tmp_path / "run"
    assert cli(run_dir, "train.steps=2").returncode == 0
    before = tree_digest(run_dir / "checkpoints")
    result = cli(run_dir, "train.steps=4", "model.mlp_dim=96")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "mlp" in result.stderr and "128" in result.stderr and "96" in result.stderr
    assert tree_digest(run_dir / "checkpoints") == before


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    assert cli(run_dir, "train.steps=8", "checkpoint.local.every_steps=4").returncode == 0
    for tier in ("local", "persistent"):  # step 8 is in both: the last interval and the end
        newest = run_dir / "checkpoints" / tier / "8"
        victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a torn write
    result = cli(run_dir, "train.steps=10", "checkpoint.local.every_steps=4")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step 8" in result.stderr and "corrupt" in result.stderr
    assert "resumed at step 4" in result.stdout


def test_load_parameters_path_starts_a_new_run_from_those_parameters(tmp_path):
    source = tmp_path / "source"
    assert cli(source, "train.steps=3").returncode == 0
    target = tmp_path / "target"
    # lr 0: the new run's one step changes nothing, so its parameters are the source's
    result = cli(target, "train.steps=1", "optim.lr=0", f"checkpoint.load_parameters_path={source}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed" not in result.stdout  # a new run: step 1, fresh optimizer
    loaded = params_at(target / "checkpoints" / "persistent" / "1")
    original = params_at(source / "checkpoints" / "persistent" / "3")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(original), strict=True):
        np.testing.assert_array_equal(a, b)
