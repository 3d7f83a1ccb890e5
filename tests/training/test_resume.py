"""Stopping a run anywhere and starting it again changes nothing, bit for bit.

Each test runs the real CLI in subprocesses on one CPU device, with the grain pipeline
(a three-source mixture, packed), kills, preempts or interrupts it mid-run, starts it again
with the same command, and compares the per-step losses (one record per step in
metrics.jsonl) and the final parameters with an uninterrupted run. The runs clip attention
logits (optim.qk_clip_threshold, QK-clip: a rescale after every update that reads the step's
own statistics), which a resume must carry on exactly as well.
"""

import json
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from support.runs import ARGS, STEPS, interrupt, logged_step_at_least, losses, run_to_end

from maxtrain import config as config_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.training.run_model import model_def

# The tiny run's largest logit starts near 0.09 and grows past 0.3: clipped from the first steps.
QK_CLIP = 0.1
RUN = [*ARGS, f"optim.qk_clip_threshold={QK_CLIP}"]


def final_params(run_dir: Path):
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", RUN)
    abstract = nnx.to_pure_dict(model_def(cfg).abstract_state)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    step_dir = run_dir / "checkpoints" / "persistent" / str(STEPS)
    return jax.device_get(load_parameters(step_dir, abstract))


def save_in_flight(run_dir: Path) -> bool:
    """An Orbax temporary step directory exists: an async save is being written right now."""
    local = run_dir / "checkpoints" / "local"
    return local.exists() and any(".orbax-checkpoint-tmp" in p.name for p in local.iterdir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict[int, float], dict]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_to_end(run_dir, RUN)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    max_logits = [r["train/attention/max_logit"] for r in records if "train/loss" in r]
    assert sum(m > QK_CLIP for m in max_logits) >= STEPS // 2  # the clip works on most steps
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
    killed = interrupt(run_dir, logged_step_at_least(9), signal.SIGKILL, RUN)
    assert killed.returncode == -signal.SIGKILL

    # A save of the resumed run (not a temporary directory the kill left behind).
    resumed_on = logged_step_at_least(max(losses(run_dir)) + 1)
    killed = interrupt(run_dir, lambda d: resumed_on(d) and save_in_flight(d), signal.SIGKILL, RUN)
    assert killed.returncode == -signal.SIGKILL
    assert "resumed at step" in killed.stdout

    for sig, status, said, at in [
        (signal.SIGTERM, 0, "SIGTERM: saved step ", 17),
        (signal.SIGINT, 130, "interrupted (SIGINT): saved step ", 22),
    ]:
        stopped = interrupt(run_dir, logged_step_at_least(at), sig, RUN)
        assert stopped.returncode == status, stopped.stderr[-2000:]
        assert "Traceback" not in stopped.stderr
        saved_step = int(stopped.stdout.split(said)[1].split()[0])
        assert (run_dir / "checkpoints" / "local" / str(saved_step)).is_dir()

    resumed = run_to_end(run_dir, RUN)
    assert f"resumed at step {saved_step}" in resumed.stdout
    assert_identical_to_straight(run_dir, straight)
