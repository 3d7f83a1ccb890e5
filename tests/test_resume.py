"""Stopping a run anywhere and starting it again changes nothing, bit for bit.

Each test runs the real CLI in subprocesses on one CPU device, with the grain pipeline
(a three-source mixture, packed), kills, preempts or interrupts it mid-run, starts it again
with the same command, and compares the per-step losses (one record per step in
metrics.jsonl) and the final parameters with an uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from xla_env import xla_flags

from maxtrain import config as config_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.training.run_model import model_def

STEPS = 60
ARGS = [
    "model_name=tiny",
    "model.vocab_size=1024",  # the embedded corpus's tokenizer
    "data.kind=grain",
    "data.packing=first_fit",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "checkpoint.local.every_steps=4",
    "checkpoint.persistent.every_steps=20",
]


def command(run_dir: Path, args: list[str] = ARGS) -> list[str]:
    return [
        sys.executable, "-m", "maxtrain.train", str(config_lib.CONFIGS_DIR / "base.yml"), *args,
        f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
    ]  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}


def run_to_end(run_dir: Path, args: list[str] = ARGS) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command(run_dir, args), capture_output=True, text=True, env=env(), timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step, one record per step (a resumed run drops the records of the steps it
    trains again)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == sorted(set(steps)), f"duplicate or unordered steps in metrics.jsonl: {steps}"
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def final_params(run_dir: Path):
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", ARGS)
    abstract = nnx.to_pure_dict(model_def(cfg).abstract_state)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    step_dir = run_dir / "checkpoints" / "persistent" / str(STEPS)
    return jax.device_get(load_parameters(step_dir, abstract))


def interrupt(run_dir: Path, when, sig: int, args: list[str] = ARGS) -> subprocess.CompletedProcess:
    """Starts the run, sends `sig` as soon as when(run_dir) is true, returns the exit."""
    proc = subprocess.Popen(command(run_dir, args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env())  # fmt: skip
    deadline = time.monotonic() + 240
    while not when(run_dir):
        assert proc.poll() is None, f"run ended before the interruption: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "interruption point never reached"
        time.sleep(0.002)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def logged_step_at_least(step: int):
    def reached(run_dir: Path) -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and any(
            json.loads(x)["step"] >= step for x in path.read_text().splitlines()[-3:]
        )

    return reached


def save_in_flight(run_dir: Path) -> bool:
    """An Orbax temporary step directory exists: an async save is being written right now."""
    local = run_dir / "checkpoints" / "local"
    return local.exists() and any(".orbax-checkpoint-tmp" in p.name for p in local.iterdir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict[int, float], dict]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_to_end(run_dir)
    return losses(run_dir), final_params(run_dir)


def assert_identical_to_straight(run_dir: Path, straight) -> None:
    straight_losses, straight_params = straight
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == straight_losses  # exact float equality, every step
    for (path, a), b in zip(
        jax.tree.leaves_with_path(final_params(run_dir)),
        jax.tree.leaves(straight_params),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_killed_stopped_and_interrupted_again_and_again_then_resumed_is_bit_exact(
    tmp_path, straight
):
    """One run, stopped four ways in turn, each time started again with the same command:
    SIGKILL early, SIGKILL while an async save is being written, SIGTERM (saves the step to the
    local tier, exit 0), Ctrl-C (the same stop, exit 130). Every step's loss and the final
    parameters equal the uninterrupted run's. (One chain rather than one test per way: each
    start costs seconds, and a resume that is not exact shows at the end either way.)"""
    run_dir = tmp_path / "run"
    killed = interrupt(run_dir, logged_step_at_least(9), signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL

    # A save of the resumed run (not a temporary directory the kill left behind).
    resumed_on = logged_step_at_least(max(losses(run_dir)) + 1)
    killed = interrupt(run_dir, lambda d: resumed_on(d) and save_in_flight(d), signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert "resumed at step" in killed.stdout

    for sig, status, said, at in [
        (signal.SIGTERM, 0, "SIGTERM: saved step ", 25),
        (signal.SIGINT, 130, "interrupted (SIGINT): saved step ", 40),
    ]:
        stopped = interrupt(run_dir, logged_step_at_least(at), sig)
        assert stopped.returncode == status, stopped.stderr[-2000:]
        assert "Traceback" not in stopped.stderr
        saved_step = int(stopped.stdout.split(said)[1].split()[0])
        assert (run_dir / "checkpoints" / "local" / str(saved_step)).is_dir()

    resumed = run_to_end(run_dir)
    assert f"resumed at step {saved_step}" in resumed.stdout
    assert_identical_to_straight(run_dir, straight)
