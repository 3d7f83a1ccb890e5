"""Ends the trainer does not save on: SIGKILL, and a second Ctrl-C. Nothing it started (grain's
worker processes, multiprocessing's resource tracker) outlives it by more than a few seconds.

(SIGTERM and a first Ctrl-C save and resume bit-exactly: tests/training/test_resume.py.)
"""

import os
import signal
import subprocess
import time
from pathlib import Path

from support.runs import ARGS, command, env, logged_step_at_least

WORKERS = [*ARGS, "data.num_workers=2"]


def descendants(pid: int) -> set[int]:
    """Every live process below pid, from /proc."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # not a process, or gone meanwhile
            continue
        parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"}


def _state(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def start_with_workers(run_dir: Path) -> tuple[subprocess.Popen, set[int], Path]:
    """The trainer with 2 grain workers, once it has logged a step; what it started; the file
    its stderr goes to (read while it runs)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    stderr = run_dir.parent / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(command(run_dir, WORKERS), stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env())  # fmt: skip
    deadline = time.monotonic() + 240
    while not logged_step_at_least(2)(run_dir):
        assert proc.poll() is None, f"run ended early: {stderr.read_text()}"
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.05)
    children = descendants(proc.pid)
    assert len(children) >= 3, children  # two workers and the resource tracker
    return proc, children, stderr


def assert_gone_within(pids: set[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(pids)
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the trainer: {left}"


def test_sigkill_leaves_no_process_behind(tmp_path):
    proc, children, _ = start_with_workers(tmp_path / "run")
    proc.kill()
    proc.communicate(timeout=60)
    assert_gone_within(children, 5.0)


def test_a_second_sigint_aborts_at_once_with_one_line(tmp_path):
    """The first Ctrl-C is acknowledged at once; the second, sent as soon as that line shows
    (the step and its save still ahead), exits without saving. (Two signals sent back to back
    would merge into one: the kernel keeps one pending SIGINT.)"""
    proc, children, stderr = start_with_workers(tmp_path / "run")
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while "Ctrl-C again exits at once" not in stderr.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.read_text().splitlines() == [
        "maxtrain: interrupted (SIGINT): saving after this step; Ctrl-C again exits at once",
        "maxtrain: interrupted again (SIGINT): exiting now, without saving",
    ]
    assert "saved step" not in out
    assert_gone_within(children, 5.0)
