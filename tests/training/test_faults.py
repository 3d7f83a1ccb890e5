"""Faults at the command line: bad numbers, a different model, damaged checkpoints, a full
disk, two trainers on one run, a finished run started again, and starting from another run's
parameters. Every one ends in a clear line, nothing lost."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from support.runs import stopped_at, tree_digest
from support.xla_env import xla_flags

from maxtrain import config as config_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.common.errors import DEBUG_ENV
from maxtrain.training import run_lock
from maxtrain.training.loop import main
from maxtrain.training.run_model import model_def

TINY = [
    "model_name=tiny",
    "data.kind=synthetic",
    "train.log_every=1",
    "train.eval_every=0",
    "train.seq_len=32",
    "train.global_batch_size=8",
]


# Sets RLIMIT_FSIZE, then becomes the trainer: a write past the limit fails with EFBIG ("File
# too large"; Python ignores SIGXFSZ). Not a preexec_fn: forking this multithreaded process
# (jax) to run Python in the child can deadlock.
LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def argv(run_dir: Path, *args: str) -> list[str]:
    """The train command's arguments: the tiny model writing to run_dir, then args."""
    base = str(config_lib.CONFIGS_DIR / "base.yml")
    return [base, *TINY, f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", *args]


def cli(
    run_dir: Path, *args: str, max_file_bytes: int | None = None
) -> subprocess.CompletedProcess:
    """Runs the trainer on the tiny model; max_file_bytes: no file it writes may grow past
    this."""
    cmd = [sys.executable, "-m", "maxtrain.train", *argv(run_dir, *args)]
    if max_file_bytes is not None:
        cmd = [sys.executable, "-c", LIMITED, str(max_file_bytes), *cmd[1:]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def logged_steps(run_dir: Path) -> list[int]:
    """The step of every train record in metrics.jsonl, in file order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "train/loss" in r]


def params_at(step_dir: Path, *overrides: str):
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [*TINY, *overrides])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nnx.to_pure_dict(model_def(cfg).abstract_state),
    )
    return jax.device_get(load_parameters(step_dir, abstract))


# lr warms up from 0: step 1 leaves the parameters as they were, step 2 (lr 2.5e11) makes them
# huge but finite, and the loss of step 3, computed on them, is NaN, and so every later one (a
# skipped update leaves them as they were). The three tests below train 6 steps with it: one
# step program (train.on_nonfinite and the checkpoint settings are the host's), compiled once.
BLOW_UP_AT_3 = ["optim.lr=1e12", "optim.warmup_steps=4", "optim.clip_norm=0"]
EVERY_STEP = ["checkpoint.local.every_steps=1", "checkpoint.local.keep=10"]
# The runs that start from a finished run (the fixture `finished`): the embedding is 2 MiB, above
# the full disk's 1 MiB, and the lr schedule is 8 steps long whatever train.steps says, so the
# first 4 steps of the 8-step run are those of a run stopped at 4 (and one step program serves).
BIG = ["model.vocab_size=8192", "checkpoint.local.every_steps=4", "optim.schedule_steps=8"]


def test_nonfinite_loss_stops_and_the_run_resumes_from_the_last_finite_checkpoint(tmp_path):
    """The state saved at step 2 gave step 3's NaN loss: a run resumed from it failed again at
    once, whatever the lr. It is moved aside and the line names step 1, from which the run
    resumes with a lower lr."""
    run_dir = tmp_path / "run"
    result = cli(run_dir, "train.steps=6", *EVERY_STEP, *BLOW_UP_AT_3)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "the loss is not finite at step 3" in line
    assert "the newest finite checkpoint, step 1, is kept" in line
    local = sorted(p.name for p in (run_dir / "checkpoints" / "local").iterdir())
    assert local[0] == "1" and local[1].startswith("2.nonfinite-") and len(local) == 2

    sane = [*BLOW_UP_AT_3[1:], "optim.lr=1e-3"]
    resumed = cli(run_dir, "train.steps=6", *EVERY_STEP, *sane)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed at step 1" in resumed.stdout
    assert logged_steps(run_dir) == [1, 2, 3, 4, 5, 6]  # step 2's old record replaced


def test_nonfinite_loss_skip_policy_drops_the_bad_updates(tmp_path):
    run_dir = tmp_path / "run"
    result = cli(run_dir, "train.steps=6", "train.on_nonfinite=skip", *BLOW_UP_AT_3)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = result.stderr.strip().splitlines()
    assert [w.split("skipped (")[1].split(" in a row")[0] for w in warnings] == list("1234")
    assert all("maxtrain: warning: the loss is not finite at step" in w for w in warnings)
    params = params_at(run_dir / "checkpoints" / "persistent" / "6")
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_too_many_skips_in_a_row_stop_like_stop(tmp_path):
    """train.max_consecutive_skips=3: steps 3, 4, 5 are skipped with a warning each, the fourth
    non-finite step in a row (the last, 6) ends the run; steps 2-5 were saved from states that
    gave a NaN loss, so step 1 is the one to resume from."""
    run_dir = tmp_path / "run"
    skip = ["train.on_nonfinite=skip", "train.max_consecutive_skips=3"]
    result = cli(run_dir, "train.steps=6", *skip, *EVERY_STEP, *BLOW_UP_AT_3)
    assert result.returncode == 1
    *warnings, line = result.stderr.strip().splitlines()
    assert [w.split(";")[0][-9:] for w in warnings] == ["at step 3", "at step 4", "at step 5"]
    assert "4 steps in a row (3-6), more than train.max_consecutive_skips=3" in line
    assert "the newest finite checkpoint, step 1, is kept" in line
    local = [p.name for p in (run_dir / "checkpoints" / "local").iterdir()]
    assert [n for n in local if n.isdigit()] == ["1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 8-step run (step 4 in the local tier, the last, 8, in the persistent one) for the
    tests that start from a run's checkpoints: one launch instead of one per test, and a later
    launch of the same shape with train.steps=8 loads its step program instead of compiling one.
    Tests that change the run work on a copy (copy_of, stopped_at)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = cli(run_dir, "train.steps=8", *BIG)
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def test_full_disk_is_one_line_and_the_next_run_resumes_then_a_finished_run_is_left_alone(
    tmp_path, finished, capsys
):
    """A save that cannot be written ends the run with one line naming the tier directory and
    the cause, and removes the partial step. The disk fills through RLIMIT_FSIZE: a write past
    1 MiB fails with EFBIG ("File too large") as a full disk fails with ENOSPC, and it needs no
    privileges (a small tmpfs would need mount rights CI may lack); the same path was checked
    by hand on a 2 MB tmpfs ("No space left on device"). The next run resumes from the last
    complete step and replaces the records the failed run logged after it. Started once more,
    the finished run says so and changes nothing."""
    run_dir = stopped_at(finished, 4, tmp_path / "run")  # a run at step 4, its embedding 2 MiB
    full = cli(run_dir, "train.steps=8", *BIG, max_file_bytes=2**20)
    assert full.returncode == 2
    [line] = full.stderr.strip().splitlines()
    assert line.startswith(f"maxtrain: error: saving step 8 to {run_dir / 'checkpoints'}")
    assert "failed: File too large" in line and "a restart resumes from step 4" in line
    assert not [p for p in run_dir.rglob("*") if "orbax-checkpoint-tmp" in p.name]

    resumed = cli(run_dir, "train.steps=8", *BIG)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed at step 4" in resumed.stdout
    assert logged_steps(run_dir) == list(range(1, 9))

    before = tree_digest(run_dir)
    capsys.readouterr()
    assert main(argv(run_dir, "train.steps=8", *BIG)) == 0  # nothing to build: in this process
    [line] = capsys.readouterr().out.strip().splitlines()
    assert f"run {run_dir} is complete: step 8" in line
    assert tree_digest(run_dir) == before


def test_checkpoint_of_another_model_exits_2_naming_the_parameter_and_touches_nothing(
    tmp_path, finished, capsys, monkeypatch
):
    """Through the command's main in this process: a refusal needs no interpreter of its own
    (tests/training/test_bad_inputs.py shows exit 2 and one line at the process boundary)."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    run_dir = copy_of(finished, tmp_path)
    before = tree_digest(run_dir / "checkpoints")
    capsys.readouterr()
    assert main(argv(run_dir, "train.steps=10", *BIG, "model.mlp_dim=96")) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert "mlp" in err and "128" in err and "96" in err
    assert tree_digest(run_dir / "checkpoints") == before


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, finished):
    run_dir = copy_of(finished, tmp_path)
    # Step 8, the last, is saved once, to the persistent tier (though due in both).
    assert not (run_dir / "checkpoints" / "local" / "8").exists()
    newest = run_dir / "checkpoints" / "persistent" / "8"
    victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a torn write
    # train.steps=8 as before: a damaged step 8 does not make the run complete
    result = cli(run_dir, "train.steps=8", *BIG)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step 8" in result.stderr and "corrupt" in result.stderr
    assert "resumed at step 4" in result.stdout
    assert logged_steps(run_dir) == list(range(1, 9))


def test_load_parameters_path_starts_a_new_run_from_those_parameters(tmp_path, finished):
    target = tmp_path / "target"
    # lr 0: the new run's one step changes nothing, so its parameters are the source's
    result = cli(
        target, "train.steps=1", *BIG, "optim.lr=0", f"checkpoint.load_parameters_path={finished}"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed" not in result.stdout  # a new run: step 1, fresh optimizer
    loaded = params_at(target / "checkpoints" / "persistent" / "1", *BIG)
    original = params_at(finished / "checkpoints" / "persistent" / "8", *BIG)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(original), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_second_trainer_on_the_same_run_dir_refuses_with_one_line(tmp_path, capsys):
    """The lock is an flock: held here through another open file, as another process would."""
    argv = [str(config_lib.CONFIGS_DIR / "base.yml"), *TINY, f"run.output_dir={tmp_path}"]
    with run_lock.held(tmp_path / "run"):
        assert main([*argv, "run.name=run", "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is in use by another trainer" in err
    assert f"pid {os.getpid()} on " in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_lock_left_by_a_killed_trainer_is_taken_over_with_a_note(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    left = {"pid": 99999999, "host": "gone", "started": "2025-01-01T00:00:00"}
    (run_dir / run_lock.LOCK).write_text(json.dumps(left))  # kill -9 leaves it filled in
    with run_lock.held(run_dir):
        assert json.loads((run_dir / run_lock.LOCK).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "taking over" in err and "pid 99999999 on gone" in err
    assert (run_dir / run_lock.LOCK).read_text() == ""  # a clean end empties it
