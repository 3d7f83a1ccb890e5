"""One trainer per run directory: `<run_dir>/.lock`, held while the run trains.

Two trainers on one run directory would interleave their checkpoints, metrics and summary, and
each would resume from the other's steps. The lock is flock(2) on an open file: the kernel
releases it when the process ends, however it ends (kill -9 included), so a lock is never
left stuck. The file says who holds it (pid, host, start time), so a second trainer names the
holder. A holder that ends normally empties the file; a trainer that finds it filled in by a
process that no longer holds the lock (killed before it could) takes it over and says so.

Multi-process runs: only process 0 takes it, since the others may share the filesystem and
would lock each other out. flock works on local disks and on NFS (Linux emulates it there with
POSIX locks); the run directory is a local path (metrics.jsonl is written with open()).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from maxtrain.common.errors import UserError

LOCK = ".lock"


class RunDirBusy(UserError):
    """Another trainer holds the run directory; the CLI exits 2."""


class RunDirError(UserError):
    """The run directory cannot be created (under a file, no permission); the CLI exits 2."""


@contextlib.contextmanager
def held(run_dir: Path, take: bool = True) -> Iterator[None]:
    """Holds `<run_dir>/.lock` for the block (creating run_dir); RunDirBusy if another process
    holds it. take=False (processes other than 0): does nothing."""
    if not take:
        yield
        return
    created = _create(run_dir)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(
                f"{run_dir} is in use by another trainer ({_describe(_read(fd))}); wait for it "
                "to end, or pick another run.name"
            ) from None
        if not _same_file(fd, path):  # its holder removed it (below) as we opened it
            raise RunDirBusy(f"{run_dir} was being released by another trainer; start again")
        if previous := _read(fd):
            print(
                f"maxtrain: note: taking over {path}, left by {_describe(previous)}, which "
                "ended without releasing it",
                file=sys.stderr,
                flush=True,
            )
        _write(fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()})
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # an empty file: the last holder ended cleanly
            if created is not None and os.listdir(run_dir) == [LOCK]:
                path.unlink()  # a refused start leaves nothing, run.output_dir included
                _remove_empty(run_dir, up_to=created)
    finally:
        os.close(fd)  # releases the lock


def _create(run_dir: Path) -> Path | None:
    """Creates run_dir and its missing parents; returns the topmost one it created (None: it
    existed). RunDirError, one line, where it cannot: a parent is a file, no permission."""
    created = None
    for directory in (run_dir, *run_dir.parents):
        if directory.exists():
            break
        created = directory
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(
            f"cannot create the run directory {run_dir} (run.output_dir/run.name): "
            f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
        ) from None
    return created


def _remove_empty(run_dir: Path, up_to: Path) -> None:
    """Removes run_dir and its parents up to `up_to`, each only if empty."""
    for directory in (run_dir, *run_dir.parents):
        with contextlib.suppress(OSError):  # not empty: something else lives there
            directory.rmdir()
        if directory == up_to:
            return


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"unreadable": text[:80]}


def _write(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _describe(holder: dict | None) -> str:
    if not holder:
        return "a process that has not said who it is yet"
    if "pid" not in holder:
        return f"a process that wrote {holder}"
    return f"pid {holder['pid']} on {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
