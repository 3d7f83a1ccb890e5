"""The real CLI in subprocesses: a short packed grain run's command (ARGS), running it to the
end or interrupting it at a chosen point, its per-step losses; a finished run as it was when
stopped at one of its checkpoints (stopped_at); a free port for multi-process runs; a digest
of a directory tree (to show nothing was written)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from maxtrain import config as config_lib
from support.xla_env import xla_flags

STEPS = 30  # room for a kill, a kill mid-save, a SIGTERM and a Ctrl-C between saves (test_resume)


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
    "checkpoint.persistent.every_steps=10",
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
    """A condition on a run directory: its metrics.jsonl has a record of `step` or later."""

    def reached(run_dir: Path) -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and any(
            record["step"] >= step for record in map(_record, path.read_text().splitlines()[-3:])
        )

    return reached


def _record(line: str) -> dict:
    """A metrics.jsonl line; the trainer may be writing the last one: not yet a record."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return {"step": -1}


def stopped_at(run_dir: Path, step: int, copy: Path) -> Path:
    """A copy of the single-process run run_dir as a run stopped at `step` leaves it: its
    checkpoints of later steps, its summary and the metrics records of later steps removed.
    Started again it resumes from `step`; on a step program that does not depend on
    train.steps (a constant schedule or optim.schedule_steps), the first `step` steps of an
    uninterrupted run are those of a run stopped there, so this stands for that run, one
    launch and one trainer build fewer."""
    shutil.copytree(run_dir, copy)
    for tier in (copy / "checkpoints").iterdir():
        for saved in tier.iterdir():
            if saved.name.isdigit() and int(saved.name) > step:
                shutil.rmtree(saved)
    (copy / "summary.json").unlink(missing_ok=True)
    metrics = copy / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step]
    metrics.write_text("".join(f"{line}\n" for line in kept))
    return copy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()
